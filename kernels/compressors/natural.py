"""``natural``: natural compression, stochastic rounding of |x| to a power of two (unbiased).

For |x| = 2^e (1 + m), m in [0, 1): send 2^(e+1) with probability m, else 2^e, so E = |x|.
Subnormals round to 0 or 2^-126 the same way. Only sign + exponent survive (9 bits); they are
stored as uint16 bfloat16 bit patterns with a zero mantissa, so decode is a shift. The draw is
integer-only (23 random bits against the 23 mantissa bits), bit-exact with the numpy twin.
|x| >= 2^127 cannot round up (no larger finite power of two) and rounds down: refused.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number
from testbed.kernels.parallel import kernel
from testbed.kernels.rng import hash_u32, stream_key

from .base import Compressor

_SALT = 0x4E415455  # "NATU"
#: 2^127: the largest power of two in float32; values at or above it cannot round up.
NATURAL_MAX = float(2.0**127)


@kernel("xb.size")
def _encode_bits(xb, key, out):
    for i in prange(xb.size):
        f = np.int64(xb[i])
        s = (f >> 31) & 1
        e = (f >> 23) & 0xFF
        m = f & 0x7FFFFF
        up = 1 if np.int64(hash_u32(i, key) >> np.uint64(9)) < m else 0
        e2 = min(e + up, 254)
        out[i] = (s << 15) | (e2 << 7)


@njit(cache=True)
def _decode_bits(code, ob):
    for i in prange(code.size):
        ob[i] = np.uint32(code[i]) << np.uint32(16)


# Bit views are taken outside the parallel loops (Numba's parallel backend writes through a
# view taken inside a prange kernel into a copy, observed with numba 0.68).
@njit(cache=True)
def natural_encode(x, key, out):
    """Natural-compression codes (uint16, bfloat16 bits with zero mantissa) of float32 ``x``."""
    _encode_bits(x.view(np.uint32), key, out)


@njit(cache=True)
def natural_decode(code, out):
    """float32 ``out`` from natural-compression codes (exact)."""
    _decode_bits(code, out.view(np.uint32))


class NaturalCompressor(Compressor):
    """Natural compression with a shared ``seed`` (default 0); 2 bytes per element."""

    name = "natural"

    def __init__(self, seed: int = 0):
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(seed=seed)
        self.seed = seed

    def _compress(self, x, step):
        if x.size and float(np.max(np.abs(x))) >= NATURAL_MAX:
            raise ValueError("x has |values| >= 2^127, which natural compression cannot round "
                             "up without overflow; scale the gradient")
        out = np.empty(x.size, dtype=np.uint16)
        natural_encode(x, stream_key(self.seed, step, _SALT), out)
        return (out,), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        c = np.ascontiguousarray(payload[0], dtype=np.uint16)
        out = np.empty(c.size, dtype=np.float32)
        natural_decode(c, out)
        return out

    def payload_bytes(self, n_elements):
        """2 bytes per element (9 significant bits)."""
        return 2 * int(n_elements)
