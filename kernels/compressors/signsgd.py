"""``signsgd``: one bit per element, sign(x) with sign(0) = +1; decompresses to +-1.

Bits are packed little-endian within a byte (element 8b+j is bit j of byte b), as
``np.packbits(..., bitorder="little")``. Not summable as bits (signSGD aggregates by majority
vote of the signs instead).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from testbed.kernels.parallel import block_range, kernel
from testbed.kernels.simd import host_cpu_has, mask64, store_u64le, stream_parts, vector_of

from .base import Compressor


@intrinsic
def sign_mask64(typingctx, x, base):
    """uint64 whose bit j is ``x[base + j] >= 0`` for a C-contiguous float32 ``x``: eight
    8-lane compares (vcmpps + vmovmskps on AVX2, a mask register on AVX-512)."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"
            and isinstance(base, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        vty = vector_of(ir.FloatType(), 8)

        def compare8(k):
            ptr = builder.gep(ary.data, [builder.add(args[1], ir.Constant(args[1].type, 8 * k))])
            v = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=4)
            # ordered >=: -0.0 counts as non-negative, NaN would not (inputs are finite)
            return builder.fcmp_ordered(">=", v, ir.Constant(vty, None))

        return mask64(builder, compare8)

    return types.uint64(x, base), codegen


@njit(cache=True, inline="always")
def _sign_word(x, out_bits, w, contiguous):
    """Signs of elements ``64w .. 64w + 63`` into bytes ``8w .. 8w + 7``."""
    m = sign_mask64(x, 64 * w)
    if contiguous:  # one unaligned 8-byte store: out_bits may be any slice of a frame
        store_u64le(out_bits, 8 * w, m)
    else:
        for b in range(8):
            out_bits[8 * w + b] = (m >> np.uint64(8 * b)) & np.uint64(0xFF)


def _read_streams() -> int:
    """Interleaved read streams per part for :func:`_sign_words`, by host CPU. Measured with
    the kernel paired with numpy add in one process: on AMD Zen 3 (AVX2) one stream read
    ~20 GB/s and four 26-31 GB/s; on AMD Zen 5 (AVX-512) two streams ran at 1.05-1.06 of numpy
    add, four at 0.95-0.96 and eight at 0.99-1.00. Numba's cache is keyed on the host CPU's
    name and features, so a cached kernel always matches this choice."""
    return 2 if host_cpu_has("avx512f") else 4


READ_STREAMS = _read_streams()


@kernel("x.size")
def _sign_words(x, out_bits):
    """The whole 64-element words of :func:`sign_pack`. Each part of the tensor is walked as
    ``READ_STREAMS`` interleaved pieces: several sequential read streams keep more of the
    hardware prefetcher busy than one, so a single core reads beyond one stream's rate."""
    contiguous = out_bits.strides[0] == 1
    nw = x.size // 64
    nb = stream_parts(nw // 4)
    for p in prange(nb):
        w0, w1, _, _ = block_range(p, nb, nw, 1, nw)
        q = (w1 - w0) // READ_STREAMS
        for w in range(w0, w0 + q):
            for s in range(READ_STREAMS):
                _sign_word(x, out_bits, w + s * q, contiguous)
        for w in range(w0 + READ_STREAMS * q, w1):
            _sign_word(x, out_bits, w, contiguous)


@njit(cache=True)
def sign_pack(x, out_bits):
    """Pack ``x_i >= 0`` of float32 ``x`` into uint8 ``out_bits`` (ceil(n/8) bytes).

    64-element groups are reduced to one uint64 (bit j = element j) and stored as 8 bytes,
    the layout of ``np.packbits(..., bitorder="little")``; the tail is packed byte by byte.
    """
    x = np.ascontiguousarray(x)  # no copy for the usual contiguous input
    n = x.size
    nw = n // 64
    if nw:
        _sign_words(x, out_bits)
    for b in range(nw * 8, (n + 7) // 8):
        v = 0
        for j in range(min(8, n - 8 * b)):
            v |= (1 if x[8 * b + j] >= 0.0 else 0) << j
        out_bits[b] = v


@njit(cache=True)
def sign_unpack(bits, pos, neg, out):
    """``out_i = pos`` where bit i is set, else ``neg`` (float32 ``out`` of length n)."""
    p = np.float32(pos)
    q = np.float32(neg)
    n = out.size
    for b in prange((n + 7) // 8):
        v = bits[b]
        for j in range(min(8, n - 8 * b)):
            out[8 * b + j] = p if (v >> j) & 1 else q


def packed_len(n: int) -> int:
    """Bytes holding n sign bits."""
    return (int(n) + 7) // 8


def pack_signs(x: np.ndarray) -> np.ndarray:
    """The packed sign bits of x (a new uint8 array)."""
    out = np.empty(packed_len(x.size), dtype=np.uint8)
    sign_pack(x, out)
    return out


def unpack_signs(bits, n: int, pos: float, neg: float) -> np.ndarray:
    """float32 vector of n elements: pos where the bit is set, neg elsewhere."""
    bits = np.ascontiguousarray(bits, dtype=np.uint8)
    if bits.size != packed_len(n):
        raise ValueError(f"payload has {bits.size} sign bytes, expected {packed_len(n)} for n={n}")
    out = np.empty(int(n), dtype=np.float32)
    sign_unpack(bits, pos, neg, out)
    return out


class SignsgdCompressor(Compressor):
    """signSGD: the sign bits only."""

    name = "signsgd"

    def _compress(self, x, step):
        return (pack_signs(x),), {"n": int(x.size)}

    def _decompress(self, payload, ctx):
        return unpack_signs(payload[0], int(ctx["n"]), 1.0, -1.0)

    def payload_bytes(self, n_elements):
        """One bit per element, rounded up to whole bytes."""
        return packed_len(n_elements)
