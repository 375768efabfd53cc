"""The counter-based generator family (``testbed.kernels.rng``) against its numpy twins."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from testbed.kernels import rng
from testbed.kernels.reference import rng as ref

U64 = st.integers(0, 2**64 - 1)


@njit
def _draws(keys, idx):
    h = np.empty(idx.size, np.uint64)
    u = np.empty(idx.size, np.float64)
    for j in range(idx.size):
        h[j] = rng.hash_u32(idx[j], keys[j])
        u[j] = rng.uniform(idx[j], keys[j])
    return h, u


@njit
def _uniform01(seed, counters):
    out = np.empty(counters.size)
    for j in range(counters.size):
        out[j] = rng.uniform01(seed, counters[j])
    return out


@njit
def _counter_keys(seed, hi):
    out = np.empty(hi.size, np.uint64)
    for j in range(hi.size):
        out[j] = rng.counter_key(seed, hi[j])
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
                min_size=1, max_size=50))
def test_hash_and_uniform_equal_twins(pairs):
    idx = np.array([p[0] for p in pairs], np.int64)
    keys = np.array([p[1] for p in pairs], np.uint64)
    h, u = _draws(keys, idx)
    np.testing.assert_array_equal(h, ref.hash_u32(idx, keys))
    np.testing.assert_array_equal(u, ref.uniform(idx, keys))


@settings(max_examples=40, deadline=None)
@given(U64, st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=50))
def test_uniform01_equals_twin_for_64_bit_seeds_and_counters(seed, counters):
    c = np.array(counters, np.int64)
    np.testing.assert_array_equal(_uniform01(np.uint64(seed), c), ref.uniform01(seed, c))
    hi = (c >> 32).astype(np.uint64)
    np.testing.assert_array_equal(_counter_keys(np.uint64(seed), hi), ref.counter_key(seed, hi))


def test_uniform01_does_not_repeat_past_2_32():
    """The high word of a 64-bit counter selects another key: counters 2**32 apart differ."""
    c = np.arange(1000, dtype=np.int64)
    a = ref.uniform01(42, c)
    b = ref.uniform01(42, c + 2**32)
    assert np.mean(a == b) < 0.01
    np.testing.assert_array_equal(_uniform01(np.uint64(42), c + 2**32), b)


def test_uniform_draws_look_uniform():
    u = ref.uniform01(7, np.arange(200_000, dtype=np.int64) * 4)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)
    hist = np.bincount((u * 16).astype(np.int64), minlength=16)
    expect = u.size / 16
    chi2 = float(((hist - expect) ** 2 / expect).sum())
    assert chi2 < 50  # 15 degrees of freedom: p < 1e-5 beyond ~44


@njit
def _draws16(idx, key):
    out = np.empty(idx.size, np.int64)
    for j in range(idx.size):
        out[j] = rng.draw16(idx[j], key)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=50), st.integers(0, 2**32 - 1))
def test_draw16_equals_twin(idx, key):
    i = np.array(idx, np.int64)
    np.testing.assert_array_equal(_draws16(i, np.uint64(key)), ref.draw16(i, key))


def test_draw16_halves_of_one_hash_look_uniform_and_independent():
    """Elements i and i + 8 of a 16-block share a hash (low and high halves)."""
    key = rng.stream_key(9, 1, 2)
    d = ref.draw16(np.arange(320_000), key)
    h = ref.hash_u32(np.arange(160_000), key).astype(np.int64)
    blocks = d.reshape(-1, 16)
    np.testing.assert_array_equal(blocks[:, :8].ravel(), h & 0xFFFF)
    np.testing.assert_array_equal(blocks[:, 8:].ravel(), h >> 16)
    assert d.min() >= 0 and d.max() < 2**16
    for v in (d >> 12, d & 15):  # the top and the bottom 4 bits
        hist = np.bincount(v, minlength=16)
        expect = d.size / 16
        assert float(((hist - expect) ** 2 / expect).sum()) < 50
    lo, hi = blocks[:, :8].ravel() / 2**16 - 0.5, blocks[:, 8:].ravel() / 2**16 - 0.5
    assert abs(np.corrcoef(lo, hi)[0, 1]) < 5 / math.sqrt(lo.size)


def test_stream_key_is_a_32_bit_function_of_seed_step_salt():
    keys = {int(rng.stream_key(s, t, salt)) for s in range(8) for t in range(8)
            for salt in (0, 1)}
    assert len(keys) == 128 and max(keys) < 2**32
    assert rng.stream_key(3, 4, 5) == rng.stream_key(3, 4, 5)
    assert ref.stream_key is rng.stream_key  # pure Python, shared by kernels and twins
