"""``fp16``: IEEE half precision, round to nearest even (bit-exact with numpy's cast).

Numba has no CPU float16 type: ``fp16_encode``/``fp16_decode`` use an LLVM intrinsic
(``fptrunc``/``fpext`` to ``half``: vcvtps2ph/vcvtph2ps on x86 with F16C, fcvt on arm64) and
fall back to a portable bit-manipulation version (``fp16_encode_sw``) elsewhere; both are
tested bit-exact against numpy. Callable from other ``@njit`` code, e.g. the SmartNIC codec
stage per packet.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from testbed.kernels.parallel import block_range, kernel
from testbed.kernels.simd import (
    LANES,
    STREAM_MIN_BYTES,
    aligned_head,
    contiguous,
    half_block,
    host_cpu_has,
    store_fence,
    stream_parts,
)

from .base import Compressor

#: Largest finite half: values beyond ~65520 become inf, so the compressor refuses them.
FP16_MAX = 65504.0


@njit(cache=True, inline="always")
def fp16_bits(f):
    """Half-precision bits (as int) of float32 bits ``f``, round to nearest even."""
    sign = (f >> 16) & 0x8000
    a = f & 0x7FFFFFFF
    if a >= 0x7F800000:  # inf / NaN
        return sign | 0x7C00 | (0x200 if a > 0x7F800000 else 0)
    if a >= 0x477FF000:  # rounds past 65504
        return sign | 0x7C00
    if a >= 0x38800000:  # normal half
        r = a - 0x38000000
        r = r + 0xFFF + ((r >> 13) & 1)
        return sign | (r >> 13)
    if a <= 0x33000000:  # at most half of the smallest subnormal: rounds to zero
        return sign
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = 126 - e
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return sign | q


@njit(cache=True, inline="always")
def fp16_to_f32_bits(h):
    """float32 bits (as int) of half bits ``h``."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return sign
        e32 = 113
        while (m & 0x400) == 0:
            m <<= 1
            e32 -= 1
        return sign | (e32 << 23) | ((m & 0x3FF) << 13)
    if e == 31:
        return sign | 0x7F800000 | (m << 13)
    return sign | ((e + 112) << 23) | (m << 13)


@kernel("xb.size")
def _encode_bits_sw(xb, out):
    for i in prange(xb.size):
        out[i] = fp16_bits(np.int64(xb[i]))


@kernel("h.size")
def _decode_bits_sw(h, ob):
    for i in prange(h.size):
        ob[i] = fp16_to_f32_bits(np.int64(h[i]))


@intrinsic
def f32_to_f16(typingctx, x):
    """Hardware float32 -> half bits (uint16), round to nearest even (LLVM ``fptrunc``:
    one vcvtps2ph per 8/16 lanes on x86 with F16C, fcvt on arm64)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def f16_to_f32(typingctx, h):
    """Hardware half bits (uint16) -> float32 (exact; LLVM ``fpext``)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@kernel("x.size")
def _encode_hw(x, out):
    n = x.size
    stream = 2 * n >= STREAM_MIN_BYTES  # streaming stores for outputs beyond the caches
    head = min(aligned_head(out, 0) if stream else 0, n)
    nblk = (n - head) // LANES if contiguous(x) and contiguous(out) else 0
    nb = stream_parts(nblk)
    for p in prange(nb):
        b0, b1, _, _ = block_range(p, nb, nblk, 1, nblk)
        for b in range(b0, b1):
            half_block(x, head + b * LANES, out, stream)
        if stream:
            store_fence()
    for i in range(head):
        out[i] = f32_to_f16(x[i])
    for i in range(head + nblk * LANES, n):
        out[i] = f32_to_f16(x[i])


@kernel("h.size")
def _decode_hw(h, out):
    for i in prange(h.size):
        out[i] = f16_to_f32(h[i])


def _host_has_half_conversion() -> bool:
    """True when LLVM lowers float<->half to instructions here (x86 F16C, any arm64)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    return host_cpu_has("f16c")  # else the portable bit-twiddling path


#: Whether the kernels use the hardware conversion (else the bit-exact software one).
HW_HALF = _host_has_half_conversion()

if HW_HALF:

    @njit(cache=True)
    def fp16_encode(x, out):
        """float32 ``x`` -> half bits in uint16 ``out`` (same length), round to nearest even."""
        _encode_hw(x, out)

    @njit(cache=True)
    def fp16_decode(h, out):
        """Half bits in uint16 ``h`` -> float32 ``out`` (exact)."""
        _decode_hw(h, out)

else:
    # Bit views are taken outside the parallel loops (Numba's parallel backend writes through
    # a view taken inside a prange kernel into a copy, observed with numba 0.68).
    @njit(cache=True)
    def fp16_encode(x, out):
        """float32 ``x`` -> half bits in uint16 ``out`` (same length), round to nearest even."""
        _encode_bits_sw(x.view(np.uint32), out)

    @njit(cache=True)
    def fp16_decode(h, out):
        """Half bits in uint16 ``h`` -> float32 ``out`` (exact)."""
        _decode_bits_sw(h, out.view(np.uint32))


@njit(cache=True)
def fp16_encode_sw(x, out):
    """Portable software form of :func:`fp16_encode` (bit manipulation only): the fallback
    on hosts without hardware half conversion, tested here on every host."""
    _encode_bits_sw(x.view(np.uint32), out)


@njit(cache=True)
def fp16_decode_sw(h, out):
    """Portable software form of :func:`fp16_decode` (see :func:`fp16_encode_sw`)."""
    _decode_bits_sw(h, out.view(np.uint32))


class Fp16Compressor(Compressor):
    """Half precision; refuses |x| > 65504 (use bf16 for wide-range gradients).

    Summable with care: :meth:`aggregate` adds in float32 and rounds the sum once to half, so
    the n-worker sum must itself stay within +-65504 and carries one extra rounding.
    """

    name = "fp16"
    summable = True
    carrier = "float16"

    def _compress(self, x, step):
        if x.size and float(np.max(np.abs(x))) > FP16_MAX:
            raise ValueError(f"x has |values| above {FP16_MAX} (fp16 range); scale the "
                             "gradient or use get_compressor('bf16')")
        out = np.empty(x.size, dtype=np.uint16)
        fp16_encode(x, out)
        return (out.view(np.float16),), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        h = np.ascontiguousarray(payload[0])
        if h.dtype == np.float32:  # an aggregated sum already widened
            return h.copy()
        out = np.empty(h.size, dtype=np.float32)
        fp16_decode(h.view(np.uint16), out)
        return out

    def _aggregate(self, payloads):
        acc = np.zeros(payloads[0][0].size, dtype=np.float32)
        tmp = np.empty_like(acc)
        for p in payloads:
            fp16_decode(np.ascontiguousarray(p[0]).view(np.uint16), tmp)
            acc += tmp
        if acc.size and float(np.max(np.abs(acc))) > FP16_MAX:
            raise ValueError("the fp16 sum overflows half precision; use bf16 or fewer workers")
        out = np.empty(acc.size, dtype=np.uint16)
        fp16_encode(acc, out)
        return (out.view(np.float16),)

    def payload_bytes(self, n_elements):
        """2 bytes per element."""
        return 2 * int(n_elements)
