"""``terngrad``: ternary {-1, 0, +1} * max|x|, stochastic and unbiased.

q_i = sign(x_i) * [u_i < |x_i| / s] with s = max |x|; x̂ = q * s. (GRACE's optional
2.5-sigma gradient clipping is left out: it makes the estimate biased.)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number
from testbed.kernels.parallel import kernel
from testbed.kernels.reductions import absmax
from testbed.kernels.rng import stream_key, uniform

from .base import Compressor

_SALT = 0x5445524E  # "TERN"


@kernel("x.size")
def terngrad_quantize(x, scale, key, out):
    """Ternary int8 ``out`` for float32 ``x`` with ``scale`` = max|x| (0 gives zeros)."""
    inv = 1.0 / scale if scale > 0.0 else 0.0
    for i in prange(x.size):
        v = np.float64(x[i])
        b = 1 if uniform(i, key) < abs(v) * inv else 0
        out[i] = -b if v < 0.0 else b


@njit(cache=True)
def terngrad_dequantize(q, scale, out):
    """x̂ = q * scale into float32 ``out``."""
    s = np.float32(scale)
    for i in prange(q.size):
        out[i] = np.float32(q[i]) * s


class TerngradCompressor(Compressor):
    """TernGrad with a shared ``seed`` (default 0)."""

    name = "terngrad"

    def __init__(self, seed: int = 0):
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(seed=seed)
        self.seed = seed

    def _compress(self, x, step):
        scale = float(absmax(x))
        out = np.empty(x.size, dtype=np.int8)
        terngrad_quantize(x, scale, stream_key(self.seed, step, _SALT), out)
        return (out,), {"n": int(x.size), "scale": scale}

    def _decompress(self, payload, ctx):
        q = np.ascontiguousarray(payload[0], dtype=np.int8)
        out = np.empty(q.size, dtype=np.float32)
        terngrad_dequantize(q, float(ctx["scale"]), out)
        return out

    def payload_bytes(self, n_elements):
        """1 byte per element (int8 ternary; the scale travels in the ctx)."""
        return int(n_elements)
