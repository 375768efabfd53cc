"""Shared pieces of the compressors: the interface, input checks, the counter-based RNG, the
wire format and small reductions.

Randomness: every stochastic kernel draws from a *counter-based* generator: the uniform for
element ``i`` is a hash of ``(i, key)`` where ``key = stream_key(seed, step, salt)``. Results
therefore do not depend on thread count or on which part of a tensor a packet carries, the
numpy twins reproduce them bit for bit, and two workers with the same ``(seed, step)`` draw
the same numbers (the basis of randomk's shared indices and THC's shared rotation).
"""

from __future__ import annotations

import inspect
import json
import math
import struct
import types as pytypes

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

#: 2**-24: turns a 24-bit integer into a float in [0, 1) exactly.
_INV24 = 1.0 / 16777216.0

#: Work (elements) from which the kernels run their parallel (prange) variant. Below it they
#: run serially: a parallel region costs tens of microseconds when idle and up to tens of
#: milliseconds on a loaded 2-core machine (measured with the OpenMP layer), which would
#: dominate per-packet calls from the data path.
PAR_MIN = 1 << 20

# Start Numba's parallel thread pool now. A cache-loaded serial @njit function that calls one
# of the prange kernels below does not launch it itself, and the first parallel call then
# segfaults (observed with numba 0.68 + the OpenMP layer); compiling in-process hides this.
numba.get_num_threads()

#: Elements per partial sum in the chunked reductions: fixed (not per thread) so that the
#: result does not depend on the number of threads.
REDUCE_CHUNK = 1 << 16


def kernel(size: str):
    """Decorator: compile ``fn`` as a serial and a parallel (prange) Numba kernel and return
    an ``@njit(cache=True)`` dispatcher with the same signature that runs the parallel one
    when the expression ``size`` (over the arguments, e.g. ``"x.size"``) is >= PAR_MIN.

    The result is callable from Python and from other ``@njit`` code; ``fn.serial`` and
    ``fn.parallel`` expose both variants (tests compare them).
    """

    def deco(fn):
        ser = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                                 fn.__defaults__, fn.__closure__)
        ser.__qualname__ = fn.__qualname__ + "_serial"
        ser.__module__ = fn.__module__
        ser_jit = njit(cache=True)(ser)
        par_jit = njit(cache=True, parallel=True)(fn)
        args = ", ".join(inspect.signature(fn).parameters)
        lines = "\n" * (fn.__code__.co_firstlineno - 1)  # keep a distinct, real source line
        src = (f"{lines}def {fn.__name__}({args}):\n"
               f"    if {size} >= _PAR_MIN:\n"
               f"        return _par({args})\n"
               f"    return _ser({args})\n")
        ns = {"_par": par_jit, "_ser": ser_jit, "_PAR_MIN": PAR_MIN, "np": np}
        exec(compile(src, fn.__code__.co_filename, "exec"), ns)
        wrapper = ns[fn.__name__]
        wrapper.__doc__ = fn.__doc__
        wrapper.__module__ = fn.__module__
        wrapper.__qualname__ = fn.__qualname__ + "_dispatch"
        disp = njit(cache=True)(wrapper)
        disp.serial = ser_jit
        disp.parallel = par_jit
        return disp

    return deco


def _as_i32(builder, v):
    i32 = ir.IntType(32)
    w = v.type.width
    return builder.trunc(v, i32) if w > 32 else builder.zext(v, i32) if w < 32 else v


def _lowbias32(builder, i, key):
    """LLVM IR of the 32-bit hash: wrap-around 32-bit lanes, so loops vectorise 8/16 wide
    (Numba itself widens uint32 arithmetic to 64 bits)."""
    i32 = ir.IntType(32)
    h = builder.add(builder.mul(_as_i32(builder, i), ir.Constant(i32, 0x9E3779B1)),
                    _as_i32(builder, key))
    h = builder.xor(h, builder.lshr(h, ir.Constant(i32, 16)))
    h = builder.mul(h, ir.Constant(i32, 0x7FEB352D))
    h = builder.xor(h, builder.lshr(h, ir.Constant(i32, 15)))
    h = builder.mul(h, ir.Constant(i32, 0x846CA68B))
    return builder.xor(h, builder.lshr(h, ir.Constant(i32, 16)))


@intrinsic
def hash_u32(typingctx, i, key):
    """32-bit hash (lowbias32 finaliser) of element index ``i`` under stream ``key``:
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
        return builder.fmul(f, ir.Constant(ir.FloatType(), _INV24))

    return types.float32(i, key), codegen


@njit(cache=True, inline="always")
def uniform(i, key):
    """Uniform float64 in [0, 1) with 24 random bits (the float32 draw, widened exactly)."""
    return np.float64(uniform32(i, key))


def stream_key(seed: int, step: int, salt: int = 0) -> np.uint64:
    """Key of the random stream for ``(seed, step, salt)`` (splitmix64, folded to 32 bits)."""
    m64 = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + salt * 0x8CB92BA72F3D8DD7
         + 0x632BE59BD9B4E019) & m64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
    z ^= z >> 31
    return np.uint64((z ^ (z >> 32)) & 0xFFFFFFFF)


# ----------------------------------------------------------------------------- reductions


@njit(cache=True, inline="always")
def _sum_sq(x, lo, hi):
    # eight independent accumulators in a fixed order (still deterministic): breaks the add
    # latency chain without fast-math reassociation
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    body = lo + ((hi - lo) // 8) * 8
    for i in range(lo, body, 8):
        v0, v1 = np.float64(x[i]), np.float64(x[i + 1])
        v2, v3 = np.float64(x[i + 2]), np.float64(x[i + 3])
        v4, v5 = np.float64(x[i + 4]), np.float64(x[i + 5])
        v6, v7 = np.float64(x[i + 6]), np.float64(x[i + 7])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
        s4 += v4 * v4
        s5 += v5 * v5
        s6 += v6 * v6
        s7 += v7 * v7
    for i in range(body, hi):
        v = np.float64(x[i])
        s0 += v * v
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(cache=True, inline="always")
def _sum_abs(x, lo, hi):
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    body = lo + ((hi - lo) // 8) * 8
    for i in range(lo, body, 8):
        s0 += abs(np.float64(x[i]))
        s1 += abs(np.float64(x[i + 1]))
        s2 += abs(np.float64(x[i + 2]))
        s3 += abs(np.float64(x[i + 3]))
        s4 += abs(np.float64(x[i + 4]))
        s5 += abs(np.float64(x[i + 5]))
        s6 += abs(np.float64(x[i + 6]))
        s7 += abs(np.float64(x[i + 7]))
    for i in range(body, hi):
        s0 += abs(np.float64(x[i]))
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@kernel("x.size")
def _chunk_sums(x, power):
    nchunk = (x.size + REDUCE_CHUNK - 1) // REDUCE_CHUNK
    part = np.zeros(nchunk, dtype=np.float64)
    for c in prange(nchunk):
        lo = c * REDUCE_CHUNK
        hi = min(x.size, lo + REDUCE_CHUNK)
        part[c] = _sum_sq(x, lo, hi) if power == 2 else _sum_abs(x, lo, hi)
    return part


@njit(cache=True)
def l2norm(x):
    """L2 norm of a float32 vector, accumulated in float64 over fixed chunks (deterministic)."""
    part = _chunk_sums(x, 2)
    s = 0.0
    for c in range(part.size):
        s += part[c]
    return np.sqrt(s)


@njit(cache=True)
def l1norm(x):
    """L1 norm of a float32 vector, accumulated in float64 over fixed chunks (deterministic)."""
    part = _chunk_sums(x, 1)
    s = 0.0
    for c in range(part.size):
        s += part[c]
    return s


@kernel("x.size")
def absmax(x):
    """max |x_i| as float32 (0 for an empty vector); order-independent, hence exact."""
    nchunk = (x.size + REDUCE_CHUNK - 1) // REDUCE_CHUNK
    part = np.zeros(max(nchunk, 1), dtype=np.float32)
    for c in prange(nchunk):
        lo = c * REDUCE_CHUNK
        hi = min(x.size, lo + REDUCE_CHUNK)
        m = np.float32(0.0)
        for i in range(lo, hi):
            a = abs(x[i])
            if a > m:
                m = a
        part[c] = m
    return part.max()


@kernel("x.size")
def all_finite(x):
    """True when no element of the float32 vector is NaN or +-inf."""
    bad = 0
    for i in prange(x.size):
        v = x[i]
        if not (v - v == 0.0):
            bad += 1
    return bad == 0


# ----------------------------------------------------------------------------- checks


def check_vector(x, name: str = "x") -> np.ndarray:
    """Return ``x`` as a contiguous 1-D float32 array of finite values, or raise ValueError."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a numpy array (1-D float32), got {type(x).__name__}; "
                         f"use np.asarray({name}, dtype=np.float32)")
    if x.dtype != np.float32:
        raise ValueError(f"{name} must have dtype float32, got {x.dtype}; "
                         f"convert with {name}.astype(np.float32)")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}; flatten it with {name}.ravel()")
    x = np.ascontiguousarray(x)
    if x.size and not all_finite(x):
        raise ValueError(f"{name} contains NaN or inf; compressors need finite values "
                         "(check the gradient or the loss scaling first)")
    return x


def check_step(step) -> int:
    """``step`` as a non-negative int, or ValueError naming it."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def check_number(name: str, value, lo: float, hi: float, *, integer: bool = False,
                 lo_open: bool = False) -> float | int:
    """Validate a numeric parameter in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    ok_type = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"parameter {name!r} must be {kind}, got {value!r}")
    v = int(value) if integer else float(value)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise ValueError(f"parameter {name!r} must be in {left}{lo}, {hi}], got {value!r}")
    return v


def count_for_ratio(n: int, ratio: float) -> int:
    """GRACE's element count for a compress ratio: max(1, int(n * ratio)), 0 for n == 0."""
    return 0 if n == 0 else min(n, max(1, int(n * ratio)))


# ----------------------------------------------------------------------------- wire format

_MAGIC = b"TBCZ"
_WIRE_VERSION = 1
_DTYPES = ("float32", "float16", "uint16", "int8", "uint8", "int16", "int32", "float64",
           "int64", "uint32")
_DTYPE_CODE = {np.dtype(d): k for k, d in enumerate(_DTYPES)}


def encode_payload(name: str, params: dict, ctx: dict, payload: tuple) -> bytes:
    """Self-describing bytes: magic, compressor name, JSON params+ctx, then typed arrays.

    Layout (little-endian): ``b"TBCZ" u8 version u8 len(name) name u32 len(meta) meta(JSON)
    u8 n_arrays`` and per array ``u8 dtype_code u8 ndim u32*ndim shape raw-bytes``. No pickle.
    """
    meta = json.dumps({"params": params, "ctx": ctx}, sort_keys=True).encode()
    nb = name.encode()
    parts = [_MAGIC, struct.pack("<BB", _WIRE_VERSION, len(nb)), nb,
             struct.pack("<I", len(meta)), meta, struct.pack("<B", len(payload))]
    for a in payload:
        a = np.asarray(a)
        code = _DTYPE_CODE.get(a.dtype)
        if code is None:
            raise ValueError(f"payload dtype {a.dtype} has no wire code")
        parts.append(struct.pack("<BB", code, a.ndim))
        parts.append(struct.pack(f"<{a.ndim}I", *a.shape))
        parts.append(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
    return b"".join(parts)


def decode_payload(data) -> tuple[str, dict, dict, tuple]:
    """Inverse of :func:`encode_payload`: ``(name, params, ctx, payload)``; ValueError if malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    mv = memoryview(data).cast("B")
    try:
        if bytes(mv[:4]) != _MAGIC:
            raise ValueError("data is not a testbed compressed payload (bad magic)")
        ver, ln = struct.unpack_from("<BB", mv, 4)
        if ver != _WIRE_VERSION:
            raise ValueError(f"data has wire version {ver}, expected {_WIRE_VERSION}")
        off = 6
        name = bytes(mv[off:off + ln]).decode()
        off += ln
        (lm,) = struct.unpack_from("<I", mv, off)
        off += 4
        meta = json.loads(bytes(mv[off:off + lm]))
        off += lm
        (na,) = struct.unpack_from("<B", mv, off)
        off += 1
        arrays = []
        for _ in range(na):
            code, ndim = struct.unpack_from("<BB", mv, off)
            off += 2
            shape = struct.unpack_from(f"<{ndim}I", mv, off)
            off += 4 * ndim
            dt = np.dtype(_DTYPES[code]).newbyteorder("<")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if off + nbytes > len(mv):
                raise ValueError("data is truncated")
            arr = np.frombuffer(mv[off:off + nbytes], dtype=dt).reshape(shape)
            arrays.append(arr.astype(dt.newbyteorder("="), copy=True))
            off += nbytes
        if off != len(mv):
            raise ValueError(f"data has {len(mv) - off} trailing bytes")
    except (struct.error, IndexError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"data is not a valid compressed payload: {e}") from None
    return name, meta["params"], meta["ctx"], tuple(arrays)


# ----------------------------------------------------------------------------- interface


class Compressor:
    """A gradient compressor (GRACE's Compressor abstraction).

    ``compress(x, step)`` returns ``(payload, ctx)``: a tuple of numpy arrays that travel on
    the wire and a small dict of JSON scalars (length, step, scales) the receiver needs.
    ``decompress(payload, ctx)`` returns float32 of the original length. ``summable`` says
    whether payloads of n workers (compressed with the same ``step`` and shared parameters)
    can be added elementwise (:meth:`aggregate`) and decompressed once to the sum.
    """

    name = "base"
    summable = False
    #: True when compress() keeps state between calls (momentum, warm start): use one
    #: instance per tensor.
    stateful = False

    def __init__(self, **params):
        self.params = params

    # subclasses implement these two
    def _compress(self, x: np.ndarray, step: int) -> tuple[tuple, dict]:
        raise NotImplementedError

    def _decompress(self, payload: tuple, ctx: dict) -> np.ndarray:
        raise NotImplementedError

    def payload_bytes(self, n_elements: int) -> int:
        """Bytes of the payload arrays for an ``n_elements`` gradient (upper bound when the
        size depends on the data); the encoded form adds a small header with the ctx."""
        raise NotImplementedError

    def compress(self, x: np.ndarray, step: int = 0) -> tuple[tuple, dict]:
        """Compress a finite 1-D float32 gradient; ``step`` selects the shared random stream."""
        x = check_vector(x)
        return self._compress(x, check_step(step))

    def decompress(self, payload: tuple, ctx: dict) -> np.ndarray:
        """Rebuild the float32 gradient from ``payload`` and ``ctx`` (as returned by compress)."""
        if not isinstance(payload, tuple):
            raise ValueError(f"payload must be the tuple returned by compress(), got "
                             f"{type(payload).__name__}")
        if not isinstance(ctx, dict) or "n" not in ctx:
            raise ValueError("ctx must be the dict returned by compress() (it has no 'n')")
        return self._decompress(payload, ctx)

    def aggregate(self, payloads: list) -> tuple:
        """Elementwise sum of n workers' payloads, as the network would add them.

        Only for ``summable`` compressors; every worker must have used the same ``step`` and
        shared parameters, and the result decompresses with any one worker's ctx.
        """
        if not self.summable:
            raise ValueError(f"compressor {self.name!r} is not summable; gather the payloads "
                             "and decompress each (e.g. allgather) instead")
        if not payloads:
            raise ValueError("payloads must hold at least one worker's payload")
        shapes = {tuple(a.shape for a in p) for p in payloads}
        if len(shapes) != 1:
            raise ValueError(f"payloads differ in shape {sorted(shapes)}; workers must compress "
                             "tensors of the same length with the same parameters")
        return self._aggregate(payloads)

    def _aggregate(self, payloads: list) -> tuple:
        raise NotImplementedError

    def encode(self, x: np.ndarray, step: int = 0) -> bytes:
        """Compress ``x`` and serialise payload + ctx + parameters to self-describing bytes."""
        payload, ctx = self.compress(x, step)
        return self.encode_compressed(payload, ctx)

    def encode_compressed(self, payload: tuple, ctx: dict) -> bytes:
        """Serialise an already compressed (or aggregated) payload with its ctx."""
        return encode_payload(self.name, self.params, ctx, payload)

    def decode(self, data: bytes) -> np.ndarray:
        """Decompress bytes produced by :meth:`encode` of a compressor of the same name."""
        name, _params, ctx, payload = decode_payload(data)
        if name != self.name:
            raise ValueError(f"data was encoded by compressor {name!r}, not {self.name!r}; "
                             "use testbed.kernels.compressors.decode_any(data)")
        return self.decompress(payload, ctx)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"{type(self).__name__}({args})"


def num_threads() -> int:
    """Threads Numba's parallel loops use (for sizing chunked kernels)."""
    return numba.get_num_threads()
