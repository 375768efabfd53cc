"""A network split over two servers: this machine and a netns server reached by real ssh."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from testbed import nsserver
from testbed.topologies import LeafSpine, TopologyError
from testbed.topologies.cluster import Server, crossing_links, parse_servers, place

_CRASH_LOCK = "/run/testbed/tb-crash-test.lock"


def test_default_placement_keeps_leaves_with_their_hosts():
    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100)
    servers = parse_servers(["localhost", Server("10.9.9.9", name="b")])
    where = place(topo, servers)
    assert where["tbl1"] == where["tbh1"] == where["tbh2"] == "localhost"
    assert where["tbl2"] == where["tbh3"] == where["tbh4"] == "b"
    assert {where["tbsp1"], where["tbsp2"]} == {"localhost", "b"}
    crossing = crossing_links(topo, where)
    assert len(crossing) == 2
    assert all({s.a[:4], s.b[:4]} == {"tbl1", "tbsp"} or {s.a[:4], s.b[:4]} == {"tbl2", "tbsp"}
               for s in crossing)  # only spine-to-leaf links cross
    pinned = place(topo, servers, {"tbsp1": "b", "tbsp2": 1})
    assert pinned["tbsp1"] == pinned["tbsp2"] == "b"
    with pytest.raises(TopologyError, match="not a server"):
        place(topo, servers, {"tbsp1": "c"})
    with pytest.raises(TopologyError, match="first server must be 'localhost'"):
        parse_servers(["b", "localhost"])


# A process that builds a cluster network and then dies by SIGKILL together with its guardian
# (as a whole cgroup would), leaving both servers dirty. It takes a lock file of its own: the
# test holds this machine's lock throughout, so nobody else's cleanup can see (or tidy) the
# wreck before `cleanup_servers` does.
_CRASH = """
import sys
from testbed import lifeline
from testbed.nsserver import NetnsServer
from testbed.topologies import LeafSpine, TestbedNet
srv = NetnsServer(3).__enter__()
topo = LeafSpine(leaves=2, spines=1, hosts_per_leaf=1, bw_mbps=100)  # bridges: quick to build
net = TestbedNet(topo, servers=["localhost", srv.server]).__enter__()
print(srv.key, srv.address, net.placement["tbl2"], lifeline._owned["guardian"].proc.pid,
      flush=True)
sys.stdin.read()
"""


@pytest.mark.mininet
def test_cleanup_on_both_servers_after_a_crash_leaves_nothing():
    why = nsserver.available()
    if why:
        pytest.skip(f"no netns server here: {why}")
    from testbed.cleanup import leftovers
    from testbed.netlock import emulation_lock
    from testbed.topologies.cluster import cleanup_servers

    key = None
    with emulation_lock(timeout=600):
        proc = subprocess.Popen([sys.executable, "-c", _CRASH], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "TESTBED_LOCK": _CRASH_LOCK})
        try:
            line = proc.stdout.readline().split()
            assert len(line) == 4 and line[2] == "tb-srv3", line
            key, address, _, guardian = line
            os.kill(int(guardian), signal.SIGKILL)  # first: it would tidy this machine's half
            os.killpg(proc.pid, signal.SIGKILL)  # the owner and its ssh clients die at once
            proc.wait(10)
            srv = Server(address, name="tb-srv3", ssh_options=(
                "-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"))
            local, remote = cleanup_servers([srv])
            # the server's own cleanup found its half: the remote leaf's bridge and host shell
            assert "tbl2" in remote["tb-srv3"], remote
            assert not local["errors"], local
            assert any("sshd" in x for x in local["processes"]), local  # the server's sshd too
            assert not os.path.exists("/run/netns/tb-srv3")
            left = leftovers()
            assert not any(left.values()), left
            for _ in range(50):  # the server's veth goes with its namespace, asynchronously
                if not os.path.exists("/sys/class/net/tbsrv3r"):
                    break
                time.sleep(0.1)
            assert not os.path.exists("/sys/class/net/tbsrv3r")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            if key:
                shutil.rmtree(os.path.dirname(key), ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_CRASH_LOCK)


@pytest.fixture(scope="module")
def server():
    why = nsserver.available()
    if why:
        pytest.skip(f"no netns server here: {why}")
    with nsserver.NetnsServer(2) as srv:
        yield srv


def _remote_leftovers(srv) -> dict:
    """``testbed.cleanup.leftovers()`` as the server sees it, over ssh."""
    code = "import json; from testbed.cleanup import leftovers; print(json.dumps(leftovers()))"
    res = subprocess.run(srv.server.ssh_base() + [srv.server.dest, sys.executable, "-c",
                                                  json.dumps(code)],
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(res.stdout)


def _pool_processes(conn) -> dict[str, tuple[int, int]]:
    """The collectives' pool processes as a server sees them (its own ``ps``): name (``tbp-``
    a server's pool, ``tbw-`` a rank) -> (pid, parent pid)."""
    out = {}
    for line in conn.run("ps -eo pid=,ppid=,stat=,comm=", check=False).splitlines():
        pid, ppid, stat, comm = line.split(None, 3)
        if comm.startswith(("tbp-", "tbw-")) and not stat.startswith("Z"):  # Z: dead
            out[comm.strip()] = (int(pid), int(ppid))
    return out


class _PoolWatch:
    """Watches a server's process table (its own ``ps``, in a loop on the server) while a
    collective runs, keeping every view that shows the server's pool ``name``, with that
    pool's network namespace and the server's own."""

    def __init__(self, conn, name: str):
        loop = (f"while :; do ps -eo pid=,ppid=,stat=,comm=; for p in $(pgrep -x {name}); do "
                "echo ns $(readlink /proc/$p/ns/net /proc/self/ns/net); done; echo ---; "
                "sleep 0.01; done")
        self.name = name
        self.seen: list[dict] = []
        self.proc = subprocess.Popen(conn.argv(loop), stdout=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        procs, ns = {}, []
        for line in self.proc.stdout:
            if line.startswith("---"):
                if self.name in procs and len(ns) == 2:  # else the pool exited meanwhile
                    self.seen.append({"procs": procs, "ns": ns})
                procs, ns = {}, []
            elif line.startswith("ns "):
                ns = line.split()[1:]
            else:
                pid, ppid, stat, comm = line.split(None, 3)
                if comm.startswith(("tbp-", "tbw-")) and not stat.startswith("Z"):
                    procs[comm.strip()] = (int(pid), int(ppid))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)
        self._thread.join(10)


@pytest.mark.mininet
def test_ring_and_ina_exact_across_two_servers(server):
    from testbed.collectives import CollectiveError, CollectiveSpec, run_collective
    from testbed.collectives.testing import check_rows
    from testbed.topologies import TestbedNet

    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100, switch="programmable")
    pool = f"tbp-{server.netns}"
    with TestbedNet(topo, servers=["localhost", server.server]) as net:
        assert net.placement["tbl2"] == net.placement["tbh4"] == server.netns
        # the remote half really runs on the server: its shells are ssh sessions there
        assert "ssh" in net.mininet.get("tbh4").shell.args[0]
        assert net.mininet.get("tbh4").cmd("ip -o link show tbh4-eth0").count("tbh4-eth0") == 1
        (tunnel,) = net.tunnel_report()
        assert sorted(tunnel["links"]) == ["tbl1-tbsp2", "tbl2-tbsp1"]
        assert tunnel["rate_mbps"] > 0 and tunnel["latency_ms"] is not None
        # both ends of a tunnel are VXLAN devices, shaped like every other port of a
        # programmable switch: by its engine's shape stage, not a qdisc
        for node in ("tbl1", "tbsp2"):
            peer = "tbsp2" if node == "tbl1" else "tbl1"
            sw = net.mininet.get(node)
            (intf,) = [i for i in sw.intfList() if i.link and peer in
                       (i.link.intf1.node.name, i.link.intf2.node.name)]
            assert "vxlan id" in sw.cmd(f"ip -d link show {intf.name}")
            assert " htb " not in sw.cmd(f"tc qdisc show dev {intf.name}")
            assert dict(net.programs_plan()[node])["shape"]["rate_mbps"][intf.name] == 100.0
            assert intf.name in net.counters()["datapath"][node]["stages"]["shape"]["ports"]
        assert net.describe()["cluster"]["servers"] == ["localhost", server.netns]
        conn = net.connections[server.netns]
        # long enough (about half a second each) for the watch to see the server's ranks
        for algo, extra in (("ring", {"repetitions": 6}), ("ina", {"window": 16,
                                                                   "repetitions": 3})):
            spec = CollectiveSpec(algo=algo, nbytes=4 * 200_011, timeout_s=20, seed=3, **extra)
            with _PoolWatch(conn, pool) as watch:
                rows = run_collective(net, spec)
            # a cluster network's rows carry its tunnel flag beyond the report columns
            assert all(r.pop("tunnel_bound") is False and r.pop("tunnel_why") == ""
                       for r in rows), rows
            check_rows(rows, spec, 4)
            # tbh3 and tbh4 ran in a pool started over ssh on the server: the ranks are that
            # pool's children, the pool lives in the server's network namespace, and the
            # ranks of this machine's hosts are not its children
            views = [v for v in watch.seen if {"tbw-tbh3", "tbw-tbh4"} <= set(v["procs"])]
            assert views, watch.seen
            procs, (pool_ns, server_ns) = views[0]["procs"], views[0]["ns"]
            pid = procs[pool][0]
            assert procs["tbw-tbh3"][1] == procs["tbw-tbh4"][1] == pid, procs
            assert pool_ns == server_ns != os.readlink("/proc/self/ns/net"), views[0]
            assert all(procs[w][1] != pid for w in ("tbw-tbh1", "tbw-tbh2") if w in procs)
        counters = net.switch_client("tbsp2").counters()  # through the forwarded socket
        assert counters
        # the server's pool dies mid-run: an error naming the server and its ranks, no hang
        spec = CollectiveSpec(algo="ring", nbytes=4 * 20_011, timeout_s=5, repetitions=2000)
        box: dict = {}
        runner = threading.Thread(target=lambda: box.update(err=_run_expecting_error(
            run_collective, net, spec)), daemon=True)
        t0 = time.monotonic()
        runner.start()
        while runner.is_alive() and pool not in _pool_processes(conn):
            time.sleep(0.02)
        pid = _pool_processes(conn)[pool][0]
        # the server's own cleanup sweep (testbed cleanup --servers) would find the pool
        swept = _remote_leftovers(server)["processes"]
        assert any(p.startswith(f"{pid} ") and "testbed.collectives.remotepool" in p
                   for p in swept), swept
        conn.run(f"kill -KILL {pid}")
        t_kill = time.monotonic()
        runner.join(60)
        assert not runner.is_alive(), "the collective hung after its remote pool died"
        print(f"killed pool: error after {time.monotonic() - t_kill:.1f} s "
              f"(run started {t_kill - t0:.1f} s before)")
        err = box["err"]
        assert isinstance(err, CollectiveError), err
        assert f"server {server.netns} (ranks [2, 3]: tbh3, tbh4)" in str(err), err
        t1 = time.monotonic()  # the server's ranks die with their pool (a moment later)
        while _pool_processes(conn) and time.monotonic() - t1 < 5:
            time.sleep(0.05)
        assert not _pool_processes(conn), _pool_processes(conn)
    left = _remote_leftovers(server)
    # the server's own veth and (shared /run) namespace name are the fixture's, not the net's
    left["links"] = [i for i in left["links"] if i != server.srv_if]
    left["netns"] = [n for n in left["netns"] if n != server.netns]
    # (and the files of its sshd and its client key: shared /run and /tmp)
    left["files"] = [f for f in left["files"] if f not in (server.dir, server._keydir)]
    assert not any(left.values()), left


def _run_expecting_error(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


def test_server_lock_is_held_by_the_server_until_released(server):
    """The remote emulation lock: an flock taken by a session on the server (a lock file of
    the test's own: the server shares this machine's lock, which the fixture holds)."""
    from testbed.topologies.cluster import Connection, ServerLock

    path = f"{server.dir}/test.lock"
    conn = Connection(server.server)
    try:
        lock = ServerLock(conn, timeout=5, path=path)
        busy = subprocess.run(["flock", "-n", path, "true"], check=False)
        assert busy.returncode != 0  # held on the server
        with pytest.raises(TopologyError, match="busy"):
            ServerLock(conn, timeout=0, path=path)
        lock.release()
        assert subprocess.run(["flock", "-n", path, "true"], check=False).returncode == 0
    finally:
        conn.close()


def test_doctor_checks_a_server_over_ssh(server):
    from testbed.doctor import check_servers

    (check,) = check_servers([server.server])
    assert check["name"] == f"server {server.netns}"
    assert check["status"] in ("ok", "degraded"), check  # its own doctor: required all there
    assert check["underlay"]["rate_mbps"] > 0 and check["underlay"]["latency_ms"] is not None
    (bad,) = check_servers([Server("10.250.99.2", ssh_options=("-o", "ConnectTimeout=1"))])
    assert bad["status"] == "missing" and "cannot reach" in bad["detail"]


def test_training_jobs_refuse_hosts_on_another_kernel():
    """A training job's pool enters host namespaces through this machine's /proc: a net whose
    hosts sit on another kernel is refused before anything starts, naming the hosts. (No
    second kernel is available here, so the net answers as a real cross-machine one would.)"""
    from testbed.collectives.runner import require_local_namespaces

    class CrossMachineNet:
        def hosts_on_other_kernels(self):
            return ["tbh3", "tbh4"]

    with pytest.raises(ValueError, match=r"\['tbh3', 'tbh4'\].*another server's kernel"):
        require_local_namespaces(CrossMachineNet())
    require_local_namespaces(object())  # a plain net: nothing to refuse
