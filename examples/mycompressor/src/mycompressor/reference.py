"""Numpy twins of the absmax8 kernels: same names, same inputs minus ``out``, new arrays."""

from __future__ import annotations

import numpy as np

LEVELS = 127


def absmax8_quantize(x: np.ndarray, inv_scale) -> np.ndarray:
    """int8 ``rint(x * inv_scale)`` clipped to [-127, 127], the product in float32."""
    v = np.rint(x.astype(np.float32) * np.float32(inv_scale))
    return np.clip(v, -LEVELS, LEVELS).astype(np.int8)


def absmax8_dequantize(q: np.ndarray, scale) -> np.ndarray:
    """float32 ``q * scale``."""
    return q.astype(np.float32) * np.float32(scale)
