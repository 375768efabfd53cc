"""The ``trim`` stage on batches of real frames: drain rate, trimming, drop-tail, ECN, the
plain-Python twin of the queue, and run-time configuration."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.datapath.batch import PORT_DROP, PORT_HELD, Batch, DropReason, sparse_zeros
from testbed.datapath.trim import ShapeStage, TrimStage, earliest_departure
from testbed.kernels import packets, trimming, wire
from testbed.kernels.reference import packets as ref_packets
from testbed.kernels.reference import trimming as ref_trimming

T0 = 5_000_000_000  # an arbitrary monotonic clock origin (ns)
MACS = ("02:00:00:00:00:01", "02:00:00:00:00:02")
IPS = ("10.0.0.1", "10.0.0.2")


def trim_layout_frames(m: int, count: int, seed: int = 0, bits: int = 1):
    """``count`` testbed frames carrying the trimming layout of random chunks of m values,
    plus the chunks."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(m).astype(np.float32) for _ in range(count)]
    h = wire.new_headers(count)
    h["codec"] = wire.Codec.TRIM_LAYOUT
    h["elem_count"] = m
    h["head_bytes"] = trimming.head_bytes_for(m, bits)
    h["chunk_offset"] = np.arange(count) * m
    pls = [trimming.encode(x, bits=bits, seed=seed, counter=i * m) for i, x in enumerate(xs)]
    buf, ln = packets.build(h, pls, *MACS, *IPS, 5000)
    return [bytes(buf[i, :ln[i]]) for i in range(count)], xs


def int32_frames(m: int, count: int):
    """Testbed INT32 frames (head_bytes 0: not trimmable)."""
    h = wire.new_headers(count)
    h["elem_count"] = m
    h["chunk_offset"] = np.arange(count)
    buf, ln = packets.build(h, [np.arange(m, dtype=np.int32)] * count, *MACS, *IPS, 5000)
    return [bytes(buf[i, :ln[i]]) for i in range(count)]


def load(batch: Batch, frames, out_ports, in_port=0) -> None:
    """Fill an empty batch with frames already forwarded to ``out_ports``."""
    batch.reset()
    for f, p in zip(frames, out_ports, strict=True):
        i = batch.alloc(1)
        batch.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        batch.length[i] = len(f)
        batch.in_port[i] = in_port
        batch.out_port[i] = p


def rows(batch: Batch, lo: int = 0):
    """(bytes, out_port) of rows lo.. of the batch."""
    return [(bytes(batch.buf[i, :batch.length[i]]), int(batch.out_port[i]))
            for i in range(lo, batch.n)]


def decided(batch: Batch, n: int):
    """What the stage did with the batch's first ``n`` rows, in a twin's terms: ("pass",
    bytes), ("held", None) or ("drop", None); every drop must be a full queue's."""
    out = []
    for i in range(n):
        op = int(batch.out_port[i])
        out.append(("pass", bytes(batch.buf[i, :batch.length[i]])) if op >= 0 else
                   ("held", None) if op == PORT_HELD else ("drop", None))
        if op == PORT_DROP:
            assert batch.reason[i] == DropReason.QUEUE_FULL
    return out


def sent(batch: Batch):
    """Frames the engine would transmit from this batch, in row order."""
    return [(f, p) for f, p in rows(batch) if p >= 0]


# ---------------------------------------------------------------------------------------------


def test_drain_follows_the_configured_rate_exactly():
    frames = int32_frames(256, 20)  # 1094-byte frames
    ln = len(frames[0])
    stage = TrimStage(n_ports=2, rate_mbps=10.0, threshold_bytes=10**6)
    tx_ns = ln * 8 * 1000 / 10.0  # ns per frame at 10 Mb/s
    b = Batch(64)
    load(b, frames, [1] * 20)
    stage.process(b, T0)
    assert list(b.out_port[:20]) == [1] + [PORT_HELD] * 19  # the idle port sends one at once
    total = 1
    t = 0
    while t < 25 * tx_ns:
        t += 250_000
        b.reset()
        stage.process(b, T0 + t)
        total += len(sent(b))
        assert total == min(20, 1 + int(t // tx_ns)), t
        d = stage.next_deadline_ns()
        if total < 20:
            assert d == T0 + int(np.ceil((total) * tx_ns))
        else:
            assert d is None
    c = stage.counters()["ports"]["port1"]
    assert (c["passed"], c["enqueued"], c["dequeued"], c["hwm_pkts"]) == (1, 19, 19, 19)
    assert c["hwm_bytes"] == 19 * ln and c["depth_pkts"] == 0


def test_trims_above_threshold_and_headers_go_first():
    m = 256
    frames, xs = trim_layout_frames(m, 10)
    ln = len(frames[0])
    stage = TrimStage(n_ports=2, rate_mbps=100.0, threshold_bytes=3 * ln)
    b = Batch(64)
    load(b, frames, [1] * 10)
    stage.process(b, T0)
    assert list(b.out_port[:10]) == [1] + [PORT_HELD] * 9
    c = stage.counters()["ports"]["port1"]
    assert (c["passed"], c["enqueued"], c["trimmed"], c["dropped"]) == (1, 3, 6, 0)
    out = []
    for t in range(1, 200):
        b.reset()
        stage.process(b, T0 + t * 100_000)
        out += sent(b)
    assert stage.queued() == 0 and len(out) == 9
    hb = trimming.head_bytes_for(m, 1)
    # strict priority: the six trimmed headers leave before the three queued data frames
    assert [len(f) for f, _ in out] == [wire.PAYLOAD_OFFSET + hb] * 6 + [ln] * 3
    assert [f for f, _ in out[6:]] == frames[1:4]
    for k, (f, _) in enumerate(out[:6]):
        arr = np.frombuffer(f, np.uint8).copy()
        assert packets.parse_frame(arr, len(f)) == 0  # a valid frame: lengths and flag agree
        assert ref_packets.ipv4_checksum(f[14:34]) == int.from_bytes(f[24:26], "big")
        assert wire.unpack_header(arr, wire.HEADER_OFFSET)["flags"] & wire.Flags.TRIMMED
        src = frames[4 + k]
        assert f == ref_trimming.trim_frame(src)  # the numpy twin of trim_frame agrees
        est, full = trimming.decode(arr[wire.PAYLOAD_OFFSET:], m)
        assert not full
        ref_est, _ = ref_trimming.decode(arr[wire.PAYLOAD_OFFSET:].copy(), m)
        np.testing.assert_array_equal(est, ref_est)
        x = xs[4 + k]
        s = float(np.abs(x).max())
        assert np.abs(est - x).max() <= 2 * s * (1 + 1e-6)  # one step of the 1-bit head


def test_drop_tail_mode_drops_instead_of_trimming():
    frames, _ = trim_layout_frames(256, 10)
    ln = len(frames[0])
    stage = TrimStage(n_ports=2, rate_mbps=100.0, threshold_bytes=3 * ln, mode="drop_tail")
    b = Batch(64)
    load(b, frames, [1] * 10)
    stage.process(b, T0)
    assert list(b.out_port[:10]) == [1] + [PORT_HELD] * 3 + [PORT_DROP] * 6
    assert all(b.reason[i] == DropReason.QUEUE_FULL for i in range(4, 10))
    c = stage.counters()["ports"]["port1"]
    assert (c["passed"], c["enqueued"], c["trimmed"], c["dropped"]) == (1, 3, 0, 6)


def test_shape_stage_is_a_drop_tail_link_on_the_ports_it_names():
    frames, _ = trim_layout_frames(256, 1010)  # trimmable, yet a shaping queue never trims
    ln = len(frames[0])
    stage = ShapeStage(ports=["a", "b"], rate_mbps={"b": 100.0}, burst_bytes=0)
    b = Batch(2048)
    load(b, frames[:5], [0] * 5)
    stage.process(b, T0)
    assert list(b.out_port[:5]) == [0] * 5  # port a is not shaped: nothing held
    # port b: one leaves at once, the kernel's default queue (txqueuelen, 1000) holds the next
    # 1000 and the rest are dropped, never trimmed
    load(b, frames, [1] * 1010)
    stage.process(b, T0)
    assert list(b.out_port[:1010]) == [1] + [PORT_HELD] * 1000 + [PORT_DROP] * 9
    c = stage.counters()
    assert c["mode"] == "drop_tail" and c["ports"]["b"]["trimmed"] == 0
    assert (c["ports"]["b"]["dropped"], c["ports"]["b"]["depth_pkts"]) == (9, 1000)
    # the queue drains at 100 Mb/s: after 10 frame times, 10 more have left, in order
    b.reset()
    stage.process(b, T0 + int(10 * ln * 8 * 1000 / 100.0))
    assert [f for f, _ in sent(b)] == frames[1:11]
    # by default a port may run HTB's burst (15 000 B) ahead of its clock: that many bytes
    # leave at once; the stage is next due when the exact clock reaches the head frame, and
    # then sends the next burst's worth together (one wake-up per burst, not per frame)
    burst = ShapeStage(ports=["a", "b"], rate_mbps={"b": 100.0})
    load(b, frames[:30], [1] * 30)
    burst.process(b, T0)
    first = 15_000 // ln + 1
    assert list(b.out_port[:30]) == [1] * first + [PORT_HELD] * (30 - first)
    due = burst.next_deadline_ns()
    assert due == T0 + int(np.ceil(first * ln * 80.0))
    b.reset()
    burst.process(b, due)
    assert len(sent(b)) == first
    stage.configure(rate_mbps={"a": 5.0}, threshold_pkts=3)  # a time-dilated or resized link
    assert stage.ns_per_byte[0] == pytest.approx(8000 / 5.0)
    with pytest.raises(ValueError, match="drops its tail or trims as UET does"):
        stage.configure(mode="trim")
    with pytest.raises(ValueError, match="mode='ndp'"):
        stage.configure(mode={"b": "ndp"})
    with pytest.raises(ValueError, match="threshold_pkts"):
        ShapeStage(n_ports=1, queue_slots=10, threshold_pkts=20)


def test_a_queue_that_empties_starts_again_at_its_first_slot():
    """A port whose queue holds one frame at a time, many times over, writes only its ring's
    first slot: the rest of the ring's memory is never touched (first touches of pages cost
    an engine on a fresh network), and the frames leave in order all the same."""
    frames, _ = trim_layout_frames(2, 60)
    ln = len(frames[0])
    stage = ShapeStage(ports=["a"], rate_mbps={"a": 100.0}, burst_bytes=0, queue_slots=64,
                       threshold_pkts=64)
    b = Batch(64)
    now, out = T0, []
    for i in range(0, 60, 2):  # two frames: one leaves, one waits a frame time, then leaves
        load(b, frames[i:i + 2], [0, 0])
        stage.process(b, now)
        assert list(b.out_port[:2]) == [0, PORT_HELD]
        out.append(b.buf[0, :b.length[0]].tobytes())
        now += int(np.ceil(2 * ln * 80.0))
        b.reset()
        stage.process(b, now)
        out += [f for f, _ in sent(b)]
    assert out == frames
    assert stage.q_buf[0, 1:64].max() == 0  # slot 0 only, 30 times


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def test_a_queue_buffer_takes_memory_a_small_page_at_a_time():
    """One frame written into each of 16 ports' rings of a 64 MiB queue buffer makes about
    16 small pages resident, not 16 huge ones (32 MiB, as a numpy array of that size would
    on a host whose transparent huge pages are on); the buffer reads as zeros."""
    q = sparse_zeros((16, 2048, 2048), np.uint8)
    assert q.shape == (16, 2048, 2048) and q.flags.c_contiguous and q.flags.writeable
    before = _rss_kib()
    q[:, 0, :100] = 7
    grown = _rss_kib() - before
    assert grown < 16 * 64, f"{grown} KiB resident after 16 frames"
    assert int(q[:, 0, :100].sum()) == 16 * 100 * 7 and q[:, 1:3].max() == 0


def test_untrimmable_frames_are_dropped_and_header_queue_full_drops():
    frames, _ = trim_layout_frames(64, 6)
    other = int32_frames(64, 2)
    junk = bytes(range(60))  # not IPv4
    stage = TrimStage(n_ports=1, rate_mbps=1.0, threshold_pkts=1, header_slots=2)
    b = Batch(64)
    load(b, [frames[0], frames[1]] + other + [junk] + frames[2:], [0] * 9)
    stage.process(b, T0)
    assert list(b.out_port[:9]) == [0, PORT_HELD, PORT_DROP, PORT_DROP, PORT_DROP, PORT_HELD,
                                    PORT_HELD, PORT_DROP, PORT_DROP]
    c = stage.counters()["ports"]["port0"]
    assert (c["trimmed"], c["dropped"], c["hdr_hwm_pkts"]) == (2, 5, 2)


def test_ecn_marks_above_marking_threshold():
    frames = int32_frames(64, 6)
    ln = len(frames[0])
    stage = TrimStage(n_ports=1, rate_mbps=1.0, threshold_bytes=100 * ln,
                      ecn_threshold_bytes=2 * ln)
    b = Batch(64)
    load(b, frames, [0] * 6)
    stage.process(b, T0)
    assert stage.counters()["ports"]["port0"]["ecn_marked"] == 3  # 4th..6th found >= 2 queued
    stage.configure(rate_mbps=1000.0)
    out = []
    for t in range(1, 30):
        b.reset()
        stage.process(b, T0 + t * 10**7)
        out += sent(b)
    flags = [wire.unpack_header(f, wire.HEADER_OFFSET)["flags"] & wire.Flags.ECN for f, _ in out]
    assert flags == [0, 0, wire.Flags.ECN, wire.Flags.ECN, wire.Flags.ECN]


def test_emission_respects_batch_room_and_keeps_order():
    frames = int32_frames(16, 12)
    stage = TrimStage(n_ports=1, rate_mbps=1000.0, threshold_bytes=10**6)
    b = Batch(14)
    load(b, frames, [0] * 12)
    stage.process(b, T0)
    b2 = Batch(4)  # only four rows free
    out = []
    for t in range(1, 10):
        b2.reset()
        stage.process(b2, T0 + 10**9 + t)
        out += [f for f, _ in sent(b2)]
        assert b2.n <= 4
    assert out == frames[1:]


def test_per_port_settings_and_run_time_configure():
    stage = TrimStage(ports=["tbs1-eth1", "tbs1-eth2"], rate_mbps={"tbs1-eth2": 50},
                      threshold=5000)
    assert stage.ns_per_byte[1] == 8000.0 / 50 and stage.ns_per_byte[0] == 8000.0 / 100
    stage.configure(rate_mbps=[10, 20], threshold_bytes={1: 777}, mode="drop_tail",
                    header_priority=False)
    assert list(stage.ns_per_byte) == [800.0, 400.0]
    assert list(stage.thr_bytes) == [5000, 777]
    assert stage.counters()["mode"] == "drop_tail" and not stage.header_priority
    before = stage.thr_bytes.copy()
    with pytest.raises(ValueError, match="mode"):
        stage.configure(threshold_bytes=1, mode="red")
    assert list(stage.thr_bytes) == list(before)  # a rejected configure changes nothing
    with pytest.raises(ValueError, match="rate_mbps"):
        stage.configure(rate_mbps=0)
    with pytest.raises(ValueError, match="unknown port"):
        stage.configure(rate_mbps={"tbs9-eth1": 10})
    with pytest.raises(ValueError, match="unknown settings"):
        stage.configure(rate=10)
    with pytest.raises(ValueError, match="threshold_pkts"):
        stage.configure(threshold_pkts=10**6)
    with pytest.raises(ValueError, match="2 ports"):
        stage.configure(rate_mbps=[1, 2, 3])
    with pytest.raises(ValueError, match="ports"):
        TrimStage()


def ref_valid(f: bytes) -> bool:
    """The numpy twin of ``parse_frame`` accepts ``f`` as a testbed frame."""
    return ref_packets.parse_frame(np.frombuffer(f, np.uint8), len(f))[0] == 0


# ---------------------------------------------------------------------------------------------
# plain-Python twin of the queue (same decisions, same bytes, same order)


class TrimTwin:
    """Deque-per-port model of ``trim_kernel``."""

    def __init__(self, n_ports, nspb, thr_bytes, thr_pkts, ecn, mode, hdr_prio, qslots, hslots,
                 burst=0):
        self.slack = burst * nspb  # how far ahead of its clock a port may send
        self.nspb, self.thr_bytes, self.thr_pkts, self.ecn = nspb, thr_bytes, thr_pkts, ecn
        self.mode, self.hdr_prio, self.qslots, self.hslots = mode, hdr_prio, qslots, hslots
        self.dq = [deque() for _ in range(n_ports)]
        self.hq = [deque() for _ in range(n_ports)]
        self.next_free = [0.0] * n_ports
        self.epoch = None

    def _drain(self, p, now, out, emitted):
        while True:
            use_h = bool(self.hq[p]) and (self.hdr_prio or not self.dq[p])
            if (not use_h and not self.dq[p]) or self.next_free[p] > now + self.slack:
                return
            f = (self.hq[p] if use_h else self.dq[p]).popleft()
            out.append((f, p))
            self.next_free[p] += len(f) * self.nspb
            emitted.add(p)

    def process(self, pkts, now_ns):
        if self.epoch is None:
            self.epoch = now_ns
        now = float(now_ns - self.epoch)
        out, emitted, decisions = [], set(), []
        for p in range(len(self.dq)):
            self._drain(p, now, out, emitted)
        for f, p in pkts:
            dqb = sum(len(x) for x in self.dq[p])
            if not self.dq[p] and not self.hq[p] and p not in emitted \
                    and self.next_free[p] <= now + self.slack:
                self.next_free[p] = max(self.next_free[p], now) + len(f) * self.nspb
                decisions.append(("pass", f))
                continue
            full = dqb + len(f) > self.thr_bytes or len(self.dq[p]) >= self.qslots or (
                self.thr_pkts > 0 and len(self.dq[p]) >= self.thr_pkts)
            if not full:
                if self.ecn > 0 and dqb >= self.ecn and ref_valid(f):
                    g = bytearray(f)
                    g[wire.HEADER_OFFSET + wire.FIELD_OFFSETS["flags"]] |= int(wire.Flags.ECN)
                    g[40:42] = b"\0\0"
                    f = bytes(g)
                self.dq[p].append(f)
                decisions.append(("held", None))
                continue
            if self.mode == "trim" and ref_valid(f):
                hb = int.from_bytes(f[wire.HEADER_OFFSET + wire.FIELD_OFFSETS["head_bytes"]:][:2],
                                    "little")
                if 0 < hb < len(f) - wire.PAYLOAD_OFFSET:
                    g = ref_trimming.trim_frame(f)
                    q, cap = (self.hq[p], self.hslots) if self.hdr_prio else (self.dq[p],
                                                                             self.qslots)
                    if len(q) < cap:
                        q.append(g)
                        decisions.append(("held", None))
                        continue
            decisions.append(("drop", None))
        for p in range(len(self.dq)):
            self._drain(p, now, out, emitted)
        return decisions, out


_POOL_T, _ = trim_layout_frames(16, 4, seed=3)
_POOL_T += trim_layout_frames(128, 4, seed=4)[0]
_POOL_N = int32_frames(8, 2) + int32_frames(200, 2)
_POOL_X = [bytes(np.random.default_rng(1).integers(0, 256, 90, dtype=np.uint8))]
POOL = _POOL_T + _POOL_N + _POOL_X

step = st.tuples(st.integers(0, 3_000_000),
                 st.lists(st.tuples(st.integers(0, len(POOL) - 1), st.integers(0, 1)),
                          max_size=8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rate=st.sampled_from([1.0, 10.0, 100.0, None]), thr_bytes=st.sampled_from([0, 1500, 4000]),
       thr_pkts=st.sampled_from([0, 2, 5]), ecn=st.sampled_from([0, 600]),
       mode=st.sampled_from(["trim", "drop_tail"]), hdr_prio=st.booleans(),
       burst=st.sampled_from([0, 1500, 15_000]), steps=st.lists(step, min_size=1, max_size=12))
def test_trim_kernel_matches_plain_python_twin(rate, thr_bytes, thr_pkts, ecn, mode, hdr_prio,
                                               burst, steps):
    stage = TrimStage(n_ports=2, rate_mbps=rate or 1.0, threshold_bytes=thr_bytes,
                      threshold_pkts=thr_pkts, ecn_threshold_bytes=ecn, mode=mode,
                      header_priority=hdr_prio, queue_slots=6, header_slots=3,
                      burst_bytes=burst)
    if rate is None:  # an unshaped port (the shape stage's default): no drain time at all
        stage.ns_per_byte[:] = 0.0
    twin = TrimTwin(2, 8000.0 / rate if rate else 0.0, thr_bytes, thr_pkts, ecn, mode, hdr_prio,
                    6, 3, burst)
    b = Batch(64)
    now = T0
    for dt, pk in steps:
        now += dt
        pkts = [(POOL[i], p) for i, p in pk]
        load(b, [f for f, _ in pkts], [p for _, p in pkts])
        stage.process(b, now)
        decisions, out = twin.process(pkts, now)
        assert decided(b, len(pkts)) == decisions
        assert rows(b, len(pkts)) == out
    assert stage.queued() == sum(len(q) for q in twin.dq + twin.hq)


# ---------------------------------------------------------------------------------------------
# Mininet: the stages inside a running engine (helpers shared with the impair and codec tests)

PY = [sys.executable]
#: Capture testbed frames (UDP dport 41000) arriving on an interface; stop after ``idle`` s
#: without one (once one came) or 60 s; write them length-prefixed. Plain Python: starts fast.
CAPTURE = r"""
import os, socket, struct, sys, time
iface, out, ready, idle = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 23)  # SO_RCVBUFFORCE
s.bind((iface, 0))
s.settimeout(0.05)
open(ready, "w").close()
frames, last, t_end = [], None, time.monotonic() + 60
while time.monotonic() < t_end:
    try:
        data, addr = s.recvfrom(4096)
    except socket.timeout:
        if last is not None and time.monotonic() - last > idle:
            break
        continue
    if addr[2] == socket.PACKET_OUTGOING:
        continue
    if len(data) >= 42 and data[12:14] == b"\x08\x00" and data[23] == 17 \
            and data[36:38] == b"\xa0\x28":
        frames.append(data)
        last = time.monotonic()
with open(out, "wb") as fh:
    for f in frames:
        fh.write(struct.pack("<H", len(f)) + f)
"""


def start_capture(host, tmp_path, name: str, idle: float = 1.0):
    """Start :data:`CAPTURE` on ``host``'s interface; return (process, output path)."""
    out, ready = tmp_path / f"{name}.cap", tmp_path / f"{name}.ready"
    p = host.popen(PY + ["-c", CAPTURE, host.defaultIntf().name, str(out), str(ready),
                         str(idle)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "capture did not start"
        time.sleep(0.02)
    return p, out


def finish_capture(proc, out) -> list[bytes]:
    """Wait for the capture to stop by itself; return the frames in arrival order."""
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    data, frames, k = out.read_bytes(), [], 0
    while k < len(data):
        n = int.from_bytes(data[k:k + 2], "little")
        frames.append(data[k + 2:k + 2 + n])
        k += 2 + n
    return frames


def send_frames(host, frames, tmp_path, name: str, pps: float = 0.0):
    """Start sending ``frames`` once each, in order, from ``host`` (the data path bench's
    batched sender); returns the process (``gen_done`` checks it)."""
    from testbed.datapath.bench import save_frames

    path = tmp_path / f"{name}.npz"
    save_frames(str(path), frames)
    return host.popen(PY + ["-m", "testbed.datapath.bench", "gen", "--iface",
                            host.defaultIntf().name, "--src-mac", host.MAC(), "--dst-mac",
                            host.MAC(), "--src-ip", host.IP(), "--dst-ip", host.IP(), "--load",
                            str(path), "--count", str(len(frames)), "--pps", str(pps)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def gen_done(proc, count: int) -> None:
    """The sender exited cleanly having sent ``count`` frames."""
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert json.loads(out)["sent"] == count


def host_frames(src, dst, payloads, headers):
    """Frames from host ``src`` to host ``dst`` (real MACs/IPs) with these headers/payloads."""
    buf, ln = packets.build(headers, payloads, src.MAC(), dst.MAC(), src.IP(), dst.IP(), 41000)
    return [bytes(buf[i, :ln[i]]) for i in range(len(payloads))]


def port_of(switch, host) -> str:
    """The switch interface that leads to ``host``."""
    (sw_intf, _), = switch.connectionsTo(host)
    return sw_intf.name


@pytest.mark.mininet
def test_incast_trims_at_switch_and_receiver_decodes_coarse_estimate(tmp_path):
    """4 senders -> 1 receiver whose switch port drains at 20 Mb/s: above the threshold the
    switch trims (nothing is lost, trimmed frames decode to the head estimate); in drop_tail
    mode the same incast loses frames instead."""
    from testbed.testing import programmable_star

    m, per_sender = 256, 50
    rng = np.random.default_rng(11)
    xs = {(w, k): rng.standard_normal(m).astype(np.float32)
          for w in range(4) for k in range(per_sender)}
    progs = [("forward", {}), ("trim", {"rate_mbps": 1000.0, "threshold_bytes": 6 * 1134,
                                        "header_slots": 512})]
    with programmable_star(5, programs=progs) as (_net, hosts, sw):
        rx = hosts[4]
        rx_port = port_of(sw, rx)
        for h in hosts[:4]:  # no ARP from the receiver: only our frames cross its port
            rx.setARP(h.IP(), h.MAC())
        with sw.client() as c:
            c.configure("forward", l2={rx.MAC(): rx_port})
            c.configure("trim", rate_mbps={rx_port: 20.0})
        sent = {}
        for w in range(4):
            h = wire.new_headers(per_sender)
            h["codec"] = wire.Codec.TRIM_LAYOUT
            h["worker_id"] = w
            h["elem_count"] = m
            h["head_bytes"] = trimming.head_bytes_for(m, 1)
            h["chunk_offset"] = np.arange(per_sender) * m
            pls = [trimming.encode(xs[w, k], bits=1, seed=w, counter=k * m)
                   for k in range(per_sender)]
            sent[w] = host_frames(hosts[w], rx, pls, h)
        for mode in ("trim", "drop_tail"):
            with sw.client() as c:
                c.configure("trim", mode=mode)
                before = c.counters()["stages"]["trim"]["ports"][rx_port]
            cap, out = start_capture(rx, tmp_path, mode)
            gens = [send_frames(hosts[w], sent[w], tmp_path, f"{mode}{w}") for w in range(4)]
            for g in gens:
                gen_done(g, per_sender)
            got = finish_capture(cap, out)
            with sw.client() as c:
                after = c.counters()["stages"]["trim"]["ports"][rx_port]
            d = {k: after[k] - before[k] for k in ("passed", "enqueued", "trimmed", "dropped")}
            # what the stage let through is exactly what the receiver got
            assert len(got) == d["passed"] + d["enqueued"] + d["trimmed"]
            full = trimmed = 0
            by_bytes = {f: (w, k) for w in range(4) for k, f in enumerate(sent[w])}
            for f in got:
                if f in by_bytes:
                    full += 1
                    continue
                w = f[wire.HEADER_OFFSET + wire.FIELD_OFFSETS["worker_id"]]
                k = int.from_bytes(f[wire.HEADER_OFFSET + wire.FIELD_OFFSETS["chunk_offset"]:]
                                   [:4], "little") // m
                assert f == ref_trimming.trim_frame(sent[w][k])  # cut exactly at the head
                est, complete = trimming.decode(np.frombuffer(f, np.uint8)[
                    wire.PAYLOAD_OFFSET:].copy(), m)
                assert not complete
                pl = trimming.encode(xs[w, k], bits=1, seed=w, counter=k * m)
                np.testing.assert_array_equal(est, trimming.decode(trimming.trim(pl), m)[0])
                s = float(np.abs(xs[w, k]).max())
                assert np.abs(est - xs[w, k]).max() <= 2 * s * (1 + 1e-6)
                trimmed += 1
            if mode == "trim":
                assert d["trimmed"] == trimmed > 0.3 * 4 * per_sender
                assert d["dropped"] == 0 and full + trimmed == len(got)
            else:
                assert trimmed == d["trimmed"] == 0
                assert d["dropped"] > 0.3 * 4 * per_sender and full == len(got)


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.lists(st.integers(0, 3), min_size=6, max_size=6), min_size=3,
                       max_size=3),
       free=st.lists(st.floats(0.0, 1e12, allow_nan=False), min_size=6, max_size=6))
def test_earliest_departure_matches_its_numpy_twin(counts, free):
    """The kernel behind ``next_deadline_ns``: the earliest clock of the ports holding a
    frame in any of the three classes, ``inf`` when none holds one."""
    q_cnt = np.array(counts, np.int64)
    next_free = np.array(free, np.float64)
    busy = q_cnt.sum(axis=0) > 0
    want = next_free[busy].min() if busy.any() else np.inf
    assert earliest_departure(q_cnt, next_free) == want


def test_the_deadline_after_each_burst_is_the_queues_earliest_departure():
    """``next_deadline_ns`` reads the departure the burst's kernel left (only the kernel
    changes the queues): after bursts that fill, drain and empty a shaped port's queue it is
    the epoch plus the twin's earliest departure, rounded up, and None once nothing waits."""
    from testbed.datapath.batch import Batch

    stage = ShapeStage(n_ports=2, rate_mbps=10.0, burst_bytes=0)
    batch = Batch(64)
    t = 1_000_000
    for frames, step in ((20, 0), (5, 300_000), (0, 600_000), (0, 10**9)):
        t += step
        batch.n = 0
        first = batch.alloc(frames)
        batch.length[first:first + frames] = 1000
        batch.out_port[first:first + frames] = np.arange(frames) % 2
        stage.process(batch, t)
        busy = stage.q_cnt.sum(axis=0) > 0
        want = None if not busy.any() else \
            stage._epoch + int(np.ceil(stage.next_free[busy].min()))
        assert stage.next_deadline_ns() == want, (frames, step)
    assert want is None  # the last burst found the queues empty

