"""The testbed's wire format, declared once.

A testbed packet is ``Ethernet / IPv4 / UDP(dport=TESTBED_UDP_PORT) / TestbedHeader / payload``.
``HEADER_FIELDS`` is the single table of the testbed header; from it we derive

* ``HEADER_DTYPE`` - the numpy structured dtype the Numba kernels read and write, and
* the scapy layer (``testbed.datapath.scapy_layer``), used for pcaps and fuzzing.

A test proves both produce identical bytes.

Byte order: Ethernet/IP/UDP are big-endian as always. The testbed header and the payload are
**little-endian** (documented choice: the data path is software on x86/arm64, and Numba
cannot operate on non-native byte-order arrays). Offsets below are relative to the start of
the testbed header, which sits at ``HEADER_OFFSET`` bytes into an untagged Ethernet frame.
"""

from __future__ import annotations

import enum

import numpy as np

#: UDP destination port that marks a testbed packet (scapy binds the layer to it).
TESTBED_UDP_PORT = 41000
#: Value of the ``magic`` field ("TB" little-endian); anything else is not ours.
MAGIC = 0x4254
VERSION = 1

ETH_LEN = 14
IPV4_LEN = 20  # we never emit IP options; the parser rejects them as malformed
UDP_LEN = 8
#: Offset of the testbed header in an Ethernet frame.
HEADER_OFFSET = ETH_LEN + IPV4_LEN + UDP_LEN

#: SwitchML's client default: 256 int32 elements per packet.
DEFAULT_ELEMENTS_PER_PACKET = 256


class MsgType(enum.IntEnum):
    """Message types (``msg_type`` field)."""

    DATA = 0  # worker -> switch contribution
    RESULT = 1  # switch -> workers aggregated result (also answer to a retransmission)
    RETRANSMIT = 2  # worker -> switch, a contribution sent again after a timeout
    ACK = 3
    CONTROL = 4


class Flags(enum.IntFlag):
    """Bits of the ``flags`` field."""

    NONE = 0
    TRIMMED = 1  # a switch cut the payload at head_bytes
    OVERFLOW = 2  # fixed-point overflow detected (ATP style); payload is not a valid sum
    LAST = 4  # last chunk of a message
    ECN = 8  # congestion experienced (set by a queue above its marking threshold)


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


# (name, numpy type code). Order is wire order; all little-endian; no padding.
HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "<u2"),  # MAGIC
    ("version", "u1"),  # VERSION
    ("msg_type", "u1"),  # MsgType
    ("job_id", "<u2"),  # tenant/job; slots are partitioned per job
    ("worker_id", "<u2"),  # 0..n-1 within the job (bit in the slot bitmap)
    ("slot", "<u2"),  # job-relative aggregator slot index
    ("slot_set", "u1"),  # 0/1: which of the two slot sets (SwitchML shadow copy)
    ("flags", "u1"),  # Flags
    ("codec", "u1"),  # Codec
    ("n_workers", "u1"),  # workers in the job (informative; switch uses its own config)
    ("exponent", "<i2"),  # shared block exponent (max-combined by the aggregator)
    ("elem_count", "<u2"),  # number of payload elements
    ("head_bytes", "<u2"),  # payload bytes that form the trimmable head (0 = not trimmable)
    ("chunk_offset", "<u4"),  # element offset of this chunk in the whole tensor
    ("scale", "<f4"),  # codec scale (e.g. THC / QSGD norm), 0 if unused
)

HEADER_DTYPE = np.dtype([(n, t) for n, t in HEADER_FIELDS])
HEADER_LEN = HEADER_DTYPE.itemsize  # 28 bytes
#: Byte offset of each field within the testbed header (handy for Numba byte-level code).
FIELD_OFFSETS: dict[str, int] = {n: HEADER_DTYPE.fields[n][1] for n, _ in HEADER_FIELDS}
#: Offset of the payload in an Ethernet frame.
PAYLOAD_OFFSET = HEADER_OFFSET + HEADER_LEN


def frame_len(payload_bytes: int) -> int:
    """Length of an Ethernet frame (no FCS) carrying ``payload_bytes`` of testbed payload."""
    return PAYLOAD_OFFSET + payload_bytes


def new_headers(count: int) -> np.ndarray:
    """A zeroed array of ``count`` headers with magic and version filled in."""
    h = np.zeros(count, dtype=HEADER_DTYPE)
    h["magic"] = MAGIC
    h["version"] = VERSION
    return h
