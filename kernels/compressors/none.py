"""``none``: the identity compressor (float32 on the wire); the baseline every other one is
measured against."""

from __future__ import annotations

import numpy as np

from .base import Compressor


class NoneCompressor(Compressor):
    """Sends the float32 gradient unchanged; summable (plain float32 addition)."""

    name = "none"
    summable = True

    def _compress(self, x, step):
        return (x.copy(),), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        return np.asarray(payload[0], dtype=np.float32).copy()

    def _aggregate(self, payloads):
        acc = np.zeros_like(payloads[0][0], dtype=np.float32)
        for p in payloads:
            acc += p[0]
        return (acc,)

    def payload_bytes(self, n_elements):
        """4 bytes per element."""
        return 4 * int(n_elements)
