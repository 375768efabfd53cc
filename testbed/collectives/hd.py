"""Recursive halving-doubling over TCP (Rabenseifner / MPICH style) and a binomial broadcast.

Allreduce: reduce-scatter by recursive halving (partner = rank XOR d, d = p/2 .. 1, each step
exchanges half of the current range), then allgather by recursive doubling. When n is not a
power of two, the first 2*(n-p) ranks pair up (p = largest power of two <= n): the odd one
sends its whole array to its even partner, which joins the power-of-two exchange, and sends
the sum back at the end.

A round ends when this rank received its partner's half and its own half left the socket
(``Comm.drain``), not when ``sendall`` handed the bytes to a send buffer that autotuning grows
to megabytes: otherwise a rank whose receive finished first starts the next round while its
previous message still waits in that buffer, the two messages share the uplink, and the
previous partner, still waiting for its half, falls behind; every later round inherits that
skew. Measured on a star of 8 at 100 Mb/s (4 MiB, time dilation 16, not CPU-bound, 4 runs
each): 1.27-1.71 of the model without draining, 1.22-1.44 with it.

A round whose messages are large starts with a **rendezvous** (MPI's ready-to-send): each rank
sends its partner a one-byte "entered" and waits for the partner's before sending data
(:data:`~testbed.collectives.spec.HD_RENDEZVOUS_BYTES`; smaller rounds send eagerly). Without
it a rank that finished round k early sends round k+1 to a partner still receiving its own
round k: the partner's downlink carries two messages, its round-k sender runs at half rate,
and that pair's lateness spreads to every later round. The flow model's rounds are the
rendezvous' rounds (:mod:`testbed.collectives.flowmodel`: a sender-driven fluid simulation
of the same rounds predicts 7.5-8 % more on the leaf-spines and the fat-tree of ``bench
fidelity``, and exactly the rendezvous' time with it). Measured (4 MiB, 100 Mb/s, Reno, not
CPU-bound, 3 runs each, alternating; measured/model): star of 8 at dilation 16 1.37-1.49
without, 1.08-1.28 with; leaf-spine 4x2x2 at 2:1 at dilation 8 1.08-1.47 (median 1.25)
without, 1.06-1.15 (median 1.11) with. The price is one one-way latency per large round.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from testbed.collectives.report import shard_bounds
from testbed.collectives.spec import HD_RENDEZVOUS_BYTES
from testbed.collectives.transport import CollectiveError, Comm, chunks

#: Debug hook: when this environment variable names a directory, every rank appends one JSON
#: line per round (round name, partner, bytes sent and received, start, sent, received and end
#: times in ``time.monotonic`` seconds) to ``<dir>/hd-rank<r>.jsonl``. It shows where a run's
#: time goes against the flow model's per-round prediction; unset, it costs one dict lookup.
TRACE_ENV = "TESTBED_HD_TRACE"


class _Trace:
    """Per-round timestamps of one rank (a no-op unless :data:`TRACE_ENV` is set)."""

    def __init__(self, rank: int):
        self.dir = os.environ.get(TRACE_ENV)
        self.rank = rank
        self.rows: list[dict] = []

    def round(self, name: str, partner: int, sent: int, got: int, t0: float, t_recv: float,
              t_sent: float) -> None:
        if self.dir:
            self.rows.append({"rank": self.rank, "round": name, "partner": partner,
                              "sent": sent, "got": got, "t0": t0, "t_recv": t_recv,
                              "t_sent": t_sent, "t_end": time.monotonic()})

    def flush(self) -> None:
        if self.dir and self.rows:
            with open(os.path.join(self.dir, f"hd-rank{self.rank}.jsonl"), "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.rows))
            self.rows.clear()


def _pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def fold(n: int):
    """(p, rem, new_rank(old) -> int|None, old_rank(new) -> int)."""
    p = _pow2(n)
    rem = n - p

    def new(r: int) -> int | None:
        if r < 2 * rem:
            return None if r % 2 else r // 2
        return r - rem

    def old(v: int) -> int:
        return 2 * v if v < rem else v + rem

    return p, rem, new, old


def hd_peers(rank: int, n: int, op: str) -> list[int]:
    """Ranks this rank talks to in ``op`` with halving-doubling (or binomial broadcast)."""
    if op == "broadcast":
        peers = set()
        d = 1
        while d < n:
            if rank < d and rank + d < n:
                peers.add(rank + d)
            elif d <= rank < 2 * d:
                peers.add(rank - d)
            d *= 2
        return sorted(peers)
    p, rem, new, old = fold(n)
    peers = set()
    if rank < 2 * rem:
        peers.add(rank ^ 1)
    v = new(rank)
    if v is not None:
        d = 1
        while d < p:
            peers.add(old(v ^ d))
            d *= 2
    return sorted(peers)


def _sent_at(fut, trace: _Trace) -> list[float]:
    """A list that gets the time ``fut`` (a send) completed, when tracing."""
    at: list[float] = []
    if trace.dir:
        fut.add_done_callback(lambda _f: at.append(time.monotonic()))
    return at


_READY = np.ones(1, np.uint8)


def _meet(comm: Comm, partner: int, send_bytes: int, recv_bytes: int) -> None:
    """The round's rendezvous (see the module docstring): when the larger of the two messages
    has :data:`HD_RENDEZVOUS_BYTES` or more (both ranks compute the same pair of sizes, so both
    decide alike), say "entered" and wait until the partner said it too."""
    if max(send_bytes, recv_bytes) < HD_RENDEZVOUS_BYTES:
        return
    comm.send(partner, _READY)
    got = np.zeros(1, np.uint8)
    comm.recv(partner, got)
    if got[0] != 1:
        raise CollectiveError(f"{comm.who(comm.rank)}: rank {partner} broke the "
                              f"halving-doubling rendezvous (got {got[0]}, not 1)")


def _halving(comm: Comm, out: np.ndarray, v: int, p: int, old, chunk: int,
             tmp: np.ndarray, trace: _Trace) -> None:
    """Recursive halving among p virtual ranks; afterwards shard v (of p) holds the sum."""
    b = shard_bounds(out.size, p)
    s0, s1 = 0, p
    d = p // 2
    while d >= 1:
        t0 = time.monotonic()
        mid = (s0 + s1) // 2
        partner = old(v ^ d)
        if v & d:
            keep, give = (mid, s1), (s0, mid)
        else:
            keep, give = (s0, mid), (mid, s1)
        _meet(comm, partner, int(b[give[1]] - b[give[0]]) * out.itemsize,
              int(b[keep[1]] - b[keep[0]]) * out.itemsize)
        fut = comm.send(partner, out[b[give[0]]:b[give[1]]])
        sent = _sent_at(fut, trace)
        for a, z in chunks(int(b[keep[0]]), int(b[keep[1]]), chunk):
            t = tmp[: z - a]
            comm.recv(partner, t)
            out[a:z] += t
        t_recv = time.monotonic()
        fut.result()
        comm.drain(partner)
        trace.round(f"halving d={d}", partner, int(b[give[1]] - b[give[0]]) * out.itemsize,
                    int(b[keep[1]] - b[keep[0]]) * out.itemsize, t0, t_recv,
                    sent[0] if sent else t_recv)
        s0, s1 = keep
        d //= 2


def _doubling(comm: Comm, out: np.ndarray, v: int, p: int, old, trace: _Trace) -> None:
    """Recursive doubling among p virtual ranks; shard v valid at entry, all at exit."""
    b = shard_bounds(out.size, p)
    s0, s1 = v, v + 1
    d = 1
    while d < p:
        t0 = time.monotonic()
        partner = old(v ^ d)
        if v & d:
            other = (s0 - (s1 - s0), s0)
        else:
            other = (s1, s1 + (s1 - s0))
        _meet(comm, partner, int(b[s1] - b[s0]) * out.itemsize,
              int(b[other[1]] - b[other[0]]) * out.itemsize)
        fut = comm.send(partner, out[b[s0]:b[s1]])
        sent = _sent_at(fut, trace)
        comm.recv(partner, out[b[other[0]]:b[other[1]]])
        t_recv = time.monotonic()
        fut.result()
        comm.drain(partner)
        trace.round(f"doubling d={d}", partner, int(b[s1] - b[s0]) * out.itemsize,
                    int(b[other[1]] - b[other[0]]) * out.itemsize, t0, t_recv,
                    sent[0] if sent else t_recv)
        s0, s1 = min(s0, other[0]), max(s1, other[1])
        d *= 2


def allreduce(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Halving-doubling allreduce of ``x`` into ``out`` for any n >= 2."""
    r = comm.rank
    p, rem, new, old = fold(n)
    out[:] = x
    tmp = np.empty(min(chunk, out.size), dtype=out.dtype)
    trace = _Trace(r)
    if r < 2 * rem:
        if r % 2:  # folded away: hand the array to the partner, get the sum back
            comm.send(r - 1, out).result()
            comm.recv(r - 1, out)
            return
        for a, z in chunks(0, out.size, chunk):
            t = tmp[: z - a]
            comm.recv(r + 1, t)
            out[a:z] += t
    v = new(r)
    _halving(comm, out, v, p, old, chunk, tmp, trace)
    _doubling(comm, out, v, p, old, trace)
    if r < 2 * rem:
        comm.send(r + 1, out).result()
    trace.flush()


def reduce_scatter(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Recursive-halving reduce-scatter (n a power of two): ``out`` = shard ``rank`` of the sum."""
    work = x.copy()
    tmp = np.empty(min(chunk, work.size), dtype=work.dtype)
    _halving(comm, work, comm.rank, n, lambda v: v, chunk, tmp, _Trace(comm.rank))
    b = shard_bounds(x.size, n)
    out[:] = work[b[comm.rank]:b[comm.rank + 1]]


def allgather(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Recursive-doubling allgather (n a power of two)."""
    b = shard_bounds(out.size, n)
    out[b[comm.rank]:b[comm.rank + 1]] = x
    _doubling(comm, out, comm.rank, n, lambda v: v, _Trace(comm.rank))


def broadcast(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """Binomial-tree broadcast from rank 0 (round d = 1, 2, 4, ...: ranks < d send to rank +
    d), one send at a time: a rank's send of round d leaves its socket (``Comm.drain``) before
    its send of round 2d starts. Queued all at once, a rank's sends shared its uplink, so its
    first child got the array after all of them (the root's three children of 8 ranks at 3 S/B
    instead of 1, 2 and 3): 4 MiB on a star of 8 at 100 Mb/s took 2.07-2.10 s against the
    binomial tree's 1.05 s (5 ranks: 1.39 s against 1.05)."""
    r = comm.rank
    trace = _Trace(r)
    if r == 0:
        out[:] = x
    d = 1
    while d < n:
        t0 = time.monotonic()
        if r < d and r + d < n:
            comm.send(r + d, out).result()
            comm.drain(r + d)
            trace.round(f"binomial d={d}", r + d, out.nbytes, 0, t0, t0, time.monotonic())
        elif d <= r < 2 * d:
            comm.recv(r - d, out)
            trace.round(f"binomial d={d}", r - d, 0, out.nbytes, t0, time.monotonic(), t0)
        d *= 2
    trace.flush()
