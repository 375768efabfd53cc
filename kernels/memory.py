"""Error feedback (GRACE's Memory abstraction), separate from and composable with any compressor.

``ResidualMemory``: ``compensate(x) = beta * residual + gamma * x`` (GRACE defaults beta =
gamma = 1: plain x + residual) and ``update(x_compensated, decompressed)`` stores
``residual = x_compensated - decompressed``, i.e. what compression lost this step is added
back next step. ``NoMemory`` does nothing (no error feedback). ``compress_with_feedback``
runs the three steps. Keep one memory per tensor. Kernels are ``@njit(cache=True)`` with
numpy twins in ``testbed.kernels.reference.memory``.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from testbed.kernels.checks import check_number, check_vector
from testbed.kernels.parallel import kernel

__all__ = ["NoMemory", "ResidualMemory", "compress_with_feedback", "ef_compensate", "ef_update"]


@kernel("x.size")
def ef_compensate(x, residual, beta, gamma, out):
    """``out = beta * residual + gamma * x`` (float32)."""
    b = np.float32(beta)
    g = np.float32(gamma)
    for i in prange(x.size):
        out[i] = b * residual[i] + g * x[i]


@kernel("xc.size")
def ef_update(xc, decompressed, residual):
    """``residual = xc - decompressed`` in place (float32)."""
    for i in prange(xc.size):
        residual[i] = xc[i] - decompressed[i]


class ResidualMemory:
    """Residual error feedback for one tensor (parameters ``beta`` = 1.0, ``gamma`` = 1.0)."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        self.beta = check_number("beta", 0.0, 1e6)(beta)
        self.gamma = check_number("gamma", 0.0, 1e6)(gamma)
        self.residual: np.ndarray | None = None

    def compensate(self, x: np.ndarray) -> np.ndarray:
        """``beta * residual + gamma * x`` as a new float32 array (residual starts at zero)."""
        x = check_vector(x)
        if self.residual is None:
            self.residual = np.zeros(x.size, dtype=np.float32)
        elif self.residual.size != x.size:
            raise ValueError(f"x has {x.size} elements but this memory holds a residual of "
                             f"{self.residual.size}; use one memory per tensor (or reset())")
        out = np.empty_like(x)
        ef_compensate(x, self.residual, self.beta, self.gamma, out)
        return out

    def update(self, x_compensated: np.ndarray, decompressed: np.ndarray) -> None:
        """Store ``residual = x_compensated - decompressed``."""
        xc = check_vector(x_compensated, "x_compensated")
        dec = check_vector(decompressed, "decompressed")
        if xc.size != dec.size:
            raise ValueError(f"decompressed has {dec.size} elements, x_compensated {xc.size}; "
                             "pass the decompressed form of this tensor")
        if self.residual is None or self.residual.size != xc.size:
            self.residual = np.zeros(xc.size, dtype=np.float32)
        ef_update(xc, dec, self.residual)

    def reset(self) -> None:
        """Drop the residual."""
        self.residual = None


class NoMemory:
    """No error feedback: compensate returns x, update does nothing."""

    residual = None

    def compensate(self, x: np.ndarray) -> np.ndarray:
        """x itself (checked)."""
        return check_vector(x)

    def update(self, x_compensated: np.ndarray, decompressed: np.ndarray) -> None:
        """Nothing to remember."""

    def reset(self) -> None:
        """Nothing to forget."""


def compress_with_feedback(compressor, memory, x: np.ndarray, step: int = 0):
    """Compensate x with ``memory``, compress it, and update the memory with what was lost.

    Returns ``(payload, ctx)`` like ``compressor.compress``. The sender decompresses its own
    payload once to learn the residual (GRACE does the same).
    """
    xc = memory.compensate(x)
    payload, ctx = compressor.compress(xc, step)
    if not isinstance(memory, NoMemory):
        memory.update(xc, compressor.decompress(payload, ctx))
    return payload, ctx
