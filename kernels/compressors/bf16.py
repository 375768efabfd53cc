"""``bf16``: bfloat16 (the top 16 bits of float32), round to nearest even."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.parallel import kernel

from .base import Compressor

#: Smallest float32 magnitude that rounds to inf in bfloat16 (half-way above 0x7F7F).
BF16_INF_FROM = np.array([0x7F7F8000], dtype=np.uint32).view(np.float32)[0]


@njit(cache=True, inline="always")
def bf16_bits(f):
    """bfloat16 bits (as int) of float32 bits ``f``, round to nearest even; NaN stays NaN."""
    if (f & 0x7FFFFFFF) > 0x7F800000:
        return ((f >> 16) & 0x8000) | 0x7FC0
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) & 0xFFFF


@kernel("xb.size")
def _encode_bits(xb, out):
    for i in prange(xb.size):
        out[i] = bf16_bits(np.int64(xb[i]))


@njit(cache=True)
def _decode_bits(h, ob):
    for i in prange(h.size):
        ob[i] = np.uint32(h[i]) << np.uint32(16)


# The bit views are taken outside the parallel loops: Numba's parallel backend writes through
# an array view taken inside a prange kernel into a copy (observed with numba 0.68).
@njit(cache=True)
def bf16_encode(x, out):
    """float32 ``x`` -> bfloat16 bits in uint16 ``out``."""
    _encode_bits(x.view(np.uint32), out)


@njit(cache=True)
def bf16_decode(h, out):
    """bfloat16 bits in uint16 ``h`` -> float32 ``out`` (exact)."""
    _decode_bits(h, out.view(np.uint32))


class Bf16Compressor(Compressor):
    """bfloat16: float32's range with 8 significant bits. Summable like fp16 (the sum is
    accumulated in float32 and rounded to bf16 once, as SHARP's bf16 reductions do).
    The few float32 values at the very top of the range (>= 3.3962e38) would round to
    inf, hence the range check."""

    name = "bf16"
    summable = True
    carrier = "bfloat16"

    def _compress(self, x, step):
        if x.size and np.max(np.abs(x)) >= BF16_INF_FROM:
            raise ValueError(f"x has values that round to inf in bfloat16 "
                             f"(|x| >= {float(BF16_INF_FROM):.6g}); scale the gradient")
        out = np.empty(x.size, dtype=np.uint16)
        bf16_encode(x, out)
        return (out,), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        h = np.ascontiguousarray(payload[0], dtype=np.uint16)
        out = np.empty(h.size, dtype=np.float32)
        bf16_decode(h, out)
        return out

    def _aggregate(self, payloads):
        acc = np.zeros(payloads[0][0].size, dtype=np.float32)
        tmp = np.empty_like(acc)
        for p in payloads:
            bf16_decode(np.ascontiguousarray(p[0], dtype=np.uint16), tmp)
            acc += tmp
        out = np.empty(acc.size, dtype=np.uint16)
        bf16_encode(acc, out)
        return (out,)

    def payload_bytes(self, n_elements):
        """2 bytes per element."""
        return 2 * int(n_elements)
