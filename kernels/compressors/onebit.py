"""``onebit``: 1-bit SGD with two means: bit = x >= 0; x̂ = mean of the non-negative elements
where the bit is set, mean of the negative ones elsewhere (the reconstruction that minimises
the squared error for a given sign split)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.reductions import REDUCE_CHUNK

from .base import Compressor
from .signsgd import pack_signs, packed_len, unpack_signs


@njit(cache=True)
def onebit_means(x):
    """(mean of x_i >= 0, mean of x_i < 0), 0.0 for an empty side; float64, fixed chunks."""
    nchunk = (x.size + REDUCE_CHUNK - 1) // REDUCE_CHUNK
    sp = np.zeros(nchunk, dtype=np.float64)
    sn = np.zeros(nchunk, dtype=np.float64)
    cp = np.zeros(nchunk, dtype=np.int64)
    for c in prange(nchunk):
        lo = c * REDUCE_CHUNK
        hi = min(x.size, lo + REDUCE_CHUNK)
        a = 0.0
        b = 0.0
        k = 0
        for i in range(lo, hi):
            v = np.float64(x[i])
            if v >= 0.0:
                a += v
                k += 1
            else:
                b += v
        sp[c] = a
        sn[c] = b
        cp[c] = k
    tp = 0.0
    tn = 0.0
    npos = 0
    for c in range(nchunk):
        tp += sp[c]
        tn += sn[c]
        npos += cp[c]
    nneg = x.size - npos
    return (tp / npos if npos else 0.0), (tn / nneg if nneg else 0.0)


class OnebitCompressor(Compressor):
    """Sign bits + two float means in the ctx."""

    name = "onebit"

    def _compress(self, x, step):
        pos, neg = onebit_means(x)
        return (pack_signs(x),), {"n": int(x.size), "pos": float(pos), "neg": float(neg)}

    def _decompress(self, payload, ctx):
        return unpack_signs(payload[0], int(ctx["n"]), float(ctx["pos"]), float(ctx["neg"]))

    def payload_bytes(self, n_elements):
        """One bit per element, rounded up to whole bytes."""
        return packed_len(n_elements)
