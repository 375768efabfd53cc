"""Plain numpy twins of the error-feedback kernels in :mod:`testbed.kernels.memory`."""

from __future__ import annotations

import numpy as np


def ef_compensate(x, residual, beta, gamma) -> np.ndarray:
    """beta * residual + gamma * x (float32)."""
    return np.float32(beta) * residual + np.float32(gamma) * x


def ef_update(xc, decompressed) -> np.ndarray:
    """xc - decompressed (float32)."""
    return xc - decompressed
