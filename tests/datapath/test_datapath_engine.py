"""Engine, forward program, control channel and Mininet nodes (real packets, real namespaces)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.datapath.aggclient import udp_frame
from testbed.datapath.batch import PORT_DROP, PORT_FLOOD, PORT_UNSET, Batch, Stage
from testbed.datapath.control import ControlError, socket_path
from testbed.datapath.engine import (
    COALESCE_MAX_FACTOR,
    DEFAULT_COALESCE_US,
    MAX_COALESCE_US,
    MIN_FRAME_BYTES,
    MIN_RX_RING_FRAMES,
    RX_ABSORB_S,
    RX_RING_FRAMES,
    Engine,
    at_once,
    make_stage,
    normalize_programs,
    rx_ring_frames,
)
from testbed.datapath.forward import ForwardStage, forward_reference, mac_to_int

PY = [sys.executable, "-m", "testbed.datapath.bench"]
MACS = [bytes([2, 0, 0, 0, 0, k]) for k in range(1, 6)]


def _frame(rng, dst, src, kind):
    if kind == "short":
        return bytes(rng.integers(0, 256, int(rng.integers(1, 14)), dtype=np.uint8))
    if kind == "l2":
        return dst + src + b"\x88\xb5" + bytes(int(rng.integers(0, 60)))
    ip_s = bytes([10, 0, 0, int(rng.integers(1, 6))])
    ip_d = bytes([10, 0, 0, int(rng.integers(1, 6))])
    f = bytearray(udp_frame(src, dst, ip_s, ip_d, int(rng.integers(1, 65535)),
                            int(rng.integers(1, 65535)), bytes(int(rng.integers(0, 40)))))
    if kind == "badver":
        f[14] = 0x65
    elif kind == "badihl":
        f[14] = 0x43
    elif kind == "badtot":
        f[16:18] = (len(f) - 10).to_bytes(2, "big")
    elif kind == "trunc":
        f = f[: int(rng.integers(14, 34))]
    return bytes(f)


kinds = st.sampled_from(["ok"] * 6 + ["l2", "short", "badver", "badihl", "badtot", "trunc"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(-1, 3), kinds,
                          st.booleans()), min_size=1, max_size=60),
       st.booleans(), st.booleans(), st.integers(0, 2**32))
def test_forward_kernel_matches_reference(pkts, flood, use_l3, seed):
    """Random frames (valid, broken IPv4, runts, broadcast) through kernel and Python twin."""
    rng = np.random.default_rng(seed)
    l2 = {MACS[0].hex(":"): 0, MACS[1].hex(":"): [1, 2, 3]}  # static + an ECMP group
    l3 = {"10.0.0.4": [2, 3]} if use_l3 else {}
    st_ = ForwardStage(ports=["a", "b", "c", "d"], l2=l2, l3=l3, flood=flood)
    ref_l2 = {mac_to_int(MACS[0]): [0], mac_to_int(MACS[1]): [1, 2, 3]}
    ref_l3 = {0x0A000004: [2, 3]} if use_l3 else {}
    learned: dict[int, int] = {}
    frames, ports = [], []
    for d, s, p, kind, bcast in pkts:
        dst = b"\xff" * 6 if bcast else MACS[d]
        frames.append(_frame(rng, dst, MACS[s], kind))
        ports.append(p)
    b = Batch(len(frames))
    for i, f in enumerate(frames):
        b.buf[i, : len(f)] = np.frombuffer(f, np.uint8)
        b.length[i] = len(f)
        b.in_port[i] = ports[i]
    b.n = len(frames)
    st_.process(b, 0)
    got = [(int(b.out_port[i]), int(b.reason[i])) for i in range(b.n)]
    exp = forward_reference(frames, ports, ref_l2, ref_l3, learned, True, flood, True)
    assert got == exp


def test_forward_decided_packets_untouched_and_ecmp_spreads():
    """Packets decided earlier are left alone; an ECMP group uses all members per flow."""
    st_ = ForwardStage(ports=["a", "b", "c"], l2={"02:00:00:00:00:09": ["b", "c"]},
                       learn=False)
    rng = np.random.default_rng(0)
    b = Batch(200)
    for i in range(200):
        f = udp_frame(b"\x02\0\0\0\0\1", b"\x02\0\0\0\0\x09", bytes([10, 0, 0, 1]),
                      bytes([10, 0, 0, 9]), 1000 + i, 2000, bytes(10))
        b.buf[i, : len(f)] = np.frombuffer(f, np.uint8)
        b.length[i] = len(f)
        b.in_port[i] = 0
    b.n = 200
    b.out_port[0] = PORT_DROP
    st_.process(b, 0)
    assert b.out_port[0] == PORT_DROP
    used = set(b.out_port[1:].tolist())
    assert used == {1, 2}
    b2 = Batch(200)  # same flows again -> same members
    b2.buf[:] = b.buf
    b2.length[:] = b.length
    b2.in_port[:] = 0
    b2.n = 200
    st_.process(b2, 0)
    assert np.array_equal(b2.out_port[1:], b.out_port[1:])
    del rng


def test_bad_config_errors_name_the_parameter():
    """Bad programs/settings fail with a message naming what to fix."""
    with pytest.raises(ValueError, match="unknown program 'nope'"):
        make_stage("nope", {}, ["a"])
    with pytest.raises(ValueError, match="no programs configured"):
        normalize_programs([])
    with pytest.raises(ValueError, match="unknown port 'zz'"):
        ForwardStage(ports=["a"], l2={"02:00:00:00:00:01": "zz"})
    with pytest.raises(ValueError, match="bad MAC address"):
        ForwardStage(ports=["a"], l2={"02:00:00": 0})
    with pytest.raises(ValueError, match="rx_burst"):
        Engine({"ports": ["a"], "programs": ["forward"], "rx_burst": 0})
    with pytest.raises(ValueError, match="flood port"):
        Engine({"ports": ["a"], "programs": ["forward"], "flood_ports": ["b"]})
    eng = Engine({"ports": ["a", "b"], "programs": ["forward", "wire"]})
    assert [s.name for s in eng.stages] == ["forward", "wire"]
    with pytest.raises(ValueError, match="unknown command"):
        eng.dispatch({"cmd": "explode"})
    with pytest.raises(ValueError, match="no aggregate stage"):
        eng.dispatch({"cmd": "reset_job", "job_id": 1})
    with pytest.raises(ValueError, match="unknown settings"):
        eng.dispatch({"cmd": "configure", "stage": "forward", "settings": {"bogus": 1}})
    with pytest.raises(ValueError, match="coalesce_us must be a number 0..10000"):
        Engine({"ports": ["a"], "programs": ["forward"], "coalesce_us": -1})
    with pytest.raises(ValueError, match="sched must be one of"):
        Engine({"ports": ["a"], "programs": ["forward"], "sched": "rr"})


def test_at_once_runs_every_item_together_and_keeps_order_and_errors():
    """Ports are opened and closed together (their rings' grace periods overlap): every item
    reaches a barrier of all of them, results come back in order, an error in its place."""
    import threading

    meet = threading.Barrier(4, timeout=10)

    def fn(x):
        meet.wait()  # only passes when all four run at once
        if x == 2:
            raise OSError("port 2")
        return x * 10

    out = at_once(fn, [0, 1, 2, 3])
    assert out[:2] == [0, 10] and out[3] == 30
    assert isinstance(out[2], OSError) and str(out[2]) == "port 2"
    assert at_once(fn, []) == []


def test_rx_rings_are_sized_by_the_dilated_port_rate():
    """Enough slots for what arrives in smallest frames during the longest coalescing wait
    and the CPU wait a ring absorbs; today's 2048 for unshaped or fast undilated ports."""
    assert rx_ring_frames(None, 64, 3200) == RX_RING_FRAMES
    assert rx_ring_frames(100, 1, DEFAULT_COALESCE_US) == RX_RING_FRAMES
    assert rx_ring_frames(100, 64, 3200) == MIN_RX_RING_FRAMES
    last = RX_RING_FRAMES
    for f in (1, 2, 4, 8, 16, 32, 64):
        for bw in (1, 10, 100, 1000):
            c = min(DEFAULT_COALESCE_US * f, MAX_COALESCE_US)
            n = rx_ring_frames(bw, f, c)
            assert n & (n - 1) == 0 and MIN_RX_RING_FRAMES <= n <= RX_RING_FRAMES
            arrive = bw * 1e6 / f / (8 * MIN_FRAME_BYTES) * (COALESCE_MAX_FACTOR * c * 1e-6
                                                             + RX_ABSORB_S)
            assert n >= arrive or n == RX_RING_FRAMES, (bw, f, n, arrive)
            assert n >= rx_ring_frames(bw / 2, f, c)
        assert rx_ring_frames(100, f, c) <= last
        last = rx_ring_frames(100, f, c)


def test_coalescing_wait_is_set_over_the_control_channel():
    eng = Engine({"ports": ["a"], "programs": ["forward"], "coalesce_us": 40})
    assert eng.hold_s == pytest.approx(40e-6) and eng.config["coalesce_us"] == 40
    assert eng.dispatch({"cmd": "coalesce", "us": 640}) == 640.0
    # the adaptive wait restarts from the new base, and `config` reports it
    assert eng.hold_s == pytest.approx(640e-6)
    assert eng.dispatch({"cmd": "config"})["coalesce_us"] == 640.0
    for bad in (20_000, -1, None, "800", True):
        with pytest.raises(ValueError, match=r"coalesce_us must be a number 0\.\.10000"):
            eng.dispatch({"cmd": "coalesce", "us": bad})
    assert eng.hold_s == pytest.approx(640e-6)  # a refused value changes nothing


def _engine_procs(node: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if f"testbed-node={node}".encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def _leftovers(nodes: list[str]) -> list[str]:
    found = []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for node in nodes:
        if _engine_procs(node):
            found.append(f"process testbed-node={node}")
        for suffix in (".sock", ".json", ".counters.json"):
            if os.path.exists(socket_path(node).removesuffix(".sock") + suffix):
                found.append(f"file {node}{suffix}")
        if f" {node}-eth" in links:
            found.append(f"interface {node}-eth*")
    return found


@pytest.mark.mininet
def test_forward_every_frame_intact_control_and_no_leftovers(tmp_path):
    """3000 frames of random size (up to MTU) h1->h2 arrive byte-identical, none lost;
    counters are readable while running and at the end; nothing is left behind."""
    from testbed.datapath.bench import load_frames
    from testbed.testing import programmable_star

    n = 3000
    with programmable_star(3, programs=[("forward", {})]) as (_net, (h1, h2, h3), s1):
        assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())
        sent, got = tmp_path / "sent.npz", tmp_path / "got.npz"
        sink = h2.popen(PY + ["sink", "--iface", h2.defaultIntf().name, "--count", str(n),
                              "--duration", "60", "--save", str(got), "--ready-file",
                              str(tmp_path / "ready")], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
        while not (tmp_path / "ready").exists():
            assert sink.poll() is None, sink.communicate()
        gen = h1.popen(PY + ["gen", "--iface", h1.defaultIntf().name, "--src-mac", h1.MAC(),
                             "--dst-mac", h2.MAC(), "--src-ip", h1.IP(), "--dst-ip", h2.IP(),
                             "--elems", "0", "--count", str(n), "--pps", "20000", "--save",
                             str(sent)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        g_out, g_err = gen.communicate(timeout=60)
        assert gen.returncode == 0, g_err
        s_out, s_err = sink.communicate(timeout=60)
        assert sink.returncode == 0, s_err
        assert json.loads(g_out)["sent"] == n
        tx, rx = load_frames(str(sent)), load_frames(str(got))
        assert len(rx) == n
        assert rx == tx  # every frame, in order, byte for byte
        assert max(len(f) for f in tx) > 1400
        # the packet loop is a real-time thread (a switch does not wait for the hosts'
        # CPUs); the engine's other threads stay time-shared
        assert os.sched_getscheduler(s1.engine_pid()) == os.SCHED_FIFO
        with s1.client() as c:
            assert c.config()["sched"] == "fifo" and "sched_note" not in c.config()
            live = c.counters()
            p1 = live["ports"]["tbs1-eth1"]
            assert p1["rx_packets"] >= n and live["ports"]["tbs1-eth2"]["tx_packets"] >= n
            assert live["stages"]["forward"]["unicast"] >= n
            assert "cpu" in live and "cpu_max" in live
            # h3 saw none of it: learned MACs, no flooding of known unicast
            assert live["ports"]["tbs1-eth3"]["tx_packets"] < 20
            c.configure("forward", l2={h3.MAC(): 2}, learn=False)
            with pytest.raises(ControlError, match="unknown settings"):
                c.configure("forward", colour="red")
            with pytest.raises(ControlError, match="no stage"):
                c.configure("nope", x=1)
        assert "0% packet loss" in h1.cmd("ping -c 1", h3.IP())
    assert s1.final_counters is not None
    assert s1.final_counters["ports"]["tbs1-eth1"]["rx_packets"] >= n
    assert _leftovers(["tbs1"]) == []


@pytest.mark.mininet
def test_smartnic_bump_in_the_wire():
    """h1 -- tbn1(SmartNIC wire) -- tbs1 -- tbn2 -- h2: traffic crosses both NIC engines."""
    from testbed.testing import programmable_star

    with programmable_star(2, programs=[("forward", {})], nic_programs=[("wire", {})]) as (
            net, (h1, h2), _s1):
        assert "0% packet loss" in h1.cmd("ping -c 3 -i 0.2", h2.IP())
        n1 = net.get("tbn1").client().counters()
        assert n1["ports"]["tbn1-eth1"]["rx_packets"] >= 3
        assert n1["ports"]["tbn1-eth2"]["tx_packets"] >= 3
        assert n1["stages"]["wire"]["seen"] >= 6
    assert _leftovers(["tbs1", "tbn1", "tbn2"]) == []


def test_engine_rejects_unknown_port_name():
    """A config naming an interface that does not exist fails clearly at open()."""
    eng = Engine({"ports": ["tbnosuchport0"], "programs": ["forward"]})
    with pytest.raises(ValueError, match="tbnosuchport0"):
        eng.open()
    eng.close()


def test_flood_unset_counts():
    """Engine routing: flood excludes the ingress port; undecided packets count NO_ROUTE."""
    eng = Engine({"ports": ["a", "b", "c"], "programs": ["forward"]})
    b = eng.batch
    b.n = 3
    b.in_port[:3] = [0, 1, -1]
    b.length[:3] = 100
    b.out_port[:3] = [PORT_FLOOD, PORT_UNSET, 2]
    eng._route(3)
    assert eng.tx_count.tolist() == [0, 1, 2]
    assert eng.drops[1, 12] == 1
    assert eng.rx_pk.tolist() == [1, 1, 0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(-4, 4), st.integers(-1, 2), st.integers(14, 1514),
                          st.integers(0, 19)), min_size=1, max_size=80),
       st.lists(st.booleans(), min_size=3, max_size=3))
def test_tally_and_route_matches_numpy_twin(rows, mask):
    """Per-port rx/tx/drops and the per-port send lists == the vectorised numpy twin."""
    from testbed.datapath.engine import tally_and_route, tally_reference

    n, n_ports = len(rows), 3
    out_port = np.array([r[0] for r in rows], np.int16)
    in_port = np.array([r[1] for r in rows], np.int16)
    length = np.array([r[2] for r in rows], np.int32)
    reason = np.array([r[3] for r in rows], np.uint8)
    flood = np.array(mask, np.bool_)
    tx_rows = np.zeros((n_ports, n), np.int64)
    tx_count = np.zeros(n_ports, np.int64)
    acc = [np.zeros(n_ports, np.int64) for _ in range(4)]
    drops = np.zeros((n_ports + 1, 32), np.int64)
    tally_and_route(n, out_port, in_port, length, reason, n_ports, flood, tx_rows, tx_count,
                    *acc, drops)
    ref = tally_reference(out_port, in_port, length, reason, n_ports, flood)
    for p in range(n_ports):
        assert tx_rows[p, : tx_count[p]].tolist() == ref["rows"][p].tolist()
    for got, key in zip(acc, ("rx_pk", "rx_by", "tx_pk", "tx_by"), strict=True):
        assert got.tolist() == ref[key].tolist()
    assert np.array_equal(drops, ref["drops"])


@given(st.lists(st.tuples(st.integers(-1, 1), st.integers(-4, 1)), min_size=1, max_size=50))
def test_wire_kernel_matches_numpy_twin(rows):
    """The SmartNIC wire program == its numpy twin."""
    from testbed.datapath.forward import wire_kernel, wire_reference

    in_port = np.array([r[0] for r in rows], np.int16)
    out_port = np.array([r[1] for r in rows], np.int16)
    expect = wire_reference(in_port, out_port)
    wire_kernel(in_port, out_port, len(rows))
    assert np.array_equal(out_port, expect)


class _Broken(Stage):
    """A stage that always raises (stands in for a buggy program)."""

    name = "broken"

    def process(self, batch, now_ns):
        raise RuntimeError("boom")


@pytest.mark.mininet
def test_failing_stage_drops_burst_and_engine_continues():
    """Real frames on a veth pair: a stage exception drops that burst with reason OTHER and
    is counted; the engine keeps serving."""
    from testbed.datapath.io import PacketPort
    from testbed.netlock import emulation_lock

    with emulation_lock():
        subprocess.run(["ip", "link", "add", "tbdx0", "type", "veth", "peer", "name", "tbdx1"],
                       check=True)
        eng = None
        try:
            for d in ("tbdx0", "tbdx1"):
                subprocess.run(["ip", "link", "set", d, "up"], check=True)
            eng = Engine({"node": "tbdx", "ports": ["tbdx0"], "programs": ["forward"]})
            eng.stages.insert(0, _Broken())
            eng.open()
            buf = np.zeros((4, 2048), np.uint8)
            peer = PacketPort("tbdx1", buf, promisc=False)
            f = udp_frame(b"\x02\0\0\0\0\1", b"\x02\0\0\0\0\2", bytes([10, 0, 0, 1]),
                          bytes([10, 0, 0, 2]), 1, 9, bytes(30))
            for _ in range(3):
                peer.send_one(f)
            got = 0
            for _ in range(200):
                got += eng.run_burst()
                if got >= 3:
                    break
                __import__("time").sleep(0.01)
            peer.close()
            c = eng.counters()
            assert got >= 3  # ours (+ maybe IPv6 chatter of the fresh veth)
            assert c["ports"]["tbdx0"]["rx_packets"] == got
            assert c["ports"]["tbdx0"]["drops"] == {"OTHER": got}  # every frame, counted
            assert c["stage_errors"]["broken"] >= 1
        finally:
            if eng is not None:
                eng.close()
            subprocess.run(["ip", "link", "del", "tbdx0"], check=False)


class _HeldUntil:
    """A stage holding one frame due at ``due_ns`` (only its deadline matters here)."""

    def __init__(self, due_ns):
        self.due_ns = due_ns

    def next_deadline_ns(self):
        return self.due_ns


def test_idle_engine_sleeps_until_a_sub_millisecond_deadline_instead_of_spinning():
    """poll() counts whole milliseconds: a frame due in 0.6 ms must be waited for, not polled
    for with a zero timeout (which returned at once and spun a CPU until it was due)."""
    engine = SimpleNamespace(stages=[_HeldUntil(None), _HeldUntil(time.monotonic_ns() + 600_000)],
                             hold_s=0.0)
    engine._deadline_wait_ns = lambda: Engine._deadline_wait_ns(engine)
    t0 = time.monotonic_ns()
    assert Engine._idle_wait(engine, select.poll()) == []
    assert time.monotonic_ns() - t0 >= 500_000  # a sleep never returns early
    assert Engine._deadline_wait_ns(engine) <= 0  # and it is due now
    # nothing held: None; a deadline already passed: due (<= 0)
    assert Engine._deadline_wait_ns(SimpleNamespace(stages=[_HeldUntil(None)])) is None
    assert Engine._deadline_wait_ns(SimpleNamespace(stages=[_HeldUntil(1)])) < 0
