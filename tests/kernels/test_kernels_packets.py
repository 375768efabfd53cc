"""Batch packet kernels (testbed.kernels.packets) against the Python twin and scapy."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import njit
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from testbed.datapath.batch import FRAME_MAX, DropReason
from testbed.kernels import packets as pk
from testbed.kernels import wire
from testbed.kernels.reference import packets as ref

SMAC, DMAC = "02:00:00:00:00:01", "02:54:42:00:00:fe"
SIP, DIP = "10.0.0.1", "10.0.0.254"


def random_headers(rng: np.random.Generator, count: int, codec=wire.Codec.INT32) -> np.ndarray:
    h = wire.new_headers(count)
    raw = rng.integers(0, 256, size=(count, wire.HEADER_LEN), dtype=np.uint8)
    h2 = raw.view(wire.HEADER_DTYPE).reshape(count)
    for name in ("job_id", "worker_id", "slot", "slot_set", "n_workers", "exponent",
                 "chunk_offset", "scale", "flags", "seq"):
        h[name] = h2[name]
    h["scale"] = np.where(np.isfinite(h["scale"]), h["scale"], 1.5)
    h["flags"] &= ~np.uint8(wire.Flags.TRIMMED)
    h["msg_type"] = rng.integers(0, len(wire.MsgType), count)
    h["codec"] = int(codec)
    h["head_bytes"] = 0
    return h


def int32_frames(rng, count, elems=None):
    h = random_headers(rng, count)
    sizes = elems if elems is not None else rng.integers(0, 300, count)
    h["elem_count"] = sizes
    payloads = [rng.integers(-2**31, 2**31, size=int(s), dtype=np.int64).astype(np.int32)
                for s in sizes]
    buf, length = pk.build(h, payloads, SMAC, DMAC, SIP, DIP, 40001)
    return h, payloads, buf, length


def test_one_definition_of_drop_reasons_and_frame_max():
    assert DropReason is wire.DropReason
    assert pk.FRAME_MAX == FRAME_MAX == wire.FRAME_MAX


def test_header_layout_follows_wire_table():
    offsets = np.cumsum([0] + [np.dtype(f.code).itemsize for f in wire.HEADER_FIELDS])
    assert dict(zip([f.name for f in wire.HEADER_FIELDS], offsets[:-1].tolist(),
                    strict=True)) == wire.FIELD_OFFSETS
    assert wire.HEADER_LEN == offsets[-1] == wire.HEADER_DTYPE.itemsize
    assert wire.PAYLOAD_OFFSET == wire.HEADER_OFFSET + wire.HEADER_LEN


def _off(name: str) -> int:
    return wire.HEADER_OFFSET + wire.FIELD_OFFSETS[name]


def test_build_matches_twin_and_parses_back():
    rng = np.random.default_rng(1)
    h, payloads, buf, length = int32_frames(rng, 40, elems=[0, 1, 3, 255, 256] + [7] * 35)
    smac, dmac = pk.mac_to_array(SMAC).tobytes(), pk.mac_to_array(DMAC).tobytes()
    for i in range(40):
        want = ref.build_frame(h[i], payloads[i].tobytes(), smac, dmac, pk.ip_to_u32(SIP),
                               pk.ip_to_u32(DIP), 40001, wire.TESTBED_UDP_PORT)
        assert bytes(buf[i, :length[i]]) == want
    headers, status = pk.parse(buf, length)
    assert (status == 0).all()
    assert headers.tobytes() == h.tobytes()


def test_scapy_reads_built_frames_and_checksums_verify():
    rng = np.random.default_rng(2)
    h, payloads, buf, length = int32_frames(rng, 5)
    for i in range(5):
        raw = bytes(buf[i, :length[i]])
        p = Ether(raw)
        assert p[Ether].src == SMAC and p[Ether].dst == DMAC
        assert p[IP].src == SIP and p[IP].dst == DIP and p[IP].ihl == 5
        assert p[IP].len == length[i] - wire.ETH_LEN
        assert p[UDP].dport == wire.TESTBED_UDP_PORT and p[UDP].sport == 40001
        assert p[UDP].len == length[i] - wire.ETH_LEN - wire.IPV4_LEN
        assert p[UDP].chksum == 0
        ip_only = p[IP].copy()
        del ip_only.chksum
        assert IP(bytes(ip_only))[IP].chksum == p[IP].chksum  # scapy recomputes the same
        body = bytes(p[UDP].payload)
        assert body[wire.HEADER_LEN:] == payloads[i].tobytes()
        assert pk.ipv4_checksum_ok(buf[i])


def test_parse_batch_random_bytes_never_crashes_and_matches_twin():
    rng = np.random.default_rng(3)
    n = 300
    buf = rng.integers(0, 256, size=(n, 128), dtype=np.uint8)
    # make a third of them look like IPv4/UDP to the testbed port so later checks are reached
    buf[::3, 12:14] = [0x08, 0x00]
    buf[::3, 14] = 0x45
    buf[::3, 23] = 17
    buf[::3, 36:38] = [0xA0, 0x28]
    buf[::3, 20:22] = 0
    length = rng.integers(-5, 140, size=n).astype(np.int32)
    headers, status = pk.parse(buf, length)
    h_ref, s_ref = ref.parse_batch(buf, length, n)
    assert np.array_equal(status, s_ref)
    ok = status == 0
    assert headers[ok].tobytes() == h_ref[ok].tobytes()


def test_truncated_frames_give_too_short_or_bad_length():
    rng = np.random.default_rng(4)
    _, _, buf, length = int32_frames(rng, 1, elems=[16])
    full = int(length[0])
    cut = np.repeat(buf, full, axis=0)
    lens = np.arange(full, dtype=np.int32)
    _, status = pk.parse(cut, lens)
    _, s_ref = ref.parse_batch(cut, lens, full)
    assert np.array_equal(status, s_ref)
    assert (status[: wire.ETH_LEN] == DropReason.TOO_SHORT).all()
    assert (status[wire.ETH_LEN + wire.IPV4_LEN:] == DropReason.BAD_LENGTH).all()
    assert set(status.tolist()) <= {DropReason.TOO_SHORT, DropReason.BAD_LENGTH}
    # Ethernet padding after the IP packet is fine
    padded = np.zeros((1, FRAME_MAX), np.uint8)
    padded[0, :full] = buf[0, :full]
    _, st = pk.parse(padded, np.array([full + 10], np.int32))
    assert st[0] == 0


def _mutated(field_off: int, value: bytes, elems: int = 4, fix_csum: bool = True):
    rng = np.random.default_rng(5)
    _, _, buf, length = int32_frames(rng, 1, elems=[elems])
    f = buf[0]
    f[field_off:field_off + len(value)] = np.frombuffer(value, np.uint8)
    if fix_csum:
        pk.set_ipv4_checksum(f)
    return buf, length


@pytest.mark.parametrize("off,value,reason", [
    (12, b"\x86\xdd", DropReason.NOT_IPV4),
    (14, b"\x65", DropReason.NOT_IPV4),
    (14, b"\x46", DropReason.IP_OPTIONS),
    (14, b"\x44", DropReason.BAD_LENGTH),
    (23, b"\x06", DropReason.NOT_UDP),
    (36, b"\x00\x35", DropReason.NOT_UDP),
    (20, b"\x20\x00", DropReason.OTHER),  # more-fragments
    (16, b"\xff\xff", DropReason.BAD_LENGTH),
    (38, b"\x00\x30", DropReason.BAD_LENGTH),  # UDP length != IP payload
    (_off("magic"), b"\x00\x00", DropReason.BAD_MAGIC),
    (_off("version"), b"\x09", DropReason.BAD_VERSION),
    (_off("msg_type"), b"\x09", DropReason.UNKNOWN_TYPE),
    (_off("codec"), b"\x63", DropReason.BAD_CODEC),
    (_off("elem_count"), b"\x05\x00", DropReason.BAD_LENGTH),  # 5*4 != 16 payload bytes
    (_off("head_bytes"), b"\x11\x00", DropReason.BAD_LENGTH),  # head beyond payload
    (_off("flags"), bytes([int(wire.Flags.TRIMMED)]), DropReason.BAD_LENGTH),
])
def test_each_malformation_has_its_reason(off, value, reason):
    buf, length = _mutated(off, value)
    _, status = pk.parse(buf, length)
    s_ref, _ = ref.parse_frame(buf[0], int(length[0]))
    assert status[0] == reason == s_ref


def test_codec_sizes_float16_and_trim_layout():
    h = wire.new_headers(3)
    h["codec"] = [int(wire.Codec.FLOAT16), int(wire.Codec.FLOAT16), int(wire.Codec.TRIM_LAYOUT)]
    h["elem_count"] = [4, 5, 256]
    h["head_bytes"] = [0, 0, 40]
    buf, length = pk.build(h, [b"x" * 8, b"x" * 8, b"y" * 1064], SMAC, DMAC, SIP, DIP, 1)
    _, status = pk.parse(buf, length)
    assert status.tolist() == [0, DropReason.BAD_LENGTH, 0]


def test_primitives_roundtrip_against_numpy():
    rng = np.random.default_rng(6)
    f = np.zeros(64, np.uint8)
    for _ in range(50):
        off = int(rng.integers(0, 56))
        u16, u32 = int(rng.integers(0, 2**16)), int(rng.integers(0, 2**32))
        i16 = int(rng.integers(-2**15, 2**15))
        bits = np.uint32(rng.integers(0, 2**32))
        pk.wr_u16le(f, off, u16)
        assert pk.rd_u16le(f, off) == u16 == f[off:off + 2].view("<u2")[0]
        pk.wr_u16be(f, off, u16)
        assert pk.rd_u16be(f, off) == u16 == f[off:off + 2].view(">u2")[0]
        pk.wr_i16le(f, off, i16)
        assert pk.rd_i16le(f, off) == i16 == f[off:off + 2].view("<i2")[0]
        pk.wr_u32le(f, off, u32)
        assert pk.rd_u32le(f, off) == u32 == f[off:off + 4].view("<u4")[0]
        pk.wr_u32be(f, off, u32)
        assert pk.rd_u32be(f, off) == u32 == f[off:off + 4].view(">u4")[0]
        val = np.array([bits], np.uint32).view(np.float32)[0]
        if np.isfinite(val):  # NaN payload bits may be quieted by float conversions
            pk.wr_f32le(f, off, val)
            assert f[off:off + 4].view("<u4")[0] == bits
            assert np.float32(pk.rd_f32le(f, off)).view(np.uint32) == bits


@njit(cache=True)
def _read_fields(f):
    h = pk.header(f)
    return (h.magic, h.version, h.msg_type, h.job_id, h.worker_id, h.slot, h.slot_set, h.flags,
            h.codec, h.n_workers, h.exponent, h.elem_count, h.head_bytes, h.chunk_offset,
            h.scale, h.seq)


@njit(cache=True)
def _write_fields(f, v):
    h = pk.header(f)
    h.magic, h.version, h.msg_type, h.job_id = v[0], v[1], v[2], v[3]
    h.worker_id, h.slot, h.slot_set, h.flags = v[4], v[5], v[6], v[7]
    h.codec, h.n_workers, h.exponent, h.elem_count = v[8], v[9], v[10], v[11]
    h.head_bytes, h.chunk_offset, h.scale, h.seq = v[12], v[13], v[14], v[15]


def test_header_record_reads_and_writes_every_field_in_place():
    assert [f.name for f in wire.HEADER_FIELDS][-1] == "seq"  # _read_fields lists them all
    rng = np.random.default_rng(7)
    h, _, buf, length = int32_frames(rng, 20)
    for i in range(20):
        got = _read_fields(buf[i])
        assert got == tuple(h[i].item()), i
        assert wire.unpack_header(buf[i].tobytes(), wire.HEADER_OFFSET) == h[i]
    f = buf[0].copy()
    vals = (0x1234, 9, 2, 513, 31, 8191, 1, 5, 1, 64, -149, 300, 40, 2**32 - 2, -0.125,
            2**32 - 1)
    _write_fields(f, vals)
    view = f[wire.HEADER_OFFSET:wire.PAYLOAD_OFFSET].view(wire.HEADER_DTYPE)[0]
    assert tuple(view.item()) == vals
    assert bytes(f[wire.PAYLOAD_OFFSET:]) == bytes(buf[0, wire.PAYLOAD_OFFSET:])  # in place


def test_pack_header_and_describe():
    b = wire.pack_header(msg_type=int(wire.MsgType.RESULT), job_id=3, seq=7, flags=3)
    h = wire.unpack_header(b)
    d = wire.describe_header(h)
    assert d["msg_type"] == "RESULT" and d["job_id"] == 3 and d["seq"] == 7
    assert d["magic"] == wire.MAGIC and d["version"] == wire.VERSION
    assert "TRIMMED" in d["flags"] and "OVERFLOW" in d["flags"]
    with pytest.raises(ValueError, match="no field 'jobid'"):
        wire.pack_header(jobid=1)
    with pytest.raises(ValueError, match="needs"):
        wire.unpack_header(b[:5])


def test_checksum_swap_and_set_addresses():
    rng = np.random.default_rng(8)
    _, _, buf, length = int32_frames(rng, 10)
    for i in range(10):
        f = buf[i]
        assert pk.ipv4_checksum(f) == ref.ipv4_checksum(bytes(f[14:34]))
        pk.swap_addresses(f)
        assert pk.ipv4_checksum_ok(f)
        p = Ether(bytes(f[:length[i]]))
        assert (p[IP].src, p[IP].dst, p[UDP].sport, p[UDP].dport) == (DIP, SIP, 41000, 40001)
        assert (p[Ether].src, p[Ether].dst) == (DMAC, SMAC)
        pk.set_addresses(f, pk.mac_to_array("02:00:00:00:00:07"), pk.mac_to_array(DMAC),
                         pk.ip_to_u32("10.0.0.7"), pk.ip_to_u32(DIP), 1234, 41000)
        assert pk.ipv4_checksum_ok(f)
        p = Ether(bytes(f[:length[i]]))
        assert (p[IP].src, p[UDP].sport, p[Ether].src) == ("10.0.0.7", 1234, "02:00:00:00:00:07")
        f[30] ^= 0xFF  # corrupt the destination address: checksum must notice
        assert not pk.ipv4_checksum_ok(f)


@njit(cache=True)
def _njit_caller(buf, length, n):
    """Uses the primitives from other njit code, as the data path does."""
    total = 0
    for i in range(n):
        f = buf[i]
        if pk.parse_frame(f, length[i]) == DropReason.NONE:
            h = pk.header(f)
            p = pk.payload_i32(f, h.elem_count)
            for k in range(p.shape[0]):
                total += p[k]
            h.slot += 1
    return total


def test_primitives_callable_from_njit():
    rng = np.random.default_rng(9)
    h, payloads, buf, length = int32_frames(rng, 8)
    want = sum(int(p.astype(np.int64).sum()) for p in payloads)
    assert _njit_caller(buf, length, 8) == want
    headers, status = pk.parse(buf, length)
    assert (headers["slot"] == (h["slot"].astype(np.int64) + 1) % 65536).all()


def test_wrappers_reject_bad_input_with_names():
    buf = np.zeros((2, FRAME_MAX), np.uint8)
    with pytest.raises(TypeError, match="length"):
        pk.parse(buf, np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="buf"):
        pk.parse(buf.astype(np.int16), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="length"):
        pk.parse(buf, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="n"):
        pk.parse(buf, np.zeros(2, np.int32), n=5)
    with pytest.raises(ValueError, match="payloads"):
        pk.build(wire.new_headers(2), [b""], SMAC, DMAC, SIP, DIP, 1)
    with pytest.raises(ValueError, match="mac"):
        pk.build(wire.new_headers(1), [b""], "nope", DMAC, SIP, DIP, 1)
    with pytest.raises(ValueError, match="ip"):
        pk.build(wire.new_headers(1), [b""], SMAC, DMAC, "10.0.0", DIP, 1)
    with pytest.raises(ValueError, match="sport"):
        pk.build(wire.new_headers(1), [b""], SMAC, DMAC, SIP, DIP, 70000)
    with pytest.raises(ValueError, match="payloads"):
        pk.build(wire.new_headers(1), [b"x" * 3000], SMAC, DMAC, SIP, DIP, 1)
    with pytest.raises(TypeError, match="headers"):
        pk.build(np.zeros(1), [b""], SMAC, DMAC, SIP, DIP, 1)


def test_frames_from_the_testbed_port_are_testbed_frames():
    """A RESULT goes from the aggregator's port 41000 to the worker's own port."""
    buf, length = _mutated(36, b"\x00\x35")  # dport 53: not to the testbed port ...
    buf[0, 34:36] = np.frombuffer((41000).to_bytes(2, "big"), np.uint8)  # ... but from it
    _, status = pk.parse(buf, length)
    assert status[0] == ref.parse_frame(buf[0], int(length[0]))[0] == DropReason.NONE


@njit(cache=True)
def _bump_borrowed(t):
    a, k, b = pk.borrow_arrays(t)
    a[0] += k
    b[1] = 7.5
    return a.size + b.size


def test_borrowed_arrays_write_through_and_leave_reference_counts_alone():
    a, b = np.zeros(3, np.int64), np.zeros((2, 2))
    before = sys.getrefcount(a), sys.getrefcount(b)
    for _ in range(100):
        assert _bump_borrowed((a, 2, b[0])) == 5
    assert a[0] == 200 and b[0, 1] == 7.5 and b.sum() == 7.5
    assert (sys.getrefcount(a), sys.getrefcount(b)) == before
