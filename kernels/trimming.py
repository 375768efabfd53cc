"""Trimming-friendly payload layout (HotNets'24 "JIT gradient compression by packet trimming").

A chunk of ``m`` float32 values is encoded so that the *front* of the payload (the head, the
first ``head_bytes`` bytes, which go into the header field of that name) is a coarse unbiased
estimate on its own and the *tail* carries the refinement. A congested switch cuts the frame
at ``PAYLOAD_OFFSET + head_bytes`` (:func:`trim_frame`) and the receiver still decodes it.

Payload layout (``Codec.TRIM_LAYOUT``, all little-endian)::

    offset 0   float32  s = max|x| of the chunk (the head's scale)
    offset 4   uint8    b = head bits per element (1, 2, 4 or 8)
    offset 5   uint8    LAYOUT_VERSION
    offset 6   uint16   0 (reserved)
    offset 8   heads    m * b bits, element i in bits [i*b, (i+1)*b) LSB-first, zero padded
                        to a multiple of 4 bytes          -> head_bytes = 8 + that
    head_bytes float32[m] the values themselves (the refinement)

Heads are *stochastic* b-bit quantisations of x on ``L = 2**b - 1`` uniform steps over
``[-s, s]``: with ``u = (x/s + 1) / 2 * L`` the head is ``floor(u) + Bernoulli(frac(u))``,
decoded as ``s * (2q/L - 1)``. Its expectation is x (unbiased; b = 1 is a stochastic sign
scaled by s). The Bernoulli draws are ``testbed.kernels.rng.uniform01(seed, counter + i)``
(counter-based), so encodes are reproducible and independent across chunks when each chunk
passes its own ``counter`` (e.g. its ``chunk_offset``).

Decoding a full payload is **bit-exact** (the tail is the float32 values; we chose exactness
over saving the head's m*b bits: a 3.9 % overhead for b = 1, m = 256, 40 + 1024 bytes). A
trimmed payload (exactly ``head_bytes`` long) decodes to the unbiased head estimate, whose
per-element error is at most ``2 * s / L`` (one step). The deviations from exact
unbiasedness are the float32 rounding of the decoded estimate (2**-24 relative) and the
24-bit resolution of the draws (a rounding probability off by at most 2**-24).

njit kernels: ``head_bytes_for(m, bits)``, ``total_bytes_for(m, bits)``,
``encode_into(x, bits, seed, counter, out) -> nbytes``, ``decode_into(payload, nbytes, m,
out) -> 1 full / 0 trimmed / -1 malformed``, ``trim_frame(frame, length) -> new length or
-reason``, ``trim_frames(buf, length, n) -> frames trimmed``, whole-tensor ``encode_chunks_into`` /
``decode_chunks_into`` and their ``parallel=True`` forms ``*_par``. Python wrappers: :func:`encode`,
:func:`decode`, :func:`trim`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_finite
from testbed.kernels.packets import (
    FLAG_TRIMMED,
    OFF_UDP_LEN,
    PAYLOAD_MAX,
    f32_from_bits,
    header,
    parse_frame,
    rd_f32le,
    rd_u16be,
    set_payload_bytes,
    wr_f32le,
)
from testbed.kernels.rng import uniform01
from testbed.kernels.wire import HEADER_LEN, UDP_LEN

LAYOUT_VERSION = 1
#: Bytes before the heads: scale (4), bits (1), version (1), reserved (2).
PREAMBLE = 8
#: Head widths the layout supports (each divides 8, so a head never straddles a byte).
BITS_ALLOWED = (1, 2, 4, 8)

_ABS_MASK = np.uint32(0x7FFFFFFF)


@njit(cache=True)
def head_bytes_for(m, bits):
    """``head_bytes`` of an m-element chunk with b-bit heads."""
    h = (m * bits + 7) // 8
    return PREAMBLE + (h + 3) // 4 * 4


@njit(cache=True)
def total_bytes_for(m, bits):
    """Full payload bytes of an m-element chunk with b-bit heads."""
    return head_bytes_for(m, bits) + 4 * m


@njit(cache=True)
def encode_into(x, bits, seed, counter, out):
    """Encode float32 ``x`` (m values, finite) into ``out`` (uint8, >= total_bytes_for(m, bits))
    with b-bit stochastic heads drawn from ``(seed, counter + i)``; return the payload bytes."""
    m = x.shape[0]
    levels = (1 << bits) - 1
    hb = head_bytes_for(m, bits)
    xb = x.view(np.uint32)
    mx = np.uint32(0)
    for i in range(m):
        b = xb[i] & _ABS_MASK
        if b > mx:
            mx = b
    s = f32_from_bits(mx)
    wr_f32le(out, 0, s)
    out[4] = bits
    out[5] = LAYOUT_VERSION
    out[6] = 0
    out[7] = 0
    out[PREAMBLE + (m * bits + 7) // 8:hb] = 0  # padding
    inv = 1.0 / np.float64(s) if s > 0 else 0.0
    half_l = 0.5 * levels
    per_byte = 8 // bits
    # build each head byte in a register (no read-modify-write of the output per element)
    for k in range((m * bits + 7) // 8):
        acc = 0
        i0 = k * per_byte
        for j in range(min(per_byte, m - i0)):
            i = i0 + j
            u = (np.float64(x[i]) * inv + 1.0) * half_l
            fl = np.floor(u)
            q = np.int64(fl) + (uniform01(seed, counter + i) < u - fl)
            q = min(max(q, 0), levels)
            acc |= q << (j * bits)
        out[PREAMBLE + k] = acc
    out[hb:hb + 4 * m] = x.view(np.uint8)
    return hb + 4 * m


@njit(cache=True)
def decode_into(payload, nbytes, m, out):
    """Decode an m-element payload of ``nbytes`` into float32 ``out``: return 1 after a
    bit-exact full decode, 0 after decoding a trimmed (head-only) payload, -1 when the payload
    is malformed (unknown bits/version or a length that is neither head nor full)."""
    if nbytes < PREAMBLE:
        return -1
    bits = np.int64(payload[4])
    if payload[5] != LAYOUT_VERSION or not (bits == 1 or bits == 2 or bits == 4 or bits == 8):
        return -1
    hb = head_bytes_for(m, bits)
    if nbytes == hb + 4 * m:
        out[:m] = payload[hb:hb + 4 * m].view(np.float32)
        return 1
    if nbytes != hb:
        return -1
    s = np.float64(rd_f32le(payload, 0))
    levels = (1 << bits) - 1
    mask = levels
    step = 2.0 * s / levels
    for i in range(m):
        pos = i * bits
        q = (np.int64(payload[PREAMBLE + (pos >> 3)]) >> (pos & 7)) & mask
        out[i] = np.float32(q * step - s)
    return 0


@njit(cache=True)
def encode_chunks_into(x, chunk, bits, seed, out, nbytes):
    """Encode every ``chunk``-element chunk c of ``x`` into row c of ``out`` (uint8[nch, >=
    total_bytes_for(chunk, bits)]) with counter ``c * chunk``; ``nbytes[c]`` gets its size."""
    nch = (x.shape[0] + chunk - 1) // chunk
    for c in range(nch):
        lo = c * chunk
        hi = min(lo + chunk, x.shape[0])
        nbytes[c] = encode_into(x[lo:hi], bits, seed, lo, out[c])


@njit(cache=True)
def decode_chunks_into(payloads, nbytes, chunk, out):
    """Decode row c of ``payloads`` (``nbytes[c]`` bytes) into ``out[c*chunk:...]``; return the
    number of malformed rows (left unwritten)."""
    nch = (out.shape[0] + chunk - 1) // chunk
    bad = 0
    for c in range(nch):
        lo = c * chunk
        hi = min(lo + chunk, out.shape[0])
        if decode_into(payloads[c], nbytes[c], hi - lo, out[lo:hi]) < 0:
            bad += 1
    return bad


@njit(cache=True, parallel=True)
def encode_chunks_into_par(x, chunk, bits, seed, out, nbytes):
    """Parallel :func:`encode_chunks_into` (same result: the random stream is per element)."""
    nch = (x.shape[0] + chunk - 1) // chunk
    for c in prange(nch):
        lo = c * chunk
        hi = min(lo + chunk, x.shape[0])
        nbytes[c] = encode_into(x[lo:hi], bits, seed, lo, out[c])


@njit(cache=True, parallel=True)
def decode_chunks_into_par(payloads, nbytes, chunk, out):
    """Parallel :func:`decode_chunks_into`."""
    nch = (out.shape[0] + chunk - 1) // chunk
    bad = 0
    for c in prange(nch):
        lo = c * chunk
        hi = min(lo + chunk, out.shape[0])
        if decode_into(payloads[c], nbytes[c], hi - lo, out[lo:hi]) < 0:
            bad += 1
    return bad


@njit(cache=True)
def trim_frame(frame, length):
    """Trim a testbed frame to its head: cut at ``PAYLOAD_OFFSET + head_bytes``, set
    ``Flags.TRIMMED``, fix IPv4 total length and checksum and UDP length (UDP checksum 0).

    Returns the new length; the unchanged ``length`` when there is nothing to cut
    (``head_bytes`` 0 = not trimmable, or no tail beyond the head); ``-reason`` (a negative
    ``DropReason``) when the frame is not a valid testbed frame.
    """
    st = parse_frame(frame, length)
    if st != 0:
        return -st
    h = header(frame)
    head = np.int64(h.head_bytes)
    payload = rd_u16be(frame, OFF_UDP_LEN) - UDP_LEN - HEADER_LEN
    if head == 0 or head >= payload:
        return length
    h.flags |= FLAG_TRIMMED
    return set_payload_bytes(frame, head)


@njit(cache=True)
def trim_frames(buf, length, n):
    """Apply :func:`trim_frame` to frames ``0..n-1`` of ``buf``; lengths are updated for
    trimmed frames (invalid ones are left as they are). Returns how many were trimmed."""
    done = 0
    for i in range(n):
        r = trim_frame(buf[i], length[i])
        if r > 0 and r != length[i]:
            length[i] = r
            done += 1
    return done


# ---------------------------------------------------------------------------------------------
# validating Python wrappers


def _check_bits(bits) -> int:
    if bits not in BITS_ALLOWED:
        raise ValueError(f"bits: head bits per element must be one of {BITS_ALLOWED}, "
                         f"got {bits!r}")
    return int(bits)


def encode(x: np.ndarray, bits: int = 1, seed: int = 0, counter: int = 0) -> np.ndarray:
    """Encode one chunk of float32 values; return the payload (uint8) of
    ``total_bytes_for(len(x), bits)`` bytes. ``head_bytes_for(len(x), bits)`` is its head."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
        raise TypeError("x: expected a 1-D float32 numpy array (one chunk of a gradient)")
    bits = _check_bits(bits)
    check_finite("x", x, "the trimming layout needs finite values")
    for name, v in (("seed", seed), ("counter", counter)):
        if not isinstance(v, (int, np.integer)) or not 0 <= v < 2**63:
            raise ValueError(f"{name}: must be an int in [0, 2**63), got {v!r}")
    x = np.ascontiguousarray(x)
    total = int(total_bytes_for(x.shape[0], bits))
    if x.shape[0] > 0xFFFF:
        raise ValueError(f"x: {x.shape[0]} elements do not fit the 16-bit elem_count field")
    out = np.empty(total, dtype=np.uint8)
    encode_into(x, bits, int(seed), int(counter), out)
    return out


def decode(payload: np.ndarray, m: int) -> tuple[np.ndarray, bool]:
    """Decode a payload of ``m`` elements (full or trimmed to its head); return
    ``(values float32[m], full)`` where ``full`` is False for a trimmed payload."""
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
        raise TypeError("payload: expected a 1-D uint8 numpy array")
    if not isinstance(m, (int, np.integer)) or m < 0:
        raise ValueError(f"m: element count must be a non-negative int, got {m!r}")
    out = np.empty(int(m), dtype=np.float32)
    r = decode_into(np.ascontiguousarray(payload), payload.shape[0], int(m), out)
    if r < 0:
        raise ValueError(f"payload: {payload.shape[0]} bytes is not a valid trimming layout for "
                         f"m={m} elements (expected head_bytes or head_bytes + 4*m bytes with "
                         f"bits in {BITS_ALLOWED})")
    return out, bool(r == 1)


def trim(payload: np.ndarray) -> np.ndarray:
    """The head of an encoded payload (what survives a trimming switch)."""
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
        raise TypeError("payload: expected a 1-D uint8 numpy array")
    if payload.shape[0] < PREAMBLE or payload[4] not in BITS_ALLOWED:
        raise ValueError("payload: not a trimming layout (too short or bad bits byte)")
    m = (payload.shape[0] - PREAMBLE) // 4
    # total = 8 + pad4(ceil(m*b/8)) + 4m; find m from the total length
    bits = int(payload[4])
    for mm in range(m, -1, -1):
        if total_bytes_for(mm, bits) == payload.shape[0]:
            return payload[: head_bytes_for(mm, bits)].copy()
    raise ValueError("payload: length matches no element count; is it already trimmed?")


def max_elements(bits: int, payload_max: int = PAYLOAD_MAX) -> int:
    """Largest chunk whose full payload fits ``payload_max`` bytes."""
    bits = _check_bits(bits)
    m = payload_max // 4
    while m > 0 and total_bytes_for(m, bits) > payload_max:
        m -= 1
    return m
