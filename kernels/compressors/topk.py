"""``topk``: the k = max(1, int(ratio * n)) largest-magnitude elements (values + indices).

Exact: ties at the k-th magnitude go to the lowest indices; indices are sent ascending.
Not summable (workers pick different indices: gather, then decompress each).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number

from ._select import topk_select
from .base import Compressor, count_for_ratio

__all__ = ["TopkCompressor", "topk_select", "gather", "scatter"]


@njit(cache=True)
def gather(x, idx, out):
    """``out[j] = x[idx[j]]``."""
    for j in prange(idx.size):
        out[j] = x[idx[j]]


@njit(cache=True)
def scatter(vals, idx, out):
    """``out[idx[j]] = vals[j]`` (indices distinct); ``out`` must be zeroed by the caller."""
    for j in prange(idx.size):
        out[idx[j]] = vals[j]


def sparse_decompress(payload, ctx):
    """float32 vector of length ctx['n'] with payload (values, indices) scattered in."""
    vals = np.ascontiguousarray(payload[0], dtype=np.float32)
    idx = np.ascontiguousarray(payload[1], dtype=np.int32)
    n = int(ctx["n"])
    if vals.size != idx.size or (idx.size and (idx.min() < 0 or idx.max() >= n)):
        raise ValueError(f"payload values/indices do not fit a vector of {n} elements")
    out = np.zeros(n, dtype=np.float32)
    scatter(vals, idx, out)
    return out


class TopkCompressor(Compressor):
    """Exact top-k by magnitude (parameter ``ratio``, default 0.01)."""

    name = "topk"

    def __init__(self, ratio: float = 0.01):
        ratio = check_number("ratio", 0.0, 1.0, lo_open=True)(ratio)
        super().__init__(ratio=ratio)
        self.ratio = ratio

    def _compress(self, x, step):
        k = count_for_ratio(x.size, self.ratio)
        idx = np.empty(k, dtype=np.int32)
        topk_select(x, k, idx)
        vals = np.empty(k, dtype=np.float32)
        gather(x, idx, vals)
        return (vals, idx), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        return sparse_decompress(payload, ctx)

    def payload_bytes(self, n_elements):
        """k float32 values + k int32 indices."""
        return 8 * count_for_ratio(int(n_elements), self.ratio)
