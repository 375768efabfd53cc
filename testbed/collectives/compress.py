"""Compressed allreduce: any ``testbed.kernels.compressors`` compressor, allgather-based.

Each worker compensates its gradient with its error-feedback memory (optional,
``kernels.memory.ResidualMemory``), compresses it with the shared ``step`` (the repetition
index), serialises it (``encode_compressed``: self-describing bytes), and a ring allgather of
those variable-size blobs gives every worker all n of them; each worker decodes and sums
them in rank order. Allgather works for every compressor (GRACE: top-k etc. are not
summable); summable ones would also allow reducing the payloads first.

Correctness: the result must equal the float32 sum of the n decompressed payloads (checked
by the pool, which replays every worker's compressor and memory); ``max_abs_err`` is reported
against the exact sum of the raw inputs, i.e. it is the compression error.
"""

from __future__ import annotations

import struct

import numpy as np

from testbed.collectives.transport import Comm

_LEN = struct.Struct("<Q")


def make(spec) -> tuple:
    """(compressor, memory) for one worker of ``spec``."""
    from testbed.kernels.compressors import get_compressor
    from testbed.kernels.memory import NoMemory, ResidualMemory

    comp = get_compressor(spec.compressor, **spec.compressor_params)
    return comp, (ResidualMemory() if spec.error_feedback else NoMemory())


def compress_one(comp, mem, x: np.ndarray, step: int) -> tuple[bytes, np.ndarray]:
    """Compensate, compress, update the memory; return (encoded bytes, decompressed)."""
    from testbed.kernels.memory import compress_with_feedback

    payload, ctx = compress_with_feedback(comp, mem, x, step)
    return comp.encode_compressed(payload, ctx), comp.decompress(payload, ctx)


def allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, comp, mem,
              step: int) -> int:
    """Compressed allreduce of ``x`` into ``out``; returns the bytes this worker sent."""
    r = comm.rank
    blob, _ = compress_one(comp, mem, x, step)
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
    acc = np.zeros(x.size, dtype=np.float32)
    for b in blobs:
        acc += comp.decode(b)
    out[:] = acc
    return sent


def warm(spec) -> None:
    """Compile/load the compressor's kernels on a tiny vector (serial path, fork-safe)."""
    comp, mem = make(spec)
    compress_one(comp, mem, np.linspace(-1, 1, 64, dtype=np.float32), 0)


def check(replicas: list, inputs: list[np.ndarray], outputs: list[np.ndarray],
          step: int) -> tuple[float, bool]:
    """(max error against the exact sum of the raw inputs, every output equal to the float32
    sum of the n decompressed payloads within the float summation bound)."""
    n = len(inputs)
    decs = [compress_one(comp, mem, x, step)[1] for (comp, mem), x in zip(replicas, inputs,
                                                                         strict=True)]
    ref = np.zeros(inputs[0].size, dtype=np.float64)
    mag = np.zeros_like(ref)
    exact = np.zeros_like(ref)
    for d, x in zip(decs, inputs, strict=True):
        ref += d
        mag += np.abs(d)
        exact += x
    eps = float(np.finfo(np.float32).eps)
    bound = (n - 1) * eps * mag + eps * np.abs(ref) + 1e-30
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
