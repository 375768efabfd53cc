"""absmax8: kernels equal their numpy twins bit for bit; the error is at most half a step."""

from __future__ import annotations

import numpy as np
import pytest
from mycompressor import (
    Absmax8Compressor,
    absmax8_dequantize,
    absmax8_quantize,
    reference,
    scales,
)

from testbed.kernels.compressors import decode_any, get_compressor


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 65537])
@pytest.mark.parametrize("spread", [1e-30, 1.0, 3e37])
def test_kernels_equal_twins(n, spread):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * spread).astype(np.float32)
    scale, inv = scales(x)
    q = np.empty(n, dtype=np.int8)
    absmax8_quantize(x, inv, q)
    assert np.array_equal(q, reference.absmax8_quantize(x, inv))
    out = np.empty(n, dtype=np.float32)
    absmax8_dequantize(q, scale, out)
    assert np.array_equal(out, reference.absmax8_dequantize(q, scale))


def test_registered_and_error_bound():
    c = get_compressor("absmax8")  # found through the entry point, not an import above
    assert type(c) is Absmax8Compressor
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    x_hat = decode_any(c.encode(x))
    step = float(np.abs(x).max()) / 127
    assert np.max(np.abs(x_hat - x)) <= step / 2 * (1 + 1e-6)
    assert np.abs(x_hat).max() == pytest.approx(np.abs(x).max(), rel=1e-6)
    assert c.payload_bytes(x.size) == x.size
    assert np.array_equal(c.decompress(*c.compress(np.zeros(5, np.float32))), np.zeros(5))
