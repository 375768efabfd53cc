"""The ``nic_codec`` stage on batches of real frames: byte-exact against a numpy twin, round trip
equal to the compressors' own decode, overflow, pass-through and configuration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from testbed.datapath.batch import PORT_UNSET, Batch
from testbed.datapath.codec import CodecStage
from testbed.kernels import packets, wire
from testbed.kernels.compressors import get_compressor
from testbed.kernels.reference import compressors as ref_comp
from testbed.kernels.reference import fixedpoint as ref_fixed
from testbed.kernels.reference.packets import ipv4_checksum

HOST, NET = 0, 1
F = wire.FIELD_OFFSETS
H = wire.HEADER_OFFSET


def float_frame(x: np.ndarray, msg_type=wire.MsgType.DATA, codec=wire.Codec.FLOAT32,
                head_bytes: int = 0, payload: np.ndarray | None = None) -> bytes:
    """One testbed frame carrying ``x`` (or raw ``payload``) with ``elem_count = len(x)``."""
    h = wire.new_headers(1)
    h["msg_type"] = msg_type
    h["codec"] = codec
    h["elem_count"] = len(x)
    h["head_bytes"] = head_bytes
    h["chunk_offset"] = 512
    h["exponent"] = -3
    buf, ln = packets.build(h, [x if payload is None else payload], "02:00:00:00:00:01",
                            "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2", 5000)
    return bytes(buf[0, :ln[0]])


def through(stage: CodecStage, fs, in_port: int):
    """Run frames arriving on ``in_port`` through the stage; return (frames, out_ports)."""
    b = Batch(len(fs) + 4)
    for f in fs:
        i = b.alloc(1)
        b.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        b.length[i] = len(f)
        b.in_port[i] = in_port
    stage.process(b, 0)
    return [bytes(b.buf[i, :b.length[i]]) for i in range(b.n)], list(b.out_port[:b.n])


def payload_of(f: bytes, dtype: str) -> np.ndarray:
    """The payload of a testbed frame as ``dtype`` (little-endian)."""
    return np.frombuffer(f[wire.PAYLOAD_OFFSET:], dtype=dtype).copy()


# ---------------------------------------------------------------------------------------------
# numpy twin of the frame rewrite


def _rewrite(f: bytes, codec: int, payload: bytes, flags_or: int = 0, scale=None,
             head_zero: bool = False) -> bytes:
    g = bytearray(f[:wire.PAYLOAD_OFFSET]) + payload
    g[H + F["codec"]] = codec
    g[H + F["flags"]] |= flags_or
    if head_zero:
        g[H + F["head_bytes"]:H + F["head_bytes"] + 2] = b"\0\0"
    if scale is not None:
        g[H + F["scale"]:H + F["scale"] + 4] = np.float32(scale).tobytes()
    udp = 8 + wire.HEADER_LEN + len(payload)
    g[16:18] = (20 + udp).to_bytes(2, "big")
    g[38:40] = udp.to_bytes(2, "big")
    g[40:42] = b"\0\0"
    g[24:26] = ipv4_checksum(bytes(g[14:34])).to_bytes(2, "big")
    return bytes(g)


def ref_encode(f: bytes, name: str, factor: float) -> bytes:
    """What the SmartNIC's host->net side must emit for a FLOAT32 frame."""
    x = payload_of(f, "<f4").astype(np.float32)
    if name == "sign":
        total = 0.0
        for v in np.abs(x.astype(np.float64)):  # sequential float64 sum, as the kernel
            total += float(v)
        return _rewrite(f, wire.Codec.SIGN, ref_comp.sign_pack(x).tobytes(),
                        scale=total / len(x), head_zero=True)
    if name == "fixed32":
        q, over = ref_fixed.atp_quantize(x, factor)
        return _rewrite(f, wire.Codec.INT32, q.astype("<i4").tobytes(),
                        int(wire.Flags.OVERFLOW) if over else 0, scale=factor, head_zero=True)
    with np.errstate(over="ignore"):  # out-of-range values become inf: that is the point
        h = ref_comp.fp16_encode(x) if name == "fp16" else ref_comp.bf16_encode(x)
    back = ref_comp.fp16_decode(h) if name == "fp16" else ref_comp.bf16_decode(h)
    over = bool((np.isfinite(x) & ~np.isfinite(back)).any())
    code = wire.Codec.FLOAT16 if name == "fp16" else wire.Codec.BFLOAT16
    return _rewrite(f, code, h.astype("<u2").tobytes(), int(wire.Flags.OVERFLOW) if over else 0,
                    head_zero=True)


def ref_decode(f: bytes, factor: float) -> bytes:
    """What the net->host side must deliver for a FLOAT16/BFLOAT16/INT32 frame."""
    codec = f[H + F["codec"]]
    m = int.from_bytes(f[H + F["elem_count"]:][:2], "little")
    if codec == wire.Codec.SIGN:
        s = np.frombuffer(f[H + F["scale"]:][:4], "<f4")[0]
        x = ref_comp.sign_unpack(np.frombuffer(f[wire.PAYLOAD_OFFSET:], np.uint8), s, -s, m)
        return _rewrite(f, wire.Codec.FLOAT32, x.astype("<f4").tobytes(), scale=0.0)
    if codec == wire.Codec.INT32:
        s = float(np.frombuffer(f[H + F["scale"]:][:4], "<f4")[0])
        x = ref_fixed.atp_dequantize(payload_of(f, "<i4"), s if s > 0 else factor)
        return _rewrite(f, wire.Codec.FLOAT32, x.astype("<f4").tobytes(), scale=0.0)
    h = payload_of(f, "<u2")
    x = ref_comp.fp16_decode(h) if codec == wire.Codec.FLOAT16 else ref_comp.bf16_decode(h)
    return _rewrite(f, wire.Codec.FLOAT32, x.astype("<f4").tobytes())


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=arrays(np.float32, st.integers(1, 300), elements=finite32),
       name=st.sampled_from(["fp16", "bf16", "fixed32", "sign"]),
       factor=st.sampled_from([1e6, 1e3, 7.5]))
def test_codec_matches_numpy_twin_both_ways(x, name, factor):
    f = float_frame(x)
    enc = CodecStage(n_ports=2, codec=name, factor=factor)
    dec = CodecStage(n_ports=2, codec=name, factor=factor)
    (e,), ports = through(enc, [f], HOST)
    assert ports == [NET]
    assert e == ref_encode(f, name, factor)
    assert packets.parse_frame(np.frombuffer(e, np.uint8).copy(), len(e)) == 0
    (d,), ports = through(dec, [e], NET)
    assert ports == [HOST]
    assert d == ref_decode(e, factor)
    assert len(d) == len(f)
    c = enc.counters()
    assert c["encoded"] == 1 and c["bytes_saved"] == len(f) - len(e)
    assert dec.counters()["decoded"] == 1


def compressor_round_trip(name: str, xs: np.ndarray) -> np.ndarray:
    """What the host behind the far NIC must get for chunks ``xs`` (one per packet):
    the compressor's own decode of its own encode (sign: EF-signSGD per packet)."""
    if name == "fixed32":
        return ref_fixed.atp_dequantize(ref_fixed.atp_quantize(xs.ravel(), 1e6)[0], 1e6)
    if name == "sign":
        comp = get_compressor("efsignsgd")
        return np.concatenate([comp.decompress(*comp.compress(x)) for x in xs])
    comp = get_compressor(name)
    return comp.decompress(*comp.compress(xs.ravel()))


@pytest.mark.parametrize("name", ["fp16", "bf16", "sign"])
def test_round_trip_through_two_nics_equals_compressor_decode(name):
    rng = np.random.default_rng(7)
    xs = (rng.standard_normal((8, 256)) * 3).astype(np.float32)
    nic_a = CodecStage(ports=["tbn1-eth0", "tbn1-eth1"], codec=name)
    nic_b = CodecStage(ports=["tbn2-eth0", "tbn2-eth1"], codec=name, host_port="tbn2-eth0",
                       net_port="tbn2-eth1")
    wire_frames, _ = through(nic_a, [float_frame(x) for x in xs], HOST)
    nbytes = 256 // 8 if name == "sign" else 2 * 256
    assert all(len(f) == wire.frame_len(nbytes) for f in wire_frames)
    delivered, _ = through(nic_b, wire_frames, NET)
    got = np.concatenate([payload_of(f, "<f4") for f in delivered])
    np.testing.assert_array_equal(got, compressor_round_trip(name, xs))
    assert nic_a.counters()["bytes_saved"] == 8 * (4 * 256 - nbytes)


def test_fixed32_round_trip_error_and_overflow_flags():
    x = np.linspace(-100, 100, 256).astype(np.float32)
    (e,), _ = through(CodecStage(n_ports=2, codec="fixed32"), [float_frame(x)], HOST)
    q = payload_of(e, "<i4")
    np.testing.assert_array_equal(q, np.rint(x.astype(np.float64) * 1e6).astype(np.int32))
    (d,), _ = through(CodecStage(n_ports=2, codec="fixed32"), [e], NET)
    assert np.abs(payload_of(d, "<f4") - x).max() <= 0.5e-6 + 1e-5  # half a quantum + f32
    big = x * 1e3  # 1e5 * 1e6 does not fit int32
    st_ = CodecStage(n_ports=2, codec="fixed32")
    (e2,), _ = through(st_, [float_frame(big)], HOST)
    assert e2[H + F["flags"]] & wire.Flags.OVERFLOW and st_.counters()["overflow"] == 1
    st16 = CodecStage(n_ports=2, codec="fp16")
    (e3,), _ = through(st16, [float_frame(np.array([1e5, 1.0], np.float32))], HOST)
    assert e3[H + F["flags"]] & wire.Flags.OVERFLOW and st16.counters()["overflow"] == 1


def test_untouched_traffic_passes_through_and_is_counted():
    x = np.ones(16, np.float32)
    junk = bytes(range(80))  # not IPv4
    int32 = float_frame(x, codec=wire.Codec.INT32, payload=np.arange(16, dtype=np.int32))
    ack = float_frame(x, msg_type=wire.MsgType.ACK)
    broken = bytearray(float_frame(x))
    broken[H + F["elem_count"]] = 17  # lengths disagree: malformed testbed frame
    s = CodecStage(n_ports=2, codec="bf16")
    out, ports = through(s, [junk, int32, ack, bytes(broken)], HOST)
    assert out == [junk, int32, ack, bytes(broken)] and ports == [NET] * 4
    c = s.counters()
    assert (c["passthrough"], c["malformed"], c["encoded"]) == (4, 1, 0)
    # from the net: INT32 is left alone unless the NIC runs fixed32; FLOAT16 is always widened
    h16 = float_frame(np.zeros(16, np.float32), codec=wire.Codec.FLOAT16,
                      payload=np.full(16, 0x3C00, np.uint16))  # 1.0 in half precision
    out, ports = through(s, [int32, h16], NET)
    assert out[0] == int32 and ports == [HOST, HOST]
    np.testing.assert_array_equal(payload_of(out[1], "<f4"), np.ones(16, np.float32))
    # a frame that would not fit the MTU once widened stays as it is
    big = float_frame(np.zeros(700, np.float32), codec=wire.Codec.FLOAT16,
                      payload=np.zeros(700, np.uint16))
    out, _ = through(s, [big], NET)
    assert out == [big] and s.counters()["too_big"] == 1


def test_cross_connect_off_and_foreign_ports():
    x = np.ones(8, np.float32)
    s = CodecStage(n_ports=3, codec="fp16", host_port=2, net_port=0, cross_connect=False)
    out, ports = through(s, [float_frame(x)], 1)  # neither host nor net: untouched
    assert out == [float_frame(x)] and ports == [PORT_UNSET]
    out, ports = through(s, [float_frame(x)], 2)
    assert len(out[0]) == wire.frame_len(16) and ports == [PORT_UNSET]


def test_encoded_frame_dissects_with_scapy():
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from testbed.datapath.scapy_layer import TestbedHeader

    x = np.arange(32, dtype=np.float32)
    (e,), _ = through(CodecStage(n_ports=2, codec="bf16"), [float_frame(x)], HOST)
    p = Ether(e)
    assert p[IP].len == len(e) - 14 and p[UDP].len == len(e) - 34
    assert p[TestbedHeader].codec == wire.Codec.BFLOAT16 and p[TestbedHeader].elem_count == 32
    chk = p[IP].chksum
    del p[IP].chksum
    assert Ether(bytes(p))[IP].chksum == chk


def test_configure_validates():
    s = CodecStage(ports=["a", "b"])
    with pytest.raises(ValueError, match="codec must be one of"):
        s.configure(codec="zstd")
    with pytest.raises(ValueError, match="both"):
        s.configure(host_port="b", net_port="b")
    with pytest.raises(ValueError, match="factor"):
        s.configure(factor=-1)
    with pytest.raises(ValueError, match="unknown settings"):
        s.configure(level=3)
    with pytest.raises(ValueError, match="2 ports"):
        CodecStage(ports=["only"])
    s.configure(codec="fixed32", factor=1e4, net_port="a", host_port="b")
    assert (s.codec, s.factor, s.host_port, s.net_port) == ("fixed32", 1e4, 1, 0)


# ---------------------------------------------------------------------------------------------
# Mininet: h1 -- tbn1 (SmartNIC) -- tbs1 -- tbn2 (SmartNIC) -- h2


@pytest.mark.mininet
def test_round_trip_through_two_smartnic_nodes(tmp_path):
    from test_datapath_trim import (
        finish_capture,
        gen_done,
        host_frames,
        port_of,
        send_frames,
        start_capture,
    )

    from testbed.testing import programmable_star

    n, m = 64, 256
    rng = np.random.default_rng(5)
    xs = (rng.standard_normal((n, m)) * 4).astype(np.float32)
    with programmable_star(2, programs=[("forward", {})],
                           nic_programs=[("nic_codec", {"codec": "fp16"})]) as (net, hosts, sw):
        h1, h2 = hosts
        nic1, nic2 = net.get("tbn1"), net.get("tbn2")
        h2.setARP(h1.IP(), h1.MAC())
        with sw.client() as c:
            c.configure("forward", l2={h2.MAC(): port_of(sw, nic2)})
        h = wire.new_headers(n)
        h["codec"] = wire.Codec.FLOAT32
        h["elem_count"] = m
        h["chunk_offset"] = np.arange(n) * m
        fs = host_frames(h1, h2, list(xs), h)
        for name in ("fp16", "bf16", "fixed32", "sign"):
            for nic in (nic1, nic2):
                with nic.client() as c:
                    c.configure("nic_codec", codec=name)
            with nic1.client() as c:
                before = c.counters()["stages"]["nic_codec"]
            cap, out = start_capture(h2, tmp_path, name)
            gen_done(send_frames(h1, fs, tmp_path, name, pps=2000), n)
            got = finish_capture(cap, out)
            assert len(got) == n
            y = np.stack([payload_of(f, "<f4") for f in got])
            np.testing.assert_array_equal(y.ravel(), compressor_round_trip(name, xs))
            for f, g in zip(fs, got, strict=True):  # addresses and header kept, codec FLOAT32
                assert len(g) == len(f) and g[:wire.HEADER_OFFSET] == f[:wire.HEADER_OFFSET]
                assert g[wire.HEADER_OFFSET:wire.PAYLOAD_OFFSET] == f[
                    wire.HEADER_OFFSET:wire.PAYLOAD_OFFSET]
            with nic1.client() as c:
                after = c.counters()["stages"]["nic_codec"]
            assert after["encoded"] - before["encoded"] == n
            saved = {"fixed32": 0, "sign": 4 * m - m // 8}.get(name, 2 * m)
            assert after["bytes_saved"] - before["bytes_saved"] == n * saved
        with nic2.client() as c:
            assert c.counters()["stages"]["nic_codec"]["decoded"] == 4 * n
