"""The scapy layer is derived from wire.HEADER_FIELDS and agrees with HEADER_DTYPE byte for byte;
scapy dissects the frames the engine emits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from testbed.datapath.aggclient import header_bytes, udp_frame
from testbed.datapath.aggregate import DEFAULT_AGG_IP, DEFAULT_AGG_MAC
from testbed.datapath.engine import Engine
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.datapath.scapy_layer import FIELD_TYPES, TestbedHeader
from testbed.kernels.wire import (
    HEADER_DTYPE,
    HEADER_FIELDS,
    HEADER_LEN,
    HEADER_OFFSET,
    MAGIC,
    TESTBED_UDP_PORT,
    VERSION,
    Codec,
    Flags,
    MsgType,
)


def _field_strategy(code: str):
    dt = np.dtype(code)
    if dt.kind == "f":
        return st.floats(width=32, allow_nan=False)
    info = np.iinfo(dt)
    return st.integers(int(info.min), int(info.max))


fields = st.fixed_dictionaries({f.name: _field_strategy(f.code) for f in HEADER_FIELDS})


def test_layer_is_derived_from_the_table():
    """Same field names, order and total length as the numpy dtype; every type is mapped."""
    assert [f.name for f in TestbedHeader.fields_desc] == [f.name for f in HEADER_FIELDS]
    assert len(TestbedHeader()) == HEADER_LEN == HEADER_DTYPE.itemsize
    assert {f.code for f in HEADER_FIELDS} <= set(FIELD_TYPES)


def test_enum_fields_show_names():
    h = TestbedHeader(msg_type=int(MsgType.RESULT), codec=int(Codec.THC),
                      flags=int(Flags.TRIMMED | Flags.ECN))
    assert h.sprintf("%msg_type% %codec%") == "RESULT THC"
    assert "TRIMMED" in h.sprintf("%flags%") and "ECN" in h.sprintf("%flags%")
    assert TestbedHeader().magic == MAGIC and TestbedHeader().version == VERSION


@settings(max_examples=300, deadline=None)
@given(fields)
def test_numpy_bytes_equal_scapy_bytes(values):
    """Random field values: numpy structured bytes == scapy bytes, and both parse back."""
    h = np.zeros(1, HEADER_DTYPE)
    for k, v in values.items():
        h[k] = v
    raw_np = h.tobytes()
    raw_sc = bytes(TestbedHeader(**values))
    assert raw_np == raw_sc
    back = TestbedHeader(raw_np)
    parsed = np.frombuffer(raw_sc, HEADER_DTYPE)[0]
    for k in (f.name for f in HEADER_FIELDS):
        if k == "scale":
            assert np.float32(back.scale) == parsed["scale"] == np.float32(values["scale"])
        else:
            assert int(getattr(back, k)) == parsed[k] == values[k]


def test_scapy_dissects_engine_result_frames():
    """Feed contributions to an engine's aggregate stage; scapy parses its RESULT frames with
    a valid IP checksum, no UDP checksum (0, legal on IPv4) and the header/payload the
    protocol says."""
    members = [{"worker": w, "mac": f"02:00:00:00:00:0{w + 1}", "ip": f"10.0.0.{w + 1}",
                "port": 6000 + w, "ingress": f"p{w}"} for w in range(2)]
    eng = Engine({"ports": ["p0", "p1"], "programs": [
        ("aggregate", {"jobs": {3: {"slots": 4, "seq0": 1, "members": members}}}),
        ("forward", {})]})
    agg_mac = mac_to_int(DEFAULT_AGG_MAC).to_bytes(6, "big")
    agg_ip = ip_to_int(DEFAULT_AGG_IP).to_bytes(4, "big")
    rng = np.random.default_rng(3)
    vals = [rng.integers(-1000, 1000, 64, dtype=np.int32) for _ in range(2)]
    b = eng.batch
    b.reset()
    for w in range(2):
        data = header_bytes(int(MsgType.DATA), 3, w, 1, 1, 2, 64, 4096, exponent=w - 3) + \
            vals[w].tobytes()
        f = udp_frame(bytes([2, 0, 0, 0, 0, w + 1]), agg_mac, bytes([10, 0, 0, w + 1]), agg_ip,
                      6000 + w, TESTBED_UDP_PORT, data)
        b.buf[w, : len(f)] = np.frombuffer(f, np.uint8)
        b.length[w] = len(f)
        b.in_port[w] = w
    b.n = 2
    for s in eng.stages:
        s.process(b, 0)
    assert b.n == 4
    for r in (2, 3):
        raw = bytes(b.buf[r, : b.length[r]])
        p = Ether(raw)
        assert TestbedHeader in p
        ip_chk = p[IP].chksum
        assert p[UDP].chksum == 0
        del p[IP].chksum  # scapy recomputes it on rebuild
        again = Ether(bytes(p))
        assert again[IP].chksum == ip_chk
        h = p[TestbedHeader]
        w = int(b.out_port[r])
        assert (h.msg_type, h.job_id, h.worker_id, h.slot, h.slot_set) == (MsgType.RESULT, 3, w,
                                                                           1, 1)
        assert (h.elem_count, h.chunk_offset, h.exponent, h.n_workers) == (64, 4096, -2, 2)
        assert p[UDP].sport == TESTBED_UDP_PORT and p[UDP].dport == 6000 + w
        assert p[IP].dst == f"10.0.0.{w + 1}" and p[Ether].dst == f"02:00:00:00:00:0{w + 1}"
        payload = np.frombuffer(raw, "<i4", 64, HEADER_OFFSET + HEADER_LEN)
        assert np.array_equal(payload, vals[0] + vals[1])
