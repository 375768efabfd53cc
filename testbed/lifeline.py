"""Nothing the testbed starts outlives the process that owns it, however that process dies.

The *owner* of an emulated network is the process holding the emulation lock
(:mod:`testbed.netlock`). Taking the lock makes the process an owner: its identity (pid and
start time) goes into the environment as ``TESTBED_OWNER``, so everything started from it
inherits it, and a *guardian* is started beside it. Two mechanisms then tie the network to
its owner's life:

* :func:`follow_owner`, called first thing by every long-lived process the testbed starts
  (data-path engines, worker pools, aggregators, services): a thread waits on a pidfd of the
  owner and, when the owner is gone, terminates the process (SIGTERM, so it can write its
  counters; ``_exit`` if it has not gone after a grace period, e.g. while it compiles).
* the guardian, ``python -m testbed.guardian`` (:mod:`testbed.guardian`): a small process in its own session
  (a signal to the owner's process group does not reach it) waiting on the same pidfd. The
  owner disarms it on a clean release of the lock. If the owner died instead (SIGKILL, the
  OOM killer, a crash), it takes the lock and runs :func:`testbed.cleanup.cleanup`: what did
  not follow the owner (processes in the hosts, Mininet's shells), the links in the root
  namespace, namespaces, and the run's files. It prints what it removed on the owner's
  standard error.

A pidfd (Linux >= 5.3) wakes the waiter the moment the owner exits, without polling; on an
older kernel the wait falls back to checking ``/proc`` twice a second.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

OWNER_ENV = "TESTBED_OWNER"
LOCK_ENV = "TESTBED_LOCK"  # read by testbed.netlock
#: seconds a process that lost its owner gets to exit on SIGTERM before it is ended outright
FOLLOW_GRACE_S = 2.0
#: seconds the guardian waits for the lock the dead owner held (its forked children may hold
#: the same open lock file until their parent-death signal has ended them)
GUARD_LOCK_WAIT_S = 3.0
_POLL_S = 0.5


def start_ticks(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks (tells a reused pid apart); None for a gone pid
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[-1].split()
    if not fields or fields[0] == b"Z" or len(fields) <= 19:
        return None
    return fields[19].decode()


def identity(pid: int | None = None) -> str:
    """``pid:start`` of a process (default: this one), the value of ``TESTBED_OWNER``."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_ticks(pid)}"


def parse_identity(text: str) -> tuple[int, str]:
    pid, _, start = text.partition(":")
    if not pid.isdigit() or not start:
        raise ValueError(f"{OWNER_ENV} must be PID:START_TICKS, got {text!r}")
    return int(pid), start


def wait_for_exit(owner: str, stop: threading.Event | None = None) -> bool:
    """Block until the process ``owner`` (``pid:start``) has exited; True then. False when
    ``stop`` was set first. Without ``stop`` a pidfd wait never wakes before the exit (the
    follower thread of a busy engine takes no GIL meanwhile)."""
    pid, start = parse_identity(owner)
    fd = None
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pass  # gone already (checked below), or a kernel without pidfds: poll /proc
    try:
        if start_ticks(pid) != start:  # after the open: the pidfd names the process checked
            return True
        poller = select.poll()
        if fd is not None:
            poller.register(fd, select.POLLIN)
        while stop is None or not stop.is_set():
            if fd is not None:
                if poller.poll(None if stop is None else _POLL_S * 1000):
                    return True
            else:
                time.sleep(_POLL_S)
                if start_ticks(pid) != start:
                    return True
        return False
    finally:
        if fd is not None:
            os.close(fd)


def follow_owner(grace_s: float = FOLLOW_GRACE_S) -> threading.Thread | None:
    """End this process when the network owner in ``TESTBED_OWNER`` exits.

    A daemon thread waits for the owner; then it sends this process SIGTERM (its handler
    stops it cleanly) and, if it is still running ``grace_s`` later, ``_exit(3)``s it. Does
    nothing without ``TESTBED_OWNER`` (a process started by hand) or when this process is the
    owner. Returns the thread (None when nothing is followed).
    """
    owner = os.environ.get(OWNER_ENV)
    if not owner:
        return None
    try:
        pid, _ = parse_identity(owner)
    except ValueError:
        return None
    if pid == os.getpid():
        return None

    def watch() -> None:
        wait_for_exit(owner)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(3)

    t = threading.Thread(target=watch, name="tb-follow-owner", daemon=True)
    t.start()
    return t


class Guardian:
    """The guardian of this process's network (see the module docstring)."""

    def __init__(self, lock_path: str):
        self.owner = identity()
        # the lock's path by the environment: an argument naming the run folder would make
        # the guardian look like a process of the network to testbed.cleanup
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "testbed.guardian", "--owner", self.owner],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, OWNER_ENV: "", LOCK_ENV: lock_path})

    def disarm(self) -> None:
        """The owner released its network cleanly: the guardian exits without cleaning."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_owned: dict[str, object] = {}


def become_owner(lock_path: str) -> None:
    """Called by the emulation lock when this process takes it: mark it the owner of what it
    starts from now on, and start its guardian."""
    _owned["env"] = os.environ.get(OWNER_ENV)
    os.environ[OWNER_ENV] = identity()
    try:
        _owned["guardian"] = Guardian(lock_path)
    except OSError as e:  # no guardian: a SIGKILLed owner leaves cleanup to the next run
        print(f"testbed: could not start the network's guardian ({e}); if this process is "
              "killed, run 'testbed cleanup'", file=sys.stderr)


def release_ownership() -> None:
    """Called by the emulation lock on a clean release: disarm the guardian."""
    guardian = _owned.pop("guardian", None)
    if isinstance(guardian, Guardian):
        guardian.disarm()
    previous = _owned.pop("env", None)
    if previous:
        os.environ[OWNER_ENV] = previous  # type: ignore[assignment]
    else:
        os.environ.pop(OWNER_ENV, None)
