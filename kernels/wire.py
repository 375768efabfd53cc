"""The testbed's wire format, declared once.

A testbed packet is ``Ethernet / IPv4 / UDP(dport=TESTBED_UDP_PORT) / TestbedHeader / payload``.
``HEADER_FIELDS`` is the single table of the testbed header; everything else is derived from it:

* ``HEADER_DTYPE`` - the numpy structured dtype. Numba kernels read and write a frame's header
  through a record view of it (:func:`testbed.kernels.packets.header`), Python code through
  :func:`unpack_header` / :func:`pack_header`;
* ``FIELD_OFFSETS`` - byte offsets relative to the header, for code that patches one field;
* the scapy layer (``testbed.datapath.scapy_layer``, for pcaps and fuzzing) and the Wireshark
  dissector, with the enum names of ``FIELD_ENUMS``.

Byte order: Ethernet/IP/UDP are big-endian as always. The testbed header and the payload are
**little-endian** (the data path is software on x86/arm64, and Numba cannot operate on
non-native byte-order arrays). The header sits at ``HEADER_OFFSET`` bytes into an untagged
Ethernet frame.

Drop reasons (:class:`DropReason`) are part of the format's contract: every parser and stage
reports why it refused a frame with one of them, and the counters are keyed by their names.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

#: UDP destination port that marks a testbed packet (scapy binds the layer to it).
TESTBED_UDP_PORT = 41000
#: Value of the ``magic`` field ("TB" little-endian); anything else is not ours.
MAGIC = 0x4254
#: Version 2 added ``seq`` (the round of a slot's use), which makes aggregation exactly-once.
VERSION = 2

ETH_LEN = 14
IPV4_LEN = 20  # we never emit IP options; the parser rejects them as malformed
UDP_LEN = 8
#: Offset of the testbed header in an Ethernet frame.
HEADER_OFFSET = ETH_LEN + IPV4_LEN + UDP_LEN
#: Largest frame the data path handles (a 1500-byte MTU plus the Ethernet header, with margin).
FRAME_MAX = 2048
#: Largest IP packet the emulated links carry.
MTU = 1500

#: SwitchML's client default: 256 int32 elements per packet.
DEFAULT_ELEMENTS_PER_PACKET = 256


class MsgType(enum.IntEnum):
    """Message types (``msg_type`` field)."""

    DATA = 0  # worker -> switch contribution
    RESULT = 1  # switch -> workers aggregated result (also answer to a retransmission)
    RETRANSMIT = 2  # worker -> switch, a contribution sent again after a timeout
    ACK = 3
    CONTROL = 4
    NACK = 5  # receiver -> sender of the UET-like transport: packet ``seq`` arrived trimmed


class Dscp(enum.IntEnum):
    """DSCP classes of Ultra Ethernet trimming (UET 1.0): a trimming switch queues TRIMMABLE
    packets in its low class, cuts them above its threshold and re-marks the cut packet
    TRIMMED (TRIMMED_LASTHOP when cut at the last hop), served ahead of data; CONTROL (ACKs,
    NACKs) is served first. The values are this testbed's defaults (UET leaves them to the
    operator); a ``trim`` stage in ``uet`` mode takes others."""

    BEST_EFFORT = 0
    TRIMMABLE = 8  # CS1
    TRIMMED = 26  # AF31
    TRIMMED_LASTHOP = 28  # AF32
    CONTROL = 46  # EF


#: NACK codes (UET_TRIMMED, UET_TRIMMED_LASTHOP) a NACK carries in its ``flags``' TRIMMED and
#: LASTHOP bits: ``Flags.TRIMMED`` alone = trimmed upstream, with ``LASTHOP`` = at the last hop.
UET_TRIMMED = 0x01
UET_TRIMMED_LASTHOP = 0x02


class Flags(enum.IntFlag):
    """Bits of the ``flags`` field."""

    NONE = 0
    TRIMMED = 1  # a switch cut the payload at head_bytes
    OVERFLOW = 2  # fixed-point overflow detected (ATP style); payload is not a valid sum
    LAST = 4  # last chunk of a message
    ECN = 8  # congestion experienced (set by a queue above its marking threshold)
    LASTHOP = 16  # trimmed at the last hop (a UET trimming switch's host-facing port)


class Codec(enum.IntEnum):
    """Payload encodings (``codec`` field). INT32 is the summable fixed-point default."""

    INT32 = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    SIGN = 4
    QSGD = 5
    THC = 6
    TRIM_LAYOUT = 7  # head (coarse) + tail (refinement), see kernels.trimming
    BYTES = 8  # opaque bytes of a message (the UET-like transport's); elem_count = bytes


class DropReason(enum.IntEnum):
    """Why a packet was dropped; every drop is counted under its reason."""

    NONE = 0
    TOO_SHORT = 1  # shorter than the headers it claims
    NOT_IPV4 = 2
    IP_OPTIONS = 3
    NOT_UDP = 4  # not UDP, or not to the testbed port
    BAD_MAGIC = 5
    BAD_VERSION = 6
    BAD_LENGTH = 7  # IP/UDP/elem_count lengths disagree with the frame
    UNKNOWN_TYPE = 8  # msg_type not valid here
    UNKNOWN_JOB = 9
    BAD_SLOT = 10  # slot outside the job's partition, or a set bit that disagrees with seq
    BAD_WORKER = 11  # worker id >= job's n_workers
    NO_ROUTE = 12  # forwarding table has no entry and flooding is off
    QUEUE_FULL = 13  # drop-tail at an egress queue
    IMPAIR_LOSS = 14  # seeded loss from the impair stage
    BAD_CODEC = 15
    ELEM_MISMATCH = 16  # contribution's elem_count differs from the slot's
    STALE = 17  # a packet of a round the slot has already left behind
    TTL = 18
    OTHER = 19  # e.g. IP fragments (we never fragment; a fragment cannot be parsed)
    NOT_MEMBER = 20  # DATA from an address/port the control plane did not register
    DUPLICATE = 21  # a contribution already counted in the current, unfinished round
    BAD_SEQ = 22  # a round the protocol cannot have reached (ahead of the window)


class HeaderField(NamedTuple):
    """One field of the testbed header: name, numpy type code, enum of its values, meaning."""

    name: str
    code: str
    enum: type | None
    doc: str


#: The testbed header, in wire order; all little-endian, no padding.
HEADER_FIELDS: tuple[HeaderField, ...] = (
    HeaderField("magic", "<u2", None, "MAGIC: anything else is not a testbed packet"),
    HeaderField("version", "u1", None, "VERSION of this table"),
    HeaderField("msg_type", "u1", MsgType, "DATA, RESULT, RETRANSMIT, ..."),
    HeaderField("job_id", "<u2", None, "tenant/job; the switch partitions its slots per job"),
    HeaderField("worker_id", "<u2", None, "0..n-1 within the job (bit in the slot bitmap)"),
    HeaderField("slot", "<u2", None, "job-relative aggregator slot index"),
    HeaderField("slot_set", "u1", None, "seq & 1: which of the slot's two register sets"),
    HeaderField("flags", "u1", Flags, "TRIMMED, OVERFLOW, LAST, ECN, LASTHOP bits"),
    HeaderField("codec", "u1", Codec, "payload encoding"),
    HeaderField("n_workers", "u1", None, "workers in the job (informative)"),
    HeaderField("exponent", "<i2", None, "shared block exponent (max-combined by the switch)"),
    HeaderField("elem_count", "<u2", None, "number of payload elements"),
    HeaderField("head_bytes", "<u2", None, "payload bytes of the trimmable head (0: none)"),
    HeaderField("chunk_offset", "<u4", None, "element offset of this chunk in the tensor"),
    HeaderField("scale", "<f4", None, "codec scale (e.g. a norm), 0 if unused"),
    HeaderField("seq", "<u4", None, "round of this use of the slot (serial number)"),
)

HEADER_DTYPE = np.dtype([(f.name, f.code) for f in HEADER_FIELDS])
HEADER_LEN = HEADER_DTYPE.itemsize
#: Byte offset of each field within the testbed header.
FIELD_OFFSETS: dict[str, int] = {f.name: HEADER_DTYPE.fields[f.name][1] for f in HEADER_FIELDS}
#: Fields whose values have names.
FIELD_ENUMS: dict[str, type] = {f.name: f.enum for f in HEADER_FIELDS if f.enum is not None}
#: Offset of the payload in an Ethernet frame.
PAYLOAD_OFFSET = HEADER_OFFSET + HEADER_LEN
#: Payload bytes that fit one MTU.
MTU_PAYLOAD = MTU - IPV4_LEN - UDP_LEN - HEADER_LEN


def frame_len(payload_bytes: int) -> int:
    """Length of an Ethernet frame (no FCS) carrying ``payload_bytes`` of testbed payload."""
    return PAYLOAD_OFFSET + payload_bytes


def new_headers(count: int) -> np.ndarray:
    """A zeroed array of ``count`` headers with magic and version filled in."""
    h = np.zeros(count, dtype=HEADER_DTYPE)
    h["magic"] = MAGIC
    h["version"] = VERSION
    return h


def pack_header(**fields) -> bytes:
    """The header bytes with ``fields`` set (magic and version filled in); unknown names fail."""
    h = new_headers(1)
    for name, value in fields.items():
        if name not in FIELD_OFFSETS:
            raise ValueError(f"pack_header: no field {name!r}; fields are {list(FIELD_OFFSETS)}")
        h[name] = value
    return h.tobytes()


def unpack_header(data, offset: int = 0) -> np.void:
    """The header at ``offset`` of ``data`` (bytes-like) as a numpy record (``h["job_id"]``)."""
    if len(data) < offset + HEADER_LEN:
        raise ValueError(f"unpack_header: {len(data) - offset} bytes, a header needs {HEADER_LEN}")
    return np.frombuffer(data, HEADER_DTYPE, 1, offset)[0]


def describe_header(h) -> dict:
    """A header record as a dict of Python values, enum fields by name (for messages/logs)."""
    out = {}
    for f in HEADER_FIELDS:
        v = h[f.name].item()
        if f.enum is not None:
            try:
                v = f.enum(v).name or v
            except ValueError:
                pass
        out[f.name] = v
    return out
