"""Fixed-point aggregation kernels against their numpy twins and the float sum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numba import njit

from testbed.kernels import fixedpoint as fp
from testbed.kernels.reference import fixedpoint as ref

F32_MAX = np.finfo(np.float32).max
DENORM = np.float32(2.0**-149)


def adversarial(length: int, rng: np.random.Generator) -> np.ndarray:
    """Random values at wildly different magnitudes plus zeros, denormals, powers of two."""
    x = rng.standard_normal(length).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-140, 120, length).astype(np.float32)
    special = np.array([0, -0.0, DENORM, -DENORM, 2.0**-126, 1.0, -1.0, 0.5, 2.0**127,
                        F32_MAX, -F32_MAX, 3.0, np.nextafter(np.float32(1), np.float32(2))],
                       dtype=np.float32)
    k = min(length, special.size)
    x[rng.choice(length, k, replace=False)] = special[:k] if length else x[:0]
    return x


@pytest.mark.parametrize("length,chunk", [(0, 256), (1, 256), (3, 1), (257, 256), (1000, 7),
                                          (4096, 256)])
def test_exponents_match_twin(length, chunk):
    x = adversarial(length, np.random.default_rng(length))
    got = fp.exponents(x, chunk)
    assert np.array_equal(got, ref.chunk_exponents(x, chunk))
    for c, e in enumerate(got):  # the definition itself: smallest e with 2**e >= max|x|
        m = float(np.abs(x[c * chunk:(c + 1) * chunk].astype(np.float64)).max())
        if m == 0:
            assert e == fp.EXP_MIN
        else:
            assert 2.0**e >= m and (e == fp.EXP_MIN or 2.0 ** (e - 1) < m)


def test_exponent_special_cases():
    x = np.array([0, 0, DENORM, 1.0, 0.75, F32_MAX, 2.0**-126, 1.5], dtype=np.float32)
    assert fp.exponents(x, 1).tolist() == [fp.EXP_MIN, fp.EXP_MIN, -149, 0, 0, 128, -126, 1]
    assert fp.block_exponent(np.array([1.0, np.inf], np.float32)) == fp.EXP_NONFINITE
    assert fp.block_exponent(np.array([np.nan], np.float32)) == fp.EXP_NONFINITE
    assert fp.block_exponent(np.zeros(0, np.float32)) == fp.EXP_MIN


@pytest.mark.parametrize("n", [1, 2, 3, 7, 32, 64])
def test_nway_sum_within_documented_bound(n):
    rng = np.random.default_rng(100 + n)
    length = 1000
    # each worker at its own magnitude so the agreed exponent differs from most workers'
    xs = np.stack([adversarial(length, rng) * 2.0 ** rng.integers(-8, 8)
                   if w % 3 else rng.standard_normal(length) for w in range(n)])
    # keep every value, and the exact sum, a finite float32
    xs = np.clip(xs, -F32_MAX / n, F32_MAX / n).astype(np.float32)
    out, exps = fp.allreduce(xs)
    exact = xs.astype(np.float64).sum(axis=0)
    bound = fp.error_bound(out, exps, n)
    assert (np.abs(out.astype(np.float64) - exact) <= bound).all()
    # and the pieces agree bit for bit with the numpy twin
    ex_ref = np.max([ref.chunk_exponents(r, 256) for r in xs], axis=0).astype(np.int16)
    assert np.array_equal(exps, ex_ref)
    qs = np.stack([fp.quantize(np.ascontiguousarray(r), exps, n) for r in xs])
    assert np.array_equal(qs, np.stack([ref.quantize(r, exps, n, 256) for r in xs]))
    agg = fp.aggregate(qs)
    assert np.array_equal(agg, ref.aggregate(qs))
    assert np.array_equal(agg.astype(np.int64), qs.astype(np.int64).sum(axis=0))  # no wrap
    assert np.array_equal(fp.dequantize(agg, exps, n), ref.dequantize(agg, exps, n, 256))


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64])
@pytest.mark.parametrize("value", [1.0, 2.0**127, F32_MAX / 64, DENORM, 0.75])
def test_worst_case_every_worker_at_max_never_overflows(n, value):
    for sign in (1, -1):
        xs = np.full((n, 300), sign * value, dtype=np.float32)
        exps = fp.agree(np.stack([fp.exponents(r) for r in xs]))
        qs = np.stack([fp.quantize(r, exps, n) for r in xs])
        exact_int = qs.astype(np.int64).sum(axis=0)
        assert (np.abs(exact_int) <= fp.INT32_MAX).all()
        agg = fp.aggregate(qs)
        assert np.array_equal(agg.astype(np.int64), exact_int)
        out = fp.dequantize(agg, exps, n)
        exact = xs.astype(np.float64).sum(axis=0)
        if np.isfinite(exact).all() and (np.abs(exact) <= F32_MAX).all():
            assert (np.abs(out - exact) <= fp.error_bound(out, exps, n)).all()


def test_zeros_and_denormals_roundtrip():
    x = np.zeros(300, np.float32)
    out, exps = fp.allreduce(np.stack([x, x]))
    assert (exps == fp.EXP_MIN).all() and (out == 0).all()
    d = np.full(10, DENORM, np.float32)
    d[::2] *= 3
    out, exps = fp.allreduce(np.stack([d, -d, d]))
    assert np.array_equal(out, d)  # denormal sums are exact with e = -148


@settings(max_examples=25, deadline=None)
@given(arrays(np.float32, st.integers(0, 600),
              elements=st.floats(-float(np.float32(1e30)), float(np.float32(1e30)), width=32)),
       st.integers(1, 64), st.sampled_from([1, 5, 256]))
def test_hypothesis_single_worker_matches_twin_and_bound(x, n, chunk):
    exps = fp.exponents(x, chunk)
    q = fp.quantize(x, exps, n, chunk)
    assert np.array_equal(q, ref.quantize(x, exps, n, chunk))
    out = fp.dequantize(q, exps, n, chunk)
    assert np.array_equal(out, ref.dequantize(q, exps, n, chunk))
    # one worker's share of the n-way bound
    f = ref.scales(exps, n)
    per = np.repeat(0.5 * (1 + 2.0**-20) / f, chunk)[: x.size]
    assert (np.abs(out.astype(np.float64) - x) <= per + 2.0**-23 * np.abs(out) + 2.0**-149).all()


def test_parallel_versions_equal_serial():
    rng = np.random.default_rng(11)
    x = adversarial(10_007, rng)
    e1, e2 = np.empty(40, np.int16), np.empty(40, np.int16)
    fp.chunk_exponents_into(x, 256, e1)
    fp.chunk_exponents_into_par(x, 256, e2)
    assert np.array_equal(e1, e2)
    q1, q2 = np.empty(x.size, np.int32), np.empty(x.size, np.int32)
    fp.quantize_chunks_into(x, e1, 4, 256, q1)
    fp.quantize_chunks_into_par(x, e1, 4, 256, q2)
    assert np.array_equal(q1, q2)
    o1, o2 = np.empty(x.size, np.float32), np.empty(x.size, np.float32)
    fp.dequantize_chunks_into(q1, e1, 4, 256, o1)
    fp.dequantize_chunks_into_par(q1, e1, 4, 256, o2)
    assert np.array_equal(o1.view(np.uint32), o2.view(np.uint32))
    a1, a2 = q1.copy(), q1.copy()
    fp.add_into(a1, q2)
    fp.add_into_par(a2, q2)
    assert np.array_equal(a1, a2)
    y = (rng.standard_normal(5001) * 3000).astype(np.float32)
    z1, z2 = np.empty(5001, np.int32), np.empty(5001, np.int32)
    assert fp.atp_quantize_into(y, 1e6, z1) == fp.atp_quantize_into_par(y, 1e6, z2) is True
    assert np.array_equal(z1, z2)
    b1, b2 = z1.copy(), z1.copy()
    assert fp.atp_add_into(b1, z1) == fp.atp_add_into_par(b2, z1)
    assert np.array_equal(b1, b2)
    fp.atp_dequantize_into(z1, 1e6, o1[:5001])
    fp.atp_dequantize_into_par(z1, 1e6, o2[:5001])
    assert np.array_equal(o1[:5001], o2[:5001])


def test_atp_overflow_is_flagged_never_wrapped():
    x = np.array([1.0, -2.5, 2147.0, 2148.0, -2149.0, 0.0], dtype=np.float32)
    q, over = fp.atp_quantize(x)
    q_ref, over_ref = ref.atp_quantize(x, 1e6)
    assert over and over_ref and np.array_equal(q, q_ref)
    assert q.tolist() == [1_000_000, -2_500_000, 2_147_000_000, fp.INT32_MAX, fp.INT32_MIN, 0]
    q, over = fp.atp_quantize(x[:3])
    assert not over
    qs = np.array([[2**30 - 1, -5, 7], [2**30, -6, 8]], dtype=np.int32)
    acc, over = fp.atp_aggregate(qs)  # exactly INT32_MAX: fits
    assert not over and acc.tolist() == [fp.INT32_MAX, -11, 15]
    qs = np.array([[2**30, -2**30, 1], [2**30, -2**30, 2], [1, -1, 3]], dtype=np.int32)
    acc, over = fp.atp_aggregate(qs)
    acc_ref, over_ref = ref.atp_aggregate(qs)
    assert over and over_ref and np.array_equal(acc, acc_ref)
    assert acc.tolist() == [fp.INT32_MAX, fp.INT32_MIN, 6]


def test_atp_nway_sum_within_bound_and_matches_twin():
    rng = np.random.default_rng(12)
    n = 16
    xs = (rng.standard_normal((n, 2000)) * 50).astype(np.float32)
    qs = []
    for r in xs:
        q, over = fp.atp_quantize(r)
        q_ref, _ = ref.atp_quantize(r, 1e6)
        assert not over and np.array_equal(q, q_ref)
        qs.append(q)
    acc, over = fp.atp_aggregate(np.stack(qs))
    assert not over
    out = fp.atp_dequantize(acc)
    assert np.array_equal(out, ref.atp_dequantize(acc, 1e6))
    exact = xs.astype(np.float64).sum(axis=0)
    assert (np.abs(out - exact) <= n * 0.5e-6 * (1 + 1e-6) + 2.0**-23 * np.abs(out)).all()


@njit(cache=True)
def _worker_and_switch(xs, chunk):
    """A worker loop + switch slot written in njit, calling the per-packet kernels."""
    n, length = xs.shape
    out = np.empty(length, np.float32)
    q = np.empty(chunk, np.int32)
    slot = np.empty(chunk, np.int32)
    for lo in range(0, length, chunk):
        hi = min(lo + chunk, length)
        e = fp.EXP_MIN
        for w in range(n):
            e = max(e, fp.block_exponent(xs[w, lo:hi]))
        s = fp.scale_for(e, n)
        for w in range(n):
            fp.quantize_into(xs[w, lo:hi], s, q[: hi - lo])
            if w == 0:
                slot[: hi - lo] = q[: hi - lo]
            else:
                fp.add_into(slot[: hi - lo], q[: hi - lo])
        fp.dequantize_into(slot[: hi - lo], s, out[lo:hi])
    return out


def test_kernels_callable_from_njit_code():
    xs = adversarial(777, np.random.default_rng(13))
    xs = np.stack([xs, xs[::-1].copy(), -xs]) / np.float32(4)
    out = _worker_and_switch(xs, 256)
    want, _ = fp.allreduce(xs)
    assert np.array_equal(out, want)


def test_bad_input_raises_clear_errors():
    x = np.ones(10, np.float32)
    e = fp.exponents(x)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        fp.exponents(x.astype(np.float64))
    with pytest.raises(ValueError, match="x: element 3 is nan"):
        bad = x.copy()
        bad[3] = np.nan
        fp.exponents(bad)
    with pytest.raises(ValueError, match="x: element 0 is inf"):
        fp.atp_quantize(np.array([np.inf], np.float32))
    with pytest.raises(ValueError, match="x: element 1 is -inf"):
        fp.allreduce(np.array([[1, -np.inf]], np.float32))
    with pytest.raises(ValueError, match="n: number of workers"):
        fp.quantize(x, e, 0)
    with pytest.raises(ValueError, match="n: number of workers"):
        fp.quantize(x, e, 65)
    with pytest.raises(ValueError, match="n: number of workers"):
        fp.allreduce(np.ones((65, 3), np.float32))
    with pytest.raises(ValueError, match="exps: expected 1 exponents"):
        fp.quantize(x, np.zeros(2, np.int16), 2)
    with pytest.raises(ValueError, match="exps: chunk 0 has exponent -3"):
        fp.quantize(x, np.full(1, -3, np.int16), 2)
    with pytest.raises(TypeError, match="exps"):
        fp.dequantize(np.zeros(10, np.int32), e.astype(np.int64), 2)
    with pytest.raises(TypeError, match="q: expected dtype int32"):
        fp.dequantize(np.zeros(10, np.int64), e, 2)
    with pytest.raises(ValueError, match="chunk"):
        fp.exponents(x, 0)
    with pytest.raises(ValueError, match="x: expected a 1-D"):
        fp.exponents(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="x: must be contiguous"):
        fp.exponents(np.ones(20, np.float32)[::2])
    with pytest.raises(ValueError, match="factor"):
        fp.atp_quantize(x, factor=0)
    with pytest.raises(TypeError, match="qs"):
        fp.aggregate(np.zeros((2, 3), np.int64))


def _misaligned(n: int, dtype, off: int) -> np.ndarray:
    """An output array whose first element sits ``off`` elements past an allocation start:
    the block kernels must handle every alignment of the output."""
    return np.zeros(n + off, dtype)[off:]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 15), st.sampled_from([16, 17, 64, 100, 256]),
       st.integers(1, 64), st.booleans(), st.integers(0, 2**31))
def test_block_kernels_equal_twins_at_every_alignment(length, off, chunk, n, stream, seed):
    """The LANES-wide block forms (plain or streaming stores, the streamed ones forced here on
    small tensors) are bit-identical to the numpy twins, including blocks that straddle two
    chunks and every output alignment."""
    x = adversarial(length, np.random.default_rng(seed)) * np.float32(2.0**-3)
    exps = ref.chunk_exponents(x, chunk)
    q = _misaligned(length, np.int32, off)
    fp._scale_chunks(x, exps, n, chunk, q, stream, False)
    assert np.array_equal(q, ref.quantize(x, exps, n, chunk))
    out = _misaligned(length, np.float32, off)
    fp._scale_chunks(q, exps, n, chunk, out, stream, True)
    assert np.array_equal(out.view(np.uint32), ref.dequantize(q, exps, n, chunk).view(np.uint32))
    y = x * np.float32(1e-30)  # ATP: mostly in range, the adversarial magnitudes overflow
    qa = _misaligned(length, np.int32, off)
    bad = fp._atp_quantize(y, 1e6, qa, stream)
    q_ref, over_ref = ref.atp_quantize(y, 1e6)
    assert np.array_equal(qa, q_ref) and (bad != 0) == over_ref
    fp._atp_dequantize(q_ref, 1e6, out, stream)
    assert np.array_equal(out, ref.atp_dequantize(q_ref, 1e6))


def test_atp_block_bounds_are_exact():
    """Products exactly at the int32 rounding bounds (round half to even: 2**31 - 0.5 does
    not fit, -2**31 - 0.5 does), just inside and outside them, NaN and +-inf, in every lane
    position of a block and with the fast-path limit on either side."""
    x = np.array([1.0, -1.0, 0.5, -0.5, np.nextafter(1.0, 0.0), np.nextafter(-1.0, 0.0),
                  np.nextafter(1.0, 2.0), 2.0, -2.0, 0.0, np.nan, np.inf, -np.inf, 3e-7],
                 dtype=np.float32)
    for f in (2147483647.5, 2147483648.5, 2147483647.4999998, 2147483646.0, 1e6, 1.0):
        for rot in range(16):
            y = np.roll(np.resize(x, 48), rot)
            for stream in (False, True):
                q = _misaligned(y.size, np.int32, rot % 4)
                bad = fp._atp_quantize(y, f, q, stream)
                q_ref, over_ref = ref.atp_quantize(y, f)
                assert np.array_equal(q, q_ref), (f, rot, stream)
                assert (bad != 0) == over_ref, (f, rot, stream)
    q = np.empty(2, np.int32)
    assert not fp.atp_quantize_into(np.array([-1.0, 1.0], np.float32), 2147483647.4, q)
    assert q.tolist() == [-2147483647, 2147483647]
    assert not fp.atp_quantize_into(np.array([-1.0, 0.0], np.float32), 2147483648.5, q)
    assert q.tolist() == [fp.INT32_MIN, 0]


def test_streaming_path_of_whole_tensors_equals_twins():
    """Tensors past STREAM_MIN_BYTES take the streaming stores through the public kernels."""
    from testbed.kernels.simd import STREAM_MIN_BYTES

    length = STREAM_MIN_BYTES // 4 + 1003
    rng = np.random.default_rng(21)
    x = rng.standard_normal(length).astype(np.float32)
    exps = ref.chunk_exponents(x, 256)
    q = _misaligned(length, np.int32, 3)
    fp.quantize_chunks_into(x, exps, 8, 256, q)
    assert np.array_equal(q, ref.quantize(x, exps, 8, 256))
    q2 = np.empty(length, np.int32)
    fp.quantize_chunks_into_par(x, exps, 8, 256, q2)
    assert np.array_equal(q2, q)
    out = _misaligned(length, np.float32, 1)
    fp.dequantize_chunks_into_par(q, exps, 8, 256, out)
    assert np.array_equal(out, ref.dequantize(q, exps, 8, 256))
    qa = _misaligned(length, np.int32, 2)
    assert not fp.atp_quantize_into(x, 1e6, qa)
    assert np.array_equal(qa, ref.atp_quantize(x, 1e6)[0])


def test_strided_arrays_take_the_scalar_path():
    """Non-contiguous views (typed layout "A") give the same results as contiguous ones."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal(2 * 1000).astype(np.float32)[::2]
    exps = ref.chunk_exponents(np.ascontiguousarray(x), 256)
    q = np.zeros(2 * 1000, np.int32)
    fp.quantize_chunks_into(x, exps, 4, 256, q[::2])
    assert np.array_equal(q[::2], ref.quantize(np.ascontiguousarray(x), exps, 4, 256))
    assert not q[1::2].any()
    out = np.zeros(2 * 1000, np.float32)
    fp.dequantize_chunks_into(q[::2], exps, 4, 256, out[::2])
    assert np.array_equal(out[::2], ref.dequantize(q[::2].copy(), exps, 4, 256))
    qa = np.zeros(2 * 1000, np.int32)
    assert not fp.atp_quantize_into(x, 1e6, qa[::2])
    assert np.array_equal(qa[::2], ref.atp_quantize(np.ascontiguousarray(x), 1e6)[0])
    fp.atp_dequantize_into(qa[::2], 1e6, out[::2])
    assert np.array_equal(out[::2], ref.atp_dequantize(qa[::2].copy(), 1e6))
