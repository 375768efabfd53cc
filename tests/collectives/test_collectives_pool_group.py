"""A pool's process group is gone, not merely signalled, when the runner moves on: workers that
outlive their pool's leader are killed and waited for until they are reaped."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from testbed.collectives.runner import _wait_group_gone


def test_stragglers_of_an_exited_pool_are_killed_and_gone_on_return():
    # the leader exits at once; its two children ignore SIGTERM and would sleep on
    p = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 30 & sleep 30 & exit 0"],
                         start_new_session=True)
    p.wait()
    try:
        _wait_group_gone(p.pid, timeout=0.2)
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
