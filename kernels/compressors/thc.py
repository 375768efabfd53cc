"""``thc``: THC-style homomorphic compression (NSDI'24) for in-network summation.

Sender: pad x to d elements (a multiple of ``block``, itself a power of two, or the next power
of two when x is shorter), rotate every block with the randomized Hadamard transform
y = H D x / sqrt(B) (D = random signs from the shared ``(seed, step)`` stream, H the
Walsh-Hadamard matrix), scale by a *shared* M = clip * norm / sqrt(d), clamp to [-M, M] and
round stochastically to the integers -g/2 .. g/2 (``g`` = granularity, 16 by default), i.e.
a grid of step M / (g/2). The payload is int8.

Agreeing the scale: every worker computes ``local_norm(x)`` (its L2 norm) and the workers
take the **maximum**, the way SwitchML agrees its block exponent (e.g. a one-value
max-allreduce one chunk ahead, or the max-combined ``exponent`` header field carrying
ceil(log2(norm)) and using 2**exponent as the norm); each then calls
``compress(x, step, norm=agreed)``. With the same step and norm, every worker's integers live
on the same grid, so the network simply adds them (int32; n workers need |sum| <= n g/2) and
``decompress(aggregate(payloads), ctx)`` returns the sum of the (rotated, quantised) inputs:
de-scale, inverse transform, drop the padding. The estimate is unbiased when no coordinate is
clipped; ``ctx['clipped']`` counts the clipped ones. Rotated coordinates are close to Gaussian
with standard deviation norm / sqrt(d), so the default clip (4 of them) rarely clips; raise
``clip`` when exact unbiasedness matters more than resolution (the grid step is
clip * norm / sqrt(d) / (g/2)).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from testbed.kernels.checks import check_number, check_step, check_vector
from testbed.kernels.parallel import kernel
from testbed.kernels.reductions import l2norm
from testbed.kernels.rng import hash_u32, stream_key, uniform

from .base import Compressor

#: Salt of the random signs D of the rotation: one stream per (seed, step) shared by every
#: worker, so rotated vectors can be added (the INA worker derives its key with it too).
SALT_SIGN = 0x5448434B  # "THCK"
#: Salt of the stochastic-rounding stream of :meth:`ThcCompressor.compress`.
SALT_QUANT = 0x54484351  # "THCQ"


@njit(cache=True)
def fwht_inplace(a):
    """Unnormalised fast Walsh-Hadamard transform of ``a`` (length a power of two), in place.

    Applying it twice multiplies by len(a).
    """
    n = a.size
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                u = a[j]
                v = a[j + h]
                a[j] = u + v
                a[j + h] = u - v
        h *= 2


@kernel("out.size")
def rht_forward(x, block, key, out):
    """Blockwise randomized Hadamard transform: out[b] = H D x[b] / sqrt(block).

    ``out`` is float32 of the padded length (a multiple of ``block``); x is zero padded.
    """
    n = x.size
    nb = out.size // block
    inv = np.float32(1.0 / np.sqrt(block))
    for b in prange(nb):
        base = b * block
        buf = out[base:base + block]
        for j in range(block):
            k = base + j
            v = x[k] if k < n else np.float32(0.0)
            buf[j] = -v if hash_u32(k, key) & np.uint64(1) else v
        fwht_inplace(buf)
        for j in range(block):
            buf[j] *= inv


@kernel("y.size")
def rht_inverse(y, block, key, n, out):
    """Inverse of :func:`rht_forward` (D H y / sqrt(block)), first n elements into ``out``."""
    nb = y.size // block
    inv = np.float32(1.0 / np.sqrt(block))
    for b in prange(nb):
        base = b * block
        buf = y[base:base + block].copy()
        fwht_inplace(buf)
        for j in range(block):
            k = base + j
            if k < n:
                v = buf[j] * inv
                out[k] = -v if hash_u32(k, key) & np.uint64(1) else v


@kernel("y.size")
def thc_quantize(y, scale, half, key, out):
    """Stochastic rounding of clamp(y / scale * half, -half, half) to int8 ``out``.

    Returns the number of clamped coordinates. ``scale`` = 0 gives zeros.
    """
    f = half / scale if scale > 0.0 else 0.0
    lim = np.float64(half)
    clipped = 0
    for i in prange(y.size):
        a = np.float64(y[i]) * f
        if a > lim:
            a = lim
            clipped += 1
        elif a < -lim:
            a = -lim
            clipped += 1
        lv = np.floor(a)
        out[i] = np.int8(lv + (1.0 if uniform(i, key) < a - lv else 0.0))
    return clipped


@njit(cache=True)
def thc_dequantize(q, scale, half, out):
    """y = q * scale / half (q int8, or an int32 in-network sum) into float32 ``out``."""
    s = scale / half
    for i in prange(q.size):
        out[i] = np.float32(q[i] * s)


@njit(cache=True)
def thc_sum(stack, out):
    """Sum int8 payload rows ``stack`` (workers x d) into int32 ``out`` (the switch's job)."""
    w, d = stack.shape
    for i in prange(d):
        s = 0
        for k in range(w):
            s += np.int32(stack[k, i])
        out[i] = s


def padded_length(n: int, block: int) -> tuple[int, int]:
    """(d, effective block) for n elements: blocks of ``block`` or one power-of-two block."""
    if n == 0:
        return 0, 1
    if n <= block:
        b = 1 << (n - 1).bit_length()
        return b, b
    return ((n + block - 1) // block) * block, block


class ThcCompressor(Compressor):
    """THC with ``granularity`` g (default 16), ``block`` (1024), ``clip`` (4.0) and a shared
    ``seed`` (0). Summable: see the module docstring for the shared-norm protocol."""

    name = "thc"
    summable = True
    carrier = "levels"

    def __init__(self, granularity: int = 16, block: int = 1024, clip: float = 4.0,
                 seed: int = 0):
        g = check_number("granularity", 2, 254, integer=True)(granularity)
        if g % 2:
            raise ValueError(f"granularity: must be even (levels -g/2..g/2), got {g}")
        block = check_number("block", 1, 1 << 24, integer=True)(block)
        if block & (block - 1):
            raise ValueError(f"block: must be a power of two, got {block}")
        clip = check_number("clip", 0.0, 1e6, lo_open=True)(clip)
        seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        super().__init__(granularity=g, block=block, clip=clip, seed=seed)
        self.g, self.block, self.clip, self.seed = g, block, clip, seed

    @staticmethod
    def local_norm(x: np.ndarray) -> float:
        """This worker's contribution to the shared scale: ||x||_2 (agree on the max)."""
        x = check_vector(x)
        return float(l2norm(x)) if x.size else 0.0

    def compress(self, x, step=0, norm=None):
        """Compress with the agreed ``norm`` (max of the workers' local_norm; None = own)."""
        x = check_vector(x)
        step = check_step(step)
        own = float(l2norm(x)) if x.size else 0.0
        if norm is None:
            norm = own
        else:
            norm = check_number("norm", 0.0, 3.4e38)(norm)
        n = x.size
        d, blk = padded_length(n, self.block)
        y = np.empty(d, dtype=np.float32)
        if n:
            rht_forward(x, blk, stream_key(self.seed, step, SALT_SIGN), y)
        scale = self.clip * norm / math.sqrt(d) if d else 0.0
        q = np.empty(d, dtype=np.int8)
        clipped = int(thc_quantize(y, scale, self.g // 2, stream_key(self.seed, step, SALT_QUANT),
                                   q)) if d else 0
        return (q,), {"n": int(n), "step": step, "scale": scale, "clipped": clipped}

    def _decompress(self, payload, ctx):
        q = np.ascontiguousarray(payload[0])
        n, step = int(ctx["n"]), int(ctx["step"])
        d, blk = padded_length(n, self.block)
        if q.size != d:
            raise ValueError(f"payload has {q.size} elements, expected {d} for n={n}")
        y = np.empty(d, dtype=np.float32)
        thc_dequantize(q, float(ctx["scale"]), self.g // 2, y)
        out = np.empty(n, dtype=np.float32)
        if n:
            rht_inverse(y, blk, stream_key(self.seed, step, SALT_SIGN), n, out)
        return out

    def _aggregate(self, payloads):
        stack = np.ascontiguousarray(np.stack([np.asarray(p[0], dtype=np.int8) for p in payloads]))
        out = np.empty(stack.shape[1], dtype=np.int32)
        thc_sum(stack, out)
        return (out,)

    def payload_bytes(self, n_elements):
        """1 byte per padded element (the scale travels in the ctx / header)."""
        return padded_length(int(n_elements), self.block)[0]
