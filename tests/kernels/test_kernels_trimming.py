"""Trimming layout and trim_frame against the numpy twin, scapy and statistics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numba import njit
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from testbed.datapath.batch import DropReason
from testbed.kernels import packets as pk
from testbed.kernels import trimming as tr
from testbed.kernels import wire
from testbed.kernels.reference import packets as ref_pk
from testbed.kernels.reference import trimming as ref

F32_MAX = np.finfo(np.float32).max


def adversarial(m: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(m).astype(np.float32)
    special = np.array([0.0, -0.0, 2.0**-149, -(2.0**-149), F32_MAX, -F32_MAX, 1e-38],
                       dtype=np.float32)
    k = min(m, special.size)
    if k:
        x[rng.choice(m, k, replace=False)] = special[:k]
    return x


@pytest.mark.parametrize("bits", tr.BITS_ALLOWED)
@pytest.mark.parametrize("m", [0, 1, 3, 255, 256, 361])
def test_encode_matches_twin_and_full_decode_is_bit_exact(bits, m):
    rng = np.random.default_rng(m * 10 + bits)
    x = adversarial(m, rng) if m % 2 else rng.standard_normal(m).astype(np.float32)
    p = tr.encode(x, bits, seed=42, counter=1000)
    assert np.array_equal(p, ref.encode(x, bits, 42, 1000))
    assert p.size == tr.total_bytes_for(m, bits) and tr.head_bytes_for(m, bits) % 4 == 0
    y, full = tr.decode(p, m)
    assert full and np.array_equal(y.view(np.uint32), x.view(np.uint32))  # -0.0, denormals
    head = tr.trim(p)
    assert head.size == tr.head_bytes_for(m, bits)
    z, full = tr.decode(head, m)
    z_ref, full_ref = ref.decode(head, m)
    assert full == full_ref == (m == 0)  # an empty chunk has no tail to lose
    assert np.array_equal(z, z_ref)
    # a head is one of the two grid points around x: error at most one step 2s/L
    s = np.float64(np.abs(x).max()) if m else 0.0
    step = 2 * s / (2**bits - 1)
    assert (np.abs(z.astype(np.float64) - x) <= step * (1 + 1e-6)).all()


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_trimmed_decode_is_unbiased(bits):
    rng = np.random.default_rng(bits)
    m, seeds = 256, 600
    x = rng.standard_normal(m).astype(np.float32)
    x[0] = 0.0
    x[1] = np.abs(x).max()  # at the top of the grid: deterministic
    acc = np.zeros(m)
    for seed in range(seeds):
        acc += tr.decode(tr.trim(tr.encode(x, bits, seed=seed)), m)[0]
    mean = acc / seeds
    s = np.float64(np.abs(x).max())
    levels = 2**bits - 1
    u = (x / s + 1) / 2 * levels
    frac = u - np.floor(u)
    sigma = 2 * s / levels * np.sqrt(frac * (1 - frac) / seeds)  # std of the mean
    err = np.abs(mean - x)
    assert (err <= 5 * sigma + 1e-6 * s).all(), err.max()
    assert err[1] <= 1e-6 * s
    # and not a constant-offset estimator: the mean error is tiny relative to the spread
    assert abs((mean - x).mean()) < 5 * np.sqrt((sigma**2).sum()) / m + 1e-6


def test_zero_chunk_and_distinct_streams():
    z = np.zeros(100, np.float32)
    y, full = tr.decode(tr.trim(tr.encode(z, 2, seed=3)), 100)
    assert not full and (y == 0).all()
    x = np.full(64, 0.25, np.float32)
    x[0] = 1.0
    a = tr.encode(x, 1, seed=1, counter=0)
    b = tr.encode(x, 1, seed=1, counter=64)
    c = tr.encode(x, 1, seed=2, counter=0)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(a, tr.encode(x, 1, seed=1, counter=0))  # reproducible


def test_chunked_kernels_match_per_chunk_and_twin():
    rng = np.random.default_rng(5)
    chunk, nch = 256, 9
    x = rng.standard_normal(chunk * nch).astype(np.float32)
    total = tr.total_bytes_for(chunk, 1)
    out = np.zeros((nch, total), np.uint8)
    out_p = np.zeros((nch, total), np.uint8)
    nb = np.zeros(nch, np.int32)
    tr.encode_chunks_into(x, chunk, 1, 9, out, nb)
    tr.encode_chunks_into_par(x, chunk, 1, 9, out_p, nb)
    assert np.array_equal(out, out_p) and (nb == total).all()
    assert np.array_equal(out, ref.encode_chunks(x, chunk, 1, 9))
    for c in range(nch):
        assert np.array_equal(out[c], tr.encode(x[c * chunk:(c + 1) * chunk], 1, 9, c * chunk))
    y = np.empty_like(x)
    assert tr.decode_chunks_into(out, nb, chunk, y) == 0
    assert np.array_equal(y, x)
    hb = tr.head_bytes_for(chunk, 1)
    heads = np.ascontiguousarray(out[:, :hb])
    hbs = np.full(nch, hb, np.int32)
    assert tr.decode_chunks_into_par(heads, hbs, chunk, y) == 0
    assert np.array_equal(y, ref.decode_chunks(heads, chunk, True))
    hbs[3] = hb - 4  # malformed row is counted
    assert tr.decode_chunks_into(heads, hbs, chunk, y) == 1


@settings(max_examples=25, deadline=None)
@given(arrays(np.float32, st.integers(0, 400),
              elements=st.floats(-float(F32_MAX), float(F32_MAX), width=32)),
       st.sampled_from(tr.BITS_ALLOWED), st.integers(0, 2**40))
def test_hypothesis_roundtrip(x, bits, seed):
    p = tr.encode(x, bits, seed=seed)
    assert np.array_equal(p, ref.encode(x, bits, seed, 0))
    y, full = tr.decode(p, x.size)
    assert full and np.array_equal(y.view(np.uint32), x.view(np.uint32))
    z, _ = tr.decode(tr.trim(p), x.size)
    assert np.isfinite(z).all()


def _trim_layout_frame(m=256, bits=1, seed=0):
    x = np.random.default_rng(seed).standard_normal(m).astype(np.float32)
    h = wire.new_headers(1)
    h["codec"] = int(wire.Codec.TRIM_LAYOUT)
    h["elem_count"] = m
    h["head_bytes"] = tr.head_bytes_for(m, bits)
    h["flags"] = int(wire.Flags.LAST)
    payload = tr.encode(x, bits, seed=seed)
    buf, length = pk.build(h, [payload], "02:00:00:00:00:01", "02:54:42:00:00:fe",
                           "10.0.0.1", "10.0.0.2", 40001)
    return x, payload, buf, length


def test_trim_frame_output_parses_and_checksums_verify():
    x, payload, buf, length = _trim_layout_frame()
    original = bytes(buf[0, :length[0]])
    new = tr.trim_frame(buf[0], length[0])
    hb = tr.head_bytes_for(256, 1)
    assert new == wire.PAYLOAD_OFFSET + hb
    trimmed = bytes(buf[0, :new])
    assert trimmed == ref.trim_frame(original)
    headers, status = pk.parse(buf, np.array([new], np.int32))
    assert status[0] == 0
    assert headers["flags"][0] == int(wire.Flags.LAST | wire.Flags.TRIMMED)
    assert pk.ipv4_checksum_ok(buf[0])
    p = Ether(trimmed)
    assert p[IP].len == new - wire.ETH_LEN and p[UDP].len == new - wire.ETH_LEN - 20
    assert p[UDP].chksum == 0
    ip_only = p[IP].copy()
    del ip_only.chksum
    assert IP(bytes(ip_only))[IP].chksum == p[IP].chksum
    body = np.frombuffer(bytes(p[UDP].payload)[wire.HEADER_LEN:], np.uint8)
    y, full = tr.decode(body, 256)
    assert not full and np.array_equal(y, tr.decode(tr.trim(payload), 256)[0])
    # trimming again changes nothing
    assert tr.trim_frame(buf[0], new) == new
    assert bytes(buf[0, :new]) == trimmed


def test_trim_frame_not_trimmable_and_invalid():
    _, _, buf, length = _trim_layout_frame(m=16)
    wire.unpack_header(buf[0], wire.HEADER_OFFSET)["head_bytes"] = 0  # a view: in place
    before = buf[0].copy()
    assert tr.trim_frame(buf[0], length[0]) == length[0]
    assert np.array_equal(buf[0], before)
    assert tr.trim_frame(buf[0], 20) == -int(DropReason.TOO_SHORT)
    wire.unpack_header(buf[0], wire.HEADER_OFFSET)["magic"] = 0
    assert tr.trim_frame(buf[0], length[0]) == -int(DropReason.BAD_MAGIC)
    rnd = np.random.default_rng(1).integers(0, 256, 2048, dtype=np.uint8)
    assert tr.trim_frame(rnd, 1500) < 0


@njit(cache=True)
def _trim_stage(buf, length, n):
    """A data-path-like trim stage: trim every frame from njit code."""
    return tr.trim_frames(buf, length, n)


def test_trim_frames_from_njit():
    frames = [_trim_layout_frame(m=m, bits=b, seed=m) for m, b in ((10, 1), (256, 2), (300, 8))]
    buf = np.concatenate([f[2] for f in frames])
    length = np.concatenate([f[3] for f in frames])
    originals = [bytes(buf[i, :length[i]]) for i in range(3)]
    assert _trim_stage(buf, length, 3) == 3
    for i in range(3):
        assert bytes(buf[i, :length[i]]) == ref.trim_frame(originals[i])
        status, _ = ref_pk.parse_frame(buf[i], int(length[i]))
        assert status == 0


def test_bad_input_raises_clear_errors():
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="bits"):
        tr.encode(x, bits=3)
    with pytest.raises(TypeError, match="x: expected a 1-D float32"):
        tr.encode(x.astype(np.float64))
    with pytest.raises(ValueError, match="x: element 2 is nan"):
        bad = x.copy()
        bad[2] = np.nan
        tr.encode(bad)
    with pytest.raises(ValueError, match="x: element 0 is inf"):
        tr.encode(np.array([np.inf], np.float32))
    with pytest.raises(ValueError, match="seed"):
        tr.encode(x, seed=-1)
    p = tr.encode(x)
    with pytest.raises(ValueError, match="payload"):
        tr.decode(p[:-1], 8)
    with pytest.raises(ValueError, match="payload"):
        tr.decode(p, 9)
    with pytest.raises(TypeError, match="payload"):
        tr.decode(p.astype(np.int8), 8)
    with pytest.raises(ValueError, match="m: element count"):
        tr.decode(p, -1)
    assert tr.max_elements(1) * 4 + tr.head_bytes_for(tr.max_elements(1), 1) <= pk.PAYLOAD_MAX
