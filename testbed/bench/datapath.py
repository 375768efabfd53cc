"""``testbed bench datapath``: data-path programs against anchors measured in the same run.

Network per measurement: a :class:`~testbed.topologies.Star` of two hosts, ``tbh1 -- tbs1 --
tbh2`` with unshaped links, built by :class:`~testbed.topologies.net.TestbedNet` like every
network; ``tbs1`` is, in turn,

* ``linux-bridge`` - the kernel bridge (ceiling),
* ``ovs-userspace`` - Open vSwitch with ``datapath_type=netdev`` (daemons started here with their
  own db/run dir under ``/run/testbed/ovs``; skipped with a reason if they cannot start),
* ``python-naive`` - a per-packet Python AF_PACKET forwarder (floor),
* ``engine-mmsg`` - the engine's forward program moving packets with ``recvmmsg``/``sendmmsg``
  instead of its PACKET_MMAP rings (what the rings are measured against),
* ``forward`` - the engine running the forward program,
* ``aggregate`` - the engine running aggregate + forward; ``tbh1`` plays ``N_AGG_WORKERS``
  workers sending contributions in protocol order; the RESULTs are counted at ``tbh2``.

The programs run exactly as written (a learning ``forward``), so the figures compare with the
anchors, which learn too. Load: the generator of :mod:`testbed.datapath.bench` in ``tbh1``
(bursts through a PACKET_MMAP TX ring) at full speed for ``duration`` seconds; the sink is the
receiving interface's kernel rx counter (read in the host's namespace, so no user-space receiver
competes for the CPUs). kpps = frames that reached the sink per second of sending. The
aggregate program is measured differently (a lost contribution wedges its slot): kpps is the
highest paced rate at which every contribution came back as a RESULT (see
:func:`_lossless_rate`). Every rate is the best of ``reps`` runs. The notes give, per variant
and size, the rate the generator's interface offered (``offered_kpps``), the generator's and
the engine's CPU per frame, the engine's own rx rate and its RX ring drops, every sample, the
CPU model and the load average before and after.

Rows (:func:`bench_row`): ``{program, packet_bytes, kpps, gbps, anchor, anchor_kpps, ratio}``,
printed by the benchmarks' one table renderer
(:func:`testbed.collectives.report.render_table`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from mininet.log import setLogLevel
from mininet.node import OVSSwitch

from testbed.bench.protocol import Outcome, parse_ints
from testbed.datapath.bench import (
    AGG_SLOTS,
    AGG_SPORT,
    BENCH_UDP_PORT,
    N_AGG_WORKERS,
)
from testbed.datapath.nodes import ProgrammableSwitch
from testbed.experiment.results import cpu_model
from testbed.kernels.wire import HEADER_OFFSET, TESTBED_UDP_PORT
from testbed.netlock import emulation_lock
from testbed.topologies import AGGREGATOR_IP, AGGREGATOR_MAC, Star
from testbed.topologies.base import host_ip, host_mac
from testbed.topologies.net import TestbedNet
from testbed.topologies.pipeline import DatapathOptions

ANCHORS = ("linux-bridge", "ovs-userspace", "python-naive", "engine-mmsg")
PROGRAMS = ("forward", "aggregate")
COLUMNS = ("program", "packet_bytes", "kpps", "gbps", "anchor", "anchor_kpps", "ratio")
HEADERS = ("program", "bytes", "kpps", "Gb/s", "anchor", "anchor kpps", "ratio")
#: RX ring slots of the aggregate variant's engine (paced bursts and a descheduled engine)
AGG_RX_RING_FRAMES = 16384
#: the lossless search of the aggregate program: first rate, ceiling, bisection steps
AGG_START_KPPS = 50.0
AGG_MAX_KPPS = 3200.0
AGG_BISECT = 3
#: seconds of each trial of the lossless search
AGG_TRIAL_S = 1.0


def _py() -> list[str]:
    return [sys.executable, "-m", "testbed.datapath.bench"]


def frame_bytes(elems: int) -> int:
    """Bytes of a benchmark frame carrying ``elems`` int32 elements behind the headers."""
    return HEADER_OFFSET + 28 + 4 * elems


def bench_row(program: str, packet_bytes: int, kpps: float, anchor: str,
              anchor_kpps: float) -> dict:
    """One benchmark row; ``ratio`` = program kpps over anchor kpps (higher: the program
    forwards more)."""
    return {"program": program, "packet_bytes": packet_bytes, "kpps": round(kpps, 1),
            "gbps": round(kpps * 1e3 * packet_bytes * 8 / 1e9, 3), "anchor": anchor,
            "anchor_kpps": round(anchor_kpps, 1),
            "ratio": round(kpps / anchor_kpps, 3) if anchor_kpps else None}


class OVSDaemons:
    """ovsdb-server + ovs-vswitchd with their own db/run dir (so we touch no system OVS)."""

    def __init__(self, rundir: str = "/run/testbed/ovs"):
        self.rundir = rundir
        self.started = False
        self.env_old: dict[str, str | None] = {}

    def start(self) -> None:
        """Start both daemons; raise RuntimeError with a reason if they cannot start."""
        for tool in ("ovsdb-tool", "ovsdb-server", "ovs-vswitchd", "ovs-vsctl"):
            if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}"):
                raise RuntimeError(f"{tool} not installed (apt-get install openvswitch-switch)")
        schema = "/usr/share/openvswitch/vswitch.ovsschema"
        os.makedirs(self.rundir, exist_ok=True)
        db = os.path.join(self.rundir, "conf.db")
        if os.path.exists(db):
            os.unlink(db)
        env = dict(os.environ, OVS_RUNDIR=self.rundir, OVS_DBDIR=self.rundir,
                   OVS_LOGDIR=self.rundir)
        run = lambda *c: subprocess.run(c, env=env, capture_output=True, text=True,  # noqa: E731
                                        timeout=30)
        r = run("ovsdb-tool", "create", db, schema)
        if r.returncode:
            raise RuntimeError(f"ovsdb-tool create failed: {r.stderr.strip()}")
        sock = os.path.join(self.rundir, "db.sock")
        r = run("ovsdb-server", db, f"--remote=punix:{sock}", "--pidfile", "--detach",
                f"--log-file={self.rundir}/ovsdb-server.log", "--no-chdir")
        if r.returncode:
            raise RuntimeError(f"ovsdb-server failed: {r.stderr.strip()}")
        self.started = True
        run("ovs-vsctl", f"--db=unix:{sock}", "--no-wait", "init")
        r = run("ovs-vswitchd", f"unix:{sock}", "--pidfile", "--detach", "--no-chdir",
                f"--log-file={self.rundir}/ovs-vswitchd.log")
        if r.returncode:
            raise RuntimeError(f"ovs-vswitchd failed: {r.stderr.strip()}")
        for k in ("OVS_RUNDIR", "OVS_DBDIR", "OVS_LOGDIR"):
            self.env_old[k] = os.environ.get(k)
            os.environ[k] = self.rundir  # Mininet's ovs-vsctl calls inherit this

    def stop(self) -> None:
        """Stop the daemons we started (by their pidfiles) and restore the environment."""
        for name in ("ovs-vswitchd", "ovsdb-server"):
            pidf = os.path.join(self.rundir, f"{name}.pid")
            try:
                with open(pidf) as fh:
                    pid = int(fh.read().strip())
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(pid, 0)
                    time.sleep(0.05)
                os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        for k, v in self.env_old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.rundir, ignore_errors=True)


class PythonForwarderSwitch(ProgrammableSwitch):
    """A namespace node running the naive per-packet Python forwarder instead of the engine."""

    def start(self, controllers) -> None:
        """Bring the ports up and start the forwarder."""
        for intf in self.intfList():
            if intf.name != "lo":
                self.cmd("ip link set", intf.name, "up")
        self._disable_offloads()
        self.naive = self.popen(_py() + ["naive", f"testbed-node={self.name}", "--ports",
                                         *self.port_names()],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop_engine(self, timeout: float = 5.0):
        """Stop the forwarder (it keeps no counters)."""
        p = getattr(self, "naive", None)
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.naive = None
        return None


def network(variant: str, rx_burst: int = 256) -> TestbedNet:
    """The (not yet started) two-host star with ``variant`` as ``tbs1``."""
    if variant in PROGRAMS or variant == "engine-mmsg":
        progs = [("forward", {})]
        if variant == "aggregate":
            # tbh1 sends on behalf of N_AGG_WORKERS workers living at tbh2 (see _measure)
            members = [{"worker": w, "mac": host_mac(1), "ip": host_ip(1), "port": AGG_SPORT,
                        "ingress": "tbs1-eth1"} for w in range(N_AGG_WORKERS)]
            progs.insert(0, ("aggregate", {
                "jobs": {1: {"slots": AGG_SLOTS, "seq0": 0, "members": members}},
                "results_via": "forward"}))
        topo = Star(2, bw_mbps=None, switch="programmable", programs={"tbs1": progs},
                    aggregator="tbs1" if variant == "aggregate" else None)
        opts = {"rx_burst": rx_burst, "io": "mmsg" if variant == "engine-mmsg" else "ring"}
        if variant == "aggregate":  # the lossless search sends paced bursts: absorb them
            opts["rx_ring_frames"] = AGG_RX_RING_FRAMES
        return TestbedNet(topo, engine_opts=opts, datapath=DatapathOptions(explicit_programs=True))
    nodes = {"linux-bridge": None,
             "ovs-userspace": {"cls": OVSSwitch, "datapath": "user", "failMode": "standalone"},
             "python-naive": {"cls": PythonForwarderSwitch}}
    if variant not in nodes:
        raise ValueError(f"variant must be one of {ANCHORS + PROGRAMS}, got {variant!r}")
    node = nodes[variant]
    return TestbedNet(Star(2, bw_mbps=None),
                      switch_nodes={"tbs1": node} if node is not None else None)


def _engine_totals(client) -> tuple[int, float, int]:
    """(frames received on all ports, CPU-seconds, frames the kernel dropped at its RX) of an
    engine."""
    c = client.counters()
    ports = c["ports"].values()
    return (sum(p["rx_packets"] for p in ports), float(c["cpu_seconds"]),
            sum(p.get("rx_kernel_drops", 0) for p in ports))


def _send(h1, mode: str, elems: int, addrs: tuple, duration: float, count: int = 0,
          pps: float = 0.0, seq_step: int = 0) -> dict:
    """Run the generator in ``h1`` (to completion) and return its JSON report."""
    src_mac, dst_mac, src_ip, dst_ip = addrs
    cmd = _py() + ["gen", "--iface", h1.defaultIntf().name, "--mode", mode, "--src-mac",
                   src_mac, "--dst-mac", dst_mac, "--src-ip", src_ip, "--dst-ip", dst_ip,
                   "--elems", str(elems), "--duration", str(duration)]
    if count:
        cmd += ["--count", str(count), "--pps", str(pps)]
    if seq_step:
        cmd += ["--seq-step", str(seq_step)]
    p = h1.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=duration + 120)
    try:
        return json.loads(out)
    except ValueError:
        raise RuntimeError(f"load generator failed: {err[-800:]!r}") from None


def _measure(variant: str, elems_list, duration: float, rx_burst: int = 256,
             reps: int = 1) -> dict[int, dict]:
    """Build tbh1--tbs1--tbh2 with ``variant`` as tbs1; return {elems: best result}.

    A result: ``kpps`` (frames at the sink per second of sending), ``offered_kpps`` (frames
    the generator's interface sent or dropped, per second), the generator's CPU per frame and,
    for the engine, its CPU per received frame and its RX drops. ``aggregate`` is measured by
    :func:`_lossless_rate` instead (its rounds wedge when a contribution is lost).
    """
    out: dict[int, dict] = {}
    with network(variant, rx_burst) as net:
        h1, h2 = net.hosts
        s1 = net.mininet.get("tbs1")
        h1.cmd("ping -c 2 -i 0.2", h2.IP())  # the switches learn both MACs
        quiet_sink(h2)
        engine = variant in PROGRAMS or variant == "engine-mmsg"
        tx_if, rx_if = h1.defaultIntf().name, h2.defaultIntf().name
        for _rep in range(reps):  # best of reps: other load on the machine only slows
            for elems in elems_list:
                if variant == "aggregate":
                    res = _lossless_rate(s1.client(), h1, h2, elems, duration)
                else:
                    res = _blast(s1.client() if engine else None, h1, h2, elems, duration,
                                 tx_if, rx_if)
                res["samples_kpps"] = out.get(elems, {}).get("samples_kpps", []) + [
                    round(res["kpps"], 1)]
                if elems not in out or res["kpps"] > out[elems]["kpps"]:
                    out[elems] = res
                else:
                    out[elems]["samples_kpps"] = res["samples_kpps"]
    return out


def quiet_sink(host) -> None:
    """Drop the benchmark's frames (UDP to port 9, RESULTs from port 41000) as they enter
    ``host``, before its IP stack: the interface's rx counter (the sink) still counts them, but
    the host no longer parses them, checks their checksum and tries to answer with ICMP. That
    work ran on the CPU of whoever delivered the frame (the switch's sender), so it made every
    variant look slower than its forwarding. The drop: a tc ingress filter redirecting to an
    interface that is down (``tbsnk0``, inside the host's namespace, which takes it along)."""
    intf = host.defaultIntf().name
    host.cmd("ip link add tbsnk0 type veth peer name tbsnk1")
    host.cmd(f"tc qdisc add dev {intf} clsact")
    for match in (f"match ip dport {BENCH_UDP_PORT} 0xffff",
                  f"match ip sport {TESTBED_UDP_PORT} 0xffff"):
        out = host.cmd(f"tc filter add dev {intf} ingress protocol ip prio 1 u32 match ip "
                       f"protocol 17 0xff {match} action mirred egress redirect dev tbsnk0")
        if out.strip():
            raise RuntimeError(f"{host.name}: cannot install the sink's drop filter: {out}")


def _blast(client, h1, h2, elems: int, duration: float, tx_if: str, rx_if: str) -> dict:
    """The generator at full speed for ``duration``: what reaches ``h2`` per second."""
    # the sink is the receiving interface's kernel counter: costs no CPU, so the
    # measurement is not capped by a user-space receiver on a shared machine
    eng0 = _engine_totals(client) if client else None
    tx0, rx0 = _if_counters(h1, tx_if), _if_counters(h2, rx_if)
    g = _send(h1, "udp", elems, (h1.MAC(), h2.MAC(), h1.IP(), h2.IP()), duration)
    time.sleep(0.2)  # drain what is still in flight
    tx1, rx1 = _if_counters(h1, tx_if), _if_counters(h2, rx_if)
    sec = g["seconds"]
    res = {"received": rx1["rx_packets"] - rx0["rx_packets"], "gen": g,
           "offered_kpps": (tx1["tx_packets"] + tx1["tx_dropped"] - tx0["tx_packets"]
                            - tx0["tx_dropped"]) / sec / 1e3,
           "gen_us_per_pkt": g["cpu_s"] / g["sent"] * 1e6 if g["sent"] else None}
    res["kpps"] = res["received"] / sec / 1e3
    if client:
        pk1, cpu1, drop1 = _engine_totals(client)
        pk0, cpu0, drop0 = eng0
        res["engine_rx_kpps"] = (pk1 - pk0) / sec / 1e3
        res["engine_us_per_pkt"] = (cpu1 - cpu0) / (pk1 - pk0) * 1e6 if pk1 > pk0 else None
        res["engine_rx_drops"] = drop1 - drop0
    return res


def _lossless_rate(client, h1, h2, elems: int, duration: float) -> dict:
    """Highest paced rate (kpps) at which every contribution of the aggregate program's
    generator comes back as a RESULT (RFC 2544 throughput: no loss at all).

    At full speed the aggregate program cannot be measured: a contribution lost anywhere (a full
    RX ring while the engine waits for a CPU) leaves its round open forever, so that slot takes
    no further rounds and the RESULT rate collapses. Each trial sends whole passes over the
    generator's ring at a paced rate, from round 0 of a freshly reset job; the rate doubles from
    ``AGG_START_KPPS`` until a trial loses a frame (``lossy_kpps``: the lowest such rate), then
    bisects ``AGG_BISECT`` times.
    """
    # tbh1 sends on behalf of workers living at tbh2 (results_via=forward routes the RESULTs
    # to tbh2 by MAC), so sender and receiver are different hosts exactly as for forwarding
    addrs = (h2.MAC(), AGGREGATOR_MAC, h2.IP(), AGGREGATOR_IP)
    rx_if = h2.defaultIntf().name
    ring = 2 * AGG_SLOTS * N_AGG_WORKERS  # frames per pass over the generator's ring
    trials = []

    def trial(kpps: float) -> bool:
        count = max(1, round(kpps * 1e3 * duration / ring)) * ring
        client.reset_job(1)  # each generator run starts at round 0 again
        before = _if_counters(h2, rx_if)["rx_packets"]
        g = _send(h1, "agg", elems, addrs, duration + 30, count=count, pps=kpps * 1e3,
                  seq_step=2)
        time.sleep(0.2)
        got = _if_counters(h2, rx_if)["rx_packets"] - before
        sent_kpps = g["sent"] / g["seconds"] / 1e3
        # lossless, and the generator kept the pace (else the rate was not tested)
        ok = got >= g["sent"] == count and sent_kpps >= 0.9 * kpps
        trials.append({"kpps": round(kpps, 1), "sent_kpps": round(sent_kpps, 1),
                       "results": got, "contributions": g["sent"], "ok": ok})
        return ok

    lo, hi = 0.0, AGG_START_KPPS
    while trial(hi):
        lo, hi = hi, hi * 2
        if hi > AGG_MAX_KPPS:
            break
    for _ in range(AGG_BISECT):
        mid = (lo + hi) / 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    best = max((t for t in trials if t["ok"]), key=lambda t: t["sent_kpps"], default=None)
    return {"kpps": best["sent_kpps"] if best else 0.0, "trials": trials, "lossy_kpps": hi}


def _if_counters(host, ifname: str) -> dict:
    """Kernel counters of ``ifname`` read inside ``host``'s namespace (/proc/net/dev)."""
    for line in host.cmd("cat /proc/net/dev").splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            f = [int(x) for x in rest.split()]
            return {"rx_packets": f[1], "rx_dropped": f[3], "tx_packets": f[9],
                    "tx_dropped": f[11]}
    raise RuntimeError(f"interface {ifname} not found in {host.name}")


def run_bench(*, duration: float, elems_list, reps: int) -> tuple[list[dict], dict]:
    """Measure every variant; return (rows, notes) (notes: skipped anchors, rates offered,
    CPU per frame of generator and engine, machine). Each rate is the best of ``reps`` runs
    (other processes on a shared machine can only slow it); the defaults are the catalog's
    (:mod:`testbed.bench.protocol`: 16 and 256 int32 elements per frame, small and SwitchML's
    default)."""
    setLogLevel("error")
    results: dict[str, dict] = {}
    notes: dict[str, object] = {"cpu_model": cpu_model(), "loadavg": os.getloadavg()}
    with emulation_lock():  # one lock for the whole run: no other network interleaves
        for variant in ("linux-bridge", "python-naive", "engine-mmsg", *PROGRAMS):
            if variant == "aggregate":  # the search is many trials already: one, short ones
                results[variant] = _measure(variant, elems_list, min(duration, AGG_TRIAL_S))
            else:
                results[variant] = _measure(variant, elems_list, duration, reps=reps)
        ovs = OVSDaemons()
        try:
            ovs.start()
            results["ovs-userspace"] = _measure("ovs-userspace", elems_list, duration, reps=reps)
        except Exception as e:  # noqa: BLE001 - any failure skips this anchor with the reason
            notes["ovs-userspace"] = f"skipped: {e}"
        finally:
            ovs.stop()
    notes["loadavg_end"] = os.getloadavg()
    anchors = [a for a in ANCHORS if a in results]
    notes["samples_kpps"] = {f"{v}/{frame_bytes(e)}B": results[v][e]["samples_kpps"]
                             for v in results for e in elems_list}
    rows = []
    for program in PROGRAMS:
        for elems in elems_list:
            r = results[program][elems]
            rows += [bench_row(program, frame_bytes(elems), r["kpps"], a,
                               results[a][elems]["kpps"]) for a in anchors]
    for v in results:
        for elems in elems_list:
            r = results[v][elems]
            notes[f"{v}/{frame_bytes(elems)}B"] = {
                k: round(r[k], 2) if isinstance(r[k], float) else r[k]
                for k in ("offered_kpps", "lossy_kpps", "gen_us_per_pkt", "engine_rx_kpps",
                          "engine_us_per_pkt", "engine_rx_drops", "trials") if k in r}
    return rows, notes


def measure(emit, quick: bool, duration: float, reps: int, elems: str) -> Outcome:
    """``testbed bench datapath`` (:mod:`testbed.bench.protocol`): every variant at each
    frame size of ``elems`` (int32 elements per frame, comma-separated)."""
    elems_list = parse_ints("elems", elems)
    rows, notes = run_bench(duration=duration, elems_list=elems_list, reps=reps)
    return Outcome(rows, notes)
