"""One emulated network at a time on a machine.

Mininet names interfaces after nodes in the root namespace, so two networks built at once
would collide (and a cleanup would tear down the other's links). Everything that builds an
emulated network or cleans up holds this lock. It is an ``flock``: the kernel releases it
when the holder dies, even by SIGKILL, so a crashed run never leaves it stuck.

The holder owns the network it builds: taking the lock starts its guardian and marks what it
starts with its identity (:mod:`testbed.lifeline`), so nothing of it outlives the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from testbed import lifeline

LOCK_PATH = os.environ.get("TESTBED_LOCK", "/run/testbed/emulation.lock")


class EmulationBusy(RuntimeError):
    """Another testbed network is running on this machine."""


@contextlib.contextmanager
def emulation_lock(timeout: float = 600.0, path: str = LOCK_PATH,
                   guard: bool = True) -> Iterator[None]:
    """Hold the machine-wide emulation lock; wait up to ``timeout`` seconds for it.

    Re-entrant within one process (a nested ``with`` is a no-op). ``guard``: make this
    process the owner of what it builds (:func:`testbed.lifeline.become_owner`); off for
    holders that build nothing (``testbed cleanup``, the guardian itself).
    """
    if _held.get(path):
        _held[path] += 1
        try:
            yield
        finally:
            _held[path] -= 1
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EmulationBusy(
                        f"another testbed network holds {path} (waited {timeout:.0f} s); "
                        "wait for it to finish, or if it is dead run 'testbed cleanup'"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[path] = 1
        if guard:
            lifeline.become_owner(path)
        try:
            yield
        finally:
            if guard:
                lifeline.release_ownership()
            _held.pop(path, None)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


_held: dict[str, int] = {}


def is_held(path: str = LOCK_PATH) -> bool:
    """Whether this process holds the lock already (a nested network or a netns server's)."""
    return bool(_held.get(path))
