"""10 000 malformed frames at each of the trim, impair and nic_codec stages: no crash, and every
frame is accounted for by the stage's counters."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.datapath.batch import FRAME_MAX, PORT_DROP, PORT_HELD, PORT_UNSET, Batch
from testbed.datapath.codec import CodecStage
from testbed.datapath.impair import ImpairStage
from testbed.datapath.trim import TrimStage
from testbed.kernels import packets, trimming, wire

N = 10_000
BURST = 64
T0 = 9_000_000_000


def _bases() -> list[np.ndarray]:
    """Valid frames of every kind the stages act on (trimming layout, float32, fp16, int32)."""
    rng = np.random.default_rng(0)
    out = []
    for codec, m in ((wire.Codec.TRIM_LAYOUT, 64), (wire.Codec.FLOAT32, 100),
                     (wire.Codec.FLOAT16, 300), (wire.Codec.INT32, 256), (wire.Codec.SIGN, 200)):
        h = wire.new_headers(1)
        h["codec"] = codec
        h["elem_count"] = m
        if codec == wire.Codec.TRIM_LAYOUT:
            h["head_bytes"] = trimming.head_bytes_for(m, 1)
            pl = trimming.encode(rng.standard_normal(m).astype(np.float32))
        elif codec == wire.Codec.FLOAT16:
            pl = rng.integers(0, 0xFFFF, m).astype(np.uint16)
        elif codec == wire.Codec.SIGN:
            pl = rng.integers(0, 256, m // 8).astype(np.uint8)
        else:
            pl = rng.standard_normal(m).astype(np.float32)
        buf, ln = packets.build(h, [pl], "02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1",
                                "10.0.0.2", 5000)
        out.append(buf[0, :ln[0]].copy())
    return out


def malformed(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``N`` frames (uint8[N, FRAME_MAX], lengths) mutated from valid ones: truncated, padded,
    bit-flipped headers, random header fields, random lengths fields, pure garbage, empty."""
    rng = np.random.default_rng(seed)
    bases = _bases()
    buf = np.zeros((N, FRAME_MAX), np.uint8)
    length = np.zeros(N, np.int32)
    hdr = wire.HEADER_OFFSET
    for i in range(N):
        b = bases[rng.integers(len(bases))]
        buf[i, :len(b)] = b
        ln = len(b)
        kind = i % 7
        if kind == 0:  # truncated anywhere
            ln = int(rng.integers(0, ln))
        elif kind == 1:  # flipped bytes in Ethernet/IP/UDP/testbed headers
            for j in rng.integers(0, wire.PAYLOAD_OFFSET, rng.integers(1, 5)):
                buf[i, j] ^= np.uint8(1 << rng.integers(8))
        elif kind == 2:  # garbage frame of any size
            ln = int(rng.integers(0, FRAME_MAX + 1))
            buf[i, :ln] = rng.integers(0, 256, ln, dtype=np.uint8)
        elif kind == 3:  # random testbed header fields (codec, flags, counts, head_bytes...)
            buf[i, hdr + 2:hdr + wire.HEADER_LEN] = rng.integers(0, 256, wire.HEADER_LEN - 2,
                                                                 dtype=np.uint8)
        elif kind == 4:  # trailing junk up to the largest frame
            extra = int(rng.integers(1, FRAME_MAX - ln + 1))
            buf[i, ln:ln + extra] = rng.integers(0, 256, extra, dtype=np.uint8)
            ln += extra
        elif kind == 5:  # IP total length / UDP length / elem_count lie
            packets.wr_u16be(buf[i], 16, int(rng.integers(0, 65536)))
            packets.wr_u16be(buf[i], 38, int(rng.integers(0, 65536)))
            packets.wr_u16le(buf[i], wire.HEADER_OFFSET + wire.FIELD_OFFSETS["elem_count"],
                             int(rng.integers(0, 65536)))
        else:  # a valid frame sprinkled in, so the good path runs too
            pass
        length[i] = ln
    return buf, length


FUZZ_BUF, FUZZ_LEN = malformed()


def bursts(out_port: int = PORT_UNSET, in_port: int = 0):
    """Yield batches of the fuzz frames, ``BURST`` at a time."""
    b = Batch(4 * BURST)
    for lo in range(0, N, BURST):
        n = min(BURST, N - lo)
        b.reset()
        b.alloc(n)
        b.buf[:n] = FUZZ_BUF[lo:lo + n]
        b.length[:n] = FUZZ_LEN[lo:lo + n]
        b.in_port[:n] = in_port
        b.out_port[:n] = out_port
        yield lo // BURST, n, b


def _drain(stage, now: int) -> list[bytes]:
    b = Batch(4 * BURST)
    out = []
    for k in range(100_000):
        b.reset()
        stage.process(b, now + k * 10**8)
        out += [bytes(b.buf[i, :b.length[i]]) for i in range(b.n) if b.out_port[i] >= 0]
        if stage.next_deadline_ns() is None:
            return out
    raise AssertionError("stage never emptied")


@pytest.mark.parametrize("mode", ["trim", "drop_tail"])
def test_trim_stage_survives_and_counts_malformed_frames(mode):
    s = TrimStage(n_ports=2, rate_mbps=10.0, threshold_bytes=8000, ecn_threshold_bytes=3000,
                  mode=mode, queue_slots=64, header_slots=64)
    emitted = []
    drops = 0
    for k, n, b in bursts(out_port=1):
        s.process(b, T0 + k * 200_000)
        dec = b.out_port[:n]
        assert set(np.unique(dec)) <= {1, PORT_HELD, PORT_DROP}
        drops += int((dec == PORT_DROP).sum())
        emitted += [bytes(b.buf[i, :b.length[i]]) for i in range(n, b.n)]
    emitted += _drain(s, T0 + 10**10)
    c = s.counters()["ports"]["port1"]
    assert c["passed"] + c["enqueued"] + c["trimmed"] + c["dropped"] == N
    assert c["dropped"] == drops
    assert c["dequeued"] == c["enqueued"] + c["trimmed"] == len(emitted)
    assert c["trimmed"] > 0 if mode == "trim" else c["trimmed"] == 0
    trimmed_out = [f for f in emitted if len(f) < 200 and
                   packets.parse_frame(np.frombuffer(f, np.uint8).copy(), len(f)) == 0 and
                   wire.unpack_header(f, wire.HEADER_OFFSET)["flags"] & wire.Flags.TRIMMED]
    if mode == "trim":
        assert trimmed_out  # trimmed frames leave as valid testbed frames


@pytest.mark.parametrize("direction", ["egress", "ingress"])
def test_impair_stage_survives_and_counts_malformed_frames(direction):
    s = ImpairStage(n_ports=2, direction=direction, filter="testbed", seed=11, loss=0.1,
                    dup=0.1, reorder=0.1, reorder_k=2, delay_ms=0.5, jitter_ms=0.2, slots=256)
    out_port = 1 if direction == "egress" else PORT_UNSET
    dropped = released = 0
    for k, n, b in bursts(out_port=out_port, in_port=1):
        s.process(b, T0 + k * 1_000_000)  # 64 frames per ms: the 256-slot ring never fills
        dec = b.out_port[:n]
        dropped += int((dec == PORT_DROP).sum())
        released += b.n - n
    c = s.counters()["ports"]["port1"]
    assert c["seen"] + c["bypassed"] + c["malformed"] == N
    assert 0 < c["bypassed"] < N and c["seen"] > 0
    assert c["overflow"] == 0 and dropped == c["lost"] + c["malformed"]
    tail = Batch(4 * BURST)
    t = T0 + 10**10
    while s.next_deadline_ns() is not None:
        tail.reset()
        s.process(tail, t)
        released += tail.n
        t += 10**8
    # every held frame (delayed, reordered, or a duplicate) leaves exactly once
    c = s.counters()["ports"]["port1"]
    assert released == c["released"]
    assert c["released"] == c["delayed"] + c["reordered"] + c["duplicated"]


def test_codec_stage_survives_and_counts_malformed_frames():
    for in_port, codec in ((0, "fp16"), (1, "fp16"), (0, "fixed32"), (1, "fixed32"),
                           (1, "bf16"), (0, "sign"), (1, "sign")):
        s = CodecStage(n_ports=2, codec=codec)
        for k, n, b in bursts(in_port=in_port):
            s.process(b, 0)
            assert (b.out_port[:n] == 1 - in_port).all()
            for i in range(n):
                j = k * BURST + i
                ln = b.length[i]
                if ln != FUZZ_LEN[j] or not np.array_equal(b.buf[i, :ln], FUZZ_BUF[j, :ln]):
                    assert packets.parse_frame(b.buf[i], ln) == 0  # rewritten: must be valid
                    assert packets.ipv4_checksum_ok(b.buf[i])
        c = s.counters()
        assert c["encoded"] + c["decoded"] + c["passthrough"] == N, (in_port, codec, c)
        assert c["malformed"] > 0 and c["passthrough"] > c["malformed"]
        assert (c["encoded"] > 0) == (in_port == 0)
        assert (c["decoded"] > 0) == (in_port == 1)
