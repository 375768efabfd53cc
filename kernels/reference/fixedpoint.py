"""Plain numpy twins of :mod:`testbed.kernels.fixedpoint` (same semantics, whole-array ops)."""

from __future__ import annotations

import numpy as np

INT32_MAX = 2147483647
INT32_MIN = -2147483648
EXP_MIN = -149


def chunk_exponents(x: np.ndarray, chunk: int) -> np.ndarray:
    """Smallest e with 2**e >= max|x| per chunk (EXP_MIN for all-zero chunks), int16."""
    nch = -(-x.shape[0] // chunk)
    pad = np.zeros(nch * chunk, dtype=np.float64)
    pad[: x.shape[0]] = np.abs(x.astype(np.float64))
    m = pad.reshape(nch, chunk).max(axis=1) if nch else np.zeros(0)
    mant, ex = np.frexp(m)
    e = np.where(mant == 0.5, ex - 1, ex)
    e = np.where(m == 0, EXP_MIN, np.maximum(e, EXP_MIN))
    return e.astype(np.int16)


def scales(exps: np.ndarray, n: int) -> np.ndarray:
    """Per-chunk scale floor(INT32_MAX / n) / 2**e (float64)."""
    return np.ldexp(np.float64(INT32_MAX // n), -exps.astype(np.int64))


def _per_element(values: np.ndarray, chunk: int, length: int) -> np.ndarray:
    return np.repeat(values, chunk)[:length]


def quantize(x: np.ndarray, exps: np.ndarray, n: int, chunk: int) -> np.ndarray:
    """int32 round-half-even of x * scale of its chunk."""
    f = _per_element(scales(exps, n), chunk, x.shape[0])
    return np.rint(x.astype(np.float64) * f).astype(np.int32)


def aggregate(qs: np.ndarray) -> np.ndarray:
    """int32 sum over workers (rows) with int32 wrap-around, like the switch."""
    return qs.sum(axis=0, dtype=np.int32)


def dequantize(q: np.ndarray, exps: np.ndarray, n: int, chunk: int) -> np.ndarray:
    """float32 of q / scale of its chunk."""
    f = _per_element(scales(exps, n), chunk, q.shape[0])
    return (q.astype(np.float64) * (1.0 / f)).astype(np.float32)


def atp_quantize(x: np.ndarray, factor: float) -> tuple[np.ndarray, bool]:
    """round(x * factor) saturated to int32, and whether any value did not fit."""
    r = np.rint(x.astype(np.float64) * factor)
    over = bool(((r > INT32_MAX) | (r < INT32_MIN) | np.isnan(r)).any())
    r = np.nan_to_num(np.clip(r, INT32_MIN, INT32_MAX), nan=0.0)
    return r.astype(np.int32), over


def atp_aggregate(qs: np.ndarray) -> tuple[np.ndarray, bool]:
    """Sum over workers with saturation after each addition, and the overflow flag."""
    acc = qs[0].astype(np.int64)
    over = False
    for w in range(1, qs.shape[0]):
        acc = acc + qs[w]
        over |= bool(((acc > INT32_MAX) | (acc < INT32_MIN)).any())
        acc = np.clip(acc, INT32_MIN, INT32_MAX)
    return acc.astype(np.int32), over


def atp_dequantize(q: np.ndarray, factor: float) -> np.ndarray:
    """float32 of q / factor."""
    return (q.astype(np.float64) * (1.0 / factor)).astype(np.float32)
