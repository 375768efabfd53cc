"""``signum``: sign of the momentum m = beta * m + (1 - beta) * x (stateful, beta = 0.9)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number

from .base import Compressor
from .signsgd import pack_signs, packed_len, unpack_signs


@njit(cache=True)
def signum_momentum(m, x, beta):
    """``m = beta * m + (1 - beta) * x`` in place (float32)."""
    b = np.float32(beta)
    c = np.float32(1.0 - beta)
    for i in prange(x.size):
        m[i] = b * m[i] + c * x[i]


class SignumCompressor(Compressor):
    """Signum with ``momentum`` (default 0.9). Keeps the momentum: one instance per tensor."""

    name = "signum"
    stateful = True

    def __init__(self, momentum: float = 0.9):
        momentum = check_number("momentum", 0.0, 1.0)(momentum)
        super().__init__(momentum=momentum)
        self.momentum = momentum
        self._m = None

    def _compress(self, x, step):
        if self._m is None:
            self._m = np.zeros(x.size, dtype=np.float32)
        elif self._m.size != x.size:
            raise ValueError(f"x has {x.size} elements but this signum instance holds momentum "
                             f"for {self._m.size}; use one compressor per tensor (or reset())")
        signum_momentum(self._m, x, self.momentum)
        return (pack_signs(self._m),), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        return unpack_signs(payload[0], int(ctx["n"]), 1.0, -1.0)

    def payload_bytes(self, n_elements):
        """One bit per element, rounded up to whole bytes."""
        return packed_len(n_elements)

    def reset(self) -> None:
        """Forget the momentum."""
        self._m = None
