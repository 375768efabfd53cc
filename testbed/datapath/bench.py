"""``testbed bench datapath``: data-path programs against anchors measured in the same run.

Topology per measurement: ``tbh1 -- tbs1 -- tbh2``; ``tbs1`` is, in turn,

* ``linux-bridge`` - the kernel bridge (ceiling),
* ``ovs-userspace`` - Open vSwitch with ``datapath_type=netdev`` (daemons started here with their
  own db/run dir under ``/run/testbed/ovs``; skipped with a reason if they cannot start),
* ``python-naive`` - a per-packet Python AF_PACKET forwarder (floor),
* ``forward`` - the engine running the forward program,
* ``aggregate`` - the engine running aggregate + forward; ``tbh1`` plays ``N_AGG_WORKERS``
  workers sending contributions in protocol order; the RESULTs are counted at ``tbh2``.

Load: a batched sender (``sendmmsg`` over a pre-built ring of frames) in ``tbh1`` at full speed
for ``DURATION_S``; the sink is the receiving interface's kernel rx counter (read in the host's
namespace, so no user-space receiver competes for the 2 cores). kpps = frames that reached the
sink per second of sending (for aggregate: RESULT packets arriving at ``tbh2``, one per
absorbed contribution; ``tbh1`` sends the contributions on behalf of workers whose address is
``tbh2``'s). Every rate is the best of ``REPS`` runs; all samples, the engine's own rx rate
and its peak CPU fraction are in the notes. Rows: ``{program, packet_bytes, kpps, gbps,
anchor, anchor_kpps, ratio}``.

The module also provides the load tools run inside hosts::

    python -m testbed.datapath.bench gen --iface tbh1-eth0 ...
    python -m testbed.datapath.bench sink --iface tbh2-eth0 ...
    python -m testbed.datapath.bench naive --ports tbs1-eth1 tbs1-eth2

Only numpy is imported at module level (the helpers must start fast inside hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from testbed.kernels.wire import HEADER_OFFSET, MsgType

BENCH_UDP_PORT = 9  # discard; the sink counts only frames to this port (or RESULTs)
N_AGG_WORKERS = 2
AGG_SLOTS = 64
#: frame sizes: 16 and 256 int32 elements behind the testbed headers (small, SwitchML default)
ELEMS = (16, 256)
DURATION_S = 2.0
#: each rate is the best of REPS runs (other processes on a shared machine can only slow it)
REPS = 3


# ------------------------------------------------------------------------------- load tools
def _mac(s: str) -> bytes:
    return bytes(int(x, 16) for x in s.split(":"))


def _ip(s: str) -> bytes:
    return bytes(int(x) for x in s.split("."))


def build_ring(mode: str, src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, elems: int,
               count: int, seed: int = 0) -> list[bytes]:
    """Frames the generator cycles through.

    ``udp``: ``count`` UDP frames to port 9 whose payload starts with a sequence number
    (``elems`` = 0: each frame a random size from 8 bytes to a full 1500-byte MTU).
    ``agg``: contributions of ``N_AGG_WORKERS`` workers for ``2*AGG_SLOTS`` chunks in protocol
    order (all workers' chunk k before chunk k+1), job 1; cycling it repeats the slot/set pattern.
    """
    from testbed.datapath.aggclient import header_bytes, udp_frame

    rng = np.random.default_rng(seed)
    sm, dm, si, di = _mac(src_mac), _mac(dst_mac), _ip(src_ip), _ip(dst_ip)
    frames = []
    if mode == "udp":
        for k in range(count):
            plen = 28 + 4 * elems if elems > 0 else int(rng.integers(8, 1473))
            body = k.to_bytes(8, "little") + rng.bytes(plen - 8)
            frames.append(udp_frame(sm, dm, si, di, 40000 + k % 64, BENCH_UDP_PORT, body))
    elif mode == "agg":
        for k in range(2 * AGG_SLOTS):
            for w in range(N_AGG_WORKERS):
                vals = rng.integers(-1000, 1000, elems, dtype=np.int32)
                data = header_bytes(int(MsgType.DATA), 1, w, k % AGG_SLOTS,
                                    (k // AGG_SLOTS) % 2, N_AGG_WORKERS, elems, k * elems)
                frames.append(udp_frame(sm, dm, si, di, 41001, 41000, data + vals.tobytes()))
    else:
        raise ValueError(f"mode must be 'udp' or 'agg', got {mode!r}")
    return frames


def save_frames(path: str, frames: list[bytes]) -> None:
    """Write frames to ``path`` (npz: concatenated bytes + lengths)."""
    data = np.frombuffer(b"".join(frames), np.uint8) if frames else np.zeros(0, np.uint8)
    np.savez(path, data=data, lens=np.array([len(f) for f in frames], np.int64))


def load_frames(path: str) -> list[bytes]:
    """Frames written by :func:`save_frames`."""
    z = np.load(path)
    data, lens = z["data"].tobytes(), z["lens"]
    offs = np.concatenate([[0], np.cumsum(lens)])
    return [data[offs[i] : offs[i + 1]] for i in range(len(lens))]


def gen(iface: str, frames: list[bytes], duration: float, count: int = 0, burst: int = 64,
        pps: float = 0.0) -> dict:
    """Send ``frames`` cyclically for ``duration`` s (or exactly ``count`` frames), batched.

    ``pps`` > 0 paces the sender (for loss-free correctness runs); 0 = as fast as possible.
    """
    from testbed.datapath.io import PacketPort

    ring = len(frames)
    reps = max(1, -(-burst // ring)) + 1  # ring repeated so any burst is a contiguous slice
    buf = np.zeros((ring * reps, 2048), np.uint8)
    lens = np.zeros(ring * reps, np.int32)
    for r in range(reps):
        for i, f in enumerate(frames):
            buf[r * ring + i, : len(f)] = np.frombuffer(f, np.uint8)
            lens[r * ring + i] = len(f)
    port = PacketPort(iface, buf, promisc=False)
    sent = 0
    pos = 0
    t0 = time.perf_counter()
    t_end = t0 + duration
    while True:
        now = time.perf_counter()
        if now >= t_end or (count and sent >= count):
            break
        n = burst if not count else min(burst, count - sent)
        if pps > 0:
            due = (sent + n) / pps - (now - t0)
            if due > 0:
                time.sleep(min(due, 0.01))
                continue
        rows = np.arange(pos, pos + n)
        done = port.send_rows(rows, lens)
        if count and done < n:  # exact-count mode: retry what the kernel refused
            port.tx_errors -= n - done
        sent += done
        pos = (pos + done) % ring
    el = time.perf_counter() - t0
    port.close()
    return {"sent": sent, "seconds": el, "tx_errors": port.tx_errors}


def sink(iface: str, duration: float, count: int = 0, save: str | None = None,
         results: bool = False, ready_file: str | None = None) -> dict:
    """Count frames to UDP port 9 (or testbed RESULTs with ``results``) arriving on ``iface``.

    Stops after ``duration`` s, 1 s after the last frame once frames flowed, or when ``count``
    frames arrived. ``save`` writes the matching frames (see :func:`save_frames`).
    """
    from testbed.datapath.io import PacketPort

    buf = np.zeros((256, 2048), np.uint8)
    lens = np.zeros(256, np.int32)
    port = PacketPort(iface, buf, promisc=False)
    if ready_file:
        open(ready_file, "w").close()
    got = 0
    nbytes = 0
    first = last = None
    saved: list[bytes] = []
    poller = select.poll()
    poller.register(port.fileno(), select.POLLIN)
    t_end = time.monotonic() + duration
    while time.monotonic() < t_end and not (count and got >= count):
        if first is not None and time.monotonic() - last > 1.0:
            break
        if not poller.poll(50):
            continue
        n = port.recv_burst(0, 256, lens)
        if not n:
            continue
        now = time.monotonic()
        fr = buf[:n]
        is_udp = (fr[:, 12] == 8) & (fr[:, 13] == 0) & (fr[:, 23] == 17)
        dport = (fr[:, 36].astype(np.int32) << 8) | fr[:, 37]
        if results:
            match = is_udp & (fr[:, HEADER_OFFSET + 3] == int(MsgType.RESULT)) & (
                ((fr[:, 34].astype(np.int32) << 8) | fr[:, 35]) == 41000)
        else:
            match = is_udp & (dport == BENCH_UDP_PORT)
        m = int(match.sum())
        if m:
            if first is None:
                first = now
            last = now
            got += m
            nbytes += int(lens[:n][match].sum())
            if save is not None:
                saved.extend(bytes(buf[i, : lens[i]]) for i in np.flatnonzero(match))
    port.close()
    span = (last - first) if first is not None and last > first else 0.0
    if save is not None:
        save_frames(save, saved)
    return {"received": got, "bytes": nbytes, "span_s": span,
            "kpps": got / span / 1e3 if span else 0.0}


def naive_forwarder(ports: list[str]) -> None:
    """Per-packet Python forwarder between ``ports`` (the benchmark's floor): recv, send."""
    socks = []
    for p in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        s.setsockopt(263, 23, 1)  # PACKET_IGNORE_OUTGOING
        s.bind((p, 3))
        s.setblocking(False)
        socks.append(s)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    by_fd = {s.fileno(): s for s in socks}
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    while not stop:
        for fd, _ in poller.poll(200):
            s = by_fd[fd]
            while True:
                try:
                    frame = s.recv(2048)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                for o in socks:
                    if o is not s:
                        try:
                            o.send(frame)
                        except OSError:
                            pass


# ------------------------------------------------------------------------------ benchmark
def _py() -> list[str]:
    return [sys.executable, "-m", "testbed.datapath.bench"]


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


def _naive_switch_cls():
    from testbed.datapath.nodes import ProgrammableSwitch

    class PythonForwarderSwitch(ProgrammableSwitch):
        """A namespace node running the naive per-packet Python forwarder."""

        def start(self, controllers) -> None:
            for intf in self.intfList():
                if intf.name != "lo":
                    self.cmd("ip link set", intf.name, "up")
            self._disable_offloads()
            self.naive = self.popen(_py() + ["naive", f"testbed-node={self.name}", "--ports",
                                             *self.port_names()],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)

        def stop_engine(self, timeout: float = 5.0):
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

    return PythonForwarderSwitch


def _measure(variant: str, elems_list, duration: float, rx_burst: int = 256,
             reps: int = 1) -> dict[int, dict]:
    """Build tbh1--tbs1--tbh2 with ``variant`` as tbs1; return {frame bytes: sink result}."""
    from mininet.link import Link
    from mininet.net import Mininet
    from mininet.node import OVSSwitch
    from mininet.nodelib import LinuxBridge

    from testbed.datapath.aggregate import DEFAULT_AGG_IP, DEFAULT_AGG_MAC
    from testbed.datapath.nodes import ProgrammableSwitch

    if variant == "linux-bridge":
        sw = {"cls": LinuxBridge}
    elif variant == "ovs-userspace":
        sw = {"cls": OVSSwitch, "datapath": "user", "failMode": "standalone"}
    elif variant == "python-naive":
        sw = {"cls": _naive_switch_cls()}
    elif variant == "forward":
        sw = {"cls": ProgrammableSwitch, "programs": [("forward", {})], "rx_burst": rx_burst}
    elif variant == "aggregate":
        sw = {"cls": ProgrammableSwitch, "programs": [
            ("aggregate", {"jobs": {1: {"n_workers": N_AGG_WORKERS, "slots": AGG_SLOTS}},
                           "results_via": "forward"}),
            ("forward", {})], "rx_burst": rx_burst}
    else:
        raise ValueError(variant)
    net = Mininet(controller=None, build=False, autoSetMacs=True, link=Link)
    out: dict[int, dict] = {}
    try:
        h1 = net.addHost("tbh1")
        h2 = net.addHost("tbh2")
        s1 = net.addSwitch("tbs1", **sw)
        net.addLink(h1, s1)
        net.addLink(h2, s1)
        net.build()
        net.start()
        for h in (h1, h2):
            h.cmd("ethtool -K", h.defaultIntf().name, "tx off rx off gso off tso off gro off")
        # learn both MACs everywhere; static ARP so nothing but our frames flows
        h1.cmd("arp -s", h2.IP(), h2.MAC())
        h2.cmd("arp -s", h1.IP(), h1.MAC())
        h1.cmd("ping -c 2 -i 0.2", h2.IP())
        for _rep in range(reps):  # best of reps: other load on the machine only slows
            for elems in elems_list:
                if variant == "aggregate":
                    # tbh1 sends on behalf of workers living at tbh2 (results_via=forward routes
                    # the RESULTs to tbh2 by MAC), so sender and receiver are different hosts
                    # exactly as for the forwarding rows
                    mode, dst_mac, dst_ip = "agg", DEFAULT_AGG_MAC, DEFAULT_AGG_IP
                    src_mac, src_ip = h2.MAC(), h2.IP()
                else:
                    mode, dst_mac, dst_ip = "udp", h2.MAC(), h2.IP()
                    src_mac, src_ip = h1.MAC(), h1.IP()
                rx_host, rx_if = h2, h2.defaultIntf().name
                # the sink is the receiving interface's kernel counter: costs no CPU, so the
                # measurement is not capped by a user-space receiver on these 2 cores
                engine = variant in ("forward", "aggregate")
                eng0 = s1.client().counters() if engine else None
                before = _rx_packets(rx_host, rx_if)
                gen_p = h1.popen(_py() + ["gen", "--iface", h1.defaultIntf().name, "--mode", mode,
                                          "--src-mac", src_mac, "--dst-mac", dst_mac, "--src-ip",
                                          src_ip, "--dst-ip", dst_ip, "--elems", str(elems),
                                          "--duration", str(duration)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                g_out, g_err = gen_p.communicate(timeout=duration + 60)
                time.sleep(0.2)  # drain what is still in flight
                got = _rx_packets(rx_host, rx_if) - before
                try:
                    g = json.loads(g_out)
                except ValueError:
                    raise RuntimeError(f"{variant}: load generator failed: {g_err[-800:]!r}") \
                        from None
                res = {"received": got, "kpps": got / g["seconds"] / 1e3, "gen": g}
                res["frame_bytes"] = HEADER_OFFSET + 28 + 4 * elems
                if engine:
                    eng1 = s1.client().counters()
                    res["engine"] = eng1
                    # what the switch itself processed (rx on the ingress port) per second
                    rx0 = eng0["ports"]["tbs1-eth1"]["rx_packets"]
                    rx1 = eng1["ports"]["tbs1-eth1"]["rx_packets"]
                    res["engine_rx_kpps"] = (rx1 - rx0) / g["seconds"] / 1e3
                res["samples_kpps"] = out.get(elems, {}).get("samples_kpps", []) + [
                    round(res["kpps"], 1)]
                if elems not in out or res["kpps"] > out[elems]["kpps"]:
                    out[elems] = res
                else:
                    out[elems]["samples_kpps"] = res["samples_kpps"]
    finally:
        net.stop()
    return out


def _rx_packets(host, ifname: str) -> int:
    """rx packet counter of ``ifname`` read inside ``host``'s namespace (/proc/net/dev)."""
    for line in host.cmd("cat /proc/net/dev").splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            return int(rest.split()[1])
    raise RuntimeError(f"interface {ifname} not found in {host.name}")


def run_bench(duration: float = DURATION_S, elems_list=ELEMS, reps: int = REPS
              ) -> tuple[list[dict], dict]:
    """Measure every variant; return (rows, notes) (notes: skipped anchors and engine stats)."""
    from mininet.log import setLogLevel

    from testbed.netlock import emulation_lock

    setLogLevel("error")
    results: dict[str, dict] = {}
    notes: dict[str, object] = {}
    with emulation_lock():
        for variant in ("linux-bridge", "python-naive", "forward", "aggregate"):
            results[variant] = _measure(variant, elems_list, duration, reps=reps)
        ovs = OVSDaemons()
        try:
            ovs.start()
            results["ovs-userspace"] = _measure("ovs-userspace", elems_list, duration, reps=reps)
        except Exception as e:  # noqa: BLE001 - any failure skips this anchor with the reason
            notes["ovs-userspace"] = f"skipped: {e}"
        finally:
            ovs.stop()
    rows = []
    anchors = [a for a in ("linux-bridge", "ovs-userspace", "python-naive") if a in results]
    notes["samples_kpps"] = {f"{v}/{HEADER_OFFSET + 28 + 4 * e}B": results[v][e]["samples_kpps"]
                             for v in results for e in elems_list}
    for program in ("forward", "aggregate"):
        for elems in elems_list:
            r = results[program][elems]
            kpps = r["kpps"]
            for a in anchors:
                akpps = results[a][elems]["kpps"]
                rows.append({
                    "program": program, "packet_bytes": r["frame_bytes"],
                    "kpps": round(kpps, 1),
                    "gbps": round(kpps * 1e3 * r["frame_bytes"] * 8 / 1e9, 3),
                    "anchor": a, "anchor_kpps": round(akpps, 1),
                    "ratio": round(kpps / akpps, 3) if akpps else None,
                })
            eng = r.get("engine", {})
            notes[f"{program}/{r['frame_bytes']}B"] = {
                "cpu_max": eng.get("cpu_max"), "max_burst": eng.get("max_burst"),
                "engine_rx_kpps": round(r.get("engine_rx_kpps", 0.0), 1),
                "offered_kpps": round(r["gen"]["sent"] / r["gen"]["seconds"] / 1e3, 1),
            }
    return rows, notes


def main(json_out: bool = False) -> int:
    """Run the benchmark and print its rows (JSON lines with ``json_out``, else a table)."""
    if os.geteuid() != 0:
        print("testbed bench datapath needs root (it builds Mininet networks)", file=sys.stderr)
        return 2
    rows, notes = run_bench()
    if json_out:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"notes": notes}))
        return 0
    print(f"{'program':<10} {'bytes':>6} {'kpps':>8} {'Gb/s':>7}  {'anchor':<14} "
          f"{'anchor kpps':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['program']:<10} {r['packet_bytes']:>6} {r['kpps']:>8} {r['gbps']:>7}  "
              f"{r['anchor']:<14} {r['anchor_kpps']:>11} {r['ratio']!s:>6}")
    for k, v in notes.items():
        print(f"# {k}: {v}")
    return 0


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="data-path benchmark and its load tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("--iface", required=True)
    g.add_argument("--mode", default="udp", choices=["udp", "agg"])
    g.add_argument("--src-mac", required=True)
    g.add_argument("--dst-mac", required=True)
    g.add_argument("--src-ip", required=True)
    g.add_argument("--dst-ip", required=True)
    g.add_argument("--elems", type=int, default=256)
    g.add_argument("--ring", type=int, default=256)
    g.add_argument("--duration", type=float, default=DURATION_S)
    g.add_argument("--count", type=int, default=0)
    g.add_argument("--pps", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save", help="write the frames sent (npz) for comparison")
    g.add_argument("--load", help="send the frames of this npz (save_frames) instead")
    s = sub.add_parser("sink")
    s.add_argument("--iface", required=True)
    s.add_argument("--duration", type=float, default=DURATION_S + 4)
    s.add_argument("--count", type=int, default=0)
    s.add_argument("--save")
    s.add_argument("--results", action="store_true")
    s.add_argument("--ready-file")
    n = sub.add_parser("naive")
    n.add_argument("marker", nargs="?", help="testbed-node=<name>")
    n.add_argument("--ports", nargs="+", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "gen":
        if a.load:
            frames = load_frames(a.load)
        else:
            frames = build_ring(a.mode, a.src_mac, a.dst_mac, a.src_ip, a.dst_ip, a.elems,
                                a.count or a.ring, a.seed)
        if a.save:
            save_frames(a.save, frames)
        print(json.dumps(gen(a.iface, frames, a.duration if not a.count else 3600, a.count,
                             pps=a.pps)))
    elif a.cmd == "sink":
        print(json.dumps(sink(a.iface, a.duration, a.count, a.save, a.results, a.ready_file)))
    else:
        naive_forwarder(a.ports)
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
