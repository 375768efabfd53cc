"""``bintree``: a pipelined binary-tree allreduce over TCP, as a testbed plug-in.

Rank r's parent is (r - 1) // 2, its children 2r + 1 and 2r + 2 (those < n). Chunk by chunk,
every rank adds its children's partial sums to its own and passes the result up; rank 0 then
holds the sum and passes it down the same tree. Chunks pipeline through the levels, so the
tree's depth costs latencies and one chunk each way, not whole arrays. A node with two
children receives (and later sends) the array twice on its one link: about 4 S/B in all,
against the ring's 2 (n - 1) / n S/B, but log2(n) latencies, not 2 (n - 1): the tree wins
for small messages on many ranks, the ring for large ones (NCCL's tree/ring split).
"""

from __future__ import annotations

import math

import numpy as np

from testbed.collectives.algorithms import PeerAlgorithm
from testbed.collectives.flowmodel import Phase
from testbed.collectives.transport import chunks, wait_all


def parent(rank: int) -> int | None:
    return None if rank == 0 else (rank - 1) // 2


def children(rank: int, n: int) -> list[int]:
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]


def depth(n: int) -> int:
    """Edges from the root to the deepest rank."""
    return int(math.floor(math.log2(n))) if n > 1 else 0


def allreduce(comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """One rank's part: reduce up the tree, then broadcast the sum down, chunk by chunk."""
    r = comm.rank
    up, kids = parent(r), children(r, n)
    out[:] = x
    tmp = np.empty(min(chunk, out.size), dtype=out.dtype)
    futs = []
    for a, z in chunks(0, out.size, chunk):
        for c in kids:  # the children's partial sums of this chunk
            t = tmp[: z - a]
            comm.recv(c, t)
            out[a:z] += t
        if up is not None:  # its region is overwritten only by the sum coming back down
            futs.append(comm.send(up, out[a:z]))
    for a, z in chunks(0, out.size, chunk):
        if up is not None:
            comm.recv(up, out[a:z])
        futs += [comm.send(c, out[a:z]) for c in kids]
    wait_all(futs)


class BinaryTree(PeerAlgorithm):
    name = "bintree"
    summary = "pipelined binary-tree allreduce (reduce up, broadcast down)"
    ops = ("allreduce",)

    def peers(self, rank, n, op):
        p = parent(rank)
        return sorted(([] if p is None else [p]) + children(rank, n))

    def rank_function(self, op):
        return allreduce

    def alpha_beta(self, op, n, nbytes, a, t, chunk_s):
        # each way: the busiest link carries the array once per child, every level adds a
        # latency, and the pipeline's fill is a chunk per level after the first (as the
        # ring's broadcast chain: n - 2 chunks for n - 1 hops)
        k, d = min(2, n - 1), depth(n)
        return 2 * (k * t + d * a + max(d - 1, 0) * chunk_s)

    def phases(self, op, n, count, chunk_el, rk):
        d, k = depth(n), min(2, n - 1)
        # the flow model pays a phase's fill at its slowest flow's rate, a child's share (1/k)
        # of its parent's link; a chunk crosses each later level at the link's full rate
        fill = max(d - 1, 0) * min(chunk_el, count) * rk.itemsize / k
        up = [rk.tcp(r, parent(r), count) for r in range(1, n)]
        down = [rk.tcp(parent(r), r, count) for r in range(1, n)]
        return [Phase("reduce up", up, trips=d, fill_bytes=fill),
                Phase("broadcast down", down, trips=d, fill_bytes=fill)]
