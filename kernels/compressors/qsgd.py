"""``qsgd``: QSGD stochastic quantisation to ``levels`` levels of |x| / ||x||_2 (unbiased).

q_i = sign(x_i) * (floor(a_i) + [u_i < frac(a_i)]) with a_i = |x_i| * levels / ||x||_2 and u_i
from the ``(seed, step)`` stream; x̂_i = q_i * ||x||_2 / levels. E[x̂] = x. Levels are stored
in int8 when ``levels`` <= 127, else int16.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number
from testbed.kernels.parallel import kernel
from testbed.kernels.reductions import l2norm
from testbed.kernels.rng import stream_key, uniform, uniform32

from .base import Compressor

_SALT = 0x51534744  # "QSGD"


@kernel("x.size")
def qsgd_quantize(x, levels, norm, key, out):
    """Quantise float32 ``x`` to signed levels in ``out`` (int8/int16) given its ``norm``.

    ``norm`` is ``l2norm(x)`` (or a larger shared norm); 0 gives all zeros. The arithmetic is
    float32 (vectorises twice as wide) unless levels / norm would overflow it (norms below
    ~1e-35, i.e. subnormal gradients), then float64.
    """
    s64 = levels / norm if norm > 0.0 else 0.0
    if s64 <= 1e37:
        scale = np.float32(s64)
        top = np.float32(levels)
        for i in prange(x.size):
            v = x[i]
            a = min(abs(v) * scale, top)
            lv = np.float32(np.int32(a))
            q = lv + (np.float32(1.0) if uniform32(i, key) < a - lv else np.float32(0.0))
            out[i] = -q if v < np.float32(0.0) else q
    else:
        top64 = np.float64(levels)
        for i in prange(x.size):
            v64 = np.float64(x[i])
            a64 = min(abs(v64) * s64, top64)
            lv64 = np.float64(np.int64(a64))
            q64 = lv64 + (1.0 if uniform(i, key) < a64 - lv64 else 0.0)
            out[i] = -q64 if v64 < 0.0 else q64


@njit(cache=True)
def qsgd_dequantize(q, norm, levels, out):
    """x̂ = q * norm / levels into float32 ``out``."""
    s = norm / levels
    for i in prange(q.size):
        out[i] = np.float32(q[i] * s)


class QsgdCompressor(Compressor):
    """QSGD with ``levels`` (default 256, as GRACE) and a shared ``seed`` (default 0)."""

    name = "qsgd"

    def __init__(self, levels: int = 256, seed: int = 0):
        levels = check_number("levels", 1, 32767, integer=True)(levels)
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(levels=levels, seed=seed)
        self.levels, self.seed = levels, seed
        self.dtype = np.int8 if levels <= 127 else np.int16

    def _compress(self, x, step):
        norm = float(l2norm(x)) if x.size else 0.0
        out = np.empty(x.size, dtype=self.dtype)
        qsgd_quantize(x, self.levels, norm, stream_key(self.seed, step, _SALT), out)
        return (out,), {"n": int(x.size), "norm": norm}

    def _decompress(self, payload, ctx):
        q = np.ascontiguousarray(payload[0])
        out = np.empty(q.size, dtype=np.float32)
        qsgd_dequantize(q, float(ctx["norm"]), self.levels, out)
        return out

    def payload_bytes(self, n_elements):
        """1 or 2 bytes per element (the norm travels in the ctx)."""
        return np.dtype(self.dtype).itemsize * int(n_elements)
