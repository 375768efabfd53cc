"""``efsignsgd``: scaled sign, (||x||_1 / n) * sign(x), meant for error feedback (EF-SignSGD).

Pair it with :class:`testbed.kernels.memory.ResidualMemory`; the scale makes the compressor a
contraction, which keeps the residual bounded.
"""

from __future__ import annotations

from testbed.kernels.reductions import l1norm

from .base import Compressor
from .signsgd import pack_signs, packed_len, unpack_signs


class EfsignsgdCompressor(Compressor):
    """Sign bits plus one scale (the mean magnitude) in the ctx."""

    name = "efsignsgd"

    def _compress(self, x, step):
        scale = float(l1norm(x)) / x.size if x.size else 0.0
        return (pack_signs(x),), {"n": int(x.size), "scale": scale}

    def _decompress(self, payload, ctx):
        s = float(ctx["scale"])
        return unpack_signs(payload[0], int(ctx["n"]), s, -s)

    def payload_bytes(self, n_elements):
        """One bit per element, rounded up to whole bytes."""
        return packed_len(n_elements)
