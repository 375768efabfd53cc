"""Scapy layer for the testbed header, derived from ``testbed.kernels.wire.HEADER_FIELDS``.

Only this module imports scapy (slow to import), so the engine never pays for it. Fields with
an enum in the table show names (``msg_type=RESULT``, ``flags=TRIMMED+ECN``). The layer is
bound to UDP destination *and* source port 41000 so scapy dissects both worker->switch packets
and the switch's ``RESULT`` packets (sent from port 41000).
"""

from __future__ import annotations

import enum

from scapy.fields import (
    ByteEnumField,
    ByteField,
    Field,
    FlagsField,
    LEIntField,
    LEShortEnumField,
    LEShortField,
    LESignedIntField,
    LESignedShortField,
    SignedByteField,
    XLEShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers
from scapy.volatile import RandFloat

from testbed.kernels.wire import HEADER_FIELDS, HEADER_LEN, MAGIC, TESTBED_UDP_PORT, VERSION


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
#: numpy type code -> scapy field class for fields whose values have names.
ENUM_FIELD_TYPES: dict[str, type] = {"u1": ByteEnumField, "<u2": LEShortEnumField}
DEFAULTS = {"magic": MAGIC, "version": VERSION}


def _field(f):
    default = DEFAULTS.get(f.name, 0)
    if f.name == "magic":
        return XLEShortField(f.name, default)
    if f.enum is not None and issubclass(f.enum, enum.IntFlag):
        if f.code != "u1":
            raise ValueError(f"wire field {f.name!r}: flag fields must be one byte")
        bits = [(m.name if (m := next((x for x in f.enum if x.value == 1 << b), None)) else
                 f"bit{b}") for b in range(8)]
        return FlagsField(f.name, default, 8, bits)
    if f.enum is not None:
        cls = ENUM_FIELD_TYPES.get(f.code)
        if cls is None:
            raise ValueError(f"wire field {f.name!r}: no scapy enum field for {f.code!r}")
        return cls(f.name, default, {int(m): m.name for m in f.enum})
    try:
        cls = FIELD_TYPES[f.code]
    except KeyError:
        raise ValueError(
            f"wire field {f.name!r} has numpy type {f.code!r} with no scapy mapping; "
            "add it to testbed.datapath.scapy_layer.FIELD_TYPES"
        ) from None
    return cls(f.name, default)


class TestbedHeader(Packet):
    """The testbed header (little-endian), fields in ``HEADER_FIELDS`` order."""

    name = "TestbedHeader"
    fields_desc = [_field(f) for f in HEADER_FIELDS]

    __test__ = False  # not a pytest test class despite the name


bind_layers(UDP, TestbedHeader, dport=TESTBED_UDP_PORT)
bind_layers(UDP, TestbedHeader, sport=TESTBED_UDP_PORT)

assert len(TestbedHeader()) == HEADER_LEN, "scapy layer length disagrees with HEADER_DTYPE"
