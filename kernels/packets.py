"""Packet kernels: parse and build Eth / IPv4 / UDP / testbed-header frames, one frame or a batch.

Everything here is ``@njit(cache=True)`` over plain numpy arrays and ints, so the data path's
own ``@njit`` stages and the workers' hot loops call it per packet. Layout constants come from
:mod:`testbed.kernels.wire` at import time (Numba freezes module globals when it compiles);
:mod:`testbed.kernels.reference.packets` is the plain-Python twin the tests compare against.

Conventions (all functions below):

* ``frame`` is a ``uint8[:]`` (a row of the data path's ``buf[N, FRAME_MAX]``), ``length`` its
  number of valid bytes. ``OFF_*`` are absolute byte offsets of Ethernet/IPv4/UDP fields.
* Ethernet/IPv4/UDP fields are big-endian; the testbed header and payload are little-endian.
* The testbed header is read and written as a record of ``wire.HEADER_DTYPE``:
  ``h = header(frame); h.slot``, ``header_at(row, base)`` for a header at another offset (a
  socket payload). Field names, types and offsets exist only in ``wire.HEADER_FIELDS``.
* IPv4 addresses are ``uint32`` in host order (``10.0.0.1`` -> ``0x0A000001``); MAC addresses
  are ``uint8[6]`` arrays. :func:`ip_to_u32` and :func:`mac_to_array` convert from strings.
* Status codes are ``wire.DropReason`` values (``NONE`` = a valid testbed frame).

Per frame: byte readers/writers ``rd_*``/``wr_*``; ``header``/``header_at``; ``payload_i32`` /
``payload_f32`` views; ``parse_frame``; ``ipv4_checksum``, ``ipv4_checksum_ok``,
``set_ipv4_checksum``; ``set_payload_bytes``; ``swap_addresses``, ``set_addresses``;
``write_eth_ip_udp`` (the one Eth/IPv4/UDP builder) and ``build_frame``. Per batch:
``parse_batch`` and ``build_batch``. :func:`parse` and :func:`build` are validating wrappers.

Why one module this long: every accessor and frame builder here is generated from, or written
against, the one wire table and is called from other ``@njit`` code; keeping them in one file
keeps Numba's per-file cache coherent and the wire knowledge in one place.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np import numpy_support

from testbed.kernels import wire
from testbed.kernels.wire import (
    ETH_LEN,
    FRAME_MAX,
    HEADER_DTYPE,
    HEADER_LEN,
    HEADER_OFFSET,
    IPV4_LEN,
    MAGIC,
    PAYLOAD_OFFSET,
    TESTBED_UDP_PORT,
    UDP_LEN,
    VERSION,
    Codec,
    DropReason,
    Flags,
)

#: Largest payload that fits a FRAME_MAX frame.
PAYLOAD_MAX = FRAME_MAX - PAYLOAD_OFFSET

# Decisions a data-path kernel writes into a batch's ``out_port`` column besides a port index
# (the batch conventions are in ``testbed.datapath.batch``).
PORT_UNSET = -1  # no stage has decided yet
PORT_DROP = -2  # dropped, with a DropReason
PORT_FLOOD = -3  # out of every port but the ingress one
PORT_HELD = -4  # kept by a stage (a queue, a delay line, the aggregator's registers)

ETHERTYPE_IPV4 = 0x0800
IPPROTO_UDP = 17
IP_TTL = 64
IP_FLAG_DF = 0x4000

# Absolute offsets of the Ethernet/IP/UDP fields.
OFF_ETH_DST = 0
OFF_ETH_SRC = 6
OFF_ETHERTYPE = 12
OFF_IP = ETH_LEN
OFF_IP_TOTLEN = ETH_LEN + 2
OFF_IP_ID = ETH_LEN + 4
OFF_IP_FRAG = ETH_LEN + 6
OFF_IP_TTL = ETH_LEN + 8
OFF_IP_PROTO = ETH_LEN + 9
OFF_IP_CSUM = ETH_LEN + 10
OFF_IP_SRC = ETH_LEN + 12
OFF_IP_DST = ETH_LEN + 16
OFF_UDP = ETH_LEN + IPV4_LEN
OFF_UDP_SPORT = OFF_UDP
OFF_UDP_DPORT = OFF_UDP + 2
OFF_UDP_LEN = OFF_UDP + 4
OFF_UDP_CSUM = OFF_UDP + 6

FLAG_TRIMMED = int(Flags.TRIMMED)  # Numba has IntEnum constants, not IntFlag ones
MSG_TYPE_MAX = max(int(t) for t in wire.MsgType)
CODEC_MAX = max(int(c) for c in Codec)


# ---------------------------------------------------------------------------------------------
# bit casts between float32 and uint32 (LLVM bitcast: no memory round trip)


@intrinsic
def _u32_bits_to_f32(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], bits, types.uint32)
        return builder.bitcast(v, context.get_value_type(types.float32))

    return types.float32(bits), codegen


@intrinsic
def _f32_to_u32_bits(typingctx, value):
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], value, types.float32)
        return builder.bitcast(v, context.get_value_type(types.uint32))

    return types.uint32(value), codegen


@njit(cache=True, inline="always")
def f32_from_bits(bits):
    """The float32 whose IEEE-754 bit pattern is ``bits`` (a uint32)."""
    return _u32_bits_to_f32(bits)


@njit(cache=True, inline="always")
def f32_to_bits(value):
    """The IEEE-754 bit pattern (uint32) of ``value`` rounded to float32."""
    return _f32_to_u32_bits(value)


# ---------------------------------------------------------------------------------------------
# byte-level readers and writers


@njit(cache=True, inline="always")
def rd_u16le(frame, off):
    """Little-endian uint16 at ``off``."""
    return np.int64(frame[off]) | (np.int64(frame[off + 1]) << 8)


@njit(cache=True, inline="always")
def rd_i16le(frame, off):
    """Little-endian int16 at ``off``."""
    v = rd_u16le(frame, off)
    return v - 65536 if v >= 32768 else v


@njit(cache=True, inline="always")
def rd_u32le(frame, off):
    """Little-endian uint32 at ``off``."""
    return (np.int64(frame[off]) | (np.int64(frame[off + 1]) << 8)
            | (np.int64(frame[off + 2]) << 16) | (np.int64(frame[off + 3]) << 24))


@njit(cache=True, inline="always")
def rd_f32le(frame, off):
    """Little-endian float32 at ``off``."""
    return _u32_bits_to_f32(np.uint32(rd_u32le(frame, off)))


@njit(cache=True, inline="always")
def wr_u16le(frame, off, value):
    """Write ``value`` (low 16 bits) little-endian at ``off``."""
    v = np.int64(value)
    frame[off] = v & 0xFF
    frame[off + 1] = (v >> 8) & 0xFF


@njit(cache=True, inline="always")
def wr_i16le(frame, off, value):
    """Write ``value`` as a little-endian int16 (two's complement) at ``off``."""
    wr_u16le(frame, off, np.int64(value) & 0xFFFF)


@njit(cache=True, inline="always")
def wr_u32le(frame, off, value):
    """Write ``value`` (low 32 bits) little-endian at ``off``."""
    v = np.int64(value)
    frame[off] = v & 0xFF
    frame[off + 1] = (v >> 8) & 0xFF
    frame[off + 2] = (v >> 16) & 0xFF
    frame[off + 3] = (v >> 24) & 0xFF


@njit(cache=True, inline="always")
def wr_f32le(frame, off, value):
    """Write ``value`` as a little-endian float32 at ``off``."""
    wr_u32le(frame, off, _f32_to_u32_bits(np.float32(value)))


@njit(cache=True, inline="always")
def rd_u16be(frame, off):
    """Big-endian (network order) uint16 at ``off``."""
    return (np.int64(frame[off]) << 8) | np.int64(frame[off + 1])


@njit(cache=True, inline="always")
def rd_u32be(frame, off):
    """Big-endian (network order) uint32 at ``off``."""
    return ((np.int64(frame[off]) << 24) | (np.int64(frame[off + 1]) << 16)
            | (np.int64(frame[off + 2]) << 8) | np.int64(frame[off + 3]))


@njit(cache=True, inline="always")
def wr_u16be(frame, off, value):
    """Write ``value`` (low 16 bits) big-endian at ``off``."""
    v = np.int64(value)
    frame[off] = (v >> 8) & 0xFF
    frame[off + 1] = v & 0xFF


@njit(cache=True, inline="always")
def wr_u32be(frame, off, value):
    """Write ``value`` (low 32 bits) big-endian at ``off``."""
    v = np.int64(value)
    frame[off] = (v >> 24) & 0xFF
    frame[off + 1] = (v >> 16) & 0xFF
    frame[off + 2] = (v >> 8) & 0xFF
    frame[off + 3] = v & 0xFF


# ---------------------------------------------------------------------------------------------
# the testbed header as a record (field names, types and offsets all come from wire.HEADER_DTYPE)


_HEADER_RECORD = numpy_support.from_dtype(HEADER_DTYPE)


@intrinsic
def _record_at(typingctx, row, base):
    """The HEADER_DTYPE record whose bytes start at ``row[base]``: a pointer into ``row``, as
    Numba represents every record (no array object is built, unlike ``row[a:b].view(...)[0]``,
    which cost a header read ~13 ns more per frame). Bounds are the caller's."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8
            and isinstance(base, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.bitcast(ptr, context.get_value_type(_HEADER_RECORD))

    return _HEADER_RECORD(row, base), codegen


@intrinsic
def _copy_header(typingctx, dst, dst_off, src, src_off):
    """Copy HEADER_LEN bytes from byte ``src_off`` of array ``src`` to byte ``dst_off`` of
    ``dst`` (uint8 frames or HEADER_DTYPE records) with one fixed-size memcpy, which LLVM
    turns into a few vector moves (a slice assignment of the same bytes cost ~4x more per
    frame). Bounds are the caller's."""
    if not all(isinstance(a, types.Array) for a in (dst, src)):
        return None

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        d = context.make_array(signature.args[0])(context, builder, args[0])
        r = context.make_array(signature.args[2])(context, builder, args[2])
        dp = builder.gep(builder.bitcast(d.data, i8p), [args[1]])
        sp = builder.gep(builder.bitcast(r.data, i8p), [args[3]])
        cgutils.raw_memcpy(builder, dp, sp, ir.Constant(ir.IntType(64), HEADER_LEN), 1)
        return context.get_dummy_value()

    return types.none(dst, dst_off, src, src_off), codegen


@intrinsic
def borrow_arrays(typingctx, tup):
    """The tuple ``tup`` with every array in it *borrowed*: the same data, shape and strides
    but no reference count (meminfo NULL), so passing it on costs no atomic increment and
    decrement per array and call.

    A kernel whose state is a record of many arrays (the aggregator's registers and job table,
    the INA worker's slots) passes those records to each of its named steps; Numba counts a
    reference for every array of a record at every call boundary, which made such a kernel
    several times slower per packet than the same steps on loose arrays. Borrowing at the
    kernel's entry point removes that. Safe only while the caller holds the arrays (a kernel
    call) and when nothing borrowed is returned to Python."""
    if not isinstance(tup, types.BaseTuple):
        return None

    def codegen(context, builder, signature, args):
        out = args[0]
        for k, ty in enumerate(signature.args[0]):
            if isinstance(ty, types.Array):
                ary = context.make_array(ty)(context, builder, builder.extract_value(out, k))
                ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
                ary.parent = cgutils.get_null_value(ary.parent.type)
                out = builder.insert_value(out, ary._getvalue(), k)
        return out

    return tup(tup), codegen


@njit(cache=True, inline="always")
def header_at(row, base):
    """The testbed header that starts at byte ``base`` of ``row`` (uint8[:]), as a record:
    ``h = header_at(row, 0); h.job_id = 7``. Reads and writes go into ``row``. IndexError
    when the header does not fit in ``row`` from ``base``."""
    if base < 0 or base + HEADER_LEN > row.shape[0]:
        raise IndexError("header_at: the header does not fit in the row")
    return _record_at(row, base)


@njit(cache=True, inline="always")
def header(frame):
    """The testbed header of an Ethernet ``frame`` as a record (see :func:`header_at`)."""
    return header_at(frame, HEADER_OFFSET)


@njit(cache=True, inline="always")
def payload_i32(frame, count):
    """View of the first ``count`` int32 payload elements (writes go into the frame)."""
    return frame[PAYLOAD_OFFSET:PAYLOAD_OFFSET + 4 * count].view(np.int32)


@njit(cache=True, inline="always")
def payload_f32(frame, count):
    """View of the first ``count`` float32 payload elements (writes go into the frame)."""
    return frame[PAYLOAD_OFFSET:PAYLOAD_OFFSET + 4 * count].view(np.float32)


# ---------------------------------------------------------------------------------------------
# IPv4 checksum and lengths


@njit(cache=True)
def ipv4_checksum(frame):
    """Internet checksum of the 20-byte IPv4 header, with the checksum field counted as zero."""
    s = np.int64(0)
    for off in range(OFF_IP, OFF_IP + IPV4_LEN, 2):
        if off != OFF_IP_CSUM:
            s += rd_u16be(frame, off)
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


@njit(cache=True)
def ipv4_checksum_ok(frame):
    """True when the IPv4 header checksum field matches the header."""
    return rd_u16be(frame, OFF_IP_CSUM) == ipv4_checksum(frame)


@njit(cache=True)
def set_ipv4_checksum(frame):
    """Recompute and store the IPv4 header checksum."""
    wr_u16be(frame, OFF_IP_CSUM, ipv4_checksum(frame))


@njit(cache=True)
def set_payload_bytes(frame, payload_bytes):
    """Set IP total length, UDP length (UDP checksum 0) and the IP checksum for a testbed
    payload of ``payload_bytes``; return the new frame length."""
    wr_u16be(frame, OFF_IP_TOTLEN, IPV4_LEN + UDP_LEN + HEADER_LEN + payload_bytes)
    wr_u16be(frame, OFF_UDP_LEN, UDP_LEN + HEADER_LEN + payload_bytes)
    wr_u16be(frame, OFF_UDP_CSUM, 0)
    set_ipv4_checksum(frame)
    return PAYLOAD_OFFSET + payload_bytes


# ---------------------------------------------------------------------------------------------
# addresses


@njit(cache=True)
def swap_addresses(frame):
    """Swap source and destination MAC, IPv4 address and UDP port (checksum stays valid)."""
    for k in range(6):
        t = frame[OFF_ETH_DST + k]
        frame[OFF_ETH_DST + k] = frame[OFF_ETH_SRC + k]
        frame[OFF_ETH_SRC + k] = t
    for k in range(4):
        t = frame[OFF_IP_SRC + k]
        frame[OFF_IP_SRC + k] = frame[OFF_IP_DST + k]
        frame[OFF_IP_DST + k] = t
    for k in range(2):
        t = frame[OFF_UDP_SPORT + k]
        frame[OFF_UDP_SPORT + k] = frame[OFF_UDP_DPORT + k]
        frame[OFF_UDP_DPORT + k] = t


@njit(cache=True)
def set_addresses(frame, src_mac, dst_mac, src_ip, dst_ip, sport, dport):
    """Overwrite MACs (uint8[6]), IPv4 addresses (host-order ints) and UDP ports, and fix the
    IPv4 checksum."""
    for k in range(6):
        frame[OFF_ETH_SRC + k] = src_mac[k]
        frame[OFF_ETH_DST + k] = dst_mac[k]
    wr_u32be(frame, OFF_IP_SRC, src_ip)
    wr_u32be(frame, OFF_IP_DST, dst_ip)
    wr_u16be(frame, OFF_UDP_SPORT, sport)
    wr_u16be(frame, OFF_UDP_DPORT, dport)
    set_ipv4_checksum(frame)


# ---------------------------------------------------------------------------------------------
# parse


@njit(cache=True)
def parse_frame(frame, length):
    """Validate one frame; return ``DropReason.NONE`` (0) for a well-formed testbed frame, else
    the reason.

    Checks in order: Ethernet length and type; IPv4 version, IHL (options rejected),
    fragments; IP total length against the frame (Ethernet padding after it is allowed);
    protocol UDP from or to ``TESTBED_UDP_PORT`` (else ``NOT_UDP``: a worker's packets go to the
    port, the switch's RESULTs come from it); UDP length = IP payload length; room for the
    testbed header; magic; version; msg_type; codec; payload size: INT32/FLOAT32 need
    ``4 * elem_count`` bytes, FLOAT16/BFLOAT16 ``2 * elem_count``; ``head_bytes`` must not exceed
    the payload, and a frame flagged TRIMMED must carry exactly ``head_bytes``. Never reads past
    ``length`` or the array.
    """
    if length > frame.shape[0] or length < ETH_LEN:
        return DropReason.TOO_SHORT if length < ETH_LEN else DropReason.BAD_LENGTH
    if rd_u16be(frame, OFF_ETHERTYPE) != ETHERTYPE_IPV4:
        return DropReason.NOT_IPV4
    if length < ETH_LEN + IPV4_LEN:
        return DropReason.TOO_SHORT
    vihl = frame[OFF_IP]
    if (vihl >> 4) != 4:
        return DropReason.NOT_IPV4
    ihl = vihl & 0xF
    if ihl > 5:
        return DropReason.IP_OPTIONS
    if ihl < 5:
        return DropReason.BAD_LENGTH
    if rd_u16be(frame, OFF_IP_FRAG) & 0x3FFF:
        return DropReason.OTHER  # MF set or non-zero fragment offset
    tot = rd_u16be(frame, OFF_IP_TOTLEN)
    if tot < IPV4_LEN or ETH_LEN + tot > length:
        return DropReason.BAD_LENGTH
    if frame[OFF_IP_PROTO] != IPPROTO_UDP:
        return DropReason.NOT_UDP
    if tot < IPV4_LEN + UDP_LEN:
        return DropReason.TOO_SHORT
    if (rd_u16be(frame, OFF_UDP_DPORT) != TESTBED_UDP_PORT
            and rd_u16be(frame, OFF_UDP_SPORT) != TESTBED_UDP_PORT):
        return DropReason.NOT_UDP
    udp_len = rd_u16be(frame, OFF_UDP_LEN)
    if udp_len != tot - IPV4_LEN:
        return DropReason.BAD_LENGTH
    if udp_len < UDP_LEN + HEADER_LEN:
        return DropReason.TOO_SHORT
    h = header(frame)
    if h.magic != MAGIC:
        return DropReason.BAD_MAGIC
    if h.version != VERSION:
        return DropReason.BAD_VERSION
    if h.msg_type > MSG_TYPE_MAX:
        return DropReason.UNKNOWN_TYPE
    codec = h.codec
    if codec > CODEC_MAX:
        return DropReason.BAD_CODEC
    payload = udp_len - UDP_LEN - HEADER_LEN
    count = np.int64(h.elem_count)
    if codec == Codec.INT32 or codec == Codec.FLOAT32:
        if 4 * count != payload:
            return DropReason.BAD_LENGTH
    elif codec == Codec.FLOAT16 or codec == Codec.BFLOAT16:
        if 2 * count != payload:
            return DropReason.BAD_LENGTH
    head = np.int64(h.head_bytes)
    if head > payload:
        return DropReason.BAD_LENGTH
    if (h.flags & FLAG_TRIMMED) and head != payload:
        return DropReason.BAD_LENGTH
    return DropReason.NONE


@njit(cache=True)
def read_header(frame, headers, i):
    """Copy the testbed header of ``frame`` into ``headers[i]`` (a HEADER_DTYPE array)."""
    _copy_header(headers, i * HEADER_LEN, frame, HEADER_OFFSET)


@njit(cache=True)
def parse_batch(buf, length, n, headers, status):
    """Parse frames ``0..n-1`` of ``buf`` (uint8[N, FRAME_MAX]) with lengths ``length``
    (int32[N]): ``status[i]`` gets the reason code, and for valid frames (status 0) the testbed
    header goes into ``headers[i]``. Rows of invalid frames in ``headers`` are left as they
    were. Returns the number of valid frames."""
    ok = 0
    for i in range(n):
        s = parse_frame(buf[i], length[i])
        status[i] = s
        if s == DropReason.NONE:
            read_header(buf[i], headers, i)
            ok += 1
    return ok


# ---------------------------------------------------------------------------------------------
# build


@njit(cache=True)
def write_header(frame, headers, i):
    """Write ``headers[i]`` (a HEADER_DTYPE array row) as the testbed header of ``frame``."""
    _copy_header(frame, HEADER_OFFSET, headers, i * HEADER_LEN)


@njit(cache=True)
def write_eth_ip_udp(frame, src_mac, dst_mac, src_ip, dst_ip, sport, dport, payload_bytes):
    """Write Ethernet, IPv4 (no options, DF, TTL 64, id 0, checksum) and UDP (checksum 0)
    headers for a testbed payload of ``payload_bytes``; return the frame length."""
    for k in range(6):
        frame[OFF_ETH_DST + k] = dst_mac[k]
        frame[OFF_ETH_SRC + k] = src_mac[k]
    wr_u16be(frame, OFF_ETHERTYPE, ETHERTYPE_IPV4)
    frame[OFF_IP] = 0x45
    frame[OFF_IP + 1] = 0
    wr_u16be(frame, OFF_IP_ID, 0)
    wr_u16be(frame, OFF_IP_FRAG, IP_FLAG_DF)
    frame[OFF_IP_TTL] = IP_TTL
    frame[OFF_IP_PROTO] = IPPROTO_UDP
    wr_u32be(frame, OFF_IP_SRC, src_ip)
    wr_u32be(frame, OFF_IP_DST, dst_ip)
    wr_u16be(frame, OFF_UDP_SPORT, sport)
    wr_u16be(frame, OFF_UDP_DPORT, dport)
    return set_payload_bytes(frame, payload_bytes)


@njit(cache=True)
def build_frame(frame, headers, i, payload, payload_bytes, src_mac, dst_mac, src_ip, dst_ip,
                sport, dport):
    """Build a complete frame: Eth/IPv4/UDP, testbed header ``headers[i]`` and the first
    ``payload_bytes`` bytes of ``payload`` (uint8[:]). Returns the frame length."""
    n = write_eth_ip_udp(frame, src_mac, dst_mac, src_ip, dst_ip, sport, dport, payload_bytes)
    write_header(frame, headers, i)
    frame[PAYLOAD_OFFSET:PAYLOAD_OFFSET + payload_bytes] = payload[:payload_bytes]
    return n


@njit(cache=True)
def build_batch(buf, length, n, headers, payload, payload_len, src_mac, dst_mac, src_ip, dst_ip,
                sport, dport):
    """Build frames ``0..n-1`` into ``buf`` (uint8[N, FRAME_MAX]) and ``length`` (int32[N]) from
    ``headers`` (HEADER_DTYPE[N]), ``payload`` (uint8[N, P]) with ``payload_len`` (int32[N])
    bytes used per row, and per-packet addresses ``src_mac``/``dst_mac`` (uint8[N, 6]),
    ``src_ip``/``dst_ip`` (uint32[N], host order) and ``sport``/``dport`` (uint16[N])."""
    for i in range(n):
        length[i] = build_frame(buf[i], headers, i, payload[i], payload_len[i], src_mac[i],
                                dst_mac[i], src_ip[i], dst_ip[i], sport[i], dport[i])


# ---------------------------------------------------------------------------------------------
# Python-side helpers and validating wrappers


def ip_to_u32(ip: str) -> int:
    """``"10.0.0.1"`` -> ``0x0A000001`` (host-order int, the form the kernels take)."""
    parts = ip.split(".")
    if len(parts) != 4 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
        raise ValueError(f"ip: {ip!r} is not a dotted IPv4 address like '10.0.0.1'")
    a, b, c, d = (int(p) for p in parts)
    return (a << 24) | (b << 16) | (c << 8) | d


def u32_to_ip(value: int) -> str:
    """``0x0A000001`` -> ``"10.0.0.1"``."""
    return ".".join(str((int(value) >> s) & 0xFF) for s in (24, 16, 8, 0))


def mac_to_array(mac: str) -> np.ndarray:
    """``"02:54:42:00:00:fe"`` -> ``uint8[6]``."""
    parts = mac.split(":")
    try:
        vals = [int(p, 16) for p in parts]
    except ValueError:
        vals = []
    if len(parts) != 6 or len(vals) != 6 or not all(0 <= v <= 255 for v in vals):
        raise ValueError(f"mac: {mac!r} is not a MAC address like '02:54:42:00:00:fe'")
    return np.array(vals, dtype=np.uint8)


def _check_array(name: str, a, dtype, ndim: int) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}; "
                        f"convert with {name}.astype(np.{np.dtype(dtype).name})")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D array, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous; pass np.ascontiguousarray({name})")


def parse(buf: np.ndarray, length: np.ndarray, n: int | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Validate arguments and run :func:`parse_batch`; return ``(headers, status)``.

    ``buf`` is uint8[N, FRAME_MAX] (or any width), ``length`` int32[N], ``n`` defaults to N.
    """
    _check_array("buf", buf, np.uint8, 2)
    _check_array("length", length, np.int32, 1)
    if length.shape[0] != buf.shape[0]:
        raise ValueError(f"length: has {length.shape[0]} entries but buf has {buf.shape[0]} rows")
    n = buf.shape[0] if n is None else int(n)
    if not 0 <= n <= buf.shape[0]:
        raise ValueError(f"n: must be between 0 and {buf.shape[0]} (rows of buf), got {n}")
    headers = np.zeros(buf.shape[0], dtype=wire.HEADER_DTYPE)
    status = np.zeros(buf.shape[0], dtype=np.uint8)
    parse_batch(buf, length, n, headers, status)
    return headers, status


def build(headers: np.ndarray, payloads: list[bytes] | list[np.ndarray], src_mac: str,
          dst_mac: str, src_ip: str, dst_ip: str, sport: int,
          dport: int = TESTBED_UDP_PORT) -> tuple[np.ndarray, np.ndarray]:
    """Build one frame per header with the same addresses; return ``(buf, length)``.

    ``headers`` is a HEADER_DTYPE array, ``payloads`` one bytes-like payload per header
    (at most ``PAYLOAD_MAX`` bytes each).
    """
    if not isinstance(headers, np.ndarray) or headers.dtype != wire.HEADER_DTYPE:
        raise TypeError("headers: expected a numpy array of testbed.kernels.wire.HEADER_DTYPE "
                        "(make one with wire.new_headers(count))")
    n = headers.shape[0]
    if len(payloads) != n:
        raise ValueError(f"payloads: {len(payloads)} payloads for {n} headers; give one each")
    for name, port in (("sport", sport), ("dport", dport)):
        if not 0 <= int(port) <= 0xFFFF:
            raise ValueError(f"{name}: UDP port must be 0..65535, got {port}")
    pl = [np.frombuffer(bytes(p), dtype=np.uint8) if not isinstance(p, np.ndarray)
          else np.ascontiguousarray(p).view(np.uint8).ravel() for p in payloads]
    width = max([len(p) for p in pl] + [1])
    if width > PAYLOAD_MAX:
        raise ValueError(f"payloads: largest payload is {width} bytes, at most {PAYLOAD_MAX} fit "
                         f"a {FRAME_MAX}-byte frame")
    payload = np.zeros((n, width), dtype=np.uint8)
    payload_len = np.zeros(n, dtype=np.int32)
    for i, p in enumerate(pl):
        payload[i, :len(p)] = p
        payload_len[i] = len(p)
    hdrs = np.ascontiguousarray(headers)
    buf = np.zeros((n, FRAME_MAX), dtype=np.uint8)
    length = np.zeros(n, dtype=np.int32)
    smac = np.tile(mac_to_array(src_mac), (n, 1))
    dmac = np.tile(mac_to_array(dst_mac), (n, 1))
    sip = np.full(n, ip_to_u32(src_ip), dtype=np.uint32)
    dip = np.full(n, ip_to_u32(dst_ip), dtype=np.uint32)
    sp = np.full(n, sport, dtype=np.uint16)
    dp = np.full(n, dport, dtype=np.uint16)
    build_batch(buf, length, n, hdrs, payload, payload_len, smac, dmac, sip, dip, sp, dp)
    return buf, length
