"""The guardian of an emulated network: ``python -m testbed.guardian --owner PID:START``.

Started beside every holder of the emulation lock (:class:`testbed.lifeline.Guardian`), in its
own session. It waits for the owner to exit; a clean release of the lock disarms it first
(SIGTERM). If the owner died holding the lock, it takes the lock and runs
:func:`testbed.cleanup.cleanup`, then says on the owner's standard error what it removed.

A module of its own, above :mod:`testbed.lifeline`, :mod:`testbed.netlock` and
:mod:`testbed.cleanup`: the lock starts it by name, so those three import nothing above them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from testbed import cleanup
from testbed.lifeline import GUARD_LOCK_WAIT_S, LOCK_ENV, parse_identity, wait_for_exit
from testbed.netlock import LOCK_PATH, EmulationBusy, emulation_lock


def guard(owner: str) -> int:
    """Wait for owner (PID:START_TICKS) to exit; clean up after it unless disarmed."""
    # SIGTERM disarms it (the owner released its network cleanly) until the owner is gone;
    # from then on it cleans up, and nothing stops it halfway
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    wait_for_exit(owner)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid, _ = parse_identity(owner)
    try:
        with emulation_lock(timeout=GUARD_LOCK_WAIT_S, guard=False):
            removed = cleanup.cleanup(force=True)
    except EmulationBusy:
        holder = cleanup.lock_file_pid(LOCK_PATH)
        if holder != pid:
            return 0  # a new network took the lock: it cleans what is left before it starts
        # the lock file still names the dead owner: only a child of it can hold the lock
        removed = cleanup.cleanup(force=True)
    what = ", ".join(f"{len(v)} {k}" for k, v in removed.items() if v and k != "errors")
    if what:
        print(f"testbed: the network's owner (pid {pid}) died without tearing it down; "
              f"removed {what}" + (f"; could not remove: {removed['errors']}"
                                   if removed["errors"] else ""), file=sys.stderr, flush=True)
    return 1 if removed["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.guardian",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--owner", required=True, help="PID:START_TICKS of the owner (the lock "
                   f"it holds: ${LOCK_ENV})")
    a = ap.parse_args(argv)
    return guard(a.owner)


if __name__ == "__main__":
    sys.exit(main())
