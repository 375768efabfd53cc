"""The ``trim`` stage in ``uet`` mode (Ultra Ethernet 1.0 trimming) on real frames: DSCP
classes, the cut, the control and trimmed queues' scheduling, BDP thresholds, settings, the
plain-Python twin of the three queues, and the last-hop ports a pipeline gives it."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datapath_trim import (
    T0,
    decided,
    int32_frames,
    load,
    ref_valid,
    rows,
    sent,
    trim_layout_frames,
)

from testbed.datapath.batch import FRAME_MAX, PORT_DROP, PORT_HELD, Batch, DropReason
from testbed.datapath.trim import ShapeStage, TrimStage, uet_trim_frame
from testbed.kernels import packets, trimming, wire
from testbed.kernels.reference import packets as ref_packets
from testbed.kernels.wire import PAYLOAD_OFFSET, Codec, Dscp, Flags, MsgType

MACS = ("02:00:00:00:00:01", "02:00:00:00:00:02")
IPS = ("10.0.0.1", "10.0.0.2")
OFF_TOS = 15
HDR = wire.HEADER_OFFSET
ELEM = {Codec.INT32: 4, Codec.FLOAT32: 4, Codec.FLOAT16: 2, Codec.BFLOAT16: 2}


def mark(f: bytes, dscp: int, ecn: int = 0) -> bytes:
    """``f`` with its IPv4 TOS set to ``dscp`` and ``ecn`` and the header checksum fixed."""
    g = bytearray(f)
    g[OFF_TOS] = (int(dscp) << 2) | ecn
    g[24:26] = ref_packets.ipv4_checksum(bytes(g[14:34])).to_bytes(2, "big")
    return bytes(g)


def frame(codec: Codec, payload: bytes, elem_count: int, head_bytes: int = 0, flags: int = 0,
          msg_type: int = MsgType.DATA, dscp: int = Dscp.TRIMMABLE, ecn: int = 0, seq: int = 0
          ) -> bytes:
    """One testbed frame with these header fields and DSCP."""
    h = wire.new_headers(1)
    h["codec"], h["elem_count"], h["head_bytes"] = codec, elem_count, head_bytes
    h["flags"], h["msg_type"], h["seq"] = flags, msg_type, seq
    buf, ln = packets.build(h, [np.frombuffer(payload, np.uint8)], *MACS, *IPS, 5000)
    return mark(bytes(buf[0, :ln[0]]), dscp, ecn)


def i32(m: int, dscp: int = Dscp.TRIMMABLE, seq: int = 0, ecn: int = 0) -> bytes:
    return frame(Codec.INT32, np.arange(seq, seq + m, dtype=np.int32).tobytes(), m, dscp=dscp,
                 seq=seq, ecn=ecn)


def nbytes(n: int, dscp: int = Dscp.TRIMMABLE, seq: int = 0) -> bytes:
    return frame(Codec.BYTES, bytes((seq + i) & 0xFF for i in range(n)), n, dscp=dscp, seq=seq)


def control(seq: int = 0) -> bytes:
    return frame(Codec.BYTES, b"", 0, msg_type=MsgType.NACK, dscp=Dscp.CONTROL, seq=seq)


def hdr(f: bytes):
    return wire.unpack_header(f, HDR)


def dscp_of(f: bytes) -> int:
    """DSCP of an IPv4 frame, -1 for anything else (best effort)."""
    if len(f) < 34 or f[12:14] != b"\x08\x00" or f[14] >> 4 != 4:
        return -1
    return f[OFF_TOS] >> 2


def ref_uet_cut(f: bytes, trim_bytes: int, dscp: int, lasthop: bool) -> bytes:
    """What a UET switch makes of a valid testbed frame it trims (the rule of the module
    docstring, written independently of the kernel)."""
    g = bytearray(f)
    h = np.frombuffer(g, wire.HEADER_DTYPE, 1, HDR)
    payload = int.from_bytes(g[38:40], "big") - wire.UDP_LEN - wire.HEADER_LEN
    room = trim_bytes - PAYLOAD_OFFSET
    codec, head = int(h["codec"][0]), int(h["head_bytes"][0])
    if int(h["flags"][0]) & Flags.TRIMMED:
        kept = payload
    elif 0 < head <= room:
        kept = min(head, payload)
    elif codec == Codec.TRIM_LAYOUT:
        kept = 0
    else:
        kept = min(payload, room)
    e = ELEM.get(codec)
    if e:
        kept -= kept % e
        h["elem_count"] = kept // e
    elif codec == Codec.BYTES:
        h["elem_count"] = kept
    h["head_bytes"] = kept
    h["flags"] |= int(Flags.TRIMMED) | (int(Flags.LASTHOP) if lasthop else 0)
    g[OFF_TOS] = (dscp << 2) | (g[OFF_TOS] & 3)
    g[16:18] = (wire.IPV4_LEN + wire.UDP_LEN + wire.HEADER_LEN + kept).to_bytes(2, "big")
    g[38:40] = (wire.UDP_LEN + wire.HEADER_LEN + kept).to_bytes(2, "big")
    g[40:42] = b"\0\0"
    g[24:26] = ref_packets.ipv4_checksum(bytes(g[14:34])).to_bytes(2, "big")
    return bytes(g[:PAYLOAD_OFFSET + kept])


def drain_all(stage: TrimStage, t0: int, step: int = 10**6, batch: int = 256):
    """Run the stage until it holds nothing; return what it sent."""
    b = Batch(batch)
    out = []
    for k in range(1, 100_000):
        b.reset()
        stage.process(b, t0 + k * step)
        out += sent(b)
        if stage.queued() == 0:
            return out
    raise AssertionError("stage never emptied")


# ---------------------------------------------------------------------------------------------
# the cut


def test_cut_bytes_remark_and_lasthop():
    f32 = i32(256)
    f16 = frame(Codec.FLOAT16, np.arange(300, dtype=np.uint16).tobytes(), 300)
    fb = nbytes(700)
    stage = TrimStage(n_ports=2, rate_mbps=1.0, threshold_bytes=0, mode="uet",
                      last_hop=[False, True])
    assert stage.trim_bytes.tolist() == [128, 128]
    src = [i32(8, ecn=2), f32, f16, fb]  # the first passes (the port is idle) and fills it
    for port in (0, 1):
        b = Batch(16)
        load(b, src, [port] * 4)
        stage.process(b, T0 + port * 10**12)
        assert list(b.out_port[:4]) == [port] + [PORT_HELD] * 3
        out = drain_all(stage, T0 + port * 10**12, step=10**7)
        assert [p for _, p in out] == [port] * 3
        lh = port == 1
        want = Dscp.TRIMMED_LASTHOP if lh else Dscp.TRIMMED
        cuts = [f for f, _ in out]
        # whole elements of the codec in trim_bytes: 13 int32 (52 B), 27 fp16 (54 B), 54 B
        assert [len(f) for f in cuts] == [PAYLOAD_OFFSET + 52, 128, 128]
        assert [int(hdr(f)["elem_count"]) for f in cuts] == [13, 27, 54]
        for f, s in zip(cuts, src[1:], strict=True):
            assert f == ref_uet_cut(s, 128, want, lh)
            assert f[PAYLOAD_OFFSET:] == s[PAYLOAD_OFFSET:len(f)]  # the payload's front, as is
            assert dscp_of(f) == want and f[OFF_TOS] & 3 == 0
            h = hdr(f)
            assert h["flags"] & Flags.TRIMMED
            assert bool(h["flags"] & Flags.LASTHOP) == lh
            assert h["head_bytes"] == len(f) - PAYLOAD_OFFSET
            arr = np.frombuffer(f, np.uint8).copy()
            assert packets.parse_frame(arr, len(f)) == 0 and ref_valid(f)
            assert packets.ipv4_checksum_ok(arr)
        c = stage.counters()["ports"][f"port{port}"]
        assert (c["trimmed"], c["trimmed_lasthop"]) == (3, 3 if lh else 0)
    # the ECN bits survive the re-mark
    src = i32(64, ecn=3)
    arr = np.zeros(FRAME_MAX, np.uint8)
    arr[:len(src)] = np.frombuffer(src, np.uint8)
    r = uet_trim_frame(arr, 128, Dscp.TRIMMED, False)
    assert bytes(arr[:r]) == ref_uet_cut(src, 128, Dscp.TRIMMED, False)
    assert arr[OFF_TOS] == (Dscp.TRIMMED << 2) | 3 and packets.ipv4_checksum_ok(arr)


def test_hotnets_head_that_fits_is_kept_whole_and_decodes():
    m = 128
    frames, xs = trim_layout_frames(m, 4, seed=5)  # 1-bit heads: 24 B, 98 B with the headers
    frames = [mark(f, Dscp.TRIMMABLE) for f in frames]
    big, _ = trim_layout_frames(400, 1, seed=6)  # its 60 B head does not fit 128 B
    stage = TrimStage(n_ports=1, rate_mbps=1.0, threshold_bytes=0, mode="uet")
    b = Batch(16)
    load(b, frames + [mark(big[0], Dscp.TRIMMABLE)], [0] * 5)
    stage.process(b, T0)
    out = [f for f, _ in drain_all(stage, T0, step=10**7)]
    hb = trimming.head_bytes_for(m, 1)
    assert [len(f) for f in out] == [PAYLOAD_OFFSET + hb] * 3 + [PAYLOAD_OFFSET]
    for k, f in enumerate(out[:3]):
        assert f == ref_uet_cut(frames[1 + k], 128, Dscp.TRIMMED, False)
        assert packets.parse_frame(np.frombuffer(f, np.uint8).copy(), len(f)) == 0
        est, full = trimming.decode(np.frombuffer(f, np.uint8)[PAYLOAD_OFFSET:].copy(), m)
        x = xs[1 + k]
        assert not full
        assert np.abs(est - x).max() <= 2 * float(np.abs(x).max()) * (1 + 1e-6)
    last = out[3]  # headers only, elem_count kept (the receiver knows the chunk it lost)
    assert hdr(last)["head_bytes"] == 0 and hdr(last)["elem_count"] == 400
    assert packets.parse_frame(np.frombuffer(last, np.uint8).copy(), len(last)) == 0


def test_already_trimmed_is_not_cut_again_and_trimmed_classes_are_not_trimmed():
    once = ref_uet_cut(i32(256), 300, Dscp.TRIMMED, False)  # trimmed upstream to 300 B
    relabelled = mark(once, Dscp.TRIMMABLE)  # a hop that lost the marking
    stage = TrimStage(n_ports=1, rate_mbps=1.0, threshold_bytes=0, mode="uet",
                      last_hop=True, trim_bytes=128)
    b = Batch(16)
    load(b, [i32(8), relabelled, once, mark(once, Dscp.TRIMMED_LASTHOP)], [0] * 4)
    stage.process(b, T0)
    out = [f for f, _ in drain_all(stage, T0, step=10**7)]
    assert [len(f) for f in out] == [len(once)] * 3  # never cut again, whatever the class
    assert dscp_of(out[0]) == Dscp.TRIMMED_LASTHOP and hdr(out[0])["flags"] & Flags.LASTHOP
    assert out[1:] == [once, mark(once, Dscp.TRIMMED_LASTHOP)]  # queued as they came
    c = stage.counters()["ports"]["port0"]
    assert (c["trimmed"], c["pretrimmed"], c["enqueued"]) == (1, 2, 2)


def test_untrimmable_and_other_classes_are_dropped_above_the_threshold():
    ln = len(i32(64))
    stage = TrimStage(n_ports=1, rate_mbps=1.0, threshold_bytes=ln, mode="uet")
    junk = bytes(range(60))  # not IPv4: best effort
    b = Batch(16)
    load(b, [i32(64), i32(64), i32(64, dscp=Dscp.BEST_EFFORT), i32(64, dscp=40), junk,
             i32(64)[:50]], [0] * 6)  # the last: trimmable class, but truncated
    stage.process(b, T0)
    assert list(b.out_port[:6]) == [0, PORT_HELD] + [PORT_DROP] * 4
    assert all(b.reason[i] == DropReason.QUEUE_FULL for i in range(2, 6))
    c = stage.counters()["ports"]["port0"]
    assert (c["trimmed"], c["dropped"], c["enqueued"]) == (0, 4, 1)


def test_a_shaping_port_turned_uet_cuts_only_trimmable_packets_at_its_own_threshold():
    """A ``shape`` port the provider turns into a UET trimming port (per port, at run time):
    its trimmable packets are cut above the trimmable-only threshold while a TCP-like packet
    still queues up to the port's drop-tail limit; the other port does not trim; back to
    drop-tail, nothing is cut."""
    ln = len(i32(256))
    stage = ShapeStage(ports=["a", "b"], rate_mbps=1.0, burst_bytes=0)
    stage.configure(mode={"b": "uet"}, trim_threshold_bytes={"b": 2 * ln},
                    last_hop={"b": True})
    assert stage.counters()["mode"] == "mixed"
    assert [stage.counters()["ports"][p]["mode"] for p in "ab"] == ["drop_tail", "uet"]
    b = Batch(64)
    tcp = i32(256, dscp=Dscp.BEST_EFFORT)
    load(b, [i32(256, seq=k) for k in range(4)] + [tcp] * 4 + [i32(256)] * 4, [1] * 8 + [0] * 4)
    stage.process(b, T0)
    # port b: one leaves, two queue, the fourth is cut (last hop); TCP queues past the
    # threshold (drop-tail's 1000 frames); port a: one leaves, the rest queue, none cut
    assert list(b.out_port[:12]) == [1] + [PORT_HELD] * 7 + [0] + [PORT_HELD] * 3
    c = stage.counters()["ports"]
    assert (c["b"]["trimmed"], c["b"]["trimmed_lasthop"], c["b"]["dropped"]) == (1, 1, 0)
    assert (c["a"]["trimmed"], c["b"]["depth_pkts"]) == (0, 7)
    cut = [f for f, p in drain_all(stage, T0, step=10**8) if len(f) < ln and p == 1]
    assert len(cut) == 1 and dscp_of(cut[0]) == Dscp.TRIMMED_LASTHOP
    stage.configure(mode="drop_tail", trim_threshold_bytes=0, last_hop=False)
    b.reset()
    load(b, [i32(256)] * 5, [1] * 5)
    stage.process(b, T0 + 10**12)
    assert stage.counters()["ports"]["b"]["trimmed"] == 1  # none more
    with pytest.raises(ValueError, match="trim_threshold_bytes"):
        stage.configure(trim_threshold_bytes={"b": -1})


# ---------------------------------------------------------------------------------------------
# scheduling


def test_control_overtakes_data_is_never_trimmed_and_drops_only_when_full():
    data = [i32(256, seq=k) for k in range(6)]
    ln = len(data[0])
    stage = TrimStage(n_ports=1, rate_mbps=10.0, threshold_bytes=2 * ln, mode="uet",
                      control_slots=3)
    big_ctl = frame(Codec.BYTES, bytes(1000), 1000, msg_type=MsgType.ACK, dscp=Dscp.CONTROL)
    ctl = [big_ctl, control(1), control(2), control(3)]
    b = Batch(32)
    load(b, data + ctl, [0] * 10)
    stage.process(b, T0)
    # one data frame leaves, two queue, three are trimmed; three control frames queue (the
    # large one whole, above the data threshold) and the fourth finds the slots full
    assert list(b.out_port[:10]) == [0] + [PORT_HELD] * 8 + [PORT_DROP]
    out = [f for f, _ in drain_all(stage, T0, step=10**5)]
    cut = [ref_uet_cut(f, 128, Dscp.TRIMMED, False) for f in data[3:]]
    # control first, untouched; then trimmed and data share the port by bytes (0.5): a
    # 126 B cut, a 1098 B frame, the two other cuts (the data queue's credit), the last frame
    assert out == ctl[:3] + [cut[0], data[1], cut[1], cut[2], data[2]]
    c = stage.counters()["ports"]["port0"]
    assert (c["ctl_enqueued"], c["ctl_dropped"], c["dropped"], c["trimmed"]) == (3, 1, 1, 3)
    assert c["ctl_bytes_sent"] == sum(len(f) for f in ctl[:3])
    assert c["passed"] + c["enqueued"] + c["trimmed"] + c["dropped"] == 10
    assert c["dequeued"] == c["enqueued"] + c["trimmed"] == 8


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_trimmed_share_of_the_port_while_both_are_backlogged(share):
    data = [i32(256, seq=k) for k in range(200)]  # 1098 B
    pre = ref_uet_cut(i32(256), 128, Dscp.TRIMMED, False)  # 126 B, arrived trimmed
    stage = TrimStage(n_ports=1, rate_mbps=100.0, threshold_bytes=10**6, mode="uet",
                      trimmed_share=share, queue_slots=256, header_slots=1024)
    b = Batch(2048)
    load(b, data + [pre] * 900, [0] * 1100)
    stage.process(b, T0)
    # 100 KB of port time (80 ns per byte at 100 Mb/s), both queues still backlogged after
    b.reset()
    stage.process(b, T0 + 100_000 * 80)
    assert stage.dq_cnt[0] > 0 and stage.hq_cnt[0] > 0
    c = stage.counters()["ports"]["port0"]
    got = c["trimmed_bytes_sent"] / (c["trimmed_bytes_sent"] + c["data_bytes_sent"])
    assert got == pytest.approx(share, abs=0.02)
    # frame by frame as the twin's byte deficit orders them (hundreds of choices)
    twin = UetTwin(1, 80.0, 10**6, 0, 0, 128, share, [False], (256, 1024, 64))
    twin.process([(f, 0) for f in data + [pre] * 900], T0, 2048)
    assert twin.process([], T0 + 100_000 * 80, 2048)[1] == sent(b)
    # alone, the trimmed class takes the whole port
    solo = TrimStage(n_ports=1, rate_mbps=100.0, mode="uet", trimmed_share=share,
                     header_slots=1024)
    load(b, [pre] * 900, [0] * 900)
    solo.process(b, T0)
    b.reset()
    solo.process(b, T0 + 50_000 * 80)
    assert len(sent(b)) == 50_000 // len(pre)


# ---------------------------------------------------------------------------------------------
# thresholds and settings


def test_bdp_thresholds_follow_rate_rtt_and_last_hop():
    stage = TrimStage(ports=["a", "b", "c"], rate_mbps={"a": 1000, "b": 400, "c": 100},
                      mode="uet", threshold_bdp=1.0, rtt_us=10, last_hop=[False, True, False])
    assert stage.thr_bytes.tolist() == [1250, int(400 * 10 / 8 * 1.5), 125]
    stage.configure(rate_mbps={"a": 100}, rtt_us={"c": 40}, threshold_bdp={"b": 2.0})
    assert stage.thr_bytes.tolist() == [125, 1500, 500]
    stage.configure(lasthop_factor=2.0, last_hop={"c": True})
    assert stage.thr_bytes.tolist() == [125, 2000, 1000]
    stage.configure(threshold_bytes={"a": 7777})  # a byte threshold leaves the BDP rule
    stage.configure(rate_mbps=10.0)
    assert stage.thr_bytes.tolist() == [7777, 50, 100]
    # the threshold acts as one: just below it is queued, above it trimmed
    ln = len(i32(64))
    t = TrimStage(n_ports=1, rate_mbps=8.0, threshold_bdp=1.0, rtt_us=3 * ln, mode="uet")
    assert t.thr_bytes[0] == 3 * ln
    b = Batch(16)
    load(b, [i32(64)] * 6, [0] * 6)
    t.process(b, T0)
    assert list(b.out_port[:6]) == [0, PORT_HELD, PORT_HELD, PORT_HELD, PORT_HELD, PORT_HELD]
    assert t.counters()["ports"]["port0"]["trimmed"] == 2


def snapshot(stage: TrimStage):
    arrays = ("thr_bytes", "thr_bdp", "rtt_us", "last_hop", "trim_bytes", "dscp",
              "ns_per_byte", "rate_mbps")
    return ({a: getattr(stage, a).tolist() for a in arrays},
            stage.trimmed_share, stage.lasthop_factor, stage.mode)


@pytest.mark.parametrize("bad, match", [
    ({"trim_bytes": PAYLOAD_OFFSET - 1}, f"trim_bytes.*from {PAYLOAD_OFFSET} \\(the minimum"),
    ({"trim_bytes": FRAME_MAX + 1}, "trim_bytes"),
    ({"trimmed_share": 0}, r"trimmed_share: must be a number in \(0, 1\]"),
    ({"trimmed_share": 1.5}, "trimmed_share"),
    ({"dscp_control": 64}, r"dscp_control: must be an integer in \[0, 63\]"),
    ({"dscp_trimmed": -1}, "dscp_trimmed"),
    ({"dscp_trimmable": Dscp.CONTROL}, "dscp_control and dscp_trimmable are both 46"),
    ({"dscp_trimmed_lasthop": 8}, "own DSCP value"),
    ({"threshold_bdp": 1.0, "rtt_us": None}, "threshold_bdp needs rtt_us"),
    ({"threshold_bdp": 1.0, "threshold_bytes": {"b": 5}, "rtt_us": 5}, "both threshold_bytes"),
    ({"last_hop": "yes"}, "last_hop: must be True or False"),
    ({"lasthop_factor": 0}, "lasthop_factor"),
    ({"rtt_us": 0}, "rtt_us"),
    ({"mode": "ndp"}, "'trim', 'drop_tail', 'uet'"),
])
def test_bad_settings_are_refused_and_change_nothing(bad, match):
    stage = TrimStage(ports=["a", "b"], mode="uet", rate_mbps=50, threshold_bytes=9000)
    before = snapshot(stage)
    # good settings in the same call must not be applied either
    good = {"rate_mbps": 7, "trim_bytes": 200, "trimmed_share": 0.75, "dscp_trimmed": 30,
            "rtt_us": 9, "last_hop": {"a": True}}
    with pytest.raises(ValueError, match=match):
        stage.configure(**{**good, **bad})
    assert snapshot(stage) == before
    with pytest.raises(ValueError, match=match):
        TrimStage(ports=["a", "b"], **{"mode": "uet", **bad})


def test_trimmed_and_trimmed_lasthop_may_share_a_class():
    stage = TrimStage(n_ports=1, mode="uet", dscp_trimmed=30, dscp_trimmed_lasthop=30,
                      dscp_control=48, dscp_trimmable=0)
    assert stage.dscp.tolist() == [48, 30, 30, 0]
    assert stage.counters()["mode"] == "uet"


# ---------------------------------------------------------------------------------------------
# plain-Python twin of the UET queues (same decisions, same bytes, same order, same counters)

NAMES = ("passed", "enqueued", "trimmed", "dropped", "dequeued", "ecn_marked", "hwm_bytes",
         "hwm_pkts", "hdr_hwm_pkts", "trimmed_lasthop", "pretrimmed", "trimmed_dropped",
         "ctl_enqueued", "ctl_dropped", "ctl_hwm_pkts", "ctl_bytes_sent", "trimmed_bytes_sent",
         "data_bytes_sent")


class UetTwin:
    """Three deques per port: control (strict), trimmed and data sharing the port by bytes."""

    def __init__(self, n_ports, nspb, thr_bytes, thr_pkts, ecn, trim_bytes, share, last_hop,
                 slots, burst=0, dscp=(46, 26, 28, 8), modes=None, trim_thr=None):
        self.slack = burst * nspb
        # per port: "uet" or "drop_tail" (no classes, no cuts), and the trimmable class's
        # own threshold (0: thr_bytes)
        self.modes = modes or ["uet"] * n_ports
        self.trim_thr = trim_thr or [0] * n_ports
        self.nspb, self.thr_bytes, self.thr_pkts, self.ecn = nspb, thr_bytes, thr_pkts, ecn
        self.trim_bytes, self.share, self.last_hop = trim_bytes, share, last_hop
        self.qslots, self.hslots, self.cslots = slots
        self.d_ctl, self.d_trimmed, self.d_lasthop, self.d_trimmable = dscp
        self.cq = [deque() for _ in range(n_ports)]
        self.hq = [deque() for _ in range(n_ports)]
        self.dq = [deque() for _ in range(n_ports)]
        self.next_free = [0.0] * n_ports
        self.deficit = [0.0] * n_ports
        self.c = [dict.fromkeys(NAMES, 0) for _ in range(n_ports)]
        self.epoch = None

    def _drain(self, p, now, out, emitted, room):
        c = self.c[p]
        while len(out) < room:
            cq, hq, dq = self.cq[p], self.hq[p], self.dq[p]
            if not (cq or hq or dq) or self.next_free[p] > now + self.slack:
                return
            if cq:
                f = cq.popleft()
                c["ctl_bytes_sent"] += len(f)
            else:
                both = bool(hq) and bool(dq)
                if not both:
                    self.deficit[p] = 0.0
                use_h = self.deficit[p] >= 0.0 if both else bool(hq)
                if use_h:
                    f = hq.popleft()
                    if both:
                        self.deficit[p] -= (1.0 - self.share) * len(f)
                    c["trimmed_bytes_sent"] += len(f)
                else:
                    f = dq.popleft()
                    if both:
                        self.deficit[p] += self.share * len(f)
                    c["data_bytes_sent"] += len(f)
            out.append((f, p))
            self.next_free[p] += len(f) * self.nspb
            c["dequeued"] += 1
            emitted.add(p)

    def _trimmed(self, p, f):
        c = self.c[p]
        if len(self.hq[p]) >= self.hslots:
            c["trimmed_dropped"] += 1
            return False
        self.hq[p].append(f)
        c["hdr_hwm_pkts"] = max(c["hdr_hwm_pkts"], len(self.hq[p]))
        return True

    def _admit(self, p, f, now, emitted):
        c = self.c[p]
        if not (self.cq[p] or self.hq[p] or self.dq[p]) and p not in emitted \
                and self.next_free[p] <= now + self.slack:
            self.next_free[p] = max(self.next_free[p], now) + len(f) * self.nspb
            c["passed"] += 1
            return ("pass", f)
        d = dscp_of(f) if self.modes[p] == "uet" else None
        if d == self.d_ctl:
            if len(self.cq[p]) < self.cslots:
                self.cq[p].append(f)
                c["enqueued"] += 1
                c["ctl_enqueued"] += 1
                c["ctl_hwm_pkts"] = max(c["ctl_hwm_pkts"], len(self.cq[p]))
                return ("held", None)
            c["dropped"] += 1
            c["ctl_dropped"] += 1
            return ("drop", None)
        if d in (self.d_trimmed, self.d_lasthop):
            if self._trimmed(p, f):
                c["enqueued"] += 1
                c["pretrimmed"] += 1
                return ("held", None)
            c["dropped"] += 1
            return ("drop", None)
        dqb = sum(len(x) for x in self.dq[p])
        thr = self.trim_thr[p] if self.trim_thr[p] and d == self.d_trimmable else self.thr_bytes
        full = dqb + len(f) > thr or len(self.dq[p]) >= self.qslots or (
            self.thr_pkts > 0 and len(self.dq[p]) >= self.thr_pkts)
        if not full:
            if self.ecn > 0 and dqb >= self.ecn and ref_valid(f):
                g = bytearray(f)
                g[HDR + wire.FIELD_OFFSETS["flags"]] |= int(Flags.ECN)
                g[40:42] = b"\0\0"
                f = bytes(g)
                c["ecn_marked"] += 1
            self.dq[p].append(f)
            c["enqueued"] += 1
            c["hwm_bytes"] = max(c["hwm_bytes"], dqb + len(f))
            c["hwm_pkts"] = max(c["hwm_pkts"], len(self.dq[p]))
            return ("held", None)
        if d == self.d_trimmable and ref_valid(f):
            lh = self.last_hop[p]
            g = ref_uet_cut(f, self.trim_bytes, self.d_lasthop if lh else self.d_trimmed, lh)
            if self._trimmed(p, g):
                c["trimmed"] += 1
                c["trimmed_lasthop"] += lh
                return ("held", None)
        c["dropped"] += 1
        return ("drop", None)

    def process(self, pkts, now_ns, room):
        if self.epoch is None:
            self.epoch = now_ns
        now = float(now_ns - self.epoch)
        out, emitted = [], set()
        for p in range(len(self.dq)):
            self._drain(p, now, out, emitted, room)
        decisions = [self._admit(p, f, now, emitted) for f, p in pkts]
        for p in range(len(self.dq)):
            self._drain(p, now, out, emitted, room)
        return decisions, out


def _pool() -> list[bytes]:
    rng = np.random.default_rng(7)
    lay, _ = trim_layout_frames(16, 2, seed=3)
    lay += trim_layout_frames(300, 2, seed=4)[0]
    pool = [mark(f, Dscp.TRIMMABLE) for f in lay]
    pool += [i32(8, seq=1), i32(200, seq=2), i32(100, ecn=1, seq=3), nbytes(40), nbytes(900),
             frame(Codec.FLOAT16, rng.bytes(600), 300),
             frame(Codec.SIGN, rng.bytes(64), 512),
             frame(Codec.BFLOAT16, rng.bytes(60), 30, head_bytes=10),
             frame(Codec.INT32, rng.bytes(400), 100, head_bytes=16)]
    pool += [i32(150, dscp=Dscp.BEST_EFFORT), nbytes(300, dscp=33), i32(64, dscp=Dscp.CONTROL),
             control(), control(9), ref_uet_cut(i32(256), 200, Dscp.TRIMMED, False),
             ref_uet_cut(nbytes(500), 128, Dscp.TRIMMED_LASTHOP, True),
             mark(ref_uet_cut(i32(256), 300, Dscp.TRIMMED, False), Dscp.TRIMMABLE),
             bytes(np.random.default_rng(1).integers(0, 256, 90, dtype=np.uint8)),
             mark(i32(30), Dscp.TRIMMABLE)[:-7]]  # a truncated frame: not trimmable
    return pool


POOL = _pool()
step = st.tuples(st.integers(0, 3_000_000),
                 st.lists(st.tuples(st.integers(0, len(POOL) - 1), st.integers(0, 1)),
                          max_size=10))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rate=st.sampled_from([1.0, 10.0, 100.0, None]), thr_bytes=st.sampled_from([0, 1500, 4000]),
       thr_pkts=st.sampled_from([0, 2, 5]), ecn=st.sampled_from([0, 600]),
       trim_bytes=st.sampled_from([PAYLOAD_OFFSET, 100, 128, 301]),
       share=st.sampled_from([1.0, 0.5, 0.25, 0.3]), burst=st.sampled_from([0, 1500]),
       room=st.sampled_from([4, 64]), steps=st.lists(step, min_size=1, max_size=12),
       modes=st.sampled_from([("uet", "uet"), ("drop_tail", "uet"), ("uet", "drop_tail")]),
       trim_thr=st.sampled_from([(0, 0), (1000, 0), (0, 3000), (2500, 2500)]))
def test_uet_kernel_matches_plain_python_twin(rate, thr_bytes, thr_pkts, ecn, trim_bytes, share,
                                              burst, room, steps, modes, trim_thr):
    """Kernel and twin agree frame by frame, per-port modes (a shaping port turned into a UET
    one beside a drop-tail one) and trimmable-only thresholds included."""
    stage = TrimStage(n_ports=2, rate_mbps=rate or 1.0, threshold_bytes=thr_bytes,
                      threshold_pkts=thr_pkts, ecn_threshold_bytes=ecn, mode=list(modes),
                      queue_slots=6, header_slots=4, control_slots=2, burst_bytes=burst,
                      trim_bytes=trim_bytes, trimmed_share=share, last_hop=[False, True],
                      trim_threshold_bytes=list(trim_thr))
    if rate is None:  # an unshaped port: no drain time at all
        stage.ns_per_byte[:] = 0.0
    twin = UetTwin(2, 8000.0 / rate if rate else 0.0, thr_bytes, thr_pkts, ecn, trim_bytes,
                   share, [False, True], (6, 4, 2), burst, modes=list(modes),
                   trim_thr=list(trim_thr))
    now = T0
    for dt, pk in steps:
        now += dt
        pkts = [(POOL[i], p) for i, p in pk]
        b = Batch(len(pkts) + room)  # room for this many emitted frames
        load(b, [f for f, _ in pkts], [p for _, p in pkts])
        stage.process(b, now)
        decisions, out = twin.process(pkts, now, room)
        assert decided(b, len(pkts)) == decisions
        assert rows(b, len(pkts)) == out
        assert all(ref_valid(f) for f, _ in out if dscp_of(f) in (26, 28))
    c = stage.counters()["ports"]
    for p in range(2):
        assert {k: c[f"port{p}"][k] for k in NAMES} == twin.c[p]
    assert stage.queued() == sum(len(q) for q in twin.cq + twin.hq + twin.dq)


def test_uet_mode_survives_malformed_frames_and_accounts_for_each():
    from test_datapath_stages_fuzz import FUZZ_BUF, FUZZ_LEN, N

    rng = np.random.default_rng(3)
    buf = FUZZ_BUF.copy()
    buf[:, OFF_TOS] = rng.choice([0, 8, 8, 8, 26, 28, 46], N) << 2
    s = TrimStage(n_ports=2, rate_mbps=10.0, threshold_bytes=8000, ecn_threshold_bytes=3000,
                  mode="uet", queue_slots=64, header_slots=64, control_slots=16,
                  last_hop=[False, True])
    emitted = []
    b = Batch(256)
    for k, lo in enumerate(range(0, N, 64)):
        n = min(64, N - lo)
        b.reset()
        b.alloc(n)
        b.buf[:n], b.length[:n] = buf[lo:lo + n], FUZZ_LEN[lo:lo + n]
        b.out_port[:n] = 1
        s.process(b, T0 + k * 200_000)
        assert set(np.unique(b.out_port[:n])) <= {1, PORT_HELD, PORT_DROP}
        emitted += [bytes(b.buf[i, :b.length[i]]) for i in range(n, b.n)]
    emitted += [f for f, _ in drain_all(s, T0 + 10**10, step=10**8)]
    c = s.counters()["ports"]["port1"]
    assert c["passed"] + c["enqueued"] + c["trimmed"] + c["dropped"] == N
    assert c["dequeued"] == c["enqueued"] + c["trimmed"] == len(emitted)
    assert c["trimmed"] == c["trimmed_lasthop"] > 0 and c["ctl_enqueued"] > 0
    # every frame cut here leaves valid, re-marked and flagged (arrivals may look alike)
    cut = [f for f in emitted if dscp_of(f) == Dscp.TRIMMED_LASTHOP and len(f) <= 128
           and ref_valid(f) and hdr(f)["flags"] & Flags.LASTHOP]
    assert len(cut) >= c["trimmed"]


# ---------------------------------------------------------------------------------------------
# the pipeline gives a UET stage its last-hop ports


def test_pipeline_marks_host_facing_ports_last_hop():
    from testbed.datapath.engine import make_stage
    from testbed.topologies import LeafSpine, Star, TopologyError
    from testbed.topologies.pipeline import DatapathOptions, Trimming, compose, dilate, node_ports

    topo = LeafSpine(2, 2, 2, switch="programmable", bw_mbps=100)
    opts = DatapathOptions(trimming=(
        Trimming("tbl1", mode="uet", threshold_bdp=1.0, rtt_us=40.0, trim_bytes=256),
        Trimming("tbsp1", mode="uet", threshold_bdp=1.0, rtt_us=40.0)))
    plan = compose(topo, opts)
    leaf = dict(plan["tbl1"])["trim"]
    assert leaf["last_hop"] == {"tbl1-eth1": True, "tbl1-eth2": True, "tbl1-eth3": False,
                                "tbl1-eth4": False}
    assert not any(dict(plan["tbsp1"])["trim"]["last_hop"].values())
    assert (leaf["mode"], leaf["trim_bytes"], leaf["threshold_bdp"], leaf["rtt_us"]) == (
        "uet", 256, 1.0, 40.0)
    assert "threshold_bytes" not in leaf
    stage = make_stage("trim", leaf, node_ports(topo, "tbl1"))
    assert stage.last_hop.tolist() == [True, True, False, False]
    assert stage.thr_bytes.tolist() == [750, 750, 500, 500]  # 100 Mb/s x 40 us, 1.5x
    # under time dilation rates fall and the RTT grows: the thresholds stay in bytes
    slow = dict(dilate(plan, 4.0)["tbl1"])["trim"]
    assert (slow["rate_mbps"], slow["rtt_us"]) == (25.0, 160.0)
    assert make_stage("trim", slow, node_ports(topo, "tbl1")).thr_bytes.tolist() == \
        stage.thr_bytes.tolist()
    # a byte threshold on one port; the others drain untrimmed
    one = dict(compose(topo, DatapathOptions(trimming=(
        Trimming("tbl1", mode="uet", threshold_bdp=2.0, rtt_us=40.0, ports=(2,)),)))["tbl1"])
    s = make_stage("trim", one["trim"], node_ports(topo, "tbl1"))
    assert s.thr_bytes[2] == 1000 and s.thr_bytes[0] > 10**9
    # a host behind a SmartNIC: the switch's port to the NIC and the NIC's to the host
    nic = compose(Star(2, switch="programmable", smartnic=True), DatapathOptions(trimming=(
        Trimming("tbs1", mode="uet"), Trimming("tbn1", mode="uet"))))
    assert set(dict(nic["tbs1"])["trim"]["last_hop"].values()) == {True}
    assert dict(nic["tbn1"])["trim"]["last_hop"] == {"tbn1-eth1": True, "tbn1-eth2": False}
    # the other modes get no last-hop ports
    assert "last_hop" not in dict(compose(topo, DatapathOptions(trimming=(
        Trimming("tbl1"),)))["tbl1"])["trim"]
    with pytest.raises(TopologyError, match="mode='ndp' must be one of"):
        compose(topo, DatapathOptions(trimming=(Trimming("tbl1", mode="ndp"),)))
    with pytest.raises(TopologyError, match="threshold_bdp needs rtt_us"):
        compose(topo, DatapathOptions(trimming=(Trimming("tbl1", threshold_bdp=1.0),)))


def test_trim_mode_ignores_the_dscp_classes():
    """A ``trim`` mode stage ignores the DSCP classes: a control-marked frame is trimmed."""
    frames, _ = trim_layout_frames(64, 4)
    frames = [mark(f, Dscp.CONTROL) for f in frames]
    stage = TrimStage(n_ports=1, rate_mbps=1.0, threshold_pkts=1)
    b = Batch(8)
    load(b, frames + int32_frames(4, 1), [0] * 5)
    stage.process(b, T0)
    c = stage.counters()["ports"]["port0"]
    assert (c["trimmed"], c["ctl_enqueued"], c["dropped"]) == (2, 0, 1)


def test_trimming_on_every_switch_with_star_and_an_own_entry_wins():
    from testbed.topologies import LeafSpine, TopologyError
    from testbed.topologies.pipeline import DatapathOptions, Trimming, compose

    topo = LeafSpine(2, 2, 2, switch="programmable", bw_mbps=100)
    plan = compose(topo, DatapathOptions(trimming=(
        Trimming("*", mode="uet", threshold_bytes=20_000),
        Trimming("tbsp2", mode="drop_tail", threshold_bytes=9_000))))
    for node in ("tbl1", "tbl2", "tbsp1"):
        trim = dict(plan[node])["trim"]
        assert (trim["mode"], trim["threshold_bytes"]) == ("uet", 20_000), node
    assert dict(plan["tbsp2"])["trim"]["mode"] == "drop_tail"  # its own entry, not both
    assert [p for p, _ in plan["tbsp2"]].count("trim") == 1
    with pytest.raises(TopologyError, match="cannot name ports"):
        compose(topo, DatapathOptions(trimming=(Trimming("*", mode="uet", ports=(1,)),)))


def test_scapy_and_the_dissector_name_nacks_and_the_lasthop_flag():
    """A NACK for a packet cut at the last hop, as the UET transport sends it, reads back with
    its names in scapy (the Wireshark dissector is generated from the same table)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from testbed.datapath.scapy_layer import TestbedHeader
    from testbed.wireshark import lua_dissector

    hdr = wire.pack_header(msg_type=int(MsgType.NACK), job_id=3, worker_id=1, seq=77,
                           flags=int(Flags.TRIMMED | Flags.LASTHOP), codec=int(Codec.BYTES))
    pkt = Ether(bytes(Ether() / IP(tos=int(Dscp.CONTROL) << 2) / UDP(sport=41000, dport=30000)
                      / hdr))
    tb = pkt[TestbedHeader]
    assert tb.sprintf("%msg_type%") == "NACK"
    assert "TRIMMED" in tb.sprintf("%flags%") and "LASTHOP" in tb.sprintf("%flags%")
    assert pkt[IP].tos >> 2 == Dscp.CONTROL and tb.seq == 77
    lua = lua_dissector()
    assert "NACK" in lua and "LASTHOP" in lua and "BYTES" in lua
