"""Plain numpy twins of :mod:`testbed.kernels.trimming` (same layout, same random stream)."""

from __future__ import annotations

import numpy as np

from testbed.kernels import wire
from testbed.kernels.reference.packets import ipv4_checksum
from testbed.kernels.reference.rng import uniform01

PREAMBLE = 8
LAYOUT_VERSION = 1


def head_bytes_for(m: int, bits: int) -> int:
    """Head size in bytes (preamble + heads padded to 4 bytes)."""
    heads = (m * bits + 7) // 8
    return PREAMBLE + (heads + 3) // 4 * 4


def encode(x: np.ndarray, bits: int, seed: int, counter: int) -> np.ndarray:
    """Payload bytes of the trimming layout for chunk ``x``."""
    m = x.shape[0]
    levels = 2**bits - 1
    s = np.float32(np.abs(x).max()) if m else np.float32(0)
    inv = 1.0 / np.float64(s) if s > 0 else 0.0
    u = (x.astype(np.float64) * inv + 1.0) * (0.5 * levels)
    fl = np.floor(u)
    r = uniform01(seed, counter + np.arange(m, dtype=np.int64))
    q = np.clip(fl.astype(np.int64) + (r < u - fl), 0, levels)
    # expand each head into its bits (LSB first) and pack the bit stream LSB-first
    bitstream = ((q[:, None] >> np.arange(bits)) & 1).astype(np.uint8).ravel()
    packed = np.packbits(bitstream, bitorder="little")
    hb = head_bytes_for(m, bits)
    heads = np.zeros(hb - PREAMBLE, dtype=np.uint8)
    heads[: packed.shape[0]] = packed
    pre = np.zeros(PREAMBLE, dtype=np.uint8)
    pre[:4] = np.frombuffer(np.float32(s).tobytes(), dtype=np.uint8)
    pre[4] = bits
    pre[5] = LAYOUT_VERSION
    return np.concatenate([pre, heads, x.astype("<f4").view(np.uint8)])


def decode(payload: np.ndarray, m: int) -> tuple[np.ndarray, bool]:
    """``(values, full)``; raises ValueError on a malformed payload."""
    bits = int(payload[4])
    hb = head_bytes_for(m, bits)
    if payload.shape[0] == hb + 4 * m:
        return payload[hb:].copy().view("<f4").astype(np.float32), True
    if payload.shape[0] != hb:
        raise ValueError("payload length is neither head nor full")
    s = np.float64(payload[:4].copy().view("<f4")[0])
    levels = 2**bits - 1
    stream = np.unpackbits(payload[PREAMBLE:hb], bitorder="little")[: m * bits]
    q = (stream.reshape(m, bits).astype(np.int64) << np.arange(bits)).sum(axis=1)
    return (q * (2.0 * s / levels) - s).astype(np.float32), False


def trim_frame(frame: bytes) -> bytes:
    """Twin of ``trimming.trim_frame`` for a valid, trimmable frame: the trimmed frame bytes."""
    f = bytearray(frame)
    off = wire.HEADER_OFFSET
    head = int.from_bytes(f[off + wire.FIELD_OFFSETS["head_bytes"]:][:2], "little")
    f[off + wire.FIELD_OFFSETS["flags"]] |= int(wire.Flags.TRIMMED)
    f = f[: wire.PAYLOAD_OFFSET + head]
    udp_len = 8 + wire.HEADER_LEN + head
    f[16:18] = (20 + udp_len).to_bytes(2, "big")
    f[38:40] = udp_len.to_bytes(2, "big")
    f[40:42] = b"\x00\x00"
    f[24:26] = ipv4_checksum(bytes(f[14:34])).to_bytes(2, "big")
    return bytes(f)


def encode_chunks(x: np.ndarray, chunk: int, bits: int, seed: int) -> np.ndarray:
    """Whole-tensor twin of ``trimming.encode_chunks_into`` for ``len(x)`` a multiple of
    ``chunk``: row c is the payload of chunk c (counter ``c * chunk``), vectorised over rows."""
    nch = x.shape[0] // chunk
    x2 = x.reshape(nch, chunk)
    levels = 2**bits - 1
    s = np.abs(x2).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(s > 0, 1.0 / s.astype(np.float64), 0.0)
    u = (x2.astype(np.float64) * inv[:, None] + 1.0) * (0.5 * levels)
    fl = np.floor(u)
    r = uniform01(seed, np.arange(nch * chunk, dtype=np.int64)).reshape(nch, chunk)
    q = np.clip(fl.astype(np.int64) + (r < u - fl), 0, levels)
    stream = ((q[:, :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(nch, -1)
    packed = np.packbits(stream, axis=1, bitorder="little")
    hb = head_bytes_for(chunk, bits)
    out = np.zeros((nch, hb + 4 * chunk), dtype=np.uint8)
    out[:, :4] = s.astype("<f4").view(np.uint8).reshape(nch, 4)
    out[:, 4] = bits
    out[:, 5] = LAYOUT_VERSION
    out[:, PREAMBLE:PREAMBLE + packed.shape[1]] = packed
    out[:, hb:] = x2.astype("<f4").view(np.uint8)
    return out


def decode_chunks(payloads: np.ndarray, chunk: int, trimmed: bool) -> np.ndarray:
    """Whole-tensor twin of ``trimming.decode_chunks_into`` for equal rows of one kind."""
    nch = payloads.shape[0]
    bits = int(payloads[0, 4])
    hb = head_bytes_for(chunk, bits)
    if not trimmed:
        return np.ascontiguousarray(payloads[:, hb:hb + 4 * chunk]).view("<f4").ravel()
    s = np.ascontiguousarray(payloads[:, :4]).view("<f4")[:, 0].astype(np.float64)
    levels = 2**bits - 1
    stream = np.unpackbits(payloads[:, PREAMBLE:hb], axis=1, bitorder="little")
    q = (stream[:, : chunk * bits].reshape(nch, chunk, bits).astype(np.int64)
         << np.arange(bits)).sum(axis=2)
    return (q * (2.0 * s[:, None] / levels) - s[:, None]).astype(np.float32).ravel()
