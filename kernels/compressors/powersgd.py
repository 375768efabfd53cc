"""``powersgd``: rank-r PowerSGD on the gradient reshaped to a near-square matrix.

The n elements are laid row-major in an R x C matrix M (C = ceil(sqrt(n)), R = ceil(n / C),
zero padded). One power iteration per step with a warm-started Q (kept from the previous
step; the first Q is Gaussian from ``seed``): P = M Q, P <- orthonormal columns (Gram-Schmidt),
Q = M^T P. The payload is (P, Q) and x̂ = P Q^T, an orthogonal projection of M, so
||x - x̂|| <= ||x|| always, and for a matrix of rank <= r the error vanishes as the warm start
converges. Stateful (one instance per tensor). Products accumulate in float64 over fixed row
blocks, so results do not depend on the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number

from .base import Compressor

_ROW_BLOCKS = 16


def matrix_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of the near-square matrix holding n elements."""
    if n == 0:
        return 0, 0
    c = math.isqrt(n - 1) + 1 if n > 1 else 1
    return (n + c - 1) // c, c


@njit(cache=True)
def matmul_mq(m, q, out):
    """``out = M @ Q`` (R x C times C x r), float64 accumulation, float32 out."""
    rows, cols = m.shape
    r = q.shape[1]
    for i in prange(rows):
        for c in range(r):
            s = 0.0
            for j in range(cols):
                s += np.float64(m[i, j]) * q[j, c]
            out[i, c] = s


@njit(cache=True)
def matmul_mtp(m, p, out):
    """``out = M^T @ P`` (C x R times R x r): fixed row blocks summed in order."""
    rows, cols = m.shape
    r = p.shape[1]
    nb = min(_ROW_BLOCKS, max(rows, 1))
    part = np.zeros((nb, cols, r), dtype=np.float64)
    for b in prange(nb):
        lo = (b * rows) // nb
        hi = ((b + 1) * rows) // nb
        for i in range(lo, hi):
            for c in range(r):
                pv = np.float64(p[i, c])
                for j in range(cols):
                    part[b, j, c] += np.float64(m[i, j]) * pv
    for j in range(cols):
        for c in range(r):
            s = 0.0
            for b in range(nb):
                s += part[b, j, c]
            out[j, c] = s


@njit(cache=True)
def orthonormalize(p):
    """Gram-Schmidt on the columns of float32 ``p`` in place (float64 arithmetic); a column
    that becomes (numerically) zero is set to zero."""
    rows, r = p.shape
    a = np.empty((rows, r), dtype=np.float64)
    for i in range(rows):
        for c in range(r):
            a[i, c] = p[i, c]
    for c in range(r):
        for d in range(c):
            dot = 0.0
            for i in range(rows):
                dot += a[i, c] * a[i, d]
            for i in range(rows):
                a[i, c] -= dot * a[i, d]
        nrm = 0.0
        for i in range(rows):
            nrm += a[i, c] * a[i, c]
        nrm = np.sqrt(nrm)
        inv = 1.0 / nrm if nrm > 1e-30 else 0.0
        for i in range(rows):
            a[i, c] *= inv
    for i in range(rows):
        for c in range(r):
            p[i, c] = a[i, c]


@njit(cache=True)
def lowrank_expand(p, q, n, out):
    """First n elements of ``P @ Q^T`` (row-major) into float32 ``out``."""
    rows = p.shape[0]
    cols = q.shape[0]
    r = p.shape[1]
    for i in prange(rows):
        for j in range(cols):
            k = i * cols + j
            if k < n:
                s = 0.0
                for c in range(r):
                    s += np.float64(p[i, c]) * q[j, c]
                out[k] = s


def as_matrix(x: np.ndarray) -> np.ndarray:
    """x laid out as the zero-padded near-square float32 matrix (a view when no padding)."""
    rows, cols = matrix_shape(x.size)
    if rows * cols == x.size:
        return x.reshape(rows, cols)
    m = np.zeros(rows * cols, dtype=np.float32)
    m[: x.size] = x
    return m.reshape(rows, cols)


class PowersgdCompressor(Compressor):
    """PowerSGD with ``rank`` (default 2) and ``seed`` (default 0) for the first Q."""

    name = "powersgd"
    stateful = True

    def __init__(self, rank: int = 2, seed: int = 0):
        rank = check_number("rank", 1, 1024, integer=True)(rank)
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(rank=rank, seed=seed)
        self.rank, self.seed = rank, seed
        self._q = None
        self._n = None

    def initial_q(self, n: int) -> np.ndarray:
        """The first (C x r) Q for an n-element tensor: standard normal from ``seed``."""
        _rows, cols = matrix_shape(n)
        rng = np.random.default_rng(self.seed)
        return rng.standard_normal((cols, self.rank)).astype(np.float32)

    def _compress(self, x, step):
        n = x.size
        if self._n is not None and self._n != n:
            raise ValueError(f"x has {n} elements but this powersgd instance is warm-started for "
                             f"{self._n}; use one compressor per tensor (or reset())")
        if self._q is None:
            self._q = self.initial_q(n)
            self._n = n
        m = as_matrix(x)
        rows, cols = m.shape
        r = self.rank
        p = np.empty((rows, r), dtype=np.float32)
        matmul_mq(m, self._q, p)
        orthonormalize(p)
        q = np.empty((cols, r), dtype=np.float32)
        matmul_mtp(m, p, q)
        self._q = q.copy()  # warm start of the next step
        return (p, q), {"n": int(n)}

    def _decompress(self, payload, ctx):
        p = np.ascontiguousarray(payload[0], dtype=np.float32)
        q = np.ascontiguousarray(payload[1], dtype=np.float32)
        n = int(ctx["n"])
        rows, cols = matrix_shape(n)
        if p.shape != (rows, self.rank) or q.shape != (cols, self.rank):
            raise ValueError(f"payload shapes {p.shape}, {q.shape} do not fit n={n}, "
                             f"rank={self.rank}")
        out = np.empty(n, dtype=np.float32)
        lowrank_expand(p, q, n, out)
        return out

    def payload_bytes(self, n_elements):
        """(R + C) * rank float32 values."""
        rows, cols = matrix_shape(int(n_elements))
        return 4 * (rows + cols) * self.rank

    def reset(self) -> None:
        """Forget the warm-start Q."""
        self._q = None
        self._n = None
