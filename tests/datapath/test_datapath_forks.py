"""Engines forked from one warm server (testbed.datapath.forks), on real networks."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testbed.datapath.control import RUN_DIR
from testbed.datapath.forks import START_ENV, EngineProcess, start_mode


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return got


def test_start_mode_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv(START_ENV, "spawn")
    with pytest.raises(ValueError, match="use one of fork, exec"):
        start_mode()
    monkeypatch.setenv(START_ENV, " EXEC ")
    assert start_mode() == "exec"
    monkeypatch.delenv(START_ENV)
    assert start_mode() == "fork"


@pytest.mark.mininet
def test_engines_fork_from_one_server_die_restart_and_leave_nothing(monkeypatch):
    """Every engine of a leaf-spine is a child of the network's fork server, in its node's
    namespace, and forwards; a SIGKILLed one is reported dead with its signal and restarted
    from the same server; after the network nothing of it is left."""
    from testbed.cleanup import leftovers
    from testbed.topologies import LeafSpine, TestbedNet

    monkeypatch.delenv(START_ENV, raising=False)
    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=1, switch="programmable")
    with TestbedNet(topo) as net:
        server = net.engine_server
        assert server is not None and server.alive()
        server_pid = server.pid
        switches = [net.mininet.get(n) for n in topo.programmable]
        assert len(switches) == 4
        pids = {}
        for sw in switches:
            pid = pids[sw.name] = sw.engine_pid()
            assert isinstance(sw.engine, EngineProcess)
            assert _ppid(pid) == server_pid
            assert b"testbed.datapath.engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{sw.pid}/ns/net")
            assert os.sched_getscheduler(pid) == os.SCHED_FIFO
        with pytest.raises(subprocess.TimeoutExpired):
            switches[0].engine.wait(0.05)
        h1, h2 = net.hosts
        assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())

        victim = switches[1]
        os.kill(pids[victim.name], signal.SIGKILL)
        dead = _wait(net.dead_engines, 10, "the killed engine to be seen dead")
        assert dead == {victim.name: -signal.SIGKILL}
        net.restart_engine(victim.name)
        new = victim.engine_pid()
        assert new != pids[victim.name] and _ppid(new) == server_pid
        assert net.dead_engines() == {}
        assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())
        engines = [sw.engine_pid() for sw in switches]
    assert net.engine_server is None
    for pid in [server_pid, *engines]:
        assert not os.path.exists(f"/proc/{pid}"), f"{pid} outlived the network"
    assert all(sw.final_counters for sw in switches)  # stopped cleanly, counters written
    assert glob.glob(os.path.join(RUN_DIR, "forks.*")) == []
    assert not any(leftovers().values())


@pytest.mark.mininet
def test_exec_mode_starts_each_engine_as_a_process_of_its_own(monkeypatch):
    from testbed.testing import programmable_star

    monkeypatch.setenv(START_ENV, "exec")
    with programmable_star(2) as (_mn, (h1, h2), s1):
        assert s1.spawner is None and isinstance(s1.engine, subprocess.Popen)
        argv = Path(f"/proc/{s1.engine_pid()}/cmdline").read_bytes().split(b"\0")
        assert b"--config" in argv and b"--fork-server" not in argv
        assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())
    assert s1.final_counters is not None
