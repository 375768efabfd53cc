"""Parallel selection kernels shared by topk, threshold and dgc.

Selection runs in two passes over fixed chunks: count matches per chunk, prefix-sum, then
write each chunk's matches at its offset. Indices come out in ascending order, independent of
the number of threads.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from testbed.kernels.parallel import kernel
from testbed.kernels.simd import mask64, splat, vector_of

#: Elements per selection chunk (a multiple of 64: chunks start on a mask word).
SELECT_CHUNK = 1 << 15


@intrinsic
def ge_mask64(typingctx, x, base, t):
    """uint64 whose bit j is ``|x[base + j]| >= t`` (C-contiguous float32 ``x``, float32 ``t``):
    eight 8-lane compares of the sign-cleared floats (vcmpps + vmovmskps on AVX2, a mask
    register on AVX-512)."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"
            and isinstance(base, types.Integer) and t == types.float32):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        vty = vector_of(ir.FloatType(), 8)
        ity = vector_of(ir.IntType(32), 8)
        tv = splat(builder, args[2], 8)

        def compare8(k):
            ptr = builder.gep(ary.data, [builder.add(args[1], ir.Constant(args[1].type, 8 * k))])
            v = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=4)
            a = builder.bitcast(builder.and_(builder.bitcast(v, ity),
                                             ir.Constant(ity, [0x7FFFFFFF] * 8)), vty)
            return builder.fcmp_ordered(">=", a, tv)

        return mask64(builder, compare8)

    return types.uint64(x, base, t), codegen


@intrinsic
def popcount64(typingctx, v):
    """Number of set bits of a uint64."""
    if v != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])

    return types.int64(v), codegen


@intrinsic
def ctz64(typingctx, v):
    """Index of the lowest set bit of a non-zero uint64."""
    if v != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.int64(v), codegen


@kernel("x.size")
def _count_ge(x, t, counts):
    nchunk = counts.size
    for c in prange(nchunk):
        lo = c * SELECT_CHUNK  # a multiple of 64
        hi = min(x.size, lo + SELECT_CHUNK)
        body = lo + ((hi - lo) // 64) * 64
        k = 0
        for i in range(lo, body, 64):
            k += popcount64(ge_mask64(x, i, t))
        for i in range(body, hi):
            k += abs(x[i]) >= t
        counts[c] = k


@kernel("x.size")
def _write_ge(x, t, offsets, out):
    nchunk = offsets.size - 1
    for c in prange(nchunk):
        lo = c * SELECT_CHUNK
        hi = min(x.size, lo + SELECT_CHUNK)
        body = lo + ((hi - lo) // 64) * 64
        o = offsets[c]
        for i in range(lo, body, 64):
            m = ge_mask64(x, i, t)
            while m != np.uint64(0):  # visit only the set bits
                out[o] = i + ctz64(m)
                o += 1
                m &= m - np.uint64(1)
        for i in range(body, hi):
            if abs(x[i]) >= t:
                out[o] = i
                o += 1


@njit(cache=True)
def select_ge(x, t):
    """Indices (int32, ascending) of the elements with ``|x_i| >= t``."""
    x = np.ascontiguousarray(x)
    t = np.float32(t)
    nchunk = (x.size + SELECT_CHUNK - 1) // SELECT_CHUNK
    counts = np.zeros(nchunk, dtype=np.int64)
    _count_ge(x, t, counts)
    offsets = np.zeros(nchunk + 1, dtype=np.int64)
    for c in range(nchunk):
        offsets[c + 1] = offsets[c] + counts[c]
    out = np.empty(offsets[nchunk], dtype=np.int32)
    _write_ge(x, t, offsets, out)
    return out


@njit(cache=True)
def count_ge(x, t):
    """Number of elements with ``|x_i| >= t``."""
    x = np.ascontiguousarray(x)
    t = np.float32(t)
    nchunk = (x.size + SELECT_CHUNK - 1) // SELECT_CHUNK
    counts = np.zeros(nchunk, dtype=np.int64)
    _count_ge(x, t, counts)
    return counts.sum()


@njit(cache=True)
def kth_smallest(a, j):
    """The ``j``-th smallest (0-based) element of ``a``; permutes ``a`` in place.

    Quickselect with a median-of-three pivot and a three-way partition (many equal values,
    e.g. zeros, cost one pass).
    """
    lo = 0
    hi = a.size - 1
    while lo < hi:
        x = a[lo]
        y = a[(lo + hi) >> 1]
        z = a[hi]
        p = max(min(x, y), min(max(x, y), z))
        lt = lo
        gt = hi
        i = lo
        while i <= gt:
            v = a[i]
            if v < p:
                a[i] = a[lt]
                a[lt] = v
                lt += 1
                i += 1
            elif v > p:
                a[i] = a[gt]
                a[gt] = v
                gt -= 1
            else:
                i += 1
        if j < lt:
            hi = lt - 1
        elif j > gt:
            lo = gt + 1
        else:
            return p
    return a[j]


@njit(cache=True)
def topk_among(x, cand, k, out):
    """Exact top-``k`` by ``|x|`` among candidate indices ``cand`` (ascending).

    Ties at the k-th magnitude go to the lowest indices. Writes ``k`` ascending indices to
    ``out``. Requires ``0 < k <= cand.size``.
    """
    m = cand.size
    mag = np.empty(m, dtype=np.float32)
    for j in range(m):
        mag[j] = abs(x[cand[j]])
    # the k-th largest magnitude, exactly (quickselect)
    v = kth_smallest(mag.copy(), m - k)
    above = 0
    for j in range(m):
        above += mag[j] > v
    ties = k - above
    o = 0
    for j in range(m):
        a = mag[j]
        if a > v:
            out[o] = cand[j]
            o += 1
        elif a == v and ties > 0:
            out[o] = cand[j]
            o += 1
            ties -= 1


@njit(cache=True)
def topk_select(x, k, out):
    """Exact top-``k`` indices of float32 ``x`` by magnitude into ``out`` (int32, ascending).

    Ties at the k-th magnitude are broken towards the lowest index (same as a stable sort of
    ``-|x|``). A strided sample gives a threshold just below the k-th magnitude; one parallel
    pass collects the few candidates above it and quickselect finishes exactly on them. If the
    sample misjudges (adversarial layouts), the threshold is lowered until at least ``k``
    elements qualify, so the result is always exact.
    """
    n = x.size
    if k <= 0:
        return
    if k >= n:
        for i in range(n):
            out[i] = i
        return
    m = min(n, 16384)
    samp = np.empty(m, dtype=np.float32)
    for j in range(m):
        samp[j] = abs(x[(j * n) // m])
    # aim for about 1.3 k + slack candidates: rank in the sample from the top
    r = min(m, int(1.3 * k * m / n) + 32)
    while True:
        t = kth_smallest(samp, m - r)
        if r >= m:
            t = np.float32(0.0)
        cand = select_ge(x, t)
        if cand.size >= k:
            break
        r = min(m, r * 4)
    topk_among(x, cand, k, out)
