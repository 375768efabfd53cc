"""Deterministic reductions over float32 vectors (norms, max magnitude, finiteness).

Partial sums run over fixed chunks of :data:`REDUCE_CHUNK` elements (in parallel from
``PAR_MIN`` elements) and are added in chunk order, so a result does not depend on the number
of threads. Numpy twins: ``testbed.kernels.reference.reductions``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.parallel import kernel

#: Elements per partial sum: fixed (not per thread) so that results do not depend on the
#: number of threads.
REDUCE_CHUNK = 1 << 16


@njit(cache=True, inline="always")
def _sum_sq(x, lo, hi):
    # eight independent accumulators in a fixed order (still deterministic): breaks the add
    # latency chain without fast-math reassociation
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    body = lo + ((hi - lo) // 8) * 8
    for i in range(lo, body, 8):
        v0, v1 = np.float64(x[i]), np.float64(x[i + 1])
        v2, v3 = np.float64(x[i + 2]), np.float64(x[i + 3])
        v4, v5 = np.float64(x[i + 4]), np.float64(x[i + 5])
        v6, v7 = np.float64(x[i + 6]), np.float64(x[i + 7])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
        s4 += v4 * v4
        s5 += v5 * v5
        s6 += v6 * v6
        s7 += v7 * v7
    for i in range(body, hi):
        v = np.float64(x[i])
        s0 += v * v
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(cache=True, inline="always")
def _sum_abs(x, lo, hi):
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    body = lo + ((hi - lo) // 8) * 8
    for i in range(lo, body, 8):
        s0 += abs(np.float64(x[i]))
        s1 += abs(np.float64(x[i + 1]))
        s2 += abs(np.float64(x[i + 2]))
        s3 += abs(np.float64(x[i + 3]))
        s4 += abs(np.float64(x[i + 4]))
        s5 += abs(np.float64(x[i + 5]))
        s6 += abs(np.float64(x[i + 6]))
        s7 += abs(np.float64(x[i + 7]))
    for i in range(body, hi):
        s0 += abs(np.float64(x[i]))
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@kernel("x.size")
def _chunk_sums(x, power):
    nchunk = (x.size + REDUCE_CHUNK - 1) // REDUCE_CHUNK
    part = np.zeros(nchunk, dtype=np.float64)
    for c in prange(nchunk):
        lo = c * REDUCE_CHUNK
        hi = min(x.size, lo + REDUCE_CHUNK)
        part[c] = _sum_sq(x, lo, hi) if power == 2 else _sum_abs(x, lo, hi)
    return part


@njit(cache=True)
def l2norm(x):
    """L2 norm of a float32 vector, accumulated in float64 over fixed chunks (deterministic)."""
    part = _chunk_sums(x, 2)
    s = 0.0
    for c in range(part.size):
        s += part[c]
    return np.sqrt(s)


@njit(cache=True)
def l1norm(x):
    """L1 norm of a float32 vector, accumulated in float64 over fixed chunks (deterministic)."""
    part = _chunk_sums(x, 1)
    s = 0.0
    for c in range(part.size):
        s += part[c]
    return s


@kernel("x.size")
def absmax(x):
    """max |x_i| as float32 (0 for an empty vector); order-independent, hence exact."""
    nchunk = (x.size + REDUCE_CHUNK - 1) // REDUCE_CHUNK
    part = np.zeros(max(nchunk, 1), dtype=np.float32)
    for c in prange(nchunk):
        lo = c * REDUCE_CHUNK
        hi = min(x.size, lo + REDUCE_CHUNK)
        m = np.float32(0.0)
        for i in range(lo, hi):
            a = abs(x[i])
            if a > m:
                m = a
        part[c] = m
    return part.max()


@kernel("x.size")
def all_finite(x):
    """True when no element of the float32 vector is NaN or +-inf."""
    bad = 0
    for i in prange(x.size):
        v = x[i]
        if not (v - v == 0.0):
            bad += 1
    return bad == 0
