"""Error feedback: kernels vs numpy twins, memory semantics, bounded residual over 1000 steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from testbed.kernels.compressors import get_compressor
from testbed.kernels.memory import (
    NoMemory,
    ResidualMemory,
    compress_with_feedback,
    ef_compensate,
    ef_update,
)
from testbed.kernels.reference import memory as ref

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rand(n, seed=0):
    """Standard normal float32 test vector."""
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@FAST
@given(st.integers(0, 200).flatmap(lambda n: st.tuples(
    *[hnp.arrays(np.float32, n, elements=st.floats(-(2.0**100), 2.0**100, width=32))] * 3)),
    st.sampled_from([1.0, 0.5, 0.9]), st.sampled_from([1.0, 0.1]))
def test_ef_kernels_equal_twins(arrays, beta, gamma):
    x, r, d = arrays
    out = np.empty_like(x)
    ef_compensate(x, r, beta, gamma, out)
    np.testing.assert_array_equal(out, ref.ef_compensate(x, r, beta, gamma))
    res = np.empty_like(x)
    ef_update(out, d, res)
    np.testing.assert_array_equal(res, ref.ef_update(out, d))


def test_parallel_variant_equals_serial():
    """The large-array (prange) variant of the kernels equals the serial one."""
    x, r = rand(3000, 1), rand(3000, 2)
    a, b = np.empty_like(x), np.empty_like(x)
    ef_compensate.serial(x, r, 1.0, 1.0, a)
    ef_compensate.parallel(x, r, 1.0, 1.0, b)
    np.testing.assert_array_equal(a, b)


def test_residual_is_what_compression_lost():
    c = get_compressor("topk", ratio=0.1)
    mem = ResidualMemory()
    g = rand(100, 3)
    payload, ctx = compress_with_feedback(c, mem, g, 0)
    sent = c.decompress(payload, ctx)
    np.testing.assert_array_equal(mem.residual, g - sent)
    g2 = rand(100, 4)
    xc = mem.compensate(g2)
    np.testing.assert_array_equal(xc, g2 + (g - sent))
    # beta/gamma follow GRACE: beta * residual + gamma * x
    m2 = ResidualMemory(beta=0.5, gamma=2.0)
    m2.update(g, sent)
    np.testing.assert_array_equal(m2.compensate(g2),
                                  np.float32(0.5) * (g - sent) + np.float32(2.0) * g2)


def test_no_memory_is_identity():
    c = get_compressor("signsgd")
    g = rand(50, 5)
    p1, _ = compress_with_feedback(c, NoMemory(), g)
    p2, _ = c.compress(g)
    np.testing.assert_array_equal(p1[0], p2[0])
    assert NoMemory().compensate(g) is not None and NoMemory.residual is None


def test_memory_bad_input_named():
    mem = ResidualMemory()
    mem.compensate(rand(10))
    with pytest.raises(ValueError, match="one memory per tensor"):
        mem.compensate(rand(11))
    with pytest.raises(ValueError, match="decompressed"):
        mem.update(rand(10), rand(9))
    with pytest.raises(ValueError, match="NaN or inf"):
        mem.compensate(np.full(10, np.nan, np.float32))
    with pytest.raises(ValueError, match="beta"):
        ResidualMemory(beta=-1.0)
    with pytest.raises(ValueError, match="x_compensated"):
        mem.update(np.zeros(10), rand(10))


def _contraction_bound(delta: float, g_max: float) -> float:
    """Bound on ||e_t|| when ||v - C(v)||^2 <= (1 - delta) ||v||^2 and ||g_t|| <= g_max:
    ||e_t|| <= sqrt(1-delta) (||e_{t-1}|| + g_max)  =>  ||e_t|| <= s g_max / (1 - s)."""
    s = math.sqrt(1.0 - delta)
    return s * g_max / (1.0 - s)


@pytest.mark.parametrize("name,params,n,delta", [
    ("topk", {"ratio": 0.1}, 200, 0.1),          # top-k keeps >= k/n of the energy
    ("efsignsgd", {}, 100, 1.0 / 100),           # ||v||_1^2 / (d ||v||^2) >= 1/d
])
def test_error_feedback_residual_bounded_1000_steps(name, params, n, delta):
    rng = np.random.default_rng(7)
    mean = rng.standard_normal(n).astype(np.float32)  # a persistent direction: broken EF drifts
    c = get_compressor(name, **params)
    mem = ResidualMemory()
    sum_g = np.zeros(n)
    sum_sent = np.zeros(n)
    g_max = 0.0
    worst = 0.0
    steps = 1000
    for t in range(steps):
        g = (mean + rng.standard_normal(n)).astype(np.float32)
        g_max = max(g_max, float(np.linalg.norm(g)))
        payload, ctx = compress_with_feedback(c, mem, g, t)
        sum_g += g
        sum_sent += c.decompress(payload, ctx)
        worst = max(worst, float(np.linalg.norm(mem.residual)))
    bound = _contraction_bound(delta, g_max)
    assert worst <= bound, (worst, bound)
    # telescoping: what was sent plus what is still owed equals what was produced
    gap = np.linalg.norm(sum_g - sum_sent - mem.residual)
    assert gap <= 1e-4 * np.linalg.norm(sum_g)
    # and the transmitted updates track the gradients: relative drift <= bound / ||sum g||
    assert np.linalg.norm(sum_g - sum_sent) <= bound
    assert np.linalg.norm(sum_g - sum_sent) / np.linalg.norm(sum_g) < 0.05


def test_without_feedback_topk_drifts():
    """Control for the test above: without memory, top-k loses a growing share of the sum."""
    rng = np.random.default_rng(7)
    n = 200
    mean = rng.standard_normal(n).astype(np.float32)
    c = get_compressor("topk", ratio=0.1)
    sum_g = np.zeros(n)
    sum_sent = np.zeros(n)
    for t in range(1000):
        g = (mean + rng.standard_normal(n)).astype(np.float32)
        p, ctx = compress_with_feedback(c, NoMemory(), g, t)
        sum_g += g
        sum_sent += c.decompress(p, ctx)
    assert np.linalg.norm(sum_g - sum_sent) / np.linalg.norm(sum_g) > 0.3
