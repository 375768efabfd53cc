"""Plain Python/numpy twins of :mod:`testbed.kernels.packets` (parse, build, checksum).

Written independently of the Numba code (``struct`` and numpy structured dtypes instead of
byte-level offsets) so the tests compare two implementations of the same wire format.
"""

from __future__ import annotations

import struct

import numpy as np

from testbed.kernels import wire

R = wire.DropReason
NONE, TOO_SHORT, NOT_IPV4, IP_OPTIONS, NOT_UDP = R.NONE, R.TOO_SHORT, R.NOT_IPV4, \
    R.IP_OPTIONS, R.NOT_UDP
BAD_MAGIC, BAD_VERSION, BAD_LENGTH, UNKNOWN_TYPE = R.BAD_MAGIC, R.BAD_VERSION, R.BAD_LENGTH, \
    R.UNKNOWN_TYPE
BAD_CODEC, OTHER = R.BAD_CODEC, R.OTHER


def ipv4_checksum(ip_header: bytes) -> int:
    """Internet checksum of a 20-byte IPv4 header with its checksum field taken as zero."""
    h = bytearray(ip_header[:20])
    h[10:12] = b"\x00\x00"
    s = sum(struct.unpack("!10H", bytes(h)))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def parse_frame(frame: bytes | np.ndarray, length: int) -> tuple[int, np.ndarray | None]:
    """Return ``(status, header)`` for a frame: status as in ``packets.parse_frame``, header a
    HEADER_DTYPE scalar array of shape (1,) when the frame is valid, else None."""
    buf = bytes(np.asarray(frame, dtype=np.uint8)[:max(length, 0)]) if length <= len(frame) \
        else None
    if buf is None:
        return BAD_LENGTH, None
    if len(buf) < 14:
        return TOO_SHORT, None
    (ethertype,) = struct.unpack("!H", buf[12:14])
    if ethertype != 0x0800:
        return NOT_IPV4, None
    if len(buf) < 34:
        return TOO_SHORT, None
    vihl, _tos, tot, _id, frag, _ttl, proto = struct.unpack("!BBHHHBB", buf[14:24])
    if vihl >> 4 != 4:
        return NOT_IPV4, None
    if vihl & 0xF > 5:
        return IP_OPTIONS, None
    if vihl & 0xF < 5:
        return BAD_LENGTH, None
    if frag & 0x3FFF:
        return OTHER, None
    if tot < 20 or 14 + tot > len(buf):
        return BAD_LENGTH, None
    if proto != 17:
        return NOT_UDP, None
    if tot < 28:
        return TOO_SHORT, None
    sport, dport, ulen, _csum = struct.unpack("!HHHH", buf[34:42])
    if wire.TESTBED_UDP_PORT not in (sport, dport):
        return NOT_UDP, None
    if ulen != tot - 20:
        return BAD_LENGTH, None
    if ulen < 8 + wire.HEADER_LEN:
        return TOO_SHORT, None
    hdr = np.frombuffer(buf[wire.HEADER_OFFSET:wire.PAYLOAD_OFFSET], dtype=wire.HEADER_DTYPE)
    h = hdr[0]
    if h["magic"] != wire.MAGIC:
        return BAD_MAGIC, None
    if h["version"] != wire.VERSION:
        return BAD_VERSION, None
    if h["msg_type"] not in {int(t) for t in wire.MsgType}:
        return UNKNOWN_TYPE, None
    if h["codec"] not in {int(c) for c in wire.Codec}:
        return BAD_CODEC, None
    payload = ulen - 8 - wire.HEADER_LEN
    codec = wire.Codec(int(h["codec"]))
    elem_size = {wire.Codec.INT32: 4, wire.Codec.FLOAT32: 4, wire.Codec.FLOAT16: 2,
                 wire.Codec.BFLOAT16: 2}.get(codec)
    if elem_size is not None and elem_size * int(h["elem_count"]) != payload:
        return BAD_LENGTH, None
    if h["head_bytes"] > payload:
        return BAD_LENGTH, None
    if int(h["flags"]) & wire.Flags.TRIMMED and h["head_bytes"] != payload:
        return BAD_LENGTH, None
    return NONE, hdr.copy()


def udp_frame(src_mac: bytes, dst_mac: bytes, src_ip: bytes, dst_ip: bytes, sport: int,
              dport: int, data: bytes) -> bytes:
    """Eth/IPv4/UDP frame around ``data`` (testbed header + payload), addresses as raw bytes;
    the same bytes as the kernels' ``write_eth_ip_udp`` (UDP checksum 0)."""
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(data), 0, 0x4000, 64, 17, 0,
                               src_ip, dst_ip))
    ip[10:12] = struct.pack("!H", ipv4_checksum(bytes(ip)))
    eth = bytes(dst_mac) + bytes(src_mac) + struct.pack("!H", 0x0800)
    return eth + bytes(ip) + struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data


def build_frame(header: np.ndarray, payload: bytes, src_mac: bytes, dst_mac: bytes,
                src_ip: int, dst_ip: int, sport: int, dport: int) -> bytes:
    """Bytes of a frame: Eth/IPv4 (DF, TTL 64, id 0)/UDP (checksum 0)/header/payload."""
    hdr = np.asarray(header, dtype=wire.HEADER_DTYPE).reshape(1).tobytes()
    return udp_frame(src_mac, dst_mac, src_ip.to_bytes(4, "big"), dst_ip.to_bytes(4, "big"),
                     sport, dport, hdr + payload)


def parse_batch(buf: np.ndarray, length: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Twin of ``packets.parse_batch``: returns ``(headers, status)`` (headers of invalid frames
    are zero)."""
    headers = np.zeros(buf.shape[0], dtype=wire.HEADER_DTYPE)
    status = np.zeros(buf.shape[0], dtype=np.uint8)
    for i in range(n):
        s, h = parse_frame(buf[i], int(length[i]))
        status[i] = s
        if h is not None:
            headers[i] = h[0]
    return headers, status
