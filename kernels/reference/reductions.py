"""Plain numpy twins of :mod:`testbed.kernels.reductions` (float64 sums: equal to rounding)."""

from __future__ import annotations

import numpy as np


def l2norm(x) -> float:
    """||x||_2 in float64."""
    return float(np.sqrt(np.sum(np.square(x.astype(np.float64)))))


def l1norm(x) -> float:
    """||x||_1 in float64."""
    return float(np.sum(np.abs(x.astype(np.float64))))


def absmax(x) -> np.float32:
    """max |x| (0 when empty)."""
    return np.float32(np.max(np.abs(x))) if x.size else np.float32(0.0)


def all_finite(x) -> bool:
    """True when no element is NaN or +-inf."""
    return bool(np.isfinite(x).all())
