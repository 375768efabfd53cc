"""``absmax8``: 8-bit absolute-max quantisation, a compressor added to the testbed as a plug-in.

Each gradient is scaled so that its largest magnitude maps to 127 and rounded to the nearest
int8 (ties to even): ``q = rint(x * 127 / max|x|)``, ``x_hat = q * max|x| / 127``. The error
of an element is at most half a step, ``max|x| / 254``. One byte per element plus the scale in
the context: 4x smaller than float32. Not summable (every worker has its own scale), so
``algo = "ring"`` gathers the workers' payloads and each worker decodes and adds them.

The kernels are module-level ``@njit(cache=True)`` functions that fill an ``out`` argument,
so other Numba code can call them per packet; their numpy twins are in
:mod:`mycompressor.reference` under the same names, and the tests compare the two bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.kernels.compressors import Compressor
from testbed.kernels.reductions import absmax

#: Largest quantised magnitude.
LEVELS = 127


@njit(cache=True)
def absmax8_quantize(x, inv_scale, out):
    """``out_i = rint(x_i * inv_scale)`` as int8, clipped to [-127, 127] (float32 product)."""
    for i in range(x.size):
        v = np.rint(x[i] * inv_scale)
        out[i] = np.int8(min(max(v, -LEVELS), LEVELS))


@njit(cache=True)
def absmax8_dequantize(q, scale, out):
    """``out_i = q_i * scale`` in float32."""
    for i in range(q.size):
        out[i] = np.float32(q[i]) * scale


def scales(x: np.ndarray) -> tuple[np.float32, np.float32]:
    """(scale, 1 / scale) of ``x`` as float32: ``max|x| / 127`` (both 0 for a zero vector)."""
    m = np.float32(absmax(x))
    if m == 0:
        return np.float32(0.0), np.float32(0.0)
    scale = np.float32(m / np.float32(LEVELS))
    return scale, np.float32(np.float32(1.0) / scale)


class Absmax8Compressor(Compressor):
    """absmax8: int8 per element, one float32 scale per tensor (no parameters)."""

    name = "absmax8"  # the entry point's name in pyproject.toml

    def __init__(self):
        super().__init__()

    def _compress(self, x, step):
        scale, inv = scales(x)
        q = np.empty(x.size, dtype=np.int8)
        absmax8_quantize(x, inv, q)
        return (q,), {"n": int(x.size), "scale": float(scale)}

    def _decompress(self, payload, ctx):
        (q,) = payload
        if q.dtype != np.int8 or q.size != int(ctx["n"]):
            raise ValueError(f"absmax8 payload must be {ctx['n']} int8 values, got "
                             f"{q.size} {q.dtype}")
        out = np.empty(q.size, dtype=np.float32)
        absmax8_dequantize(q, np.float32(ctx["scale"]), out)
        return out

    def payload_bytes(self, n_elements):
        """One byte per element."""
        return int(n_elements)
