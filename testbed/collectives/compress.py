"""Compressed allreduce with any ``testbed.kernels.compressors`` compressor, as frameworks run
it: summable encodings are reduced in their compressed type, the others are allgathered.

Each worker compensates its gradient with its error-feedback memory (optional,
``kernels.memory.ResidualMemory``) and compresses it with the shared ``step`` (the
repetition or training iteration). Then, by :func:`scheme`:

* ``"reduce_scatter"`` - the compressor's payloads add (``Compressor.summable``: fp16, bf16,
  randomk, thc, none): a ring reduce-scatter + allgather (:func:`ring.allreduce_inplace`) of
  the payload in its **wire type** (the compressor's ``carrier``, :func:`ring_carrier`): float16 added in float16 as
  PyTorch's ``fp16_compress_hook`` over NCCL does, bfloat16 decoded, added and rounded back to
  bfloat16 at every hop, randomk's k shared-index values in float32, THC's integer levels in
  int8 (int16 when n * g/2 exceeds int8) after the workers agree on the largest norm (one
  ring allgather of n scalars: every payload must use one scale). Each worker then
  decompresses the reduced payload once. A link carries 2(n-1)/n of one payload.
* ``"allgather"`` - everything else (topk, sign, qsgd, ...: GRACE's non-summable ones): the
  payloads are serialised (``encode_compressed``: self-describing bytes) and a ring
  allgather of those variable-size blobs gives every worker all n of them; each worker
  decodes and sums them in rank order. A link carries (n-1) payloads.

The flow-level model (``flowmodel.phases``) and the closed form (``model.predict``) read the
same :func:`scheme` and payload size, so prediction and run agree on the algorithm.

Correctness: the result must equal the sum of the n workers' decompressed contributions
within the rounding of the wire type (:func:`check_contributions`; the collective pool replays
every worker's compressor and memory to get them, :func:`contributions`); ``max_abs_err`` is
reported against the exact sum of the raw inputs, i.e. it is the compression error.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from testbed.collectives import ring
from testbed.collectives.report import shard_bounds
from testbed.collectives.transport import Comm

_LEN = struct.Struct("<Q")

#: The carriers a ring can add in (``Compressor.carrier``).
CARRIERS = ("float32", "float16", "bfloat16", "levels")
#: Unit roundoff of each carrier (one rounding per hop of the reduce-scatter).
_CARRIER_EPS = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                "levels": 0.0}
#: Smallest subnormal step of each carrier (absolute error of a rounding near zero).
_CARRIER_TINY = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133,
                 "levels": 0.0}


def ring_carrier(compressor: str) -> str | None:
    """The type ``compressor``'s payloads are added in on the ring (its ``carrier``), or None
    when they do not add (not ``summable``): built-ins and plug-ins alike."""
    # Function-level import: the compressors load Numba, which plain runs do not need.
    from testbed.kernels.compressors import compressor_class

    cls = compressor_class(compressor)
    if not cls.summable:
        return None
    if cls.carrier not in CARRIERS:
        raise ValueError(f"compressor {compressor!r}: carrier {cls.carrier!r} is not one of "
                         f"{CARRIERS}")
    return cls.carrier


def scheme(compressor: str) -> str:
    """``"reduce_scatter"`` when ``compressor``'s payloads are reduced on the ring in their
    compressed type, else ``"allgather"`` (see the module docstring)."""
    return "allgather" if ring_carrier(compressor) is None else "reduce_scatter"


def levels_dtype(n: int, granularity: int) -> np.dtype:
    """Integer type of THC's summed levels on the ring: int8 while ``n * g/2`` fits it."""
    return np.dtype(np.int8) if n * (granularity // 2) <= 127 else np.dtype(np.int16)


def carrier_itemsize(compressor: str, params: dict, n: int) -> int:
    """Bytes per payload element on the ring of a summable ``compressor``."""
    c = ring_carrier(compressor)
    if c == "levels":
        return levels_dtype(n, int(params.get("granularity", 16))).itemsize
    return 2 if c in ("float16", "bfloat16") else 4


def wire_plan(compressor: str, params: dict, count: int, n: int) -> tuple[str, int, int]:
    """(scheme, payload elements, bytes per element on the wire) of one worker's compressed
    ``count``-element gradient among ``n`` workers: what the models charge the links with.
    Allgather payloads travel as encoded blobs (payload bytes + an 8-byte length; the
    encoding's own header of a few dozen bytes is left out)."""
    # Function-level import: the compressors load Numba, which plain runs do not need.
    from testbed.kernels.compressors import get_compressor

    nbytes = int(get_compressor(compressor, **params).payload_bytes(count))
    if scheme(compressor) == "allgather":
        return "allgather", nbytes + _LEN.size, 1
    natural = {"float32": 4, "float16": 2, "bfloat16": 2, "levels": 1}[ring_carrier(compressor)]
    return "reduce_scatter", nbytes // natural, carrier_itemsize(compressor, params, n)


def make(spec) -> tuple:
    """(compressor, memory) for one worker of ``spec``."""
    # here, not at the top: the pool process (worker.py) imports this module before it makes
    # Numba fork-safe, and the compressor kernels must load after that
    from testbed.kernels.compressors import get_compressor
    from testbed.kernels.memory import NoMemory, ResidualMemory

    comp = get_compressor(spec.compressor, **spec.compressor_params)
    return comp, (ResidualMemory() if spec.error_feedback else NoMemory())


def compress_one(comp, mem, x: np.ndarray, step: int, norm: float | None = None
                 ) -> tuple[tuple, dict, np.ndarray]:
    """Compensate, compress (THC with the agreed ``norm``), update the memory; return
    (payload, ctx, decompressed contribution)."""
    xc = mem.compensate(x)
    if norm is not None:
        payload, ctx = comp.compress(xc, step, norm=norm)
    else:
        payload, ctx = comp.compress(xc, step)
    dec = comp.decompress(payload, ctx)
    mem.update(xc, dec)
    return payload, ctx, dec


def allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, comp, mem, step: int,
              chunk_bytes: int = 256 << 10, contribution: np.ndarray | None = None) -> int:
    """Compressed allreduce of ``x`` into ``out``; returns the payload bytes this worker sent.

    ``contribution`` (optional, x's size): receives this worker's decompressed contribution
    (what the sum must contain, for checks)."""
    if scheme(comp.name) == "reduce_scatter":
        dec, sent = _reduce(comm, x, out, n, comp, mem, step, chunk_bytes)
    else:
        dec, sent = _gather(comm, x, out, n, comp, mem, step)
    if contribution is not None:
        contribution[:] = dec
    return sent


def _reduce(comm: Comm, x, out, n: int, comp, mem, step: int, chunk_bytes: int):
    carrier = ring_carrier(comp.name)
    norm = None
    if carrier == "levels":  # one scale for every payload: the largest compensated norm
        xc = mem.compensate(x)
        norm = max(_allgather_scalars(comm, n, comp.local_norm(xc)))
    payload, ctx, dec = compress_one(comp, mem, x, step, norm)
    p = np.ascontiguousarray(payload[0])
    add = None
    if carrier == "levels":
        buf = p.astype(levels_dtype(n, comp.g))
    elif carrier == "bfloat16":
        buf, add = p.copy(), _bf16_add
    else:
        buf = p.copy()
    chunk = max(1, chunk_bytes // buf.itemsize)
    ring.allreduce_inplace(comm, buf, n, chunk, add)
    if carrier == "levels":
        buf = buf.astype(np.int32)  # the in-network sum's type, which THC decompresses
    out[:] = comp.decompress((buf,), ctx)
    b = shard_bounds(buf.size, n)
    r = comm.rank
    sent = sum(int(b[i + 1] - b[i]) for i in [(r - 1 - k) % n for k in range(n - 1)]
               + [(r - k) % n for k in range(n - 1)])
    return dec, sent * buf.itemsize


def _bf16_add(acc: np.ndarray, piece: np.ndarray) -> None:
    """bfloat16 bits ``acc += piece``: decode both, add in float32, round back once."""
    # here, not at the top: Numba kernels load after the pool made Numba fork-safe (see make)
    from testbed.kernels.compressors.bf16 import bf16_decode, bf16_encode

    a = np.empty(acc.size, dtype=np.float32)
    b = np.empty(acc.size, dtype=np.float32)
    bf16_decode(acc, a)
    bf16_decode(np.ascontiguousarray(piece), b)
    a += b
    bf16_encode(a, acc)


def _ring_blobs(comm: Comm, n: int, blob: bytes) -> tuple[list[bytes], int]:
    """Ring allgather of one variable-size byte string per rank: (all n in rank order,
    bytes this rank sent)."""
    r = comm.rank
    blobs: list[bytes | None] = [None] * n
    blobs[r] = blob
    right, left = (r + 1) % n, (r - 1) % n
    sent = 0
    lenbuf = bytearray(_LEN.size)
    for s in range(n - 1):
        send_i = (r - s) % n
        recv_i = (r - s - 1) % n
        data = blobs[send_i]
        fut = comm.send(right, np.frombuffer(_LEN.pack(len(data)) + data, dtype=np.uint8))
        sent += _LEN.size + len(data)
        comm.recv(left, np.frombuffer(lenbuf, dtype=np.uint8))
        (size,) = _LEN.unpack(lenbuf)
        buf = bytearray(size)
        comm.recv(left, np.frombuffer(buf, dtype=np.uint8))
        blobs[recv_i] = bytes(buf)
        fut.result()
    return blobs, sent


def _allgather_scalars(comm: Comm, n: int, value: float) -> list[float]:
    blobs, _ = _ring_blobs(comm, n, struct.pack("<d", float(value)))
    return [struct.unpack("<d", b)[0] for b in blobs]


def _gather(comm: Comm, x, out, n: int, comp, mem, step: int):
    payload, ctx, dec = compress_one(comp, mem, x, step)
    blobs, sent = _ring_blobs(comm, n, comp.encode_compressed(payload, ctx))
    acc = np.zeros(x.size, dtype=np.float32)
    for b in blobs:
        acc += comp.decode(b)
    out[:] = acc
    return dec, sent


def warm(spec) -> None:
    """Compile/load the compressor's kernels on a tiny vector (serial path, fork-safe)."""
    comp, mem = make(spec)
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    payload, ctx, _ = compress_one(comp, mem, x, 0)
    if ring_carrier(comp.name) == "levels":
        comp.decompress((payload[0].astype(np.int32),), ctx)
    elif ring_carrier(comp.name) == "bfloat16":
        _bf16_add(payload[0].copy(), payload[0])


def contributions(replicas: list, inputs: list[np.ndarray], step: int) -> list[np.ndarray]:
    """Every worker's decompressed contribution at ``step``, replayed with its own
    (compressor, memory) replica as the workers ran them (THC: with the agreed norm)."""
    norm = None
    comp0 = replicas[0][0]
    if ring_carrier(comp0.name) == "levels":
        norm = max(comp.local_norm(mem.compensate(x))
                   for (comp, mem), x in zip(replicas, inputs, strict=True))
    return [compress_one(comp, mem, x, step, norm)[2]
            for (comp, mem), x in zip(replicas, inputs, strict=True)]


def check(replicas: list, inputs: list[np.ndarray], outputs: list[np.ndarray],
          step: int) -> tuple[float, bool]:
    """(max error against the exact sum of the raw inputs, every output equal to the sum of
    the n decompressed contributions within the wire type's rounding)."""
    comp = replicas[0][0]
    decs = contributions(replicas, inputs, step)
    return check_contributions(comp, decs, inputs, outputs)


def check_contributions(comp, decs: list[np.ndarray], inputs: list[np.ndarray],
                        outputs: list[np.ndarray]) -> tuple[float, bool]:
    """(max |output - sum of raw inputs|, every output within the bound of the sum of the
    decompressed contributions ``decs``).

    Bound per element: allgather sums float32 decodes: ``(n-1) eps32 sum|dec| + eps32|sum|``;
    the ring reduce-scatter rounds every partial sum to its carrier (unit roundoff u, smallest
    step t): ``(n-1) (u sum|dec| + t) + u |sum|`` plus float32's; THC's integer levels add
    exactly, and only the float32 inverse transform of the sum differs from the sum of the
    inverse transforms (``8 (log2 d + 2) eps32`` of the largest possible magnitude).
    """
    n = len(decs)
    ref = np.zeros(decs[0].size, dtype=np.float64)
    mag = np.zeros_like(ref)
    exact = np.zeros_like(ref)
    for d, x in zip(decs, inputs, strict=True):
        ref += d
        mag += np.abs(d)
        exact += x
    eps = float(np.finfo(np.float32).eps)
    bound = (n - 1) * eps * mag + eps * np.abs(ref) + 1e-30
    carrier = ring_carrier(comp.name)
    if carrier == "levels":
        bound = bound + 8 * (math.log2(max(ref.size, 2)) + 2) * eps * (
            float(np.max(mag, initial=0.0)) + 1e-30)
    elif carrier is not None:
        u, t = _CARRIER_EPS[carrier], _CARRIER_TINY[carrier]
        bound = bound + (n - 1) * (u * mag + t) + u * np.abs(ref)
    ok = True
    worst = 0.0
    for out in outputs:
        o = out.astype(np.float64)
        if not np.all(np.isfinite(o)):
            return float("inf"), False
        ok = ok and bool(np.all(np.abs(o - ref) <= bound))
        if o.size:
            worst = max(worst, float(np.max(np.abs(o - exact))))
    return worst, ok
