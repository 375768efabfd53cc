"""Ring algorithms over TCP: allreduce (reduce-scatter + allgather), reduce-scatter, allgather,
and a pipelined chain broadcast.

The array is cut into n shards (``report.shard_bounds``); each step a rank sends one shard to
its right neighbour while receiving one from its left (the sender thread makes it
simultaneous). Received data is added piece by piece (``chunk`` elements) so the addition
overlaps the transfer.
"""

from __future__ import annotations

import numpy as np

from testbed.collectives.report import shard_bounds
from testbed.collectives.transport import Comm, chunks, wait_all


def ring_peers(rank: int, n: int) -> list[int]:
    """Ranks a ring member talks to."""
    return sorted({(rank - 1) % n, (rank + 1) % n} - {rank})


def _reduce_scatter(comm: Comm, out: np.ndarray, n: int, chunk: int, tmp: np.ndarray) -> None:
    """In place on ``out``: afterwards shard ``rank`` of ``out`` holds the sum over ranks."""
    r = comm.rank
    b = shard_bounds(out.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i = (r - s - 1) % n
        recv_i = (r - s - 2) % n
        fut = comm.send(right, out[b[send_i]:b[send_i + 1]])
        lo, hi = int(b[recv_i]), int(b[recv_i + 1])
        for a, z in chunks(lo, hi, chunk):
            t = tmp[: z - a]
            comm.recv(left, t)
            out[a:z] += t
        fut.result()


def _allgather(comm: Comm, out: np.ndarray, n: int) -> None:
    """In place on ``out``: shard ``rank`` is valid at entry; every shard is at exit."""
    r = comm.rank
    b = shard_bounds(out.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i = (r - s) % n
        recv_i = (r - s - 1) % n
        fut = comm.send(right, out[b[send_i]:b[send_i + 1]])
        comm.recv(left, out[b[recv_i]:b[recv_i + 1]])
        fut.result()


def allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Ring allreduce of ``x`` into ``out`` (same size)."""
    out[:] = x
    tmp = np.empty(min(chunk, out.size), dtype=out.dtype)
    _reduce_scatter(comm, out, n, chunk, tmp)
    _allgather(comm, out, n)


def reduce_scatter(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Ring reduce-scatter: ``out`` gets shard ``rank`` of the sum of every rank's ``x``."""
    work = x.copy()
    tmp = np.empty(min(chunk, work.size), dtype=work.dtype)
    _reduce_scatter(comm, work, n, chunk, tmp)
    b = shard_bounds(x.size, n)
    out[:] = work[b[comm.rank]:b[comm.rank + 1]]


def allgather(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Ring allgather: ``x`` is this rank's shard, ``out`` the concatenation of all shards."""
    b = shard_bounds(out.size, n)
    out[b[comm.rank]:b[comm.rank + 1]] = x
    _allgather(comm, out, n)


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
