"""Engines forked from one warm server (testbed.datapath.forks), on real networks."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.datapath.control import RUN_DIR, DatapathClient
from testbed.datapath.forks import START_ENV, ForkedProcess, start_mode


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


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_fork_server_whose_owner_vanished_removes_its_log(tmp_path):
    """An owner interrupted right after starting its server (a Ctrl-C in ``keep``) never
    closes it: the server ends when the owner's socket closes, and takes its log along."""
    log = tmp_path / "pools.log"
    code = ("import os, sys\n"
            "from testbed.datapath.forks import PoolServer\n"
            f"s = PoolServer({str(log)!r})\n"
            "s.wait_ready()\n"
            "print(s.pid, flush=True)\n"
            "os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[-1])
    _wait(lambda: _gone(pid), 30, "the orphaned server to end")
    _wait(lambda: not log.exists(), 10, "its log to go")


def test_a_fork_server_closed_while_it_loads_leaves_no_log(tmp_path):
    """Closed before it was ready (its owner's run was cut short), the server is ended and
    its log removed, whether it ended on its own or had to be killed."""
    from testbed.datapath.forks import PoolServer

    log = tmp_path / "pools.log"
    server = PoolServer(str(log))
    server.close(timeout=0.05)  # still importing: killed
    assert server.proc.returncode is not None
    assert not log.exists()


def test_a_fork_server_whose_owner_left_before_an_answer_ends_well(tmp_path):
    """An owner that asks for a child and closes its end before the answer (a Ctrl-C while
    it waits for the pid) is gone, not an error: the server ends with 0 and takes its log
    along, instead of dying on the broken pipe and leaving the log behind."""
    from testbed.datapath import forks

    log = tmp_path / "pools.log"
    server = forks.PoolServer(str(log))
    server.wait_ready()
    with open(tmp_path / "child.log", "w") as child_log:
        forks._send(server._sock, {"op": "spawn", "argv": ["--no-such-option"],
                                   "env": dict(os.environ), "cwd": str(tmp_path),
                                   "netns": False}, [child_log.fileno()])
    server._sock.close()  # before the server answers with the child's pid
    server._sock = None
    assert server.proc.wait(30) == 0, (log.read_text() if log.exists() else "")
    assert not log.exists()


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
            assert isinstance(sw.engine, ForkedProcess)
            assert _ppid(pid) == server_pid
            assert b"testbed.datapath.engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{sw.pid}/ns/net")
            assert os.sched_getscheduler(pid) == os.SCHED_FIFO
        with pytest.raises(subprocess.TimeoutExpired):
            switches[0].engine.wait(0.05)
        h1, h2 = net.hosts
        assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())

        victim = switches[1]
        kept = DatapathClient(victim.name)  # a control connection kept across the restart
        assert kept.counters()["pid"] == pids[victim.name]
        os.kill(pids[victim.name], signal.SIGKILL)
        dead = _wait(net.dead_engines, 10, "the killed engine to be seen dead")
        assert dead == {victim.name: -signal.SIGKILL}
        net.restart_engine(victim.name)
        new = victim.engine_pid()
        assert new != pids[victim.name] and _ppid(new) == server_pid
        assert net.dead_engines() == {}
        assert kept.counters()["pid"] == new  # its next request reaches the new engine
        kept.close()
        assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())
        engines = [sw.engine_pid() for sw in switches]
    assert net.engine_server is None
    for pid in [server_pid, *engines]:
        assert not os.path.exists(f"/proc/{pid}"), f"{pid} outlived the network"
    assert all(sw.final_counters for sw in switches)  # stopped cleanly, counters written
    assert glob.glob(os.path.join(RUN_DIR, "forks.*")) == []
    assert not any(leftovers().values())


@pytest.mark.root_required
def test_a_forked_engine_enters_the_namespace_it_is_given(tmp_path):
    """The network's switches share this namespace; a node of its own (here a process in a
    fresh one, as a host would be) gets its engine there: it serves that namespace's ports,
    answers on the control socket made here, and stops cleanly with its counters."""
    import json

    from testbed.datapath.control import ControlError, DatapathClient, control_address, listen
    from testbed.datapath.forks import EngineServer

    node = "tbfk1"
    holder = subprocess.Popen(["unshare", "-n", "sleep", "60"])
    server = eng = None
    try:
        ns = _wait(lambda: (os.readlink(f"/proc/{holder.pid}/ns/net")
                            != os.readlink("/proc/self/ns/net")
                            and os.readlink(f"/proc/{holder.pid}/ns/net")), 10, "unshare")
        subprocess.run(["nsenter", "-t", str(holder.pid), "-n", "ip", "link", "set", "lo",
                        "up"], check=True)
        config = tmp_path / "c.json"
        config.write_text(json.dumps({"node": node, "ports": ["lo"], "programs": ["forward"],
                                      "control_socket": control_address(node),
                                      "sched": "other"}))
        os.makedirs(RUN_DIR, exist_ok=True)
        server = EngineServer(["forward"], str(tmp_path / "server.log"))
        ctl = listen(control_address(node))
        with open(tmp_path / "engine.log", "w") as log:
            eng = server.spawn(["--config", str(config), "--counters-out",
                                str(tmp_path / "out.json")], holder.pid, log, [ctl])
        ctl.close()
        client = DatapathClient(control_address(node))

        def answers() -> bool:
            try:
                client.request("ping")
            except ControlError:
                return False
            return True

        _wait(answers, 60, "the engine to answer")
        assert os.readlink(f"/proc/{eng.pid}/ns/net") == ns
        assert client.counters()["ports"].keys() == {"lo"}
        client.close()
        eng.terminate()
        assert eng.wait(10) == 0
        assert json.loads((tmp_path / "out.json").read_text())["node"] == node
    finally:
        if eng is not None and eng.poll() is None:
            eng.kill()
            eng.wait(10)
        if server is not None:
            server.close()
        holder.kill()
        holder.wait()


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
