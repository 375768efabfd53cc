"""Ring algorithms over TCP: allreduce (reduce-scatter + allgather), reduce-scatter, allgather,
and a pipelined chain broadcast.

The array is cut into n shards (``report.shard_bounds``); each step a rank sends one shard to
its right neighbour while receiving one from its left (the sender thread makes it
simultaneous). Pieces of ``chunk`` elements are received, added and forwarded at once, so the
steps pipeline into one stream per link (see ``_ring``).
"""

from __future__ import annotations

import numpy as np

from testbed.collectives.report import shard_bounds
from testbed.collectives.transport import Comm, chunks, wait_all


def ring_peers(rank: int, n: int) -> list[int]:
    """Ranks a ring member talks to."""
    return sorted({(rank - 1) % n, (rank + 1) % n} - {rank})


def _ring(comm: Comm, out: np.ndarray, n: int, chunk: int, tmp: np.ndarray, rs: bool,
          ag: bool, add=None) -> None:
    """Pipelined ring over ``out`` in place: reduce-scatter (``rs``: afterwards shard
    ``rank`` holds the sum) then allgather (``ag``: shard ``rank`` valid at entry of the
    allgather, every shard at exit). ``add(acc, piece)`` combines a received piece into the
    local one in place (default ``acc += piece`` in ``out``'s dtype).

    Step s of the reduce-scatter receives shard (rank-s-2) and step s+1 sends that same shard
    on, so each received piece is added and queued for the right neighbour at once: the ring
    streams pieces instead of moving in lock-step shards (NCCL-style chunk pipelining). A
    region is never overwritten before its queued send left: the data that overwrites it
    causally depends on that send having arrived.
    """
    r = comm.rank
    b = shard_bounds(out.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    first = (r - 1) % n if rs else r
    futs = [comm.send(right, out[a:z]) for a, z in chunks(int(b[first]), int(b[first + 1]),
                                                          chunk)]
    steps = [(True, (r - s - 2) % n) for s in range(n - 1)] if rs else []
    if ag:
        steps += [(False, (r - s - 1) % n) for s in range(n - 1)]
    for k, (reduce, idx) in enumerate(steps):
        forward = k < len(steps) - 1
        for a, z in chunks(int(b[idx]), int(b[idx + 1]), chunk):
            if reduce:
                t = tmp[: z - a]
                comm.recv(left, t)
                if add is None:
                    out[a:z] += t
                else:
                    add(out[a:z], t)
            else:
                comm.recv(left, out[a:z])
            if forward:
                futs.append(comm.send(right, out[a:z]))
    wait_all(futs)


def allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Ring allreduce of ``x`` into ``out`` (same size)."""
    out[:] = x
    tmp = np.empty(min(chunk, out.size), dtype=out.dtype)
    _ring(comm, out, n, chunk, tmp, rs=True, ag=True)


def allreduce_inplace(comm: Comm, buf: np.ndarray, n: int, chunk: int, add=None) -> None:
    """Ring allreduce of ``buf`` in place in its own dtype (e.g. float16, or uint16 carrying
    bfloat16 bits with an ``add`` that decodes, adds and re-encodes): every partial sum is
    rounded to that type at each hop, as a framework's reduced-precision allreduce does."""
    tmp = np.empty(min(chunk, buf.size), dtype=buf.dtype)
    _ring(comm, buf, n, chunk, tmp, rs=True, ag=True, add=add)


def reduce_scatter(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int,
                   add=None) -> None:
    """Ring reduce-scatter: ``out`` gets shard ``rank`` of the sum of every rank's ``x``
    (``add``: another combination, as :func:`allreduce_inplace` takes it)."""
    work = x.copy()
    tmp = np.empty(min(chunk, work.size), dtype=work.dtype)
    _ring(comm, work, n, chunk, tmp, rs=True, ag=False, add=add)
    b = shard_bounds(x.size, n)
    out[:] = work[b[comm.rank]:b[comm.rank + 1]]


def allgather(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Ring allgather: ``x`` is this rank's shard, ``out`` the concatenation of all shards."""
    b = shard_bounds(out.size, n)
    out[b[comm.rank]:b[comm.rank + 1]] = x
    _ring(comm, out, n, chunk, out[:0], rs=False, ag=True)


def broadcast(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Pipelined chain from rank 0: each rank forwards chunk k while receiving chunk k+1."""
    r = comm.rank
    futs = []
    if r == 0:
        out[:] = x
    for a, z in chunks(0, out.size, chunk):
        if r > 0:
            comm.recv(r - 1, out[a:z])
        if r < n - 1:
            futs.append(comm.send(r + 1, out[a:z]))
    wait_all(futs)
