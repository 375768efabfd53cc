"""``threshold``: every element with ``|x_i| >= threshold`` (values + indices). Not summable."""

from __future__ import annotations

import numpy as np

from testbed.kernels.checks import check_number

from ._select import select_ge
from .base import Compressor
from .topk import gather, sparse_decompress


class ThresholdCompressor(Compressor):
    """Sends elements whose magnitude reaches ``threshold`` (default 0.01); the payload size
    depends on the data (``payload_bytes`` gives the upper bound, all elements)."""

    name = "threshold"

    def __init__(self, threshold: float = 0.01):
        threshold = check_number("threshold", 0.0, 3.4e38)(threshold)
        super().__init__(threshold=threshold)
        self.threshold = threshold

    def _compress(self, x, step):
        idx = select_ge(x, np.float32(self.threshold))
        vals = np.empty(idx.size, dtype=np.float32)
        gather(x, idx, vals)
        return (vals, idx), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        return sparse_decompress(payload, ctx)

    def payload_bytes(self, n_elements):
        """Upper bound: every element selected (8 bytes each)."""
        return 8 * int(n_elements)
