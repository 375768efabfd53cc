"""``randomk``: k = max(1, int(ratio * n)) elements at indices every worker derives from the
shared ``(seed, step)``, so only the k values travel and payloads are summable.

Index choice is *stratified*: [0, n) is cut into k consecutive strata of widths
floor(n/k) or ceil(n/k) and one uniform index is drawn in each (a hash of (stratum, key)).
The k indices are distinct and ascending by construction and each element is chosen with
probability 1/width ~ k/n; unlike GRACE's randperm it never picks two neighbours' worth from
one stratum. With ``unbiased=True`` each value is multiplied by its stratum width, which
makes decompress(compress(x)) an unbiased estimate of x (up to the 2^-32 granularity of the
index draw).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.kernels.checks import check_number
from testbed.kernels.rng import hash_u32, stream_key

from .base import Compressor, count_for_ratio
from .topk import scatter

_SALT = 0x52414E44  # "RAND"


@njit(cache=True, inline="always")
def _next_width(acc, q, r, k):
    """Stratum j spans ``[j*n // k, (j+1)*n // k)``: with ``n = q*k + r`` and ``acc = (j*r)
    mod k`` its width is q, plus 1 when ``acc + r`` reaches k. Returns ``(acc', width)``
    (exact, no division per stratum)."""
    acc += r
    if acc >= k:
        return acc - k, q + 1
    return acc, q


@njit(cache=True)
def randomk_indices(n, k, key, out):
    """k stratified random indices of [0, n) for stream ``key`` into int32 ``out`` (ascending)."""
    q = n // max(k, 1)
    lo = acc = 0
    for j in range(k):
        acc, w = _next_width(acc, q, n - q * k, k)
        out[j] = lo + ((np.int64(hash_u32(j, key)) * w) >> 32)
        lo += w


#: Indices computed ahead of each batch of gathers in :func:`randomk_gather`.
GATHER_BATCH = 256


@njit(cache=True)
def randomk_gather(x, k, key, scaled, out):
    """Values of x at :func:`randomk_indices` (times the stratum width when ``scaled``).

    In two phases per batch of :data:`GATHER_BATCH`: the indices (hashing, no memory
    access), then the loads alone, so that the out-of-order window holds many independent
    cache misses at once instead of a few between the hashing instructions."""
    q = x.size // max(k, 1)
    r = x.size - q * k
    lo = acc = 0
    idx = np.empty(GATHER_BATCH, dtype=np.int64)
    wid = np.empty(GATHER_BATCH, dtype=np.float32)
    for j0 in range(0, k, GATHER_BATCH):
        m = min(GATHER_BATCH, k - j0)
        for t in range(m):
            acc, w = _next_width(acc, q, r, k)
            idx[t] = lo + ((np.int64(hash_u32(j0 + t, key)) * w) >> 32)
            wid[t] = w
            lo += w
        if scaled:
            for t in range(m):
                out[j0 + t] = x[idx[t]] * wid[t]
        else:
            for t in range(m):
                out[j0 + t] = x[idx[t]]


class RandomkCompressor(Compressor):
    """Shared-seed random-k (parameters ``ratio`` = 0.01, ``seed`` = 0, ``unbiased`` = False).

    Every worker must use the same ``seed`` and ``step``; the receiver re-derives the indices.
    """

    name = "randomk"
    summable = True

    def __init__(self, ratio: float = 0.01, seed: int = 0, unbiased: bool = False):
        ratio = check_number("ratio", 0.0, 1.0, lo_open=True)(ratio)
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        if not isinstance(unbiased, (bool, np.bool_)):
            raise ValueError(f"unbiased: must be True or False, got {unbiased!r}")
        super().__init__(ratio=ratio, seed=seed, unbiased=bool(unbiased))
        self.ratio, self.seed, self.unbiased = ratio, seed, bool(unbiased)

    def indices(self, n: int, step: int = 0) -> np.ndarray:
        """The int32 indices every worker uses for an n-element tensor at ``step``."""
        k = count_for_ratio(int(n), self.ratio)
        out = np.empty(k, dtype=np.int32)
        randomk_indices(int(n), k, stream_key(self.seed, step, _SALT), out)
        return out

    def _compress(self, x, step):
        k = count_for_ratio(x.size, self.ratio)
        vals = np.empty(k, dtype=np.float32)
        randomk_gather(x, k, stream_key(self.seed, step, _SALT), self.unbiased, vals)
        return (vals,), {"n": int(x.size), "step": step}

    def _decompress(self, payload, ctx):
        n, step = int(ctx["n"]), int(ctx["step"])
        idx = self.indices(n, step)
        vals = np.ascontiguousarray(payload[0], dtype=np.float32)
        if vals.size != idx.size:
            raise ValueError(f"payload has {vals.size} values, expected {idx.size} for n={n}")
        out = np.zeros(n, dtype=np.float32)
        scatter(vals, idx, out)
        return out

    def _aggregate(self, payloads):
        acc = np.zeros(payloads[0][0].size, dtype=np.float32)
        for p in payloads:
            acc += p[0]
        return (acc,)

    def payload_bytes(self, n_elements):
        """k float32 values (indices are not sent)."""
        return 4 * count_for_ratio(int(n_elements), self.ratio)
