"""The closed-form alpha-beta model of every (op, algo) the testbed runs.

It is the one-switch special case of the flow-level model (:mod:`testbed.collectives.flowmodel`,
which gives every run's ``model_s``): one bottleneck rate B for every flow, every link busy in
both directions. On a star the two agree (tested); across a fabric only the flow model sees
which flows share a link. The formulas are the nccl-tests / MPICH ones (ring
``2(n-1)a + 2(n-1)/n S/B``, halving-doubling ``2 log2(n) a + 2(n-1)/n S/B``, ...), plus, for
halving-doubling, one latency per round whose message is large enough for its rendezvous
(``hd``).

``predict(op, algo, n, nbytes, bw_bps, alpha_s)`` returns seconds. ``bw_bps`` is the
bottleneck link rate in bit/s as configured on the links; the model converts it to *goodput*
(payload bytes per second) with the protocol's payload/frame ratio, because the emulated
links (HTB) count every byte of the Ethernet frame:

* TCP (ring, hd, rs, tree): MSS 1448 B (timestamps on) in a 1514 B frame, plus the reverse
  flow's delayed ACKs (one 66 B frame per two segments) sharing the same link direction, as
  every link carries data both ways in these algorithms: 1448 / (1514 + 33) -> 0.936.
* INA / NIC (UDP + the testbed header): 256 x 4 B = 1024 B payload in a 1098 B frame -> 0.933.

``alpha_s`` is the one-way latency of one message between two hosts (the hop latency of
the topology plus the software latency of sending a message).
"""

from __future__ import annotations

import math

from testbed.collectives.algorithms import algorithm, algorithm_names
from testbed.collectives.spec import HD_RENDEZVOUS_BYTES, INA_ELEMS, OPS
from testbed.kernels.wire import PAYLOAD_OFFSET

ETH_HDR = 14
TCP_MSS = 1448  # 1500 - 20 (IP) - 20 (TCP) - 12 (timestamp option)
TCP_FRAME = 1500 + ETH_HDR
TCP_ACK_SHARE = 66 / 2  # delayed ACK (Eth+IP+TCP with timestamps) every second segment
INA_PAYLOAD = INA_ELEMS * 4
INA_FRAME = PAYLOAD_OFFSET + INA_PAYLOAD

#: Payload fraction of the wire bytes per protocol.
GOODPUT = {"tcp": TCP_MSS / (TCP_FRAME + TCP_ACK_SHARE), "ina": INA_PAYLOAD / INA_FRAME}

#: Default pipelining chunk of the TCP broadcast chain (bytes), as in spec.chunk_bytes.
DEFAULT_CHUNK = 256 << 10


def goodput_Bps(algo: str, bw_bps: float) -> float:
    """Payload bytes per second that a link of ``bw_bps`` bit/s carries for ``algo``."""
    proto = "tcp" if algo == "tree" else algorithm(algo).traffic
    return bw_bps / 8.0 * GOODPUT[proto]


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: allreduce 2(n-1)/n, rs/ag (n-1)/n, broadcast 1."""
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "allgather"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"op={op!r} is not one of {OPS + ('reduce',)}")


#: Pieces per server shard of the reduction server (upper bound on the pipelining unit).
RS_PIECES = 64
#: Bytes a worker keeps in flight to one server (the reduction server's credit window) on a
#: 100 Mb/s link; scaled up with the link rate (``rs_window_pieces``).
RS_WINDOW_BYTES = 128 << 10
#: Bytes a worker keeps in flight to all servers together on a 100 Mb/s link (4 servers'
#: windows, as measured on the star of 4); scaled up with the link rate like the window.
RS_INFLIGHT_BYTES = 4 * RS_WINDOW_BYTES


def flow_window_bytes(bw_bps: float | None = None) -> float:
    """Bytes one flow keeps in flight where the testbed bounds it: ``RS_WINDOW_BYTES`` at
    100 Mb/s, or 10 ms of the link rate if that is more (bandwidth x a generous round trip)."""
    return RS_WINDOW_BYTES if bw_bps is None else max(RS_WINDOW_BYTES, bw_bps / 8 * 0.01)


def tcp_window_clamp(algo: str, bw_bps: float | None = None) -> int | None:
    """``TCP_WINDOW_CLAMP`` of an algorithm's connections (None: the kernel's window).

    Without a clamp a TCP flow grows its window until the kernel's 1000-packet drop-tail queue
    at its bottleneck overflows; the model's fabric is lossless and fair. The clamp set before
    the handshake makes both ends choose a small window scale (2 for 128 KiB, against 9), and
    that bounds the window for good (65535 << 2 = 256 KiB) even where the kernel's autotuning
    later raises the clamp itself.

    * Halving-doubling, :func:`flow_window_bytes`: each of its rounds starts a flow to a new
      partner, from slow start, on whichever link ECMP hashes it to, and sends a whole half in
      one message (its receiver has posted the whole buffer, so a clamp costs it no slack).
      Two such flows on one uplink of the 2:1 leaf-spine overshot the queue in slow start
      (500-1200 drops per run): 1.06-1.28 of the model; clamped, 1.01-1.02 (2:1), 1.01 (4:1).
    * Ring, twice that: its long flows across the leaf-spines' slower uplinks ran 1.14-1.18 of
      the model at 32 MiB (the sawtooth of a full queue, which also delays the acks of the
      flow coming the other way); 256 KiB: 1.07-1.08 (2:1), 1.04 (4:1). Its receiver reads
      step by step, so a smaller clamp takes the slack between steps: 128 KiB measured 1.08
      at 4 MiB against 1.02-1.03 without a clamp and 1.05 with 256 KiB.
    * The reduction server bounds its flows itself (:func:`rs_window_bytes`).
    """
    if algo == "hd":
        return int(flow_window_bytes(bw_bps))
    if algo == "ring":
        return int(2 * flow_window_bytes(bw_bps))
    return None


def rs_window_bytes(servers: int, bw_bps: float | None = None) -> float:
    """A reduction-server worker's credit window per server, in bytes: ``RS_WINDOW_BYTES`` at
    100 Mb/s or 10 ms of the link rate if that is more, but at most the server's share of
    ``RS_INFLIGHT_BYTES`` (or 40 ms of the link rate). Without the cap, each of 15 servers on
    the fat-tree got a full window: 1.9 MB in flight per worker stood in its uplink's queue,
    so every result came back that much later than its contribution left (star of 8, f=8:
    1.15-1.18 of the model against 1.01 with the cap; fat-tree, f=16: 1.07 against 1.04)."""
    per = flow_window_bytes(bw_bps)
    total = per * (RS_INFLIGHT_BYTES / RS_WINDOW_BYTES)  # 4 windows: 512 KiB or 40 ms
    return min(per, total / max(servers, 1))


def rs_chunk_bytes(nbytes: int, servers: int, chunk_bytes: int = DEFAULT_CHUNK) -> int:
    """Pipelining unit of the reduction server: at most 1/64 of a server's shard (so results
    flow back while contributions still arrive: with 1/16 the pipeline fill, m pieces per
    worker link, was a visible share of the run) and at most a quarter of the credit window at
    100 Mb/s (:func:`rs_window_bytes`, so that 4 pieces are in flight per server; faster links
    get more pieces, not larger ones), at least 4 KiB."""
    return max(4096, min(chunk_bytes, int(rs_window_bytes(servers)) // 4,
                         nbytes // servers // RS_PIECES))


def rs_window_pieces(chunk_bytes: int, bw_bps: float | None = None, servers: int = 1) -> int:
    """Pieces a reduction-server worker keeps in flight per server (:func:`rs_window_bytes`),
    >= 2.

    Measured on a 100 Mb/s star (n = 4, m = 4, 8 MB): 128 KiB in flight per flow (4 pieces of
    32 KiB) ran at ~1.08x the model; 256 KiB - 2 MiB let TCP share each uplink unevenly
    among the m flows again (1.2-1.4x)."""
    return max(2, int(rs_window_bytes(servers, bw_bps) // max(chunk_bytes, 1)))


def rs_link_load(n: int, servers: int, colocated: bool) -> float:
    """Largest bytes one link carries per direction, in units of S, for the reduction server.

    Each worker sends S/m to each of m servers and gets S/m back from each. A dedicated server
    link carries n*S/m; a worker link S. A server co-located with a worker exchanges its own
    shard locally, so its link carries (n-1)*S/m for the server plus (m-1)*S/m for the worker.
    """
    m = servers
    if colocated:
        return max(1.0 if m < n else (m - 1) / m, (n - 1 + m - 1) / m)
    return max(1.0, n / m)


def predict_compressed(scheme: str, n: int, payload_bytes: int, bw_bps: float, alpha_s: float,
                       agree_rounds: int = 0) -> float:
    """Predicted seconds of a compressed ring allreduce (``testbed.collectives.compress``):
    ``scheme`` "reduce_scatter" (a summable payload of ``payload_bytes`` reduced in its wire
    type: ``2(n-1)a + 2(n-1)/n P/B``, plus ``(n-1)a`` per agreement round of a scalar, THC's
    norm) or "allgather" (every worker's ``payload_bytes`` blob around the ring:
    ``(n-1)a + (n-1) P/B``)."""
    if scheme == "reduce_scatter":
        return (predict("allreduce", "ring", n, payload_bytes, bw_bps, alpha_s)
                + agree_rounds * (n - 1) * alpha_s)
    if scheme == "allgather":
        return predict("allgather", "ring", n, n * payload_bytes, bw_bps, alpha_s)
    raise ValueError(f"scheme={scheme!r} is not 'reduce_scatter' or 'allgather'")


def predict(op: str, algo: str, n: int, nbytes: int, bw_bps: float, alpha_s: float,
            servers: int = 1, colocated: bool = True, chunk_bytes: int = DEFAULT_CHUNK) -> float:
    """Predicted seconds of ``op`` with ``algo`` on ``n`` workers moving ``nbytes``.

    ``algo``: ring, hd (recursive halving-doubling; non-power-of-two n folds the extra ranks
    into partners first, MPICH style), tree (binomial), rs (reduction server with ``servers``
    servers, ``colocated`` with workers or on their own hosts), ina / nic (in-network
    aggregation: S/B + one round trip, independent of n).
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    alg = None  # the binomial tree is a model-only algorithm
    if algo != "tree":
        if algo not in algorithm_names():
            raise ValueError(f"algo={algo!r} is not one of {algorithm_names() + ('tree',)}")
        alg = algorithm(algo)
        if op not in alg.ops:
            raise ValueError(f"algo={algo!r} does not implement op={op!r} (it models "
                             f"{', '.join(alg.ops)} only)")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n={n!r} must be an integer >= 1")
    if nbytes < 0 or bw_bps <= 0 or alpha_s < 0:
        raise ValueError(f"need nbytes >= 0, bw_bps > 0, alpha_s >= 0; got {nbytes}, "
                         f"{bw_bps}, {alpha_s}")
    if n == 1:
        return 0.0
    a = alpha_s
    t = nbytes / goodput_Bps(algo, bw_bps)  # S/B: time to push the whole array over one link
    lg = math.ceil(math.log2(n))
    if alg is not None and alg.offloaded:  # S/B + one round trip, any n
        return t + 2 * a
    if algo == "rs":
        if servers < 1:
            raise ValueError(f"servers={servers!r} must be >= 1")
        # + pipeline fill: a server returns piece 0 once every worker sent it, and a worker's
        # link carries its first piece to each of the m servers at once: m pieces
        c = min(rs_chunk_bytes(nbytes, servers, chunk_bytes), nbytes / servers)
        fill = servers * c / goodput_Bps(algo, bw_bps)
        return 2 * a + rs_link_load(n, servers, colocated) * t + fill
    if algo == "tree":
        if op == "broadcast":
            return lg * (a + t)
        if op == "allreduce":
            return 2 * lg * (a + t)
        raise ValueError(f"algo='tree' models broadcast and allreduce, not op={op!r}")
    chunk_s = min(chunk_bytes, nbytes) / goodput_Bps(algo, bw_bps)
    return alg.alpha_beta(op, n, nbytes, a, t, chunk_s)  # a peer algorithm: ring, hd, plug-ins


def hd_time(op: str, n: int, nbytes: float, a: float, t: float) -> float:
    """Halving-doubling's alpha-beta time (see :func:`predict`): binomial broadcast,
    MPICH's recursive halving / doubling with the fold of non-power-of-two ``n``, one more
    latency per round large enough for the rendezvous."""
    if op == "broadcast":  # binomial tree
        return math.ceil(math.log2(n)) * (a + t)
    p = 1 << int(math.floor(math.log2(n)))
    meet = hd_rendezvous_rounds(nbytes, p) * a  # each large round waits for the partner's "go"
    if op == "allreduce":
        base = 2 * math.log2(p) * a + 2 * meet + 2 * (p - 1) / p * t
        if p != n:  # fold: extra ranks send their array to a partner and get the sum back
            base += 2 * (a + t)
        return base
    # reduce_scatter / allgather: power-of-two n only (validated by CollectiveSpec)
    return math.log2(p) * a + meet + (p - 1) / p * t


def hd_rendezvous_rounds(nbytes: float, p: int) -> int:
    """Rounds of one halving (or doubling) pass among ``p`` ranks over ``nbytes`` whose
    message, ``nbytes / 2**j`` in round j, is large enough for the rendezvous
    (:data:`~testbed.collectives.spec.HD_RENDEZVOUS_BYTES`); each costs one more latency."""
    return sum(1 for j in range(1, int(math.log2(p)) + 1)
               if nbytes / 2 ** j >= HD_RENDEZVOUS_BYTES)
