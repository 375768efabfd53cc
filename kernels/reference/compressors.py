"""Plain numpy twins of the compressor kernels (``testbed.kernels.compressors.*``).

Each function mirrors the Numba kernel of the same name but returns a new array instead of
filling ``out``. Elementwise and integer kernels (including the stochastic ones, which draw
from the counter-based hash of ``testbed.kernels.rng``) are bit-exact twins; float
reductions (means, matrix products) agree to rounding.
"""

from __future__ import annotations

import numpy as np

from testbed.kernels.reference.rng import draw16, hash_u32, uniform

# ----------------------------------------------------------------------------- fp16 / bf16


def fp16_encode(x) -> np.ndarray:
    """numpy's own float32 -> float16 cast (round to nearest even), as uint16 bits."""
    return x.astype(np.float16).view(np.uint16)


def fp16_decode(h) -> np.ndarray:
    """numpy's float16 -> float32 cast of uint16 bits."""
    return h.view(np.float16).astype(np.float32)


def bf16_encode(x) -> np.ndarray:
    """bfloat16 bits, round to nearest even, NaN -> quiet NaN."""
    f = x.view(np.uint32).astype(np.uint64)
    r = ((f + np.uint64(0x7FFF) + ((f >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))
    nan = (f & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    r = np.where(nan, ((f >> np.uint64(16)) & np.uint64(0x8000)) | np.uint64(0x7FC0), r)
    return (r & np.uint64(0xFFFF)).astype(np.uint16)


def bf16_decode(h) -> np.ndarray:
    """float32 from bfloat16 bits."""
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ----------------------------------------------------------------------------- sparsifiers


def topk_select(x, k) -> np.ndarray:
    """Exact top-k indices by |x|, ties to the lowest index, ascending (stable argsort)."""
    if k <= 0:
        return np.empty(0, dtype=np.int32)
    order = np.argsort(-np.abs(x), kind="stable")[:k]
    return np.sort(order).astype(np.int32)


def topk_argpartition(x, k) -> np.ndarray:
    """Top-k indices via np.argpartition (the benchmark anchor; tie order unspecified)."""
    return np.argpartition(np.abs(x), x.size - k)[x.size - k:]


def select_ge(x, t) -> np.ndarray:
    """Ascending indices with |x| >= t."""
    return np.flatnonzero(np.abs(x) >= np.float32(t)).astype(np.int32)


def randomk_indices(n, k, key) -> np.ndarray:
    """Stratified shared-seed indices (twin of randomk.randomk_indices)."""
    j = np.arange(k, dtype=np.int64)
    lo = (j * n) // k
    w = ((j + 1) * n) // k - lo
    return (lo + ((hash_u32(j, key).astype(np.int64) * w) >> 32)).astype(np.int32)


def randomk_gather(x, k, key, scaled) -> np.ndarray:
    """Values at randomk_indices, times the stratum width when scaled."""
    n = x.size
    j = np.arange(k, dtype=np.int64)
    lo = (j * n) // k
    w = ((j + 1) * n) // k - lo
    v = x[lo + ((hash_u32(j, key).astype(np.int64) * w) >> 32)]
    return v * w.astype(np.float32) if scaled else v.copy()


def dgc_sample(x, m, key) -> np.ndarray:
    """|x| at m hashed positions."""
    pos = (hash_u32(np.arange(m), key).astype(np.int64) * x.size) >> 32
    return np.abs(x[pos])


def dgc_select(x, k, m, key) -> np.ndarray:
    """Twin of dgc.dgc_select."""
    samp = dgc_sample(x, m, key)
    r = max(1, min(m, int(m * k / x.size)))
    t = np.sort(samp)[m - r]
    cand = select_ge(x, t)
    if cand.size > k:
        sub = topk_select(x[cand], k)
        return cand[sub]
    return cand


def momentum_accumulate(u, x, momentum) -> np.ndarray:
    """momentum * u + x (float32)."""
    return np.float32(momentum) * u + x


# ----------------------------------------------------------------------------- quantisers


def qsgd_quantize(x, levels, norm, key, dtype) -> np.ndarray:
    """Twin of qsgd.qsgd_quantize: the signed fixed-point level (16 fraction bits, round half
    to even) plus the 16-bit draw, shifted down (float32 arithmetic unless levels * 2**16 /
    norm would overflow it)."""
    s64 = levels / norm if norm > 0.0 else 0.0
    d = draw16(np.arange(x.size), key)
    if s64 <= 1e33:
        s16, top16 = np.float32(s64 * 65536.0), np.float32(levels * 65536.0)
        a = x * s16
    else:
        s16, top16 = s64 * 65536.0, levels * 65536.0
        a = x.astype(np.float64) * s16
    a = np.where(a < top16, a, top16)
    a = np.where(a > -top16, a, -top16)
    return ((np.rint(a).astype(np.int64) + d) >> 16).astype(dtype)


def qsgd_dequantize(q, norm, levels) -> np.ndarray:
    """q * norm / levels as float32."""
    return (q.astype(np.float64) * (norm / levels)).astype(np.float32)


def terngrad_quantize(x, scale, key) -> np.ndarray:
    """Twin of terngrad.terngrad_quantize."""
    inv = 1.0 / scale if scale > 0.0 else 0.0
    v = x.astype(np.float64)
    b = (uniform(np.arange(x.size), key) < np.abs(v) * inv).astype(np.int8)
    return np.where(v < 0.0, -b, b).astype(np.int8)


def terngrad_dequantize(q, scale) -> np.ndarray:
    """q * scale as float32."""
    return q.astype(np.float32) * np.float32(scale)


def natural_encode(x, key) -> np.ndarray:
    """Twin of natural.natural_encode (integer-only)."""
    f = x.view(np.uint32).astype(np.int64)
    s = (f >> 31) & 1
    e = (f >> 23) & 0xFF
    m = f & 0x7FFFFF
    up = ((hash_u32(np.arange(x.size), key) >> np.uint64(9)).astype(np.int64) < m).astype(np.int64)
    e2 = np.minimum(e + up, 254)
    return ((s << 15) | (e2 << 7)).astype(np.uint16)


def natural_decode(code) -> np.ndarray:
    """float32 from natural codes."""
    return (code.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ----------------------------------------------------------------------------- signs


def sign_pack(x) -> np.ndarray:
    """Bits of x >= 0, little bit order."""
    return np.packbits(x >= 0, bitorder="little")


def sign_unpack(bits, pos, neg, n) -> np.ndarray:
    """pos where the bit is set, neg elsewhere (float32, n elements)."""
    b = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
    return np.where(b, np.float32(pos), np.float32(neg)).astype(np.float32)


def onebit_means(x) -> tuple[float, float]:
    """(mean of x >= 0, mean of x < 0), 0.0 when a side is empty."""
    v = x.astype(np.float64)
    pos = v[v >= 0]
    neg = v[v < 0]
    return (float(pos.mean()) if pos.size else 0.0, float(neg.mean()) if neg.size else 0.0)


def signum_momentum(m, x, beta) -> np.ndarray:
    """beta * m + (1 - beta) * x (float32)."""
    return np.float32(beta) * m + np.float32(1.0 - beta) * x


# ----------------------------------------------------------------------------- powersgd


def matmul_mq(m, q) -> np.ndarray:
    """M @ Q in float64, float32 out."""
    return (m.astype(np.float64) @ q.astype(np.float64)).astype(np.float32)


def matmul_mtp(m, p) -> np.ndarray:
    """M^T @ P in float64, float32 out."""
    return (m.astype(np.float64).T @ p.astype(np.float64)).astype(np.float32)


def orthonormalize(p) -> np.ndarray:
    """Gram-Schmidt on the columns (float64), zero columns stay zero; float32 out."""
    a = p.astype(np.float64)
    for c in range(a.shape[1]):
        for d in range(c):
            a[:, c] -= np.dot(a[:, c], a[:, d]) * a[:, d]
        nrm = np.sqrt(np.dot(a[:, c], a[:, c]))
        a[:, c] *= 1.0 / nrm if nrm > 1e-30 else 0.0
    return a.astype(np.float32)


def lowrank_expand(p, q, n) -> np.ndarray:
    """First n elements of P @ Q^T (row-major), float32."""
    return (p.astype(np.float64) @ q.astype(np.float64).T).ravel()[:n].astype(np.float32)


# ----------------------------------------------------------------------------- thc


def fwht(a) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform along the last axis (power-of-two length)."""
    a = np.array(a, copy=True)
    lead = a.shape[:-1]
    n = a.shape[-1]
    h = 1
    while h < n:
        v = a.reshape(*lead, n // (2 * h), 2, h)
        u, w = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :] = u + w
        v[..., 1, :] = u - w
        h *= 2
    return a


def rht_forward(x, block, key, d) -> np.ndarray:
    """Blockwise H D x / sqrt(block) over x zero-padded to d (float32)."""
    v = np.zeros(d, dtype=np.float32)
    v[: x.size] = x
    neg = (hash_u32(np.arange(d), key) & np.uint64(1)).astype(bool)
    v = np.where(neg, -v, v)
    y = fwht(v.reshape(-1, block))
    return (y * np.float32(1.0 / np.sqrt(block))).ravel()


def rht_inverse(y, block, key, n) -> np.ndarray:
    """D H y / sqrt(block), first n elements."""
    z = (fwht(y.reshape(-1, block)) * np.float32(1.0 / np.sqrt(block))).ravel()[:n]
    neg = (hash_u32(np.arange(n), key) & np.uint64(1)).astype(bool)
    return np.where(neg, -z, z)


def thc_quantize(y, scale, half, key) -> tuple[np.ndarray, int]:
    """(int8 levels, clipped count): twin of thc.thc_quantize."""
    f = half / scale if scale > 0.0 else 0.0
    a = y.astype(np.float64) * f
    clipped = int(np.count_nonzero(np.abs(a) > half))
    a = np.clip(a, -float(half), float(half))
    lv = np.floor(a)
    return (lv + (uniform(np.arange(y.size), key) < a - lv)).astype(np.int8), clipped


def thc_dequantize(q, scale, half) -> np.ndarray:
    """q * scale / half as float32."""
    return (q.astype(np.float64) * (scale / half)).astype(np.float32)


def thc_sum(stack) -> np.ndarray:
    """int32 sum over workers (axis 0)."""
    return stack.astype(np.int32).sum(axis=0, dtype=np.int32)
