"""Counter-based random numbers: the one generator family of every stochastic kernel.

A draw is a pure function of a *counter* (which element, which packet) and a 32-bit *key*
(which stream); there is no generator state. Results therefore do not depend on the thread
count or on which part of a tensor a packet carries, the numpy twins in
``testbed.kernels.reference.rng`` reproduce them bit for bit, and two workers with the same
key draw the same numbers (the basis of randomk's shared indices and THC's shared rotation).

* **Element hash** :func:`hash_u32`: ``h = (i * 0x9E3779B1 + key) mod 2**32`` followed by
  the lowbias32 xorshift-multiply finaliser. It is written in LLVM IR on 32-bit lanes, so
  loops over it vectorise 8 (AVX2) or 16 (AVX-512) wide; Numba itself would widen uint32
  arithmetic to 64 bits. :func:`uniform32` / :func:`uniform` turn its top 24 bits into a
  float in [0, 1) exactly.
* **Paired 16-bit draws** :func:`draw16` (the stochastic rounding of ``qsgd``): one element
  hash serves two elements, so a 16-element block costs eight hashes. Element ``i`` takes
  the low half of ``hash_u32(j, key)`` with ``j = 8 * (i >> 4) + (i & 7)`` when
  ``(i >> 3) & 1 == 0``, else its high half: a block of 16 consecutive elements from a
  multiple of 16 uses the 8 hashes ``j = i/2 .. i/2 + 7``, low halves for its first 8
  elements and high halves for the next 8 (:func:`block_draws16_ir` builds them as vectors).
* **Keys** come from the splitmix64 finaliser (:func:`mix64`): :func:`stream_key` for a
  ``(seed, step, salt)`` triple (one stream per compressor call), :func:`counter_key` for a
  64-bit seed and the high word of a 64-bit counter.
* **Long streams** :func:`uniform01` ``(seed, counter)``: the same element hash for 64-bit
  counters (a data-path port's packet sequence, a tensor offset): the low 32 bits of the
  counter are the element, the high 32 bits select the key, so the stream never repeats.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: 2**-24: turns a 24-bit integer into a float in [0, 1) exactly.
INV24 = 1.0 / 16777216.0

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_U_GOLDEN = np.uint64(_GOLDEN)
_U_M1 = np.uint64(0xBF58476D1CE4E5B9)
_U_M2 = np.uint64(0x94D049BB133111EB)
_U_LOW32 = np.uint64(0xFFFFFFFF)
_U30, _U27, _U31, _U32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_U_ONE = np.uint64(1)


def _as_i32(builder, v):
    i32 = ir.IntType(32)
    w = v.type.width
    return builder.trunc(v, i32) if w > 32 else builder.zext(v, i32) if w < 32 else v


def _const(ty, value):
    """``value`` as a constant of the 32-bit scalar or vector type ``ty``."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def lowbias32_ir(builder, i, key):
    """LLVM IR of the element hash on wrap-around 32-bit lanes: ``i`` and ``key`` are both
    ``i32`` or both ``<n x i32>`` (a vector of n elements' hashes)."""
    ty = i.type
    h = builder.add(builder.mul(i, _const(ty, 0x9E3779B1)), key)
    h = builder.xor(h, builder.lshr(h, _const(ty, 16)))
    h = builder.mul(h, _const(ty, 0x7FEB352D))
    h = builder.xor(h, builder.lshr(h, _const(ty, 15)))
    h = builder.mul(h, _const(ty, 0x846CA68B))
    return builder.xor(h, builder.lshr(h, _const(ty, 16)))


def _lowbias32(builder, i, key):
    return lowbias32_ir(builder, _as_i32(builder, i), _as_i32(builder, key))


def block_draws16_ir(builder, i, key):
    """``<16 x i32>`` of the :func:`draw16` values of elements ``i .. i + 15`` (``i`` an
    ``i64`` multiple of 16, ``key`` an integer): eight element hashes, halves concatenated."""
    i32 = ir.IntType(32)
    v8 = ir.VectorType(i32, 8)
    j0 = builder.trunc(builder.lshr(i, ir.Constant(i.type, 1)), i32)
    k = _as_i32(builder, key)

    def splat8(v):
        one = builder.insert_element(ir.Constant(v8, ir.Undefined), v, ir.Constant(i32, 0))
        return builder.shuffle_vector(one, ir.Constant(v8, ir.Undefined),
                                      ir.Constant(v8, None))

    j = builder.add(splat8(j0), ir.Constant(v8, list(range(8))))
    h = lowbias32_ir(builder, j, splat8(k))
    lo = builder.and_(h, _const(v8, 0xFFFF))
    hi = builder.lshr(h, _const(v8, 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 16), list(range(16))))


@intrinsic
def hash_u32(typingctx, i, key):
    """32-bit hash of element ``i`` (its low 32 bits) under stream ``key`` (its low 32 bits):
    ``h = (i * 0x9E3779B1 + key) mod 2**32`` then xorshift-multiply rounds; uint32."""
    if not isinstance(i, types.Integer) or not isinstance(key, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _lowbias32(builder, args[0], args[1])

    return types.uint32(i, key), codegen


@intrinsic
def uniform32(typingctx, i, key):
    """Uniform float32 in [0, 1): the top 24 bits of :func:`hash_u32` times 2**-24 (exact)."""
    if not isinstance(i, types.Integer) or not isinstance(key, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        h = builder.lshr(_lowbias32(builder, args[0], args[1]), ir.Constant(ir.IntType(32), 8))
        f = builder.sitofp(h, ir.FloatType())
        return builder.fmul(f, ir.Constant(ir.FloatType(), INV24))

    return types.float32(i, key), codegen


@njit(cache=True, inline="always")
def uniform(i, key):
    """Uniform float64 in [0, 1) with 24 random bits (the float32 draw, widened exactly)."""
    return np.float64(uniform32(i, key))


@njit(cache=True, inline="always")
def draw16(i, key):
    """Uniform integer in [0, 2**16) for element ``i`` under ``key``: one half of the element
    hash of ``8 * (i >> 4) + (i & 7)`` (low half when bit 3 of ``i`` is clear, else high), so
    that two elements share a hash. int64."""
    i = np.int64(i)
    h = np.int64(hash_u32(((i >> 4) << 3) | (i & 7), key))
    return (h >> (((i >> 3) & 1) << 4)) & 0xFFFF


@njit(cache=True, inline="always")
def mix64(z):
    """splitmix64 finaliser of a uint64 (wrap-around arithmetic)."""
    z = (z ^ (z >> _U30)) * _U_M1
    z = (z ^ (z >> _U27)) * _U_M2
    return z ^ (z >> _U31)


@njit(cache=True, inline="always")
def counter_key(seed, hi):
    """Key of the 2**32 counters whose high word is ``hi`` in the stream of 64-bit ``seed``."""
    return mix64(np.uint64(seed) + (np.uint64(hi) + _U_ONE) * _U_GOLDEN) & _U_LOW32


@njit(cache=True, inline="always")
def uniform01(seed, counter):
    """Uniform float64 in [0, 1) (24 random bits) for a 64-bit ``seed`` and 64-bit
    ``counter``: :func:`uniform` of the counter's low word under :func:`counter_key` of its
    high word."""
    c = np.uint64(counter)
    return uniform(c & _U_LOW32, counter_key(seed, c >> _U32))


def _mix64_py(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int, step: int = 0, salt: int = 0) -> np.uint64:
    """Key of the random stream for ``(seed, step, salt)``: splitmix64 of a linear mix of the
    three, folded to 32 bits. Compressors salt it with their name so that two compressors
    with the same seed and step draw independent numbers."""
    z = (seed * _GOLDEN + step * 0xD1B54A32D192ED03 + salt * 0x8CB92BA72F3D8DD7
         + 0x632BE59BD9B4E019) & _M64
    z = _mix64_py(z)
    return np.uint64((z ^ (z >> 32)) & 0xFFFFFFFF)
