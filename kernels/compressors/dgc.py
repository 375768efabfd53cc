"""``dgc``: Deep Gradient Compression style sparsification.

A threshold is estimated from a random sample (``sample_ratio`` of the elements, at least
1024, drawn from the ``(seed, step)`` stream): the magnitude ranked ``ratio`` from the top of the sample.
Elements at or above it are selected; if more than k = max(1, int(ratio * n)) qualify, the
exact top-k of them is kept, so at most k are sent. Optional momentum correction (``momentum``
> 0): the compressor keeps u = momentum * u + x, compresses u and clears u where it sent
(DGC's momentum factor masking); pair it with ResidualMemory for DGC's local accumulation.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number
from testbed.kernels.rng import hash_u32, stream_key

from ._select import kth_smallest, select_ge, topk_among
from .base import Compressor, count_for_ratio
from .topk import gather, sparse_decompress

_SALT = 0x44474353  # "DGCS"


@njit(cache=True)
def dgc_sample(x, m, key, out):
    """``m`` magnitudes of x at uniform random positions (with replacement) of stream key."""
    n = x.size
    for j in prange(m):
        out[j] = abs(x[(np.int64(hash_u32(j, key)) * n) >> 32])


@njit(cache=True)
def dgc_select(x, k, m, key):
    """Indices (ascending, at most k) DGC sends for x with a sample of m elements."""
    samp = np.empty(m, dtype=np.float32)
    dgc_sample(x, m, key, samp)
    r = max(1, min(m, int(m * k / x.size)))
    t = kth_smallest(samp, m - r)
    cand = select_ge(x, t)
    if cand.size > k:
        out = np.empty(k, dtype=np.int32)
        topk_among(x, cand, k, out)
        return out
    return cand


@njit(cache=True)
def momentum_accumulate(u, x, momentum):
    """``u = momentum * u + x`` in place (float32)."""
    mo = np.float32(momentum)
    for i in prange(x.size):
        u[i] = mo * u[i] + x[i]


class DgcCompressor(Compressor):
    """DGC (parameters ``ratio`` = 0.3 as in GRACE, ``sample_ratio`` = 0.01, ``momentum`` = 0.0,
    ``seed`` = 0). Stateful when momentum > 0 (one instance per tensor)."""

    name = "dgc"

    def __init__(self, ratio: float = 0.3, sample_ratio: float = 0.01, momentum: float = 0.0,
                 seed: int = 0):
        ratio = check_number("ratio", 0.0, 1.0, lo_open=True)(ratio)
        sample_ratio = check_number("sample_ratio", 0.0, 1.0, lo_open=True)(sample_ratio)
        momentum = check_number("momentum", 0.0, 1.0)(momentum)
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(ratio=ratio, sample_ratio=sample_ratio, momentum=momentum, seed=seed)
        self.ratio, self.sample_ratio, self.momentum, self.seed = ratio, sample_ratio, momentum, seed
        self.stateful = momentum > 0
        self._u = None

    def _compress(self, x, step):
        n = x.size
        if self.momentum > 0:
            if self._u is None or self._u.size != n:
                if self._u is not None:
                    raise ValueError(f"x has {n} elements but this dgc instance holds momentum "
                                     f"for {self._u.size}; use one compressor per tensor")
                self._u = np.zeros(n, dtype=np.float32)
            momentum_accumulate(self._u, x, self.momentum)
            x = self._u
        k = count_for_ratio(n, self.ratio)
        if n == 0:
            idx = np.empty(0, dtype=np.int32)
        else:
            # at least 1024 samples (or all): tiny samples make the threshold erratic
            m = min(n, max(1024, int(n * self.sample_ratio)))
            idx = dgc_select(x, k, m, stream_key(self.seed, step, _SALT))
        vals = np.empty(idx.size, dtype=np.float32)
        gather(x, idx, vals)
        if self.momentum > 0:
            self._u[idx] = 0.0
        return (vals, idx), {"n": int(n)}

    def _decompress(self, payload, ctx):
        return sparse_decompress(payload, ctx)

    def payload_bytes(self, n_elements):
        """Upper bound: k values + k indices."""
        return 8 * count_for_ratio(int(n_elements), self.ratio)

    def reset(self) -> None:
        """Forget the momentum."""
        self._u = None
