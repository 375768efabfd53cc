"""Deterministic reductions over float32 vectors (norms, max magnitude, finiteness).

Partial sums run over fixed chunks of :data:`REDUCE_CHUNK` elements (in parallel from
``PAR_MIN`` elements) and are added in chunk order, so a result does not depend on the number
of threads. Numpy twins: ``testbed.kernels.reference.reductions``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.parallel import kernel
from testbed.kernels.simd import (
    LANES,
    sum_abs_blocks,
    sum_abs_blocks4,
    sum_squares_blocks,
    sum_squares_blocks4,
)

#: Elements per partial sum: fixed (not per thread) so that results do not depend on the
#: number of threads.
REDUCE_CHUNK = 1 << 16


@njit(cache=True, inline="always")
def _chunk_sum(x, lo, hi, power):
    """``sum(|x_i| ** power)`` (power 1 or 2) over ``x[lo:hi]`` in float64: LANES-wide blocks
    summed lane-wise (16 independent accumulators, a fixed order), then the tail in order."""
    nb = (hi - lo) // LANES
    s = sum_squares_blocks(x, lo, nb) if power == 2 else sum_abs_blocks(x, lo, nb)
    for i in range(lo + nb * LANES, hi):
        v = np.float64(x[i])
        s += v * v if power == 2 else abs(v)
    return s


@kernel("x.size")
def _chunk_sums(x, power):
    """Per-chunk sums. Whole chunks are summed four at a time, read together (four read
    streams: a core reads faster than with one), each sum bit-identical to its chunk alone;
    the rest one by one."""
    nchunk = (x.size + REDUCE_CHUNK - 1) // REDUCE_CHUNK
    part = np.zeros(nchunk, dtype=np.float64)
    ngroup = (x.size // REDUCE_CHUNK) // 4 if x.strides[0] == 4 else 0
    nb = REDUCE_CHUNK // LANES
    for g in prange(ngroup + nchunk - 4 * ngroup):  # one parallel region for both kinds
        if g < ngroup:
            lo = 4 * g * REDUCE_CHUNK
            if power == 2:
                s = sum_squares_blocks4(x, lo, REDUCE_CHUNK, nb)
            else:
                s = sum_abs_blocks4(x, lo, REDUCE_CHUNK, nb)
            for k in range(4):
                part[4 * g + k] = s[k]
        else:
            c = 3 * ngroup + g
            lo = c * REDUCE_CHUNK
            part[c] = _chunk_sum(x, lo, min(x.size, lo + REDUCE_CHUNK), power)
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
