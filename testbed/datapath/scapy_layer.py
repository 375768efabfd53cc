"""Scapy layer for the testbed header, derived from ``testbed.kernels.wire.HEADER_FIELDS``.

Only this module imports scapy (slow to import), so the engine never pays for it. The layer is
bound to UDP destination *and* source port 41000 so scapy dissects both worker->switch packets
and the switch's ``RESULT`` packets (sent from port 41000).
"""

from __future__ import annotations

from scapy.fields import (
    ByteField,
    Field,
    LEIntField,
    LEShortField,
    LESignedIntField,
    LESignedShortField,
    SignedByteField,
    XLEShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers
from scapy.volatile import RandFloat

from testbed.kernels.wire import HEADER_FIELDS, HEADER_LEN, TESTBED_UDP_PORT


class LEFloatField(Field):
    """IEEE-754 float32, little-endian (scapy only ships the big-endian one)."""

    def __init__(self, name: str, default: float):
        Field.__init__(self, name, default, "<f")

    def randval(self):
        """Random float32 for ``scapy.fuzz``."""
        return RandFloat(-3.0e38, 3.0e38)


#: numpy type code -> scapy field class (all little-endian, matching the numpy dtype).
FIELD_TYPES: dict[str, type] = {
    "u1": ByteField,
    "i1": SignedByteField,
    "<u2": LEShortField,
    "<i2": LESignedShortField,
    "<u4": LEIntField,
    "<i4": LESignedIntField,
    "<f4": LEFloatField,
}


def _field(name: str, code: str):
    if name == "magic":
        return XLEShortField(name, 0x4254)
    if name == "version":
        return ByteField(name, 1)
    try:
        cls = FIELD_TYPES[code]
    except KeyError:
        raise ValueError(
            f"wire field {name!r} has numpy type {code!r} with no scapy mapping; "
            "add it to testbed.datapath.scapy_layer.FIELD_TYPES"
        ) from None
    return cls(name, 0)


class TestbedHeader(Packet):
    """The 28-byte testbed header (little-endian), fields in ``HEADER_FIELDS`` order."""

    name = "TestbedHeader"
    fields_desc = [_field(n, t) for n, t in HEADER_FIELDS]

    __test__ = False  # not a pytest test class despite the name


bind_layers(UDP, TestbedHeader, dport=TESTBED_UDP_PORT)
bind_layers(UDP, TestbedHeader, sport=TESTBED_UDP_PORT)

assert len(TestbedHeader()) == HEADER_LEN, "scapy layer length disagrees with HEADER_DTYPE"
