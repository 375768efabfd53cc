"""Fixed-point aggregation kernels: SwitchML block floating point and ATP fixed factor.

(Longer than the 500-line guide: the two schemes share their block drivers, parallel forms
and argument checks, which a split would spread over two modules.)

SwitchML style (per-chunk shared exponent, an n-way int32 sum that cannot overflow)
-------------------------------------------------------------------------------------

* A *chunk* is the elements of one packet (``DEFAULT_CHUNK`` = 256). Each worker computes the
  chunk's exponent ``e``: the smallest integer with ``2**e >= max|x|``. An all-zero chunk gets
  ``EXP_MIN`` (-149: the exponent of the smallest float32 denormal, 2**-149), which is the
  identity of the max-combine. Denormals are exact: ``x = 2**-149`` gets ``e = -149``.
  A chunk holding inf/NaN gets ``EXP_NONFINITE`` (the Python wrappers reject such input
  earlier with a ``ValueError``).
* The workers agree on ``e_max`` = max of their exponents (one packet ahead, SwitchML). The
  scale is ``f = K / 2**e_max`` with ``K = floor(INT32_MAX / n)``. (SwitchML writes
  ``INT32_MAX / (n * 2**e_max)``; flooring K makes ``|q| <= K`` hold *after* rounding, so
  ``n * |q| <= INT32_MAX`` even when every worker sends ``+2**e_max``: no overflow for any
  ``1 <= n <= N_MAX``.)
* ``q = round_half_even(x * f)`` (float64 arithmetic), the aggregator adds the int32 q's,
  ``x_hat = Q / f`` (rounded to float32).

Error bound of an n-way sum, per element of a chunk with scale f (documented contract, the
tests check it): ``|x_hat - sum(x)| <= n * (0.5 + 2**-20) / f + 2**-23 * |x_hat| + 2**-149``.
The first term is the rounding of each worker's ``x * f`` (half a quantum each; the
``2**-20`` covers the float64 rounding of the product, which carries up to 55 significant
bits); the second and third are the final rounding to float32 (which dominates:
``0.5/f ~ n * 2**e_max * 2**-32``). Huge values are fine: ``e_max`` goes up to 128
(float32 max ~ 2**128) and f is computed in float64; a sum beyond the float32 range
dequantises to +-inf, as the float32 sum itself would.

ATP style (fixed factor, default 1e6, overflow detected)
--------------------------------------------------------

``q = round(x * factor)``. Values whose product does not fit int32, and int32 additions that
would wrap, set an *overflow flag* that the kernels return (ATP's worker then resends the raw
floats); the stored value saturates at INT32_MIN/INT32_MAX, it never silently wraps.
Error of an n-way sum without overflow: ``n * 0.5 / factor`` plus the float32 rounding.

Numba-callable kernels (``@njit(cache=True)``; arguments are numpy arrays and numbers):

* per packet (serial): ``block_exponent(x) -> int``, ``scale_for(e_max, n) -> float``,
  ``quantize_into(x, scale, out)``, ``add_into(acc, q)``, ``dequantize_into(q, scale, out)``,
  ``atp_quantize_into(x, factor, out) -> bool``, ``atp_add_into(acc, q) -> bool``,
  ``atp_dequantize_into(q, factor, out)``.
  (the per-packet kernels work on whole tensors too; ATP has no chunks.)
* whole tensors, one exponent per chunk: ``chunk_exponents_into(x, chunk, out)``,
  ``quantize_chunks_into(x, exps, n, chunk, out)``, ``dequantize_chunks_into(q, exps, n,
  chunk, out)``.
* ``parallel=True`` forms of the whole-tensor kernels, suffix ``_par``:
  ``chunk_exponents_into_par``, ``quantize_chunks_into_par``, ``dequantize_chunks_into_par``,
  ``add_into_par``, ``atp_quantize_into_par``, ``atp_add_into_par``,
  ``atp_dequantize_into_par`` (same arguments). Use them from Python on big tensors on an
  idle machine; from per-packet njit code use the serial ones.

The chunked SwitchML kernels and the ATP quantise/dequantise run in explicit SIMD blocks
(``testbed.kernels.simd``; a block may straddle two chunks, each lane gets its own chunk's
scale) and, for outputs of ``STREAM_MIN_BYTES`` or more, write with streaming stores: a
memory-bound kernel then moves 8 bytes per element instead of 12. Results are bit-identical
with the element-by-element formulas above (and the numpy twins).

The njit kernels assume finite input and, for SwitchML quantisation, ``max|x| <= 2**e_max``
(true by construction when ``e_max`` is the agreed max). The Python wrappers (``exponents``,
``quantize``, ``aggregate``, ``dequantize``, ``allreduce``, ``error_bound``,
``atp_quantize``, ``atp_aggregate``, ``atp_dequantize``) check dtypes, lengths, ``n`` and
finiteness and raise ``TypeError``/``ValueError`` naming the parameter.

Why one module this long: the block-floating-point kernels call each other inside ``@njit``
code, and Numba's on-disk cache keys a function on its own file only (a callee in another file
can leave a stale caller compiled); each kernel keeps its twin in ``kernels/reference``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_array, check_finite
from testbed.kernels.packets import f32_from_bits
from testbed.kernels.parallel import PAR_BLOCKS, block_range
from testbed.kernels.simd import (
    LANES,
    STREAM_MIN_BYTES,
    aligned_head,
    atp_fast_limit,
    atp_quantize_block,
    contiguous,
    scale_block,
    store_fence,
)

INT32_MAX = 2147483647
INT32_MIN = -2147483648
#: Exponent of an all-zero chunk (2**-149 is the smallest float32 denormal).
EXP_MIN = -149
#: Exponent of the largest finite float32 (< 2**128).
EXP_MAX = 128
#: Returned by ``block_exponent`` for a chunk holding inf or NaN.
EXP_NONFINITE = 32767
#: Elements per packet / per exponent (SwitchML's client default).
DEFAULT_CHUNK = 256
#: Most workers an aggregation may have (int32 headroom is split n ways).
N_MAX = 64
#: ATP's fixed quantisation factor.
ATP_FACTOR = 1e6

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_FINITE = "fixed-point aggregation needs finite values (clip or drop inf/NaN before quantising)"


# ---------------------------------------------------------------------------------------------
# SwitchML block floating point: per packet


@njit(cache=True)
def block_exponent(x):
    """Smallest e with ``2**e >= max|x|`` over float32 array ``x``; ``EXP_MIN`` for all zeros
    (or empty), ``EXP_NONFINITE`` when x holds inf/NaN."""
    # max of |x| on the IEEE bit patterns: for non-negative floats the uint32 order is the
    # float order, the integer max vectorises, and inf/NaN show up as bits >= 0x7F800000.
    bits = x.view(np.uint32)
    m = np.uint32(0)
    for i in range(bits.shape[0]):
        b = bits[i] & _ABS_MASK
        if b > m:
            m = b
    if m >= _INF_BITS:
        return EXP_NONFINITE
    if m == 0:
        return EXP_MIN
    mant, ex = math.frexp(np.float64(f32_from_bits(m)))
    e = ex - 1 if mant == 0.5 else ex
    return max(e, EXP_MIN)


@njit(cache=True)
def scale_for(e_max, n):
    """Scale ``f = floor(INT32_MAX / n) / 2**e_max`` (float64) for n workers."""
    return math.ldexp(np.float64(INT32_MAX // n), -e_max)


@njit(cache=True)
def quantize_into(x, scale, out):
    """``out[i] = round_half_even(x[i] * scale)`` as int32 (needs ``|x| * scale <= INT32_MAX``)."""
    s = np.float64(scale)
    for i in range(x.shape[0]):
        out[i] = np.int32(np.rint(np.float64(x[i]) * s))


@njit(cache=True)
def add_into(acc, q):
    """``acc += q`` (int32). With the SwitchML scale an n-way sum cannot overflow."""
    for i in range(acc.shape[0]):
        acc[i] += q[i]


@njit(cache=True)
def dequantize_into(q, scale, out):
    """``out[i] = float32(q[i] / scale)``."""
    inv = 1.0 / np.float64(scale)
    for i in range(q.shape[0]):
        out[i] = np.float32(np.float64(q[i]) * inv)


# ---------------------------------------------------------------------------------------------
# SwitchML block floating point: whole tensors, chunk-parallel


@njit(cache=True)
def chunk_exponents_into(x, chunk, out):
    """``out[c] = block_exponent(x[c*chunk:(c+1)*chunk])`` for every chunk (last may be short)."""
    nch = (x.shape[0] + chunk - 1) // chunk
    for c in range(nch):
        lo = c * chunk
        hi = min(lo + chunk, x.shape[0])
        out[c] = block_exponent(x[lo:hi])


#: 2**-e for every agreed exponent e in [EXP_MIN, EXP_MAX], exact in float64: the
#: whole-tensor kernels scale a chunk without a libm ``ldexp`` call (same value as scale_for).
_POW2_NEG = np.array([2.0 ** -e for e in range(EXP_MIN, EXP_MAX + 1)])


@njit(cache=True, inline="always")
def _chunk_scale(e, k):
    """``scale_for(e, n)`` for ``k = INT32_MAX // n`` (exact: k times a power of two)."""
    return k * _POW2_NEG[min(max(np.int64(e) - EXP_MIN, 0), EXP_MAX - EXP_MIN)]


@njit(cache=True, inline="always")
def _chunk_factor(e, k, inverse):
    """What a chunk's elements are multiplied by: its scale, or ``1 / scale`` to dequantise
    (the same expression as :func:`dequantize_into`, hence the same float64)."""
    s = _chunk_scale(e, k)
    return 1.0 / s if inverse else s


@njit(cache=True, inline="always")
def _scalar_chunks(src, exps, k, chunk, lo, hi, out, inverse):
    """Elements ``lo:hi`` of :func:`quantize_chunks_into` (or, with ``inverse``, of
    :func:`dequantize_chunks_into`), one at a time."""
    for i in range(lo, hi):
        v = np.float64(src[i]) * _chunk_factor(exps[i // chunk], k, inverse)
        out[i] = v if inverse else np.rint(v)


@njit(cache=True)
def _scale_chunks(src, exps, n, chunk, out, stream, inverse):
    """:func:`quantize_chunks_into` (``inverse`` False) or :func:`dequantize_chunks_into`
    (True) in LANES-wide blocks (``chunk >= LANES``), streaming the stores when ``stream``.
    A block that straddles two chunks multiplies each lane by its own chunk's factor, so the
    blocks can follow the output's alignment."""
    length = src.shape[0]
    nch = (length + chunk - 1) // chunk
    k = np.float64(INT32_MAX // n)
    head = min(aligned_head(out, 0) if stream else 0, length)
    _scalar_chunks(src, exps, k, chunk, 0, head, out, inverse)
    i = head
    bound = chunk  # first element of the chunk after the current one (head < chunk)
    c = 0
    f_cur = _chunk_factor(exps[0], k, inverse) if nch else 1.0
    f_next = _chunk_factor(exps[1], k, inverse) if nch > 1 else f_cur
    while i + LANES <= length:
        if i >= bound:
            c += 1
            bound += chunk
            f_cur = f_next
            f_next = _chunk_factor(exps[c + 1], k, inverse) if c + 1 < nch else f_cur
        if bound - i < LANES:  # the block straddles chunks c and c + 1
            scale_block(src, i, out, f_cur, f_next, bound - i, stream)
            i += LANES
        else:  # the blocks inside chunk c (split = LANES folds the per-lane select away)
            stop = min(bound, length) - LANES
            while i <= stop:
                scale_block(src, i, out, f_cur, f_cur, LANES, stream)
                i += LANES
    if stream:
        store_fence()
    _scalar_chunks(src, exps, k, chunk, i, length, out, inverse)


@njit(cache=True, inline="always")
def _chunks_into(src, exps, n, chunk, out, stream, inverse):
    if chunk < LANES or not (contiguous(src) and contiguous(out)):
        _scalar_chunks(src, exps, np.float64(INT32_MAX // n), chunk, 0, src.shape[0], out,
                       inverse)
    else:
        _scale_chunks(src, exps, n, chunk, out, stream, inverse)


@njit(cache=True)
def quantize_chunks_into(x, exps, n, chunk, out):
    """Quantise each chunk with the scale of its agreed exponent ``exps[c]`` for n workers
    (``exps`` in [EXP_MIN, EXP_MAX]). Tensors of ``STREAM_MIN_BYTES`` and more are written
    with streaming stores (they would not stay in the caches anyway)."""
    _chunks_into(x, exps, n, chunk, out, 4 * x.shape[0] >= STREAM_MIN_BYTES, False)


@njit(cache=True)
def dequantize_chunks_into(q, exps, n, chunk, out):
    """Dequantise each chunk with the scale of its agreed exponent ``exps[c]`` (streaming
    stores from ``STREAM_MIN_BYTES``, as :func:`quantize_chunks_into`)."""
    _chunks_into(q, exps, n, chunk, out, 4 * q.shape[0] >= STREAM_MIN_BYTES, True)


# Parallel versions: the tensor is split into PAR_BLOCKS blocks of whole chunks (one prange
# iteration each) that run the serial kernel. Worth it only on an idle multi-core machine: on
# a loaded one a parallel region waits for its slowest (descheduled) thread.


@njit(cache=True, parallel=True)
def chunk_exponents_into_par(x, chunk, out):
    """Parallel :func:`chunk_exponents_into`."""
    nch = (x.shape[0] + chunk - 1) // chunk
    nb = PAR_BLOCKS
    for b in prange(nb):
        c0, c1, lo, hi = block_range(b, nb, nch, chunk, x.shape[0])
        chunk_exponents_into(x[lo:hi], chunk, out[c0:c1])


@njit(cache=True, parallel=True)
def quantize_chunks_into_par(x, exps, n, chunk, out):
    """Parallel :func:`quantize_chunks_into`."""
    nch = (x.shape[0] + chunk - 1) // chunk
    nb = PAR_BLOCKS
    stream = 4 * x.shape[0] >= STREAM_MIN_BYTES
    for b in prange(nb):
        c0, c1, lo, hi = block_range(b, nb, nch, chunk, x.shape[0])
        _chunks_into(x[lo:hi], exps[c0:c1], n, chunk, out[lo:hi], stream, False)


@njit(cache=True, parallel=True)
def dequantize_chunks_into_par(q, exps, n, chunk, out):
    """Parallel :func:`dequantize_chunks_into`."""
    nch = (q.shape[0] + chunk - 1) // chunk
    nb = PAR_BLOCKS
    stream = 4 * q.shape[0] >= STREAM_MIN_BYTES
    for b in prange(nb):
        c0, c1, lo, hi = block_range(b, nb, nch, chunk, q.shape[0])
        _chunks_into(q[lo:hi], exps[c0:c1], n, chunk, out[lo:hi], stream, True)


@njit(cache=True, parallel=True)
def add_into_par(acc, q):
    """Parallel :func:`add_into` over a whole tensor."""
    nb = PAR_BLOCKS
    for b in prange(nb):
        _, _, lo, hi = block_range(b, nb, acc.shape[0], 1, acc.shape[0])
        add_into(acc[lo:hi], q[lo:hi])


# ---------------------------------------------------------------------------------------------
# ATP fixed factor with overflow detection


@njit(cache=True, inline="always")
def _atp_quantize_scalar(x, f, lo, hi, out):
    """Elements ``lo:hi`` of :func:`atp_quantize_into`; returns how many did not fit."""
    top = np.float64(INT32_MAX)
    bottom = np.float64(INT32_MIN)
    bad = 0
    for i in range(lo, hi):
        r = np.rint(np.float64(x[i]) * f)
        bad += (r > top) | (r < bottom) | (r != r)
        r = 0.0 if r != r else r  # NaN -> 0 (a NaN cast is undefined)
        r = top if r > top else r
        r = bottom if r < bottom else r
        out[i] = np.int32(r)
    return bad


@njit(cache=True)
def _atp_quantize(x, factor, out, stream):
    """:func:`atp_quantize_into` in LANES-wide blocks, streaming the stores when ``stream``;
    returns a non-zero value when an element did not fit."""
    n = x.shape[0]
    f = np.float64(factor)
    if not (contiguous(x) and contiguous(out)):
        return _atp_quantize_scalar(x, f, 0, n, out)
    limit = atp_fast_limit(f)
    head = min(aligned_head(out, 0) if stream else 0, n)
    bad = _atp_quantize_scalar(x, f, 0, head, out)
    i = head
    while i + LANES <= n:
        bad |= atp_quantize_block(x, i, out, f, limit, stream)
        i += LANES
    if stream:
        store_fence()
    return bad | _atp_quantize_scalar(x, f, i, n, out)


@njit(cache=True)
def atp_quantize_into(x, factor, out):
    """``out[i] = round(x[i] * factor)`` as int32; return True when any product does not fit
    int32 (or is NaN): those entries saturate (NaN -> 0), nothing wraps. Streaming stores
    from ``STREAM_MIN_BYTES``."""
    return _atp_quantize(x, factor, out, 4 * x.shape[0] >= STREAM_MIN_BYTES) > 0


@njit(cache=True)
def atp_add_into(acc, q):
    """``acc += q`` in int64 with a check; return True when any sum leaves int32 (that entry
    saturates)."""
    bad = 0
    for i in range(acc.shape[0]):
        s = np.int64(acc[i]) + np.int64(q[i])
        bad += (s > INT32_MAX) | (s < INT32_MIN)
        s = INT32_MAX if s > INT32_MAX else s
        s = INT32_MIN if s < INT32_MIN else s
        acc[i] = np.int32(s)
    return bad > 0


@njit(cache=True)
def _atp_dequantize(q, factor, out, stream):
    """:func:`atp_dequantize_into` in LANES-wide blocks, streaming the stores when ``stream``."""
    n = q.shape[0]
    inv = 1.0 / np.float64(factor)
    head = n if not (contiguous(q) and contiguous(out)) else min(
        aligned_head(out, 0) if stream else 0, n)
    for i in range(head):
        out[i] = np.float32(np.float64(q[i]) * inv)
    i = head
    while i + LANES <= n:
        scale_block(q, i, out, inv, inv, LANES, stream)
        i += LANES
    if stream:
        store_fence()
    for j in range(i, n):
        out[j] = np.float32(np.float64(q[j]) * inv)


@njit(cache=True)
def atp_dequantize_into(q, factor, out):
    """``out[i] = float32(q[i] / factor)`` (as ``q[i] * (1 / factor)`` in float64); streaming
    stores from ``STREAM_MIN_BYTES``."""
    _atp_dequantize(q, factor, out, 4 * q.shape[0] >= STREAM_MIN_BYTES)


@njit(cache=True, parallel=True)
def atp_quantize_into_par(x, factor, out):
    """Parallel :func:`atp_quantize_into`; returns the combined overflow flag."""
    nb = PAR_BLOCKS
    bad = 0
    stream = 4 * x.shape[0] >= STREAM_MIN_BYTES
    for b in prange(nb):
        _, _, lo, hi = block_range(b, nb, x.shape[0], 1, x.shape[0])
        bad += _atp_quantize(x[lo:hi], factor, out[lo:hi], stream) != 0
    return bad > 0


@njit(cache=True, parallel=True)
def atp_add_into_par(acc, q):
    """Parallel :func:`atp_add_into`; returns the combined overflow flag."""
    nb = PAR_BLOCKS
    bad = 0
    for b in prange(nb):
        _, _, lo, hi = block_range(b, nb, acc.shape[0], 1, acc.shape[0])
        bad += atp_add_into(acc[lo:hi], q[lo:hi])
    return bad > 0


@njit(cache=True, parallel=True)
def atp_dequantize_into_par(q, factor, out):
    """Parallel :func:`atp_dequantize_into`."""
    nb = PAR_BLOCKS
    stream = 4 * q.shape[0] >= STREAM_MIN_BYTES
    for b in prange(nb):
        _, _, lo, hi = block_range(b, nb, q.shape[0], 1, q.shape[0])
        _atp_dequantize(q[lo:hi], factor, out[lo:hi], stream)


# ---------------------------------------------------------------------------------------------
# validating Python wrappers


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n: expected an int (number of workers), got {type(n).__name__}")
    if not 1 <= n <= N_MAX:
        raise ValueError(f"n: number of workers must be between 1 and {N_MAX}, got {n}")
    return int(n)


def _check_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk: elements per chunk must be a positive int, got {chunk!r}")
    return int(chunk)


def _n_chunks(length: int, chunk: int) -> int:
    return (length + chunk - 1) // chunk


def _check_exps(exps, length: int, chunk: int) -> None:
    check_array("exps", exps, np.int16)
    if exps.shape[0] != _n_chunks(length, chunk):
        raise ValueError(f"exps: expected {_n_chunks(length, chunk)} exponents (one per chunk "
                         f"of {chunk} elements), got {exps.shape[0]}")
    if exps.size and (exps.min() < EXP_MIN or exps.max() > EXP_MAX):
        raise ValueError(f"exps: exponents must lie in [{EXP_MIN}, {EXP_MAX}], got "
                         f"[{exps.min()}, {exps.max()}]")


def exponents(x: np.ndarray, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Per-chunk exponents (int16) of float32 vector ``x``: smallest e with 2**e >= max|x|."""
    check_array("x", x, np.float32)
    chunk = _check_chunk(chunk)
    check_finite("x", x, _FINITE)
    out = np.empty(_n_chunks(x.shape[0], chunk), dtype=np.int16)
    chunk_exponents_into(x, chunk, out)
    return out


def agree(exps: list[np.ndarray] | np.ndarray) -> np.ndarray:
    """The exponents the workers agree on: elementwise max over workers (int16)."""
    e = np.asarray(exps)
    if e.ndim != 2 or e.dtype != np.int16:
        raise TypeError("exps: expected one int16 exponent vector per worker (2-D int16)")
    return e.max(axis=0).astype(np.int16)


def quantize(x: np.ndarray, exps: np.ndarray, n: int, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Quantise float32 ``x`` to int32 with the agreed per-chunk exponents ``exps`` for
    ``n`` workers."""
    check_array("x", x, np.float32)
    n = _check_n(n)
    chunk = _check_chunk(chunk)
    check_finite("x", x, _FINITE)
    _check_exps(exps, x.shape[0], chunk)
    own = np.empty_like(exps)
    chunk_exponents_into(x, chunk, own)
    if (own > exps).any():
        c = int(np.argmax(own > exps))
        raise ValueError(f"exps: chunk {c} has exponent {exps[c]} but its data needs "
                         f"{own[c]}; pass the max over all workers (fixedpoint.agree)")
    out = np.empty(x.shape[0], dtype=np.int32)
    quantize_chunks_into(x, exps, n, chunk, out)
    return out


def aggregate(qs: np.ndarray) -> np.ndarray:
    """Sum of int32 contributions ``qs[n, L]`` as the switch does it (first overwrites, the
    others add in int32). With SwitchML scales the sum cannot overflow."""
    if not isinstance(qs, np.ndarray) or qs.dtype != np.int32 or qs.ndim != 2:
        raise TypeError("qs: expected a 2-D int32 array (one quantised row per worker)")
    _check_n(qs.shape[0])
    acc = qs[0].copy()
    for w in range(1, qs.shape[0]):
        add_into(acc, np.ascontiguousarray(qs[w]))
    return acc


def dequantize(q: np.ndarray, exps: np.ndarray, n: int, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """float32 values of int32 sums ``q`` quantised with ``exps`` for ``n`` workers."""
    check_array("q", q, np.int32)
    n = _check_n(n)
    chunk = _check_chunk(chunk)
    _check_exps(exps, q.shape[0], chunk)
    out = np.empty(q.shape[0], dtype=np.float32)
    dequantize_chunks_into(q, exps, n, chunk, out)
    return out


def error_bound(result: np.ndarray, exps: np.ndarray, n: int,
                chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Per-element bound on ``|result - exact sum|`` for an n-way sum (see module docstring)."""
    check_array("result", result, np.float32)
    n = _check_n(n)
    chunk = _check_chunk(chunk)
    _check_exps(exps, result.shape[0], chunk)
    f = np.ldexp(np.float64(INT32_MAX // n), -exps.astype(np.int64))
    per = np.repeat(n * (0.5 + 2.0**-20) / f, chunk)[: result.shape[0]]
    return per + 2.0**-23 * np.abs(result.astype(np.float64)) + 2.0**-149


def allreduce(xs: np.ndarray, chunk: int = DEFAULT_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """End-to-end SwitchML sum of the rows of ``xs[n, L]`` (float32): exponents, agreement,
    quantise, int32 aggregate, dequantise. Returns ``(sum float32[L], agreed exps)``."""
    if not isinstance(xs, np.ndarray) or xs.dtype != np.float32 or xs.ndim != 2:
        raise TypeError("xs: expected a 2-D float32 array (one gradient row per worker)")
    n = _check_n(xs.shape[0])
    chunk = _check_chunk(chunk)
    rows = [np.ascontiguousarray(r) for r in xs]
    exps = agree(np.stack([exponents(r, chunk) for r in rows]))
    qs = np.stack([quantize(r, exps, n, chunk) for r in rows])
    return dequantize(aggregate(qs), exps, n, chunk), exps


def atp_quantize(x: np.ndarray, factor: float = ATP_FACTOR) -> tuple[np.ndarray, bool]:
    """ATP quantisation ``round(x * factor)``; returns ``(q, overflow)``."""
    check_array("x", x, np.float32)
    check_finite("x", x, _FINITE)
    if not (isinstance(factor, (int, float, np.floating)) and math.isfinite(factor)
            and factor > 0):
        raise ValueError(f"factor: must be a positive finite number, got {factor!r}")
    out = np.empty(x.shape[0], dtype=np.int32)
    over = atp_quantize_into(x, float(factor), out)
    return out, bool(over)


def atp_aggregate(qs: np.ndarray) -> tuple[np.ndarray, bool]:
    """Checked int32 sum of ``qs[n, L]``; returns ``(sum, overflow)`` (saturated on overflow)."""
    if not isinstance(qs, np.ndarray) or qs.dtype != np.int32 or qs.ndim != 2:
        raise TypeError("qs: expected a 2-D int32 array (one quantised row per worker)")
    _check_n(qs.shape[0])
    acc = qs[0].copy()
    over = False
    for w in range(1, qs.shape[0]):
        over |= bool(atp_add_into(acc, np.ascontiguousarray(qs[w])))
    return acc, over


def atp_dequantize(q: np.ndarray, factor: float = ATP_FACTOR) -> np.ndarray:
    """float32 values ``q / factor``."""
    check_array("q", q, np.int32)
    if not (isinstance(factor, (int, float, np.floating)) and math.isfinite(factor)
            and factor > 0):
        raise ValueError(f"factor: must be a positive finite number, got {factor!r}")
    out = np.empty(q.shape[0], dtype=np.float32)
    atp_dequantize_into(q, float(factor), out)
    return out
