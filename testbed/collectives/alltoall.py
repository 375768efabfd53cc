"""All-to-all over TCP: every rank's array is n equal parts, part j goes to rank j.

Small parts (under :data:`~testbed.collectives.spec.HD_RENDEZVOUS_BYTES`) are sent all at
once, every pair's part posted together, as gloo does. Large parts go by **pairwise
exchange** (MPI's algorithm for long all-to-alls): in step k = 1..n-1 rank r sends its part
for r+k and receives the part of r-k, so every host link carries one message per direction.

Why not all at once for large parts: n-1 TCP flows into every host link, behind FIFO
switch queues, do not share it fairly. Measured on a star of 8 at 100 Mb/s with plain TCP
(1 MiB per rank, no gloo): the exchange took 1.5-1.8x the max-min fluid time at dilations
1, 4 and 16, with BBR, CUBIC or Reno, with or without slow start after idle, on bridges and
on programmable switches; one rank's seven incoming flows ended between 27 and 143 ms
against 73 ms for all of them in the fluid model. A pairwise step is a permutation, so each
message has its links to itself, as the ring's and halving-doubling's do.

Each step starts with the receiver's ready-to-receive (as ``hd``'s rendezvous): rank r tells
r-k it may send and waits for r+k's word before sending to it, so a rank that finished step
k early does not send step k+1 into a downlink still carrying step k. The word for step k+1
leaves as soon as step k's part has arrived, before this rank waits for its own send to
leave: its trip overlaps that wait (the all-to-all of the MoE replay went from 1.18 to 1.17
of the model on average over four alternated runs at dilation 4). A step ends when this
rank's part left the socket (``Comm.drain``), for the reason ``hd`` gives. The flow model
prices the same steps (:func:`testbed.collectives.flowmodel.all_to_all_s`).

The all-to-all runs on **connections of its own** (``ports.a2a_port``) whose receivers offer
a small window (:func:`window_bytes`). In step k a host's uplink carries its own part to r+k
and, behind it in the same FIFO, its acknowledgements of the part coming from r-k and its
next ready-to-receive; with the kernel's autotuned window a sender keeps a whole part in
flight, so those small packets wait behind up to a part of data (acknowledgements 15 ms late
at the median, 42 ms at the 90th percentile, on a star of 8 at dilation 4), the incoming part
stalls, and the next step starts late. Measured (plain pairwise exchange, 1 MiB per rank,
star of 8 at 100 Mb/s, dilation 4, three exchanges each): 1.30-1.45 of the flow model with
the kernel's window, 1.14-1.17 with a window of 16-32 KiB; BBR, CUBIC or Reno, slow start
after idle, tail loss probes, larger buffers or initial windows, TCP small queues and a
window set after the handshake changed nothing. Jobs of more than 64 ranks use the job's own
connections (completed by the first call) and the kernel's window.
"""

from __future__ import annotations

import numpy as np

from testbed.collectives.ports import MAX_RANKS
from testbed.collectives.spec import HD_RENDEZVOUS_BYTES
from testbed.collectives.transport import CollectiveError, Comm, chunks, wait_all

_READY = np.ones(1, np.uint8)
#: The window of the all-to-all's connections at 100 Mb/s and below (see the docstring):
#: set before the handshake, it also fixes the window scale (0: never above 64 KiB, even
#: where the kernel's autotuning raises the clamp later).
A2A_WINDOW_BYTES = 32 << 10


def window_bytes(bw_bps: float | None = None) -> int:
    """``TCP_WINDOW_CLAMP`` of the all-to-all's connections: :data:`A2A_WINDOW_BYTES`, or
    2.5 ms of the link rate ``bw_bps`` where that is more."""
    return int(max(A2A_WINDOW_BYTES, (bw_bps or 0.0) / 8 * 0.0025))


def own_connections(n: int) -> bool:
    """Whether a job of ``n`` ranks all-to-alls on connections of its own (``ports.a2a_port``,
    :func:`window_bytes`), not on the job's (beyond ``ports.MAX_RANKS`` ranks)."""
    return n <= MAX_RANKS


def pairwise(part_bytes: float) -> bool:
    """Whether parts of ``part_bytes`` go by pairwise exchange (else all at once)."""
    return part_bytes >= HD_RENDEZVOUS_BYTES


def all_to_all(comm: Comm, x: np.ndarray, out: np.ndarray, n: int, chunk: int) -> None:
    """``out``'s part j is rank j's part ``rank`` of its ``x`` (1-D arrays of one dtype and
    size, a multiple of ``n``); ``comm`` must hold a connection to every other rank."""
    if x.shape != out.shape or x.dtype != out.dtype or x.ndim != 1:
        raise ValueError(f"all_to_all: x {x.dtype}{x.shape} and out {out.dtype}{out.shape} "
                         "must be 1-D arrays of one dtype and size")
    if x.size % n:
        raise ValueError(f"all_to_all: {x.size} elements do not split into {n} equal parts")
    r, m = comm.rank, x.size // n
    part = lambda j: slice(j * m, (j + 1) * m)  # noqa: E731 - a one-line index helper
    out[part(r)] = x[part(r)]
    if n < 2 or m == 0:
        return
    if not pairwise(m * x.itemsize):
        futs = [comm.send((r + k) % n, x[part((r + k) % n)]) for k in range(1, n)]
        for k in range(1, n):
            src = (r - k) % n
            comm.recv(src, out[part(src)])
        wait_all(futs)
        return
    comm.send((r - 1) % n, _READY)
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        got = np.zeros(1, np.uint8)
        comm.recv(dst, got)
        if got[0] != 1:
            raise CollectiveError(f"{comm.who(r)}: {comm.who(dst)} broke the all-to-all's "
                                  f"ready-to-receive in step {k} (got {got[0]}, not 1)")
        fut = comm.send(dst, x[part(dst)])
        lo = src * m
        for a, z in chunks(lo, lo + m, chunk):
            comm.recv(src, out[a:z])
        if k + 1 < n:  # our downlink is free of step k: the next step's source may send
            comm.send((r - k - 1) % n, _READY)
        fut.result()
        comm.drain(dst)


def reference(parts: list[np.ndarray]) -> list[np.ndarray]:
    """The twin: rank i's result from every rank's array (``parts[j]``), numpy only."""
    n = len(parts)
    return [np.concatenate([np.array_split(p, n)[i] for p in parts]) for i in range(n)]
