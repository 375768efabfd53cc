"""Reduction server (Vertex AI style): m server ranks, each owns one shard of the array.

Every worker sends shard j of its array to server j and receives the reduced shard j back.
A server reads piece k of its shard from every worker, sums it, and sends it back to every
worker while later pieces are still arriving (pipelined in ``chunk`` elements).
Server ranks are numbered n..n+m-1 after the n workers.
"""

from __future__ import annotations

import threading

import numpy as np

from testbed.collectives.report import shard_bounds
from testbed.collectives.transport import Comm, chunks, wait_all


def worker_allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, m: int,
                     chunk: int) -> None:
    """Worker side: scatter shards to the m servers and gather the sums into ``out``."""
    b = shard_bounds(x.size, m)
    futs = []
    for j in range(m):
        for a, z in chunks(int(b[j]), int(b[j + 1]), chunk):
            futs.append(comm.send(n + j, x[a:z]))
    errors: list[BaseException] = []

    def pull(j: int) -> None:
        try:
            for a, z in chunks(int(b[j]), int(b[j + 1]), chunk):
                comm.recv(n + j, out[a:z])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=pull, args=(j,), daemon=True) for j in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wait_all(futs)


def serve(comm: Comm, count: int, dtype: np.dtype, n: int, m: int, j: int, chunk: int) -> None:
    """Server ``j``: reduce shard j of every worker's array and return it to every worker."""
    b = shard_bounds(count, m)
    lo, hi = int(b[j]), int(b[j + 1])
    acc = np.empty(hi - lo, dtype=dtype)
    tmp = np.empty(min(chunk, max(hi - lo, 1)), dtype=dtype)
    futs = []
    for a, z in chunks(0, hi - lo, chunk):
        piece = acc[a:z]
        comm.recv(0, piece)  # first contribution overwrites: no zeroing pass
        t = tmp[: z - a]
        for w in range(1, n):
            comm.recv(w, t)
            piece += t
        for w in range(n):
            futs.append(comm.send(w, piece))
    wait_all(futs)
