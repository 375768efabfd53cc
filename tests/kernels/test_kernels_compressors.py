"""Compressors: Numba kernels vs numpy twins, round-trip bounds, unbiasedness, summability,
wire encoding, and input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from testbed.kernels import reductions as red
from testbed.kernels import rng
from testbed.kernels.compressors import COMPRESSORS, decode_any, get_compressor
from testbed.kernels.compressors import _select as sel
from testbed.kernels.compressors import bf16 as kbf16
from testbed.kernels.compressors import dgc as kdgc
from testbed.kernels.compressors import fp16 as kfp16
from testbed.kernels.compressors import natural as knat
from testbed.kernels.compressors import onebit as kone
from testbed.kernels.compressors import powersgd as kps
from testbed.kernels.compressors import qsgd as kq
from testbed.kernels.compressors import randomk as krk
from testbed.kernels.compressors import signsgd as ksign
from testbed.kernels.compressors import signum as ksignum
from testbed.kernels.compressors import terngrad as ktern
from testbed.kernels.compressors import thc as kthc
from testbed.kernels.compressors.base import count_for_ratio
from testbed.kernels.parallel import PAR_MIN
from testbed.kernels.reference import compressors as ref
from testbed.kernels.reference import reductions as ref_red
from testbed.kernels.reference import rng as ref_rng

EXPECTED = {"none", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad",
            "signsgd", "efsignsgd", "signum", "onebit", "natural", "powersgd", "thc"}
SUMMABLE = {"none", "fp16", "bf16", "randomk", "thc"}
LENGTHS = [0, 1, 7, 8, 9, 1023, 1025]
FAST = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def rand(n, seed=0, scale=1.0):
    """Standard normal float32 test vector."""
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def finite_vectors(min_size=0, max_size=300):
    """Hypothesis strategy: finite float32 vectors incl. zeros, subnormals and big values."""
    elems = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False,
                      allow_subnormal=True, width=32)
    return hnp.arrays(np.float32, st.integers(min_size, max_size), elements=elems)


# ----------------------------------------------------------------------------- registry


def test_registry_names():
    assert set(COMPRESSORS) == EXPECTED
    for name in COMPRESSORS:
        c = get_compressor(name)
        assert c.name == name
        assert c.summable == (name in SUMMABLE)


def test_unknown_name_lists_allowed():
    with pytest.raises(ValueError, match="unknown compressor 'zip'.*topk"):
        get_compressor("zip")


def test_unknown_parameter_named():
    with pytest.raises(ValueError, match="'levels'.*ratio=0.01"):
        get_compressor("topk", levels=3)


@pytest.mark.parametrize("name,params,word", [
    ("topk", {"ratio": 0.0}, "ratio"), ("topk", {"ratio": 1.5}, "ratio"),
    ("randomk", {"ratio": "a"}, "ratio"), ("randomk", {"seed": -1}, "seed"),
    ("randomk", {"unbiased": 1}, "unbiased"), ("qsgd", {"levels": 0}, "levels"),
    ("qsgd", {"levels": 2.5}, "levels"), ("threshold", {"threshold": -1.0}, "threshold"),
    ("dgc", {"momentum": 1.5}, "momentum"), ("dgc", {"sample_ratio": 0}, "sample_ratio"),
    ("signum", {"momentum": float("nan")}, "momentum"), ("powersgd", {"rank": 0}, "rank"),
    ("thc", {"granularity": 15}, "granularity"), ("thc", {"block": 1000}, "block"),
    ("thc", {"clip": 0.0}, "clip"), ("natural", {"seed": True}, "seed"),
])
def test_bad_parameter_values(name, params, word):
    with pytest.raises(ValueError, match=word):
        get_compressor(name, **params)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_named(name):
    c = get_compressor(name)
    with pytest.raises(ValueError, match="float32"):
        c.compress(np.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        c.compress(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="numpy array"):
        c.compress([1.0, 2.0])
    for bad in (np.nan, np.inf, -np.inf):
        x = rand(9)
        x[3] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            c.compress(x)
    with pytest.raises(ValueError, match="step"):
        c.compress(rand(4), -1)


def test_range_errors_named():
    with pytest.raises(ValueError, match="fp16 range"):
        get_compressor("fp16").compress(np.array([1e5], np.float32))
    with pytest.raises(ValueError, match="bfloat16"):
        get_compressor("bf16").compress(np.array([3.4e38], np.float32))
    with pytest.raises(ValueError, match="2\\^127"):
        get_compressor("natural").compress(np.array([2.0**127], np.float32))
    with pytest.raises(ValueError, match="norm"):
        get_compressor("thc").compress(rand(8), 0, norm=-1.0)


# ----------------------------------------------------------------------------- kernels vs twins


def _special_floats():
    """float32 values at every fp16/bf16 rounding boundary and special class."""
    base = [0.0, 1.0, 65504.0, 65519.996, 65520.0, 65536.0, 1e5, 3.4e38, 2.0**-14, 2.0**-24,
            2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 3 * 2.0**-25, 1e-40, 1.4e-45, 6.1e-5,
            0.1, 1 / 3, 2049.0, 2051.0, 1.00048828125, 1.00146484375]
    v = np.array(base, dtype=np.float32)
    near = np.concatenate([np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
    v = np.concatenate([v, near, [np.inf]]).astype(np.float32)
    return np.concatenate([v, -v])


def test_fp16_encode_bit_exact_with_numpy():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.concatenate([x[~np.isnan(x)], _special_floats()]).astype(np.float32)
    out = np.empty(x.size, np.uint16)
    with np.errstate(over="ignore"):
        kfp16.fp16_encode(x, out)
        np.testing.assert_array_equal(out, ref.fp16_encode(x))
    nan = np.array([np.nan], np.float32)
    o = np.empty(1, np.uint16)
    kfp16.fp16_encode(nan, o)
    assert np.isnan(o.view(np.float16)[0])


def test_fp16_decode_exhaustive():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(h.size, np.float32)
    kfp16.fp16_decode(h, out)
    expect = ref.fp16_decode(h)
    nan = np.isnan(expect)  # hardware conversion quiets signalling NaNs: compare NaN-ness
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), expect[~nan].view(np.uint32))


def test_bf16_kernels_bit_exact():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, _special_floats()]).astype(np.float32)
    out = np.empty(x.size, np.uint16)
    kbf16.bf16_encode(x, out)
    np.testing.assert_array_equal(out, ref.bf16_encode(x))
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    back = np.empty(h.size, np.float32)
    kbf16.bf16_decode(h, back)
    np.testing.assert_array_equal(back.view(np.uint32), ref.bf16_decode(h).view(np.uint32))
    # known roundings: 1.0, a tie that rounds to even (down), a tie that rounds up
    t = np.array([1.0, 1.00390625, 1.01171875], np.float32)
    kbf16.bf16_encode(t, out[:3])
    assert list(out[:3]) == [0x3F80, 0x3F80, 0x3F82]


def test_hash_uniform_twin():
    i = np.arange(5000)
    key = rng.stream_key(3, 4, 5)
    from numba import njit

    @njit
    def draw(n, key):
        out = np.empty(n)
        for j in range(n):
            out[j] = rng.uniform(j, key)
        return out

    u = draw(5000, key)
    np.testing.assert_array_equal(u, ref_rng.uniform(i, key))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)


@FAST
@given(finite_vectors(1, 400), st.floats(0.001, 1.0), st.integers(0, 2))
def test_topk_select_equals_twin(x, ratio, quantize):
    if quantize:  # many ties
        x = np.round(x / (10.0 ** quantize)).astype(np.float32)
    k = count_for_ratio(x.size, ratio)
    out = np.empty(k, np.int32)
    sel.topk_select(x, k, out)
    np.testing.assert_array_equal(out, ref.topk_select(x, k))


@pytest.mark.parametrize("case", ["zeros", "all_equal", "strided_spikes", "k_eq_n", "big"])
def test_topk_select_adversarial(case):
    n = 50_000
    x = np.zeros(n, np.float32)
    k = 500
    if case == "all_equal":
        x[:] = 2.5
    elif case == "strided_spikes":  # spikes exactly on the sampling stride fool the sample
        m = 16384
        x[(np.arange(m) * n) // m] = 1.0
        x[::97] = 5.0
    elif case == "k_eq_n":
        x = rand(100)
        k = 100
    elif case == "big":
        x = rand(n, 3, 1e30)
    out = np.empty(k, np.int32)
    sel.topk_select(x, k, out)
    np.testing.assert_array_equal(out, ref.topk_select(x, k))


@FAST
@given(finite_vectors(0, 300), st.floats(0.0, 2.0))
def test_select_ge_equals_twin(x, t):
    np.testing.assert_array_equal(sel.select_ge(x, np.float32(t)), ref.select_ge(x, t))
    assert sel.count_ge(x, np.float32(t)) == ref.select_ge(x, t).size


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (1001, 1001), (65537, 655),
                                 (12345, 7), (999_983, 9973)])
def test_randomk_kernels_equal_twin(n, k):
    key = rng.stream_key(7, 11, 0x52414E44)
    idx = np.empty(k, np.int32)
    krk.randomk_indices(n, k, key, idx)
    np.testing.assert_array_equal(idx, ref.randomk_indices(n, k, key))
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < n
    x = rand(n)
    for scaled in (False, True):
        v = np.empty(k, np.float32)
        krk.randomk_gather(x, k, key, scaled, v)
        np.testing.assert_array_equal(v, ref.randomk_gather(x, k, key, scaled))


@FAST
@given(finite_vectors(0, 700), st.integers(0, 15), st.floats(0.0, 2.0))
def test_mask_kernels_equal_twins_at_every_offset(x, off, t):
    """sign_pack and select_ge read 64 floats per mask from any start address."""
    y = np.concatenate([np.zeros(off, np.float32), x])[off:]
    bits = np.empty((y.size + 7) // 8, np.uint8)
    ksign.sign_pack(y, bits)
    np.testing.assert_array_equal(bits, ref.sign_pack(y))
    strided = np.zeros(2 * bits.size, np.uint8)
    ksign.sign_pack(y, strided[::2])
    np.testing.assert_array_equal(strided[::2], bits)
    np.testing.assert_array_equal(sel.select_ge(y, np.float32(t)), ref.select_ge(y, t))


def test_fp16_streaming_path_matches_numpy():
    """Outputs past STREAM_MIN_BYTES are written with streaming stores, at any alignment."""
    from testbed.kernels.simd import STREAM_MIN_BYTES

    x = rand(STREAM_MIN_BYTES // 2 + 1001, 61, 1000.0)
    for off in (0, 1, 3):
        out = np.zeros(x.size + off, np.uint16)[off:]
        kfp16.fp16_encode(x, out)
        np.testing.assert_array_equal(out, ref.fp16_encode(x))
    strided = np.zeros(2 * 1000, np.uint16)
    kfp16.fp16_encode(x[:2000:2], strided[::2])  # non-contiguous views: the scalar path
    np.testing.assert_array_equal(strided[::2], ref.fp16_encode(x[:2000:2]))
    assert not strided[1::2].any()


def test_dgc_select_equals_twin():
    x = rand(20_000, 4)
    key = rng.stream_key(0, 2, 1)
    for k in (1, 200, 6000):
        np.testing.assert_array_equal(kdgc.dgc_select(x, k, 1024, key),
                                      ref.dgc_select(x, k, 1024, key))
    u = rand(1000, 5)
    u2 = u.copy()
    kdgc.momentum_accumulate(u2, rand(1000, 6), 0.9)
    np.testing.assert_array_equal(u2, ref.momentum_accumulate(u, rand(1000, 6), 0.9))


@FAST
@given(finite_vectors(0, 300), st.sampled_from([1, 4, 127, 256, 32767]), st.integers(0, 99))
def test_qsgd_kernels_equal_twin(x, levels, step):
    key = rng.stream_key(1, step, 2)
    norm = float(red.l2norm(x)) if x.size else 0.0
    dt = np.int8 if levels <= 127 else np.int16
    out = np.empty(x.size, dt)
    kq.qsgd_quantize(x, levels, norm, key, out)
    np.testing.assert_array_equal(out, ref.qsgd_quantize(x, levels, norm, key, dt))
    assert np.all(np.abs(out.astype(np.int64)) <= levels)
    back = np.empty(x.size, np.float32)
    kq.qsgd_dequantize(out, norm, levels, back)
    np.testing.assert_array_equal(back, ref.qsgd_dequantize(out, norm, levels))


def test_sign_words_in_parts_equal_twin():
    """A tensor large enough to be split into parts (each walked as four quarters, with
    leftover words) packs as the twin, serially and in parallel."""
    x = rand(64 * 4096 * 5 + 64 * 7 + 5, 42)
    x[::13] = -0.0
    want = ref.sign_pack(x)
    nw = x.size // 64
    for fn in (ksign._sign_words.serial, ksign._sign_words.parallel):
        out = np.empty(want.size, np.uint8)
        fn(x, out)
        np.testing.assert_array_equal(out[:8 * nw], want[:8 * nw])
    out = np.empty(want.size, np.uint8)
    ksign.sign_pack(x, out)
    np.testing.assert_array_equal(out, want)


def test_qsgd_streamed_blocks_equal_twin():
    """Outputs beyond STREAM_MIN_BYTES take the streaming-store blocks (aligned output), a
    misaligned output slice the plain-store blocks; both equal the twin, serial and parallel."""
    x = rand((kq.STREAM_MIN_BYTES // 2) + 37, 41, 2.0)
    norm = float(red.l2norm(x))
    key = rng.stream_key(4, 5, 6)
    want = ref.qsgd_quantize(x, 256, norm, key, np.int16)
    for fn in (kq.qsgd_quantize.serial, kq.qsgd_quantize.parallel):
        out = np.empty(x.size, np.int16)
        fn(x, 256, norm, key, out)
        np.testing.assert_array_equal(out, want)
        buf = np.empty(x.size + 1, np.int16)
        fn(x, 256, norm, key, buf[1:])
        np.testing.assert_array_equal(buf[1:], want)


@FAST
@given(finite_vectors(0, 300), st.integers(0, 99))
def test_terngrad_natural_kernels_equal_twins(x, step):
    key = rng.stream_key(2, step, 3)
    s = float(red.absmax(x))
    assert s == float(ref_red.absmax(x))
    q = np.empty(x.size, np.int8)
    ktern.terngrad_quantize(x, s, key, q)
    np.testing.assert_array_equal(q, ref.terngrad_quantize(x, s, key))
    back = np.empty(x.size, np.float32)
    ktern.terngrad_dequantize(q, s, back)
    np.testing.assert_array_equal(back, ref.terngrad_dequantize(q, s))
    code = np.empty(x.size, np.uint16)
    knat.natural_encode(x, key, code)
    np.testing.assert_array_equal(code, ref.natural_encode(x, key))
    knat.natural_decode(code, back)
    np.testing.assert_array_equal(back, ref.natural_decode(code))


def test_natural_subnormals_and_signs():
    x = np.array([0.0, -0.0, 1e-45, -1e-40, 2.0**-126, 3.0, -6.0, 1.5 * 2.0**126], np.float32)
    code = np.empty(x.size, np.uint16)
    knat.natural_encode(x, rng.stream_key(0, 0, 0), code)
    np.testing.assert_array_equal(code, ref.natural_encode(x, rng.stream_key(0, 0, 0)))
    back = ref.natural_decode(code)
    assert back[0] == 0.0 and back[1] == 0.0 and np.signbit(back[1])
    assert back[2] in (0.0, np.float32(2.0**-126)) and back[3] in (0.0, -np.float32(2.0**-126))
    assert back[4] == np.float32(2.0**-126)
    assert back[5] in (2.0, 4.0) and back[6] in (-4.0, -8.0)
    assert back[7] in (np.float32(2.0**126), np.float32(2.0**127))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 1001])
def test_sign_kernels_equal_twins(n):
    x = rand(n, n)
    if n > 2:
        x[0], x[1] = 0.0, -0.0  # sign(0) = +1, also for -0
    bits = np.empty(ksign.packed_len(n), np.uint8)
    ksign.sign_pack(x, bits)
    np.testing.assert_array_equal(bits, ref.sign_pack(x))
    out = np.empty(n, np.float32)
    ksign.sign_unpack(bits, 0.5, -2.0, out)
    np.testing.assert_array_equal(out, ref.sign_unpack(bits, 0.5, -2.0, n))
    if n > 2:
        assert out[0] == 0.5 and out[1] == 0.5
    pos, neg = kone.onebit_means(x)
    rpos, rneg = ref.onebit_means(x)
    assert pos == pytest.approx(rpos, rel=1e-12, abs=1e-300)
    assert neg == pytest.approx(rneg, rel=1e-12, abs=1e-300)
    m = rand(n, 1)
    m2 = m.copy()
    ksignum.signum_momentum(m2, x, 0.9)
    np.testing.assert_array_equal(m2, ref.signum_momentum(m, x, 0.9))


def test_reductions_match_twins():
    x = rand(300_001, 9, 3.0)
    assert red.l2norm(x) == pytest.approx(ref_red.l2norm(x), rel=1e-12)
    assert red.l1norm(x) == pytest.approx(ref_red.l1norm(x), rel=1e-12)
    assert red.absmax(x) == ref_red.absmax(x)
    assert red.l2norm(np.zeros(0, np.float32)) == 0.0 and red.absmax(np.zeros(0, np.float32)) == 0


def test_chunk_sums_read_four_at_a_time_equal_each_chunk_alone():
    """Whole chunks summed four at a time (four read streams) give each chunk's own sum,
    bit for bit, so norms do not depend on how the chunks were grouped."""
    ch = red.REDUCE_CHUNK
    x = rand(9 * ch + 17, 12, 2.0)
    for power in (1, 2):
        part = red._chunk_sums.serial(x, power)
        alone = [red._chunk_sums.serial(np.ascontiguousarray(x[c * ch:(c + 1) * ch]), power)[0]
                 for c in range(part.size)]
        np.testing.assert_array_equal(part, alone)


@pytest.mark.parametrize("n", [1, 2, 3, 100, 1025])
def test_powersgd_kernels_match_twins(n):
    x = rand(n, n)
    m = kps.as_matrix(x)
    assert m.size >= n and np.array_equal(m.ravel()[:n], x)
    q = get_compressor("powersgd", rank=2).initial_q(n)
    p = np.empty((m.shape[0], 2), np.float32)
    kps.matmul_mq(m, q, p)
    np.testing.assert_allclose(p, ref.matmul_mq(m, q), rtol=1e-5, atol=1e-6)
    p_ref = p.copy()
    kps.orthonormalize(p)
    np.testing.assert_allclose(p, ref.orthonormalize(p_ref), rtol=1e-5, atol=1e-6)
    q2 = np.empty((m.shape[1], 2), np.float32)
    kps.matmul_mtp(m, p, q2)
    np.testing.assert_allclose(q2, ref.matmul_mtp(m, p), rtol=1e-5, atol=1e-6)
    out = np.empty(n, np.float32)
    kps.lowrank_expand(p, q2, n, out)
    np.testing.assert_allclose(out, ref.lowrank_expand(p, q2, n), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 8, 64, 1024])
def test_fwht_matches_twin_and_hadamard(size):
    a = rand(size, size)
    b = a.copy()
    kthc.fwht_inplace(b)
    np.testing.assert_array_equal(b, ref.fwht(a))
    if size <= 64:  # explicit Sylvester matrix
        h = np.array([[1.0]])
        while h.shape[0] < size:
            h = np.block([[h, h], [h, -h]])
        np.testing.assert_allclose(b, h @ a.astype(np.float64), rtol=1e-5, atol=1e-4)
    kthc.fwht_inplace(b)  # H H = size * I
    np.testing.assert_allclose(b, size * a, rtol=1e-4, atol=1e-4 * size)


@pytest.mark.parametrize("n,block", [(1, 1024), (5, 1024), (1000, 256), (3000, 1024)])
def test_thc_kernels_match_twins(n, block):
    x = rand(n, n)
    d, blk = kthc.padded_length(n, block)
    assert d >= n and d % blk == 0 and blk & (blk - 1) == 0
    key = rng.stream_key(1, 2, 3)
    y = np.empty(d, np.float32)
    kthc.rht_forward(x, blk, key, y)
    np.testing.assert_array_equal(y, ref.rht_forward(x, blk, key, d))
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)  # orthonormal
    back = np.empty(n, np.float32)
    kthc.rht_inverse(y, blk, key, n, back)
    np.testing.assert_array_equal(back, ref.rht_inverse(y, blk, key, n))
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)
    q = np.empty(d, np.int8)
    clipped = kthc.thc_quantize(y, 0.5, 8, key, q)
    rq, rclipped = ref.thc_quantize(y, 0.5, 8, key)
    np.testing.assert_array_equal(q, rq)
    assert clipped == rclipped
    deq = np.empty(d, np.float32)
    kthc.thc_dequantize(q, 0.5, 8, deq)
    np.testing.assert_array_equal(deq, ref.thc_dequantize(q, 0.5, 8))
    stack = np.stack([q, -q, q])
    s = np.empty(d, np.int32)
    kthc.thc_sum(stack, s)
    np.testing.assert_array_equal(s, ref.thc_sum(stack))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("n", LENGTHS)
def test_lengths_and_zeros(name, n):
    c = get_compressor(name)
    x = rand(n, n)
    p, ctx = c.compress(x, 1)
    y = c.decompress(p, ctx)
    assert y.dtype == np.float32 and y.shape == (n,) and np.all(np.isfinite(y))
    fixed = name not in ("threshold", "dgc")
    used = sum(a.nbytes for a in p)
    assert used == c.payload_bytes(n) if fixed else used <= c.payload_bytes(n)
    z = get_compressor(name).decompress(*get_compressor(name).compress(np.zeros(n, np.float32)))
    expected = np.ones(n, np.float32) if name in ("signsgd", "signum") else np.zeros(n, np.float32)
    np.testing.assert_array_equal(z, expected)


def test_roundtrip_bounds_dense():
    x = np.concatenate([rand(2000, 1, 10.0), [0.0, 1e-40, -3e-39, 6e-8, 65000.0]]).astype(
        np.float32)
    assert np.array_equal(get_compressor("none").decompress(*get_compressor("none").compress(x)),
                          x)
    y = get_compressor("fp16").decompress(*get_compressor("fp16").compress(x))
    assert np.all(np.abs(y - x) <= 2.0**-11 * np.abs(x) + 2.0**-25)
    y = get_compressor("bf16").decompress(*get_compressor("bf16").compress(x))
    assert np.all(np.abs(y - x) <= 2.0**-8 * np.abs(x) + 2.0**-134)
    for levels in (4, 256):
        c = get_compressor("qsgd", levels=levels)
        p, ctx = c.compress(x, 3)
        y = c.decompress(p, ctx)
        assert np.all(np.abs(y - x) <= ctx["norm"] / levels * (1 + 1e-6))
    c = get_compressor("terngrad")
    p, ctx = c.compress(x, 3)
    y = c.decompress(p, ctx)
    s = np.float32(ctx["scale"])
    assert s == np.max(np.abs(x)) and set(np.unique(y)) <= {-s, np.float32(0), s}
    assert np.all(np.abs(y - x) <= s)
    y = get_compressor("natural").decompress(*get_compressor("natural").compress(x, 2))
    nz = x != 0
    assert np.all(y[~nz] == 0)
    big = np.abs(x) >= 2.0**-126
    r = y[big] / x[big]
    assert np.all((r > 0.5 - 1e-7) & (r <= 2.0))
    m, e = np.frexp(np.abs(y[y != 0]))
    assert np.all(m == 0.5)  # powers of two only


def test_sign_family_roundtrips():
    x = rand(1001, 5)
    x[::50] = 0.0
    s = np.where(x >= 0, 1.0, -1.0).astype(np.float32)
    c = get_compressor("signsgd")
    np.testing.assert_array_equal(c.decompress(*c.compress(x)), s)
    c = get_compressor("efsignsgd")
    y = c.decompress(*c.compress(x))
    np.testing.assert_allclose(y, s * np.mean(np.abs(x)), rtol=1e-6)
    c = get_compressor("onebit")
    y = c.decompress(*c.compress(x))
    np.testing.assert_allclose(y, np.where(x >= 0, x[x >= 0].mean(), x[x < 0].mean()), rtol=1e-6)
    c = get_compressor("signum", momentum=0.9)
    m = np.zeros_like(x)
    for t in range(5):
        g = rand(1001, 10 + t)
        m = ref.signum_momentum(m, g, 0.9)
        y = c.decompress(*c.compress(g, t))
        np.testing.assert_array_equal(y, np.where(m >= 0, 1.0, -1.0).astype(np.float32))
    with pytest.raises(ValueError, match="one compressor per tensor"):
        c.compress(rand(10))


def test_sparsifier_roundtrips():
    x = rand(5000, 6)
    c = get_compressor("topk", ratio=0.01)
    (vals, idx), ctx = c.compress(x)
    assert idx.size == 50
    y = c.decompress((vals, idx), ctx)
    mask = np.zeros(x.size, bool)
    mask[idx] = True
    assert np.array_equal(y[mask], x[mask]) and np.all(y[~mask] == 0)
    assert np.abs(x[mask]).min() >= np.abs(x[~mask]).max()
    c = get_compressor("threshold", threshold=1.5)
    y = c.decompress(*c.compress(x))
    np.testing.assert_array_equal(y, np.where(np.abs(x) >= 1.5, x, 0))
    c = get_compressor("dgc", ratio=0.05)
    (vals, idx), ctx = c.compress(x, 4)
    assert 0 < idx.size <= 250 and np.array_equal(vals, x[idx])
    # the sampled threshold lands near the true 5 % quantile
    assert 100 <= idx.size
    c = get_compressor("dgc", ratio=0.05, momentum=0.9)
    (vals, idx), _ = c.compress(x, 0)
    assert np.array_equal(vals, x[idx]) and np.all(c._u[idx] == 0)
    (vals2, idx2), _ = c.compress(x, 1)  # u = 0.9 u + x
    u = np.where(np.isin(np.arange(x.size), idx), 0, x).astype(np.float32) * np.float32(0.9) + x
    np.testing.assert_array_equal(vals2, u[idx2])


def test_randomk_shared_indices_and_values():
    x = rand(10_000, 7)
    w1 = get_compressor("randomk", ratio=0.01, seed=42)
    w2 = get_compressor("randomk", ratio=0.01, seed=42)
    for step in (0, 1, 17):
        i1, i2 = w1.indices(x.size, step), w2.indices(x.size, step)
        np.testing.assert_array_equal(i1, i2)
        assert i1.size == 100 and np.unique(i1).size == 100
        y = w2.decompress(*w1.compress(x, step))
        np.testing.assert_array_equal(y[i1], x[i1])
        assert np.count_nonzero(y) == np.count_nonzero(x[i1])
    assert not np.array_equal(w1.indices(x.size, 0), w1.indices(x.size, 1))
    assert not np.array_equal(w1.indices(x.size, 0),
                              get_compressor("randomk", seed=43).indices(x.size, 0))


def test_powersgd_projection_and_low_rank_convergence():
    rng = np.random.default_rng(8)
    n = 100 * 100
    x = rand(n, 8)
    c = get_compressor("powersgd", rank=2)
    for t in range(3):
        y = c.decompress(*c.compress(x, t))
        assert np.linalg.norm(y - x) <= np.linalg.norm(x) * (1 + 1e-5)
    # an exactly rank-2 matrix is recovered once the warm-started Q has converged
    a = (rng.standard_normal((100, 2)) @ rng.standard_normal((2, 100))).astype(np.float32).ravel()
    c = get_compressor("powersgd", rank=2, seed=1)
    errs = []
    for t in range(6):
        y = c.decompress(*c.compress(a, t))
        errs.append(np.linalg.norm(y - a) / np.linalg.norm(a))
    assert errs[-1] < 1e-4, errs
    with pytest.raises(ValueError, match="one compressor per tensor"):
        c.compress(rand(10))


def test_thc_roundtrip_bound():
    x = rand(3000, 9)
    c = get_compressor("thc", clip=8.0)
    p, ctx = c.compress(x, 5)
    y = c.decompress(p, ctx)
    assert ctx["clipped"] == 0
    d = c.payload_bytes(x.size)
    step = ctx["scale"] / (c.g // 2)
    # rotation is orthonormal: per-coordinate rounding error <= step in the rotated domain
    assert np.linalg.norm(y - x) <= step * math.sqrt(d) * 1.0001
    assert np.all(np.abs(p[0].astype(int)) <= 8)


# ----------------------------------------------------------------------------- unbiasedness


def _assert_unbiased(estimates, x, res, z_max=5.0):
    """Per-coordinate z-score of the mean over trials against the true value.

    A coordinate whose estimate never varied (e.g. a rounding probability p ~ 1e-5 that did
    not fire in T trials) cannot be z-tested; its bias is p * res where res is the rounding
    gap, and seeing no event in T trials means p < 10 / T except with probability e^-10.
    """
    est = np.asarray(estimates, dtype=np.float64)
    trials = est.shape[0]
    mean = est.mean(axis=0)
    sd = est.std(axis=0, ddof=1)
    det = sd == 0
    res = np.broadcast_to(np.asarray(res, dtype=np.float64), x.shape)
    assert np.all(np.abs(mean[det] - x[det]) <= 10.0 * res[det] / trials + 1e-30)
    z = (mean[~det] - x[~det]) / (sd[~det] / math.sqrt(trials))
    assert np.max(np.abs(z), initial=0.0) < z_max, np.max(np.abs(z))


def _rounding_gap(name, c, x):
    """Largest possible rounding gap per coordinate for compressor ``name`` on x."""
    ax = np.abs(x.astype(np.float64))
    if name == "qsgd":
        return np.linalg.norm(x.astype(np.float64)) / c.levels
    if name == "terngrad":
        return ax.max()
    if name == "natural":
        return np.maximum(ax, 2.0**-126)
    if name == "randomk":
        return ax * math.ceil(1 / c.ratio)
    return np.linalg.norm(x.astype(np.float64))


@pytest.mark.parametrize("name,params", [("qsgd", {"levels": 4}), ("qsgd", {}),
                                         ("terngrad", {}), ("natural", {}),
                                         ("randomk", {"ratio": 0.25, "unbiased": True}),
                                         ("thc", {"clip": 6.0, "block": 64})])
def test_unbiased_over_seeds(name, params):
    x = rand(64, 11)
    x[5] = 0.0
    x[9] = 1e-39
    c = get_compressor(name, **params)
    ests = []
    for step in range(600):
        p, ctx = c.compress(x, step)
        if name == "thc":
            assert ctx["clipped"] == 0
        ests.append(c.decompress(p, ctx))
    _assert_unbiased(ests, x.astype(np.float64), _rounding_gap(name, c, x))


def test_bias_is_detected():
    """The z-test rejects a biased estimator (deterministic rounding to a coarse grid)."""
    x = rand(64, 11)
    biased = [np.round(x * 2) / 2 + 0.01 * np.sin(np.arange(64) + s) for s in range(600)]
    with pytest.raises(AssertionError):
        _assert_unbiased(biased, x.astype(np.float64), 0.5)
    # and a constant bias on a coordinate that never varies
    with pytest.raises(AssertionError):
        _assert_unbiased([x + 0.01] * 600, x.astype(np.float64), 0.5)


# ----------------------------------------------------------------------------- summability


@pytest.mark.parametrize("name,params", [("none", {}), ("fp16", {}), ("bf16", {}),
                                         ("randomk", {"ratio": 0.1, "seed": 3}),
                                         ("thc", {"clip": 8.0})])
def test_sum_of_payloads_decodes_to_sum(name, params):
    workers = 4
    xs = [rand(1500, 20 + w) for w in range(workers)]
    total = np.sum(np.array(xs, dtype=np.float64), axis=0)
    cs = [get_compressor(name, **params) for _ in range(workers)]
    step = 3
    if name == "thc":
        agreed = max(c.local_norm(x) for c, x in zip(cs, xs, strict=True))
        comp = [c.compress(x, step, norm=agreed) for c, x in zip(cs, xs, strict=True)]
    else:
        comp = [c.compress(x, step) for c, x in zip(cs, xs, strict=True)]
    agg = cs[0].aggregate([p for p, _ in comp])
    y = cs[1].decompress(agg, comp[2][1]).astype(np.float64)
    if name == "none":
        np.testing.assert_allclose(y, total, rtol=1e-6, atol=1e-6)
    elif name in ("fp16", "bf16"):
        eps = 2.0**-11 if name == "fp16" else 2.0**-8
        bound = eps * (workers + 1) * np.sum(np.abs(np.array(xs)), axis=0) + 1e-6
        assert np.all(np.abs(y - total) <= bound)
    elif name == "randomk":
        idx = cs[0].indices(1500, step)
        np.testing.assert_allclose(y[idx], total[idx], rtol=1e-5, atol=1e-5)
        assert np.all(np.delete(y, idx) == 0)
    else:
        ctx = comp[0][1]
        assert all(c[1]["scale"] == ctx["scale"] for c in comp)
        assert sum(c[1]["clipped"] for c in comp) == 0
        d = cs[0].payload_bytes(1500)
        step_q = ctx["scale"] / (cs[0].g // 2)
        assert np.linalg.norm(y - total) <= workers * step_q * math.sqrt(d) * 1.0001
        # linear: decompress(sum) == sum of decompress, up to float rounding
        each = np.sum([cs[0].decompress(p, c) for p, c in comp], axis=0)
        np.testing.assert_allclose(y, each, rtol=1e-4, atol=1e-4)
        assert agg[0].dtype == np.int32


def test_not_summable_refuses_aggregate():
    c = get_compressor("topk")
    p, _ = c.compress(rand(100))
    with pytest.raises(ValueError, match="not summable"):
        c.aggregate([p, p])
    with pytest.raises(ValueError, match="same length"):
        get_compressor("none").aggregate([(rand(3),), (rand(4),)])


# ----------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_encode_decode_roundtrip(name):
    x = rand(777, 12)
    c1, c2 = get_compressor(name), get_compressor(name)
    data = c1.encode(x, 9)
    assert isinstance(data, bytes)
    expected = c2.decompress(*c2.compress(x, 9))  # fresh state: same as c1's first call
    np.testing.assert_array_equal(get_compressor(name).decode(data), expected)
    np.testing.assert_array_equal(decode_any(data), expected)
    assert len(data) <= c1.payload_bytes(777) + 400  # small self-describing header
    with pytest.raises(ValueError, match="truncated|not a valid"):
        decode_any(data[:-1])
    with pytest.raises(ValueError, match="trailing"):
        decode_any(data + b"\0")
    with pytest.raises(ValueError, match="magic"):
        decode_any(b"XXXX" + data[4:])
    other = "none" if name != "none" else "fp16"
    with pytest.raises(ValueError, match="encoded by"):
        get_compressor(other).decode(data)


def test_encode_keeps_params_and_aggregates():
    x = rand(300, 13)
    c = get_compressor("qsgd", levels=16, seed=5)
    p, ctx = c.compress(x, 2)
    np.testing.assert_array_equal(decode_any(c.encode(x, 2)), c.decompress(p, ctx))
    t = get_compressor("thc")
    ps = [t.compress(rand(300, s), 1, norm=50.0) for s in range(3)]
    agg = t.aggregate([p for p, _ in ps])
    np.testing.assert_array_equal(decode_any(t.encode_compressed(agg, ps[0][1])),
                                  t.decompress(agg, ps[0][1]))


# ----------------------------------------------------------------------------- variants


def _parallel_cases():
    x = rand(5000, 31, 3.0)
    x[::97] = 0.0
    y = rand(4096, 32)
    key = rng.stream_key(5, 6, 7)
    h = np.arange(5000, dtype=np.uint16)
    norm = float(red.l2norm(x))
    nchunk = (x.size + sel.SELECT_CHUNK - 1) // sel.SELECT_CHUNK
    return [
        (red._chunk_sums, lambda: (x, 2)), (red._chunk_sums, lambda: (x, 1)),
        (red.absmax, lambda: (x,)), (red.all_finite, lambda: (x,)),
        (sel._count_ge, lambda: (x, np.float32(1.0), np.zeros(nchunk, np.int64))),
        (kbf16._encode_bits, lambda: (x.view(np.uint32), np.empty(x.size, np.uint16))),
        (kfp16._encode_bits_sw, lambda: (x.view(np.uint32), np.empty(x.size, np.uint16))),
        (kfp16._decode_bits_sw, lambda: (h, np.empty(h.size, np.uint32))),
        (kfp16._encode_hw, lambda: (x, np.empty(x.size, np.uint16))),
        (kfp16._decode_hw, lambda: (h, np.empty(h.size, np.float32))),
        (knat._encode_bits, lambda: (x.view(np.uint32), key, np.empty(x.size, np.uint16))),
        (kq.qsgd_quantize, lambda: (x, 256, norm, key, np.empty(x.size, np.int16))),
        (kq.qsgd_quantize, lambda: (x * np.float32(1e-38), 127, norm * 1e-38, key,
                                    np.empty(x.size, np.int8))),
        (ksign._sign_words, lambda: (x[:4992], np.empty(624, np.uint8))),
        (ktern.terngrad_quantize, lambda: (x, float(red.absmax(x)), key,
                                           np.empty(x.size, np.int8))),
        (kthc.rht_forward, lambda: (x, 1024, key, np.empty(5120, np.float32))),
        (kthc.rht_inverse, lambda: (y, 1024, key, 4000, np.empty(4000, np.float32))),
        (kthc.thc_quantize, lambda: (y, 2.0, 8, key, np.empty(y.size, np.int8))),
    ]


def test_parallel_variants_equal_serial():
    """Every @kernel's prange variant (used from PAR_MIN elements) equals its serial one."""
    for fn, make in _parallel_cases():
        a, b = make(), make()
        ra, rb = fn.serial(*a), fn.parallel(*b)
        np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb), err_msg=str(fn))
        for u, v in zip(a, b, strict=True):
            if isinstance(u, np.ndarray):
                np.testing.assert_array_equal(u, v, err_msg=str(fn))


def test_fp16_software_path_matches_numpy():
    """The portable fallback (hosts without hardware half conversion) is bit-exact too."""
    x = np.concatenate([rand(50_000, 33, 100.0), _special_floats()]).astype(np.float32)
    out = np.empty(x.size, np.uint16)
    kfp16.fp16_encode_sw(x, out)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out, ref.fp16_encode(x))
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    back = np.empty(h.size, np.float32)
    kfp16.fp16_decode_sw(h, back)
    np.testing.assert_array_equal(back.view(np.uint32), ref.fp16_decode(h).view(np.uint32))


def test_kernels_callable_from_njit_per_packet():
    """The data path calls the codecs per packet from its own @njit code."""
    from numba import njit

    from testbed.kernels.compressors.bf16 import bf16_encode
    from testbed.kernels.compressors.fp16 import fp16_encode
    from testbed.kernels.compressors.qsgd import qsgd_quantize
    from testbed.kernels.compressors.signsgd import sign_pack

    @njit
    def per_packet(frames, key, h16, b16, bits, q):
        for p in range(frames.shape[0]):
            x = frames[p]
            fp16_encode(x, h16[p])
            bf16_encode(x, b16[p])
            sign_pack(x, bits[p])
            qsgd_quantize(x, 256, red.l2norm(x), key, q[p])

    frames = rand(4 * 256, 40).reshape(4, 256)
    key = rng.stream_key(0, 3, 0)
    h16, b16 = np.empty((4, 256), np.uint16), np.empty((4, 256), np.uint16)
    bits, q = np.empty((4, 32), np.uint8), np.empty((4, 256), np.int16)
    per_packet(frames, key, h16, b16, bits, q)
    for p in range(4):
        x = frames[p]
        np.testing.assert_array_equal(h16[p], ref.fp16_encode(x))
        np.testing.assert_array_equal(b16[p], ref.bf16_encode(x))
        np.testing.assert_array_equal(bits[p], ref.sign_pack(x))
        np.testing.assert_array_equal(q[p], ref.qsgd_quantize(x, 256, red.l2norm(x), key, np.int16))


@FAST
@given(finite_vectors(1, 200), st.data())
def test_kth_smallest_gather_scatter_equal_twins(x, data):
    j = data.draw(st.integers(0, x.size - 1))
    a = x.copy()
    assert sel.kth_smallest(a, j) == np.sort(x)[j]
    assert np.array_equal(np.sort(a), np.sort(x))  # only permuted
    idx = np.unique(data.draw(hnp.arrays(np.int32, st.integers(0, x.size),
                                         elements=st.integers(0, x.size - 1))))
    from testbed.kernels.compressors.topk import gather, scatter

    vals = np.empty(idx.size, np.float32)
    gather(x, idx, vals)
    np.testing.assert_array_equal(vals, x[idx])
    out = np.zeros(x.size, np.float32)
    scatter(vals, idx, out)
    expect = np.zeros(x.size, np.float32)
    expect[idx] = x[idx]
    np.testing.assert_array_equal(out, expect)


def test_cached_parallel_path_in_fresh_process():
    """A new process that loads the kernels from Numba's cache and takes the prange path
    (>= PAR_MIN elements) through a serial caller must not crash (it did when the thread
    pool was not started at import)."""
    import subprocess
    import sys

    n = PAR_MIN + 123
    x = rand(n, 50)
    idx = np.empty(n // 100, np.int32)
    sel.topk_select(x, n // 100, idx)  # compiled (and cached) here
    code = ("import numpy as np\n"
            "from testbed.kernels.compressors._select import topk_select\n"
            "from testbed.kernels.compressors.signsgd import sign_pack\n"
            f"x = np.random.default_rng(50).standard_normal({n}).astype(np.float32)\n"
            f"idx = np.empty({n // 100}, np.int32)\n"
            f"topk_select(x, {n // 100}, idx)\n"
            f"bits = np.empty({(n + 7) // 8}, np.uint8)\n"
            "sign_pack(x, bits)\n"
            "assert np.array_equal(bits, np.packbits(x >= 0, bitorder='little'))\n"
            "print(int(idx.sum()))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) == int(idx.astype(np.int64).sum())
