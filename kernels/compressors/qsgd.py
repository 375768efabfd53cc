"""``qsgd``: QSGD stochastic quantisation to ``levels`` levels of |x| / ||x||_2 (unbiased).

q_i = floor(A_i / 2**16 + u_i) with A_i = rint(x_i * levels / ||x||_2 * 2**16) (the signed
level in fixed point, 16 fraction bits) and u_i = d_i / 2**16, d_i the 16-bit draw
``rng.draw16(i, key)`` of the ``(seed, step)`` stream (two elements per element hash);
x̂_i = q_i * ||x||_2 / levels. E[q_i] = A_i / 2**16 exactly, so E[x̂] = x up to the rounding
of the level to 2**-17 of a step (float32 |x| * levels / norm itself carries up to 2**-17
for levels >= 128). Levels are stored in int8 when ``levels`` <= 127, else int16.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from testbed.kernels.checks import check_number
from testbed.kernels.parallel import block_range, kernel
from testbed.kernels.reductions import l2norm
from testbed.kernels.rng import block_draws16_ir, draw16, stream_key
from testbed.kernels.simd import (
    LANES,
    STREAM_MIN_BYTES,
    address,
    call_vector_intrinsic,
    contiguous,
    is_c_array,
    load_block,
    splat,
    store_block,
    store_fence,
    stream_parts,
)

from .base import Compressor

_SALT = 0x51534744  # "QSGD"

#: Fraction bits of the fixed-point level a * 2**16 that the stochastic rounding adds the
#: 16-bit draw to; a < 32768 keeps a * 2**16 + draw below 2**31.
FRAC = 16
#: Above this levels / norm (norms below ~1e-31: subnormal gradients) levels * 2**16 / norm
#: would overflow float32 and the kernel computes in float64.
F32_SCALE_MAX = 1e33


@njit(cache=True, inline="always")
def qsgd_level(v, s16, top16, i, key):
    """The signed level of one float32 element ``v`` (element ``i``): ``A = rint(v * s16)``
    clamped to +-top16 (float32, round half to even), ``q = (A + draw16(i, key)) >> 16``
    (arithmetic shift: floor). ``s16`` and ``top16`` are levels / norm and levels times
    2**16 (float32)."""
    a = v * s16
    a = a if a < top16 else top16
    a = a if a > -top16 else -top16
    return (np.int64(np.int32(np.rint(a))) + draw16(i, key)) >> FRAC


@njit(cache=True, inline="always")
def qsgd_level64(v, s16, top16, i, key):
    """:func:`qsgd_level` in float64 (for scales beyond float32)."""
    a = np.float64(v) * s16
    a = a if a < top16 else top16
    a = a if a > -top16 else -top16
    return (np.int64(np.rint(a)) + draw16(i, key)) >> FRAC


def _saturating_trunc(builder, q, ty):
    """``q`` (``<n x i32>``) truncated to ``<n x ty>`` with signed saturation, written as
    min/max + trunc so that x86 lowers it to vpackssdw (+ vpacksswb) instead of masking."""
    bits = ty.width
    hi = ir.Constant(q.type, [(1 << (bits - 1)) - 1] * q.type.count)
    lo = ir.Constant(q.type, [-(1 << (bits - 1))] * q.type.count)
    q = builder.select(builder.icmp_signed("<", q, hi), q, hi)
    q = builder.select(builder.icmp_signed(">", q, lo), q, lo)
    return builder.trunc(q, ir.VectorType(ty, q.type.count))


@intrinsic
def qsgd_block(typingctx, x, i, out, s16, top16, key, stream):
    """:func:`qsgd_level` of the 16 elements ``x[i:i + 16]`` (``i`` a multiple of 16) into
    int8/int16 ``out``, as vectors: 8 element hashes give the 16 draws, the rounding is a
    rounding conversion, an integer add and an arithmetic shift."""
    if not (is_c_array(x, types.float32) and isinstance(i, types.Integer)
            and (is_c_array(out, types.int16) or is_c_array(out, types.int8))):
        return None

    def codegen(context, builder, sig, args):
        i32v = ir.VectorType(ir.IntType(32), LANES)
        xv = load_block(context, builder, sig.args[0], args[0], args[1])
        top = context.cast(builder, args[4], sig.args[4], types.float32)
        hi = splat(builder, top)
        lo = splat(builder, builder.fneg(top))
        a = builder.fmul(xv, splat(builder, context.cast(builder, args[3], sig.args[3],
                                                         types.float32)))
        a = builder.select(builder.fcmp_ordered("<", a, hi), a, hi)
        a = builder.select(builder.fcmp_ordered(">", a, lo), a, lo)
        a = builder.fptosi(call_vector_intrinsic(builder, "rint", a), i32v)
        idx = context.cast(builder, args[1], sig.args[1], types.int64)
        key = context.cast(builder, args[5], sig.args[5], types.uint64)
        q = builder.ashr(builder.add(a, block_draws16_ir(builder, idx, key)),
                         ir.Constant(i32v, [FRAC] * LANES))
        q = _saturating_trunc(builder, q, context.get_data_type(sig.args[2].dtype))
        store_block(context, builder, sig.args[2], args[2], args[1], q, args[6],
                    piece_bytes=16)
        return context.get_dummy_value()

    return types.void(x, i, out, types.float32, types.float32, key, types.boolean), codegen


@kernel("x.size")
def qsgd_quantize(x, levels, norm, key, out):
    """Quantise float32 ``x`` to signed levels in ``out`` (int8/int16) given its ``norm``.

    ``norm`` is ``l2norm(x)`` (or a larger shared norm); 0 gives all zeros. Each element is
    :func:`qsgd_level`: the signed level a = x * levels / norm as fixed point with 16
    fraction bits, rounded up with probability equal to its fraction by adding the element's
    :func:`~testbed.kernels.rng.draw16` and shifting down. The arithmetic is float32 (16-element blocks with
    streaming stores for outputs beyond the caches) unless levels * 2**16 / norm would
    overflow it (norms below ~1e-31, i.e. subnormal gradients), then float64.
    """
    s64 = levels / norm if norm > 0.0 else 0.0
    n = x.size
    if s64 <= F32_SCALE_MAX:
        s16 = np.float32(s64 * 65536.0)
        top16 = np.float32(levels * 65536.0)
        nblk = n // LANES if contiguous(x) and contiguous(out) else 0
        # streamed in 16-byte pieces: numpy aligns large arrays to 16 bytes, not to a block
        stream = n * out.itemsize >= STREAM_MIN_BYTES and address(out) % 16 == 0
        nb = stream_parts(nblk)
        for p in prange(nb):
            # four interleaved quarters per part: four read streams (see signsgd._sign_words)
            b0, b1, _, _ = block_range(p, nb, nblk, 1, nblk)
            m = (b1 - b0) // 4
            for b in range(b0, b0 + m):
                qsgd_block(x, b * LANES, out, s16, top16, key, stream)
                qsgd_block(x, (b + m) * LANES, out, s16, top16, key, stream)
                qsgd_block(x, (b + 2 * m) * LANES, out, s16, top16, key, stream)
                qsgd_block(x, (b + 3 * m) * LANES, out, s16, top16, key, stream)
            for b in range(b0 + 4 * m, b1):
                qsgd_block(x, b * LANES, out, s16, top16, key, stream)
            if stream:
                store_fence()
        for i in range(nblk * LANES, n):
            out[i] = qsgd_level(x[i], s16, top16, i, key)
    else:
        s16_64 = s64 * 65536.0
        top16_64 = levels * 65536.0
        for i in prange(n):
            out[i] = qsgd_level64(x[i], s16_64, top16_64, i, key)


@njit(cache=True)
def qsgd_dequantize(q, norm, levels, out):
    """x̂ = q * norm / levels into float32 ``out``."""
    s = norm / levels
    for i in prange(q.size):
        out[i] = np.float32(q[i] * s)


class QsgdCompressor(Compressor):
    """QSGD with ``levels`` (default 256, as GRACE) and a shared ``seed`` (default 0)."""

    name = "qsgd"

    def __init__(self, levels: int = 256, seed: int = 0):
        levels = check_number("levels", 1, 32767, integer=True)(levels)
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(levels=levels, seed=seed)
        self.levels, self.seed = levels, seed
        self.dtype = np.int8 if levels <= 127 else np.int16

    def _compress(self, x, step):
        norm = float(l2norm(x)) if x.size else 0.0
        out = np.empty(x.size, dtype=self.dtype)
        qsgd_quantize(x, self.levels, norm, stream_key(self.seed, step, _SALT), out)
        return (out,), {"n": int(x.size), "norm": norm}

    def _decompress(self, payload, ctx):
        q = np.ascontiguousarray(payload[0])
        out = np.empty(q.size, dtype=np.float32)
        qsgd_dequantize(q, float(ctx["norm"]), self.levels, out)
        return out

    def payload_bytes(self, n_elements):
        """1 or 2 bytes per element (the norm travels in the ctx)."""
        return np.dtype(self.dtype).itemsize * int(n_elements)
