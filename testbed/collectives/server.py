"""Reduction server (Vertex AI style): m server ranks, each owns one shard of the array.

Every worker sends shard j of its array to server j and receives the reduced shard j back.
A server sums piece k of its shard over every worker and sends it back to every worker while
later pieces are still arriving (pipelined in ``chunk`` elements). Server ranks are numbered
n..n+m-1 after the n workers.

The server drains all n worker connections at once (one reader thread per worker, each
landing its stream in its own buffer) instead of reading piece k from worker 0, then 1, ...:
with ordered reads, a worker whose piece is not being read yet fills its socket's receive
buffer and its flow stalls on a closed TCP window while the server waits for another one.
This alone helped little (m = n = 4 dedicated, 100 Mb/s, 8 MB: 1.42-1.65x the model ->
1.36-1.44x); the workers' credit window (``worker_allreduce``) and pieces of at most 32 KiB
(``model.rs_chunk_bytes``) did the rest: 1.01-1.09x at 8 and 32 MB, m = 1, 2, 4 dedicated
and co-located (``python -m testbed.bench.collectives rs 8,32``), ring 1.07-1.19x.
"""

from __future__ import annotations

import threading

import numpy as np

from testbed.collectives.report import shard_bounds
from testbed.collectives.transport import Comm, chunks, wait_all

#: Results a worker may have from one server beyond what it has from the slowest unfinished
#: one before it sends that server more (:func:`worker_allreduce`).
LEAD_PIECES = 1


def worker_allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, m: int,
                     chunk: int, window: int = 4, lead: int = LEAD_PIECES) -> None:
    """Worker side: scatter shards to the m servers and gather the sums into ``out``.

    Credit window: piece k + ``window`` of shard j is queued only when the sum of piece k came
    back from server j (``model.rs_window_pieces`` sizes it). Without it every worker queued
    its whole shards at once and TCP split each uplink among the m flows unevenly; a server
    can return piece k only when the slowest worker's piece k arrived, so the fast flows'
    data sat in buffers, the results (the downlinks) started late and the run took
    1.4-1.65x the model. The window keeps the
    n flows into a server within ``window`` pieces of each other, which steers each uplink
    to the flows that lag.

    Lockstep (``lead``): a credit is also held back while this worker has more than ``lead``
    results from that server beyond those of the slowest unfinished one. Credit windows alone
    let one server fall behind for good: its workers' uplinks filled with the other servers'
    pieces, so its own waited behind them (TCP small queues share a FIFO per socket, not by
    need), its results came late, its credits later, and its last pieces ran alone at the
    end. Star of 8, f=12, 4 MiB: about one run in four at 1.13-1.25 of the model (most often
    a network's first), one host's links at 0.6-0.8 of their rate from the first second; with
    ``lead`` = 1, 16 runs at 1.00-1.08 (0: 1.00-1.05). The slowest server's own credits are
    never held, so it cannot deadlock.
    """
    b = shard_bounds(x.size, m)
    pieces = [list(chunks(int(b[j]), int(b[j + 1]), chunk)) for j in range(m)]
    futs: list = []
    errors: list[BaseException] = []
    done = [0] * m  # results received per server
    cv = threading.Condition()

    def behind() -> int:  # results from the server furthest behind (finished ones excluded)
        return min((done[j] for j in range(m) if done[j] < len(pieces[j])), default=1 << 62)

    def pull(j: int) -> None:
        try:
            ps = pieces[j]
            for a, z in ps[:window]:
                futs.append(comm.send(n + j, x[a:z]))
            for k, (a, z) in enumerate(ps):
                comm.recv(n + j, out[a:z])
                with cv:
                    done[j] = k + 1
                    cv.notify_all()
                if k + window < len(ps):
                    with cv:  # at most `lead` results ahead of the slowest server
                        cv.wait_for(lambda k=k: errors or behind() >= k + 1 - lead)
                        if errors:
                            return
                    a2, z2 = ps[k + window]
                    futs.append(comm.send(n + j, x[a2:z2]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            with cv:
                errors.append(e)
                cv.notify_all()

    threads = [threading.Thread(target=pull, args=(j,), daemon=True) for j in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wait_all(futs)


def shard_buffers(count: int, dtype: np.dtype, n: int, m: int, j: int,
                  reuse: list | None = None) -> list[np.ndarray]:
    """Server ``j``'s receive buffers, one per worker, each the size of its shard, every page
    touched; ``reuse`` (an earlier result) is returned as it is when it fits. Allocate them
    before the timed collective and pass them to :func:`serve` every time: fresh arrays would
    be zeroed page by page by the kernel as the workers' data first lands in them, inside the
    timed run (see ``ina.InaClient._qsum``)."""
    b = shard_bounds(count, m)
    size = int(b[j + 1] - b[j])
    if reuse is not None and len(reuse) == n and all(
            a.size == size and a.dtype == dtype for a in reuse):
        return reuse
    bufs = [np.empty(size, dtype=dtype) for _ in range(n)]
    for a in bufs:
        a.fill(0)
    return bufs


def serve(comm: Comm, count: int, dtype: np.dtype, n: int, m: int, j: int, chunk: int,
          bufs: list[np.ndarray] | None = None) -> None:
    """Server ``j``: reduce shard j of every worker's array and return it to every worker
    (``bufs``: :func:`shard_buffers`, made here when not given)."""
    b = shard_bounds(count, m)
    lo, hi = int(b[j]), int(b[j + 1])
    pieces = list(chunks(0, hi - lo, chunk))
    bufs = shard_buffers(count, dtype, n, m, j, bufs)
    # worker 0 lands in acc directly (first contribution overwrites: no zeroing pass)
    acc = bufs[0]
    got = [0] * n  # pieces fully received per worker
    cv = threading.Condition()
    errors: list[BaseException] = []

    def reader(w: int) -> None:
        try:
            for k, (a, z) in enumerate(pieces):
                comm.recv(w, bufs[w][a:z])
                with cv:
                    got[w] = k + 1
                    cv.notify()
        except BaseException as e:  # noqa: BLE001 - re-raised in the serving thread
            with cv:
                errors.append(e)
                cv.notify()

    threads = [threading.Thread(target=reader, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    futs = []
    for k, (a, z) in enumerate(pieces):
        with cv:
            cv.wait_for(lambda k=k: errors or min(got) > k)
            if errors:
                raise errors[0]
        piece = acc[a:z]
        for w in range(1, n):
            piece += bufs[w][a:z]
        for w in range(n):
            futs.append(comm.send(w, piece))
    for t in threads:
        t.join()
    wait_all(futs)
