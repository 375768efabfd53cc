"""Explicit SIMD blocks and streaming stores for the whole-tensor elementwise kernels.

Why streaming stores: an elementwise kernel over a tensor larger than the caches is
memory-bound, and a plain store first reads the destination line (read for ownership): a
quantiser that reads 4 bytes and writes 4 moves 12. Non-temporal (streaming) stores write whole
lines without reading them, so the same kernel moves 8 (numpy's add, the benchmarks' anchor,
moves 16 for its 12). LLVM emits them only for *aligned vector* stores marked
``!nontemporal``, which the loop vectoriser never produces from scalar code, so the blocks
here are written in LLVM IR: :data:`LANES` elements loaded unaligned, computed as one vector
and stored to an address aligned to the block's size in bytes.

``LANES = 16`` is plain LLVM vector IR, not a target flag: an AVX-512 host computes a block in
one zmm register, an AVX2 host in two ymm, an arm64 host in four q registers.

Streaming pays off only when the output does not fit the caches and is not read back at once:
kernels use it from :data:`STREAM_MIN_BYTES` of output (plain vectorised loops below, e.g. per
packet), and call :func:`store_fence` after their last streaming store (streaming stores are
weakly ordered with respect to other stores).

Also here: :func:`mask64`, the 64-bit mask of 64 lane comparisons built from eight 8-lane
compares (one ``vmovmskps`` each on AVX2, a mask register on AVX-512), because LLVM lowers a
single ``<64 x i1>`` to ``i64`` bitcast to one byte extract per bit on AVX2.
"""

from __future__ import annotations

import platform
import sys

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from testbed.kernels.parallel import PAR_BLOCKS

#: Elements per explicit SIMD block.
LANES = 16
_X86 = platform.machine().lower() in ("x86_64", "amd64")
#: Output size (bytes) from which the whole-tensor kernels use streaming stores: larger than
#: the L2 cache of current server cores, where a plain store would miss anyway.
STREAM_MIN_BYTES = 4 << 20

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def host_cpu_has(feature: str) -> bool:
    """Whether LLVM reports ``feature`` (e.g. ``"avx512f"``, ``"f16c"``) for this host's CPU,
    the one Numba compiles for; False where it gives no feature map."""
    try:
        return bool(llvm.get_host_cpu_features().get(feature, False))
    except Exception:  # noqa: BLE001 - no feature map on some hosts
        return False


@intrinsic
def address(typingctx, a):
    """The address of ``a``'s first element (int64)."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, _I64)

    return types.int64(a), codegen


@intrinsic
def store_fence(typingctx):
    """Order every earlier store (streaming ones included) before every later one."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def store_u64le(typingctx, buf, i, value):
    """Write uint64 ``value`` little-endian into bytes ``i:i + 8`` of the uint8 array ``buf``
    with one unaligned store. The 8 bytes must be contiguous (``buf.strides[0] == 1``) and in
    bounds: the caller checks both."""
    if not (isinstance(buf, types.Array) and buf.dtype == types.uint8 and buf.ndim == 1
            and isinstance(i, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, ary.strides, 1)[0]
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.gep(ary.data, [builder.mul(idx, stride)])
        v = context.cast(builder, args[2], sig.args[2], types.uint64)
        if sys.byteorder == "big":
            v = builder.bswap(v)
        builder.store(v, builder.bitcast(ptr, _I64.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(buf, i, value), codegen


@njit(cache=True, inline="always")
def contiguous(a):
    """True when the 1-D array's elements are adjacent (what the block intrinsics assume)."""
    return a.strides[0] == a.itemsize


@njit(cache=True, inline="always")
def aligned_head(out, start):
    """Elements from ``out[start]`` to the first element whose address is a multiple of a
    block's bytes (``LANES * itemsize``): the scalar head before the streamed blocks."""
    blk = LANES * out.itemsize
    a = address(out) + start * out.itemsize
    return ((blk - (a & (blk - 1))) & (blk - 1)) // out.itemsize


@njit(cache=True, inline="always")
def stream_parts(nblocks):
    """Parts a prange kernel splits ``nblocks`` LANES-wide blocks into: PAR_BLOCKS for a whole
    tensor, 1 for a packet (one part costs no splitting)."""
    return PAR_BLOCKS if nblocks >= 64 * PAR_BLOCKS else 1


# ---------------------------------------------------------------------------------------------
# LLVM IR helpers for the block intrinsics (called from their codegen)


def vector_of(ty, lanes: int = LANES) -> ir.VectorType:
    """``<lanes x ty>``."""
    return ir.VectorType(ty, lanes)


def load_block(context, builder, arr_ty, arr, i):
    """``<LANES x dtype>`` loaded (unaligned) from ``arr[i:i + LANES]``."""
    ary = context.make_array(arr_ty)(context, builder, arr)
    elem = context.get_data_type(arr_ty.dtype)
    ptr = builder.bitcast(builder.gep(ary.data, [i]), vector_of(elem).as_pointer())
    return builder.load(ptr, align=1)


def store_block(context, builder, arr_ty, arr, i, vec, stream, piece_bytes=None) -> None:
    """Store ``vec`` to ``arr[i:i + LANES]``: a streaming store when ``stream`` (an i1; the
    caller has then aligned the address to the block's bytes, :func:`aligned_head`), a plain
    unaligned one otherwise. With ``piece_bytes`` (16: an SSE register) the streaming store
    is split into pieces of that size, each aligned to it: for blocks whose start is fixed
    (a multiple of LANES elements) in an array aligned only to 16 bytes, as numpy's are."""
    ary = context.make_array(arr_ty)(context, builder, arr)
    ptr = builder.bitcast(builder.gep(ary.data, [i]), vec.type.as_pointer())
    elem_bytes = context.get_abi_sizeof(vec.type.element)
    piece = min(piece_bytes or LANES * elem_bytes, LANES * elem_bytes) // elem_bytes
    nt = builder.module.add_metadata([ir.Constant(_I32, 1)])
    with builder.if_else(stream) as (streamed, plain):
        with streamed:
            pty = vector_of(vec.type.element, piece)
            for k in range(0, LANES, piece):
                part = vec if piece == LANES else builder.shuffle_vector(
                    vec, vec, ir.Constant(vector_of(_I32, piece), list(range(k, k + piece))))
                dst = builder.bitcast(builder.gep(ary.data, [builder.add(
                    i, ir.Constant(i.type, k))]), pty.as_pointer())
                st = builder.store(part, dst, align=piece * elem_bytes)
                st.set_metadata("nontemporal", nt)
        with plain:
            builder.store(vec, ptr, align=1)


def splat(builder, value, lanes: int = LANES):
    """A vector with ``value`` in every lane."""
    vty = vector_of(value.type, lanes)
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(vector_of(_I32, lanes), None))


def split_select(builder, split, first, second):
    """Per-lane ``first`` for lanes below ``split`` (an int64 in [0, LANES]), ``second`` from
    it on: one block that straddles a chunk boundary gets each chunk's parameter."""
    lane = ir.Constant(vector_of(_I32), list(range(LANES)))
    below = builder.icmp_signed("<", lane, splat(builder, builder.trunc(split, _I32)))
    return builder.select(below, splat(builder, first), splat(builder, second))


def call_vector_intrinsic(builder, name: str, vec):
    """``llvm.<name>`` (e.g. ``rint``) applied lane-wise to ``vec``."""
    et = vec.type.element
    suffix = {ir.DoubleType(): "f64", ir.FloatType(): "f32"}[et]
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec.type, [vec.type]),
                                        f"llvm.{name}.v{vec.type.count}{suffix}")
    return builder.call(fn, [vec])


def all_true(builder, mask):
    """i1: every lane of the ``<N x i1>`` ``mask`` is set. The lanes are widened to 64 bits
    and AND-ed in halves down to four, so AVX2 needs one ``vmovmskpd`` (a direct ``<16 x i1>``
    reduction packs the lanes to bytes first)."""
    n = mask.type.count
    wide = builder.sext(mask, vector_of(_I64, n))
    while n > 4:
        n //= 2
        lo = builder.shuffle_vector(wide, wide, ir.Constant(vector_of(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(wide, wide,
                                    ir.Constant(vector_of(_I32, n), list(range(n, 2 * n))))
        wide = builder.and_(lo, hi)
    neg = builder.icmp_signed("<", wide, ir.Constant(vector_of(_I64, n), [0] * n))
    return builder.icmp_unsigned("==", builder.bitcast(neg, ir.IntType(n)),
                                 ir.Constant(ir.IntType(n), (1 << n) - 1))


def mask64(builder, compare8):
    """``i64`` whose bit ``8k + j`` is lane j of ``compare8(k)`` (an ``<8 x i1>``), k < 8."""
    out = ir.Constant(_I64, 0)
    for k in range(8):
        byte = builder.zext(builder.bitcast(compare8(k), ir.IntType(8)), _I64)
        out = builder.or_(out, builder.shl(byte, ir.Constant(_I64, 8 * k)))
    return out


# ---------------------------------------------------------------------------------------------
# block intrinsics: one LANES-wide block of an elementwise kernel, ``i`` its first element


def is_c_array(ty, dtype) -> bool:
    """A 1-D array of ``dtype``; layout "A" is accepted because a slice may be typed so while
    contiguous at run time: the kernels check :func:`contiguous` before using a block."""
    return (isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout in ("C", "A")
            and ty.dtype == dtype)


def _scales(context, builder, sig, args, first: int):
    """The per-lane float64 parameter from the arguments ``first``, ``first + 1`` (values)
    and ``first + 2`` (split) of a block intrinsic."""
    a = context.cast(builder, args[first], sig.args[first], types.float64)
    b = context.cast(builder, args[first + 1], sig.args[first + 1], types.float64)
    split = context.cast(builder, args[first + 2], sig.args[first + 2], types.int64)
    return split_select(builder, split, a, b)


@intrinsic
def scale_block(typingctx, src, i, out, f_first, f_second, split, stream):
    """One block of a fixed-point conversion, ``v = float64(src[i + l]) * f`` with ``f =
    f_first`` for lanes ``l < split`` and ``f_second`` after (the next chunk's factor):

    * float32 -> int32 (quantise): ``out = int32(rint(v))``;
    * int32 -> float32 (dequantise): ``out = float32(v)``.
    """
    quantise = is_c_array(src, types.float32) and is_c_array(out, types.int32)
    if not (quantise or (is_c_array(src, types.int32) and is_c_array(out, types.float32))):
        return None

    def codegen(context, builder, sig, args):
        dv = vector_of(ir.DoubleType())
        v = load_block(context, builder, sig.args[0], args[0], args[1])
        v = builder.fpext(v, dv) if quantise else builder.sitofp(v, dv)
        p = builder.fmul(v, _scales(context, builder, sig, args, 3))
        r = (builder.fptosi(call_vector_intrinsic(builder, "rint", p), vector_of(_I32))
             if quantise else builder.fptrunc(p, vector_of(ir.FloatType())))
        store_block(context, builder, sig.args[2], args[2], args[1], r, args[6])
        return context.get_dummy_value()

    return types.void(src, i, out, f_first, f_second, split, types.boolean), codegen


@intrinsic
def atp_quantize_block(typingctx, x, i, out, factor, limit, stream):
    """ATP quantisation of one block: ``r = rint(float64(x) * factor)`` saturated to int32
    (NaN -> 0). Returns 1 when a lane did not fit, else 0.

    ``limit`` is a float32 below which ``|x| * factor`` surely fits (:func:`atp_fast_limit`):
    a block whose lanes are all below it (the common case) costs one compare on the inputs,
    a multiply and a rounding conversion. Other blocks take the exact bounds (a product fits
    when ``-2**31 - 0.5 <= p < 2**31 - 0.5``, round half to even) and saturate."""
    if not (is_c_array(x, types.float32) and is_c_array(out, types.int32)):
        return None

    def codegen(context, builder, sig, args):
        dv = vector_of(ir.DoubleType())
        xv = load_block(context, builder, sig.args[0], args[0], args[1])
        f = context.cast(builder, args[3], sig.args[3], types.float64)
        lim = context.cast(builder, args[4], sig.args[4], types.float32)
        p = builder.fmul(builder.fpext(xv, dv), splat(builder, f))
        every = all_true(builder, builder.fcmp_ordered(
            "<", call_vector_intrinsic(builder, "fabs", xv), splat(builder, lim)))
        bad = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))
        with builder.if_else(every, likely=True) as (fits, exact):
            with fits:
                r = call_vector_intrinsic(builder, "rint", p)
                store_block(context, builder, sig.args[2], args[2], args[1],
                            builder.fptosi(r, vector_of(_I32)), args[5])
            with exact:
                top = ir.Constant(dv, [2147483647.5] * LANES)
                above = builder.fcmp_ordered(">=", p, top)
                below = builder.fcmp_ordered("<", p, ir.Constant(dv, [-2147483648.5] * LANES))
                inside = builder.and_(builder.fcmp_ordered("<", p, top),
                                      builder.not_(below))  # false for NaN too
                r = call_vector_intrinsic(builder, "rint", builder.select(
                    inside, p, ir.Constant(dv, [0.0] * LANES)))
                r = builder.select(above, ir.Constant(dv, [float(2**31 - 1)] * LANES), r)
                r = builder.select(below, ir.Constant(dv, [float(-2**31)] * LANES), r)
                store_block(context, builder, sig.args[2], args[2], args[1],
                            builder.fptosi(r, vector_of(_I32)), args[5])
                builder.store(builder.zext(builder.not_(all_true(builder, inside)), _I64), bad)
        return builder.load(bad)

    return types.int64(x, i, out, factor, limit, types.boolean), codegen


@njit(cache=True, inline="always")
def atp_fast_limit(factor):
    """A float32 ``t`` with ``|x| < t  =>  |rint(float64(x) * factor)| < 2**31 - 1`` (the
    rounding of t is covered by a 2**-20 margin); 0 for a factor that is not > 0."""
    f = np.float64(factor)
    if not f > 0.0:
        return np.float32(0.0)
    return np.float32(min(2147483647.0 / f * (1.0 - 2.0**-20), 3.0e38))


@intrinsic
def half_block(typingctx, x, i, out, stream):
    """IEEE half precision of one block (round to nearest even): ``out`` gets the uint16 bits
    (LLVM ``fptrunc``: vcvtps2ph on x86 with F16C, fcvt on arm64)."""
    if not (is_c_array(x, types.float32) and is_c_array(out, types.uint16)):
        return None

    def codegen(context, builder, sig, args):
        v = load_block(context, builder, sig.args[0], args[0], args[1])
        h = builder.bitcast(builder.fptrunc(v, vector_of(ir.HalfType())), vector_of(ir.IntType(16)))
        if _X86:
            # With AVX512-FP16 LLVM folds the bitcast and stores a half vector, for which it
            # has no streaming store (it drops !nontemporal); an empty asm keeps the integers.
            h = builder.asm(ir.FunctionType(h.type, [h.type]), "", "=x,0", [h], False)
        store_block(context, builder, sig.args[2], args[2], args[1], h, args[3])
        return context.get_dummy_value()

    return types.void(x, i, out, types.boolean), codegen


def _lane_total(builder, total):
    """The sum of a float64 vector's lanes, added in halves (a fixed order)."""
    n = total.type.count
    while n > 1:
        n //= 2
        low = builder.shuffle_vector(total, total, ir.Constant(vector_of(_I32, n),
                                                               list(range(n))))
        high = builder.shuffle_vector(total, total, ir.Constant(vector_of(_I32, n),
                                                                list(range(n, 2 * n))))
        total = builder.fadd(low, high)
    return builder.extract_element(total, ir.Constant(_I32, 0))


def _block_sums_ir(context, builder, arr_ty, arr, lo, span, nblocks, op, streams):
    """``streams`` sums of ``op(float64(x[i]))`` over ``nblocks`` LANES-wide blocks from
    ``lo + s * span`` (s < streams), walked together block by block (one read stream each),
    each accumulated lane-wise and then added in halves."""
    dv = vector_of(ir.DoubleType())
    stop = builder.add(lo, builder.mul(nblocks, ir.Constant(_I64, LANES)))
    accs = [cgutils.alloca_once_value(builder, ir.Constant(dv, [0.0] * LANES))
            for _ in range(streams)]
    with cgutils.for_range_slice(builder, lo, stop, ir.Constant(_I64, LANES)) as (i, _):
        for s, acc in enumerate(accs):
            at = builder.add(i, builder.mul(span, ir.Constant(_I64, s))) if s else i
            v = builder.fpext(load_block(context, builder, arr_ty, arr, at), dv)
            term = (builder.fmul(v, v) if op == "square"
                    else call_vector_intrinsic(builder, "fabs", v))
            builder.store(builder.fadd(builder.load(acc), term), acc)
    return [_lane_total(builder, builder.load(acc)) for acc in accs]


def _block_sum(op: str):
    """Intrinsic ``(x, lo, nblocks) -> float64``: the sum of ``op(float64(x[i]))`` over the
    ``nblocks`` LANES-wide blocks from ``lo``, accumulated lane-wise and then added in halves
    (a fixed order, the same on every target, without fast-math reassociation)."""

    @intrinsic
    def block_sum(typingctx, x, lo, nblocks):
        if not (is_c_array(x, types.float32) and isinstance(lo, types.Integer)
                and isinstance(nblocks, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            lo_ = context.cast(builder, args[1], sig.args[1], types.int64)
            nb = context.cast(builder, args[2], sig.args[2], types.int64)
            return _block_sums_ir(context, builder, sig.args[0], args[0], lo_,
                                  ir.Constant(_I64, 0), nb, op, 1)[0]

        return types.float64(x, lo, nblocks), codegen

    return block_sum


def _block_sum4(op: str):
    """Intrinsic ``(x, lo, span, nblocks) -> (float64,) * 4``: the :func:`_block_sum` of the
    ``nblocks`` blocks from ``lo + s * span`` for s = 0..3, each bit-identical to its own
    single-stream sum. The four ranges are read together: four sequential read streams keep
    more of the hardware prefetcher busy, and one core reads much faster than with one."""

    @intrinsic
    def block_sum4(typingctx, x, lo, span, nblocks):
        if not (is_c_array(x, types.float32) and isinstance(lo, types.Integer)
                and isinstance(span, types.Integer) and isinstance(nblocks, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            lo_, span_, nb = (context.cast(builder, args[k], sig.args[k], types.int64)
                              for k in (1, 2, 3))
            sums = _block_sums_ir(context, builder, sig.args[0], args[0], lo_, span_, nb, op, 4)
            return context.make_tuple(builder, sig.return_type, sums)

        return types.UniTuple(types.float64, 4)(x, lo, span, nblocks), codegen

    return block_sum4


#: ``sum(float64(x[i])**2)`` over whole LANES-wide blocks (see :func:`_block_sum`).
sum_squares_blocks = _block_sum("square")
#: ``sum(|float64(x[i])|)`` over whole LANES-wide blocks (see :func:`_block_sum`).
sum_abs_blocks = _block_sum("abs")
#: Four :data:`sum_squares_blocks` read together (see :func:`_block_sum4`).
sum_squares_blocks4 = _block_sum4("square")
#: Four :data:`sum_abs_blocks` read together (see :func:`_block_sum4`).
sum_abs_blocks4 = _block_sum4("abs")
