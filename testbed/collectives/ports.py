"""Deterministic ports of the collectives' flows, so the fabric's ECMP choice is predictable.

A programmable switch picks one member of an ECMP group by a hash of the IPv4 5-tuple
(``testbed.datapath.forward.flow_hash``), so a flow's path depends on its ports. With
ephemeral ports the path of every TCP flow would be a coin toss per run; with the ports below
it is a pure function of (job, ranks), which the flow-level model
(:mod:`testbed.collectives.flowmodel`) evaluates the same way the switches do.

TCP (ring, halving-doubling, reduction server): rank ``r`` of job ``j`` listens on
``tcp_port(j, r, r)``; for every peer ``p > r`` it opens the connection itself, from source
port ``tcp_port(j, r, p)``, to ``tcp_port(j, p, p)``. Ports lie in ``TCP_PORT_LO`` ..
``TCP_PORT_HI`` (6000-19999): below Linux's ephemeral range (32768-60999), outside the INA
worker ports (20000-29999) and above the iperf3 ports the cross traffic uses (5201, 5301+k).

Every (src, dst) pair of a job has its own port, so ranks that share an address (a reduction
server co-located with a worker, or every rank of a test on the loopback) never bind the same
one: a job's block holds ``MAX_RANKS * (MAX_RANKS + 1) / 2`` ports, the pairs ``src < dst``
first (triangular numbering), then one listening port per rank. Jobs ``job_id`` and
``job_id + TCP_JOB_SLOTS`` share a block: do not run them on the same hosts at once.

A job's all-to-all (:mod:`testbed.collectives.alltoall`) runs on connections of its own, with
a small window, in the same layout from ``TCP_BIG_LO`` (``a2a_port``; ``A2A_JOB_SLOTS``
blocks): jobs ``job_id`` and ``job_id + A2A_JOB_SLOTS`` must not all-to-all on the same
hosts at once, nor beside a job of more than 64 ranks.

Ranks ``MAX_RANKS`` .. ``MAX_BIG_RANKS - 1`` (a job of more than 64 ranks: 128 workers on one
machine) take their ports from ``TCP_BIG_LO`` .. 65535, above the ephemeral range, in a block
of ``MAX_BIG_RANKS`` per job (``TCP_BIG_SLOTS`` of them): a pair whose higher rank ``d`` is 64
or more connects from port ``block + d``, and rank ``d`` listens on ``block + d``. That port is
unique per *address* only (every rank connecting to ``d`` binds it), so such a job needs one
rank per address, as in-network aggregation does anyway; a second rank on an address fails to
bind with a clear error. Pairs of ranks below 64 keep the ports above, so a job of 64 ranks or
fewer is unchanged.

INA (UDP): a worker of job ``j`` binds ``ina_worker_port(j)`` (``20000 + j % 10000``) and
sends to the aggregator's ``INA_AGG_PORT`` (41000).

Host fallback aggregators of shared-mode INA (UDP): the fallback of job ``j``'s tree switch
at depth ``d`` below the root binds ``fallback_port(j, d)`` (42000-60999, eight depths per
job): a host serves every tree switch on its path to the root, one per depth, and the jobs
(or one job's plans, each registered under a job id of its own) on a host bind ports of their
own, unless their ids differ by a multiple of ``FALLBACK_JOB_SLOTS``.

UET-like transport (UDP, ``testbed.collectives.uet``): a rank receives on its address's
testbed port (41000) and sprays its packets from ``uet_port(j, e)`` for entropy ``e`` (ports
30000-32767, below the ephemeral range): one rank per address, so the ports need no rank.
"""

from __future__ import annotations

from testbed.kernels.wire import TESTBED_UDP_PORT

#: First and last TCP port the collectives bind.
TCP_PORT_LO = 6000
TCP_PORT_HI = 19999
#: Ranks per job that get deterministic ports (workers + servers).
MAX_RANKS = 64
_PAIRS = MAX_RANKS * (MAX_RANKS - 1) // 2
_BLOCK = _PAIRS + MAX_RANKS
#: Distinct port blocks: jobs whose ids differ by a multiple of this share ports.
TCP_JOB_SLOTS = (TCP_PORT_HI + 1 - TCP_PORT_LO) // _BLOCK
#: The aggregator's UDP port (the testbed header's port).
INA_AGG_PORT = TESTBED_UDP_PORT
#: INA worker UDP ports: ``INA_PORT_BASE + job_id % INA_PORT_SPAN``.
INA_PORT_BASE = 20000
INA_PORT_SPAN = 10000


#: Ranks per job with deterministic ports at all (beyond MAX_RANKS: one rank per address).
MAX_BIG_RANKS = 256
#: First port of the large jobs' blocks (above Linux's ephemeral range, 32768-60999).
TCP_BIG_LO = 61000
#: Distinct large-job blocks in TCP_BIG_LO..65535.
TCP_BIG_SLOTS = (65536 - TCP_BIG_LO) // MAX_BIG_RANKS
#: Distinct blocks of the all-to-all's connections in TCP_BIG_LO..65535 (``a2a_port``).
A2A_JOB_SLOTS = (65536 - TCP_BIG_LO) // _BLOCK


def _check_rank(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_BIG_RANKS:
        raise ValueError(f"{name}={v!r}: ranks with deterministic ports are integers "
                         f"0..{MAX_BIG_RANKS - 1}; run at most {MAX_BIG_RANKS} ranks per job")


def _checked(job_id: int, src: int, dst: int, limit: int = MAX_BIG_RANKS) -> None:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise ValueError(f"job_id={job_id!r} must be an integer >= 0")
    _check_rank("src", src)
    _check_rank("dst", dst)
    if src > dst:
        raise ValueError(f"src={src} > dst={dst}: the lower rank opens the connection; its "
                         f"peer's end is the listening port tcp_port(job, {src}, {src})")
    if dst >= limit:
        raise ValueError(f"dst={dst}: these ports take jobs of at most {limit} ranks")


def _in_block(base: int, src: int, dst: int) -> int:
    """A job block's port of the pair (src < dst), or of rank src's listener (src == dst)."""
    if src == dst:
        return base + _PAIRS + src
    return base + dst * (dst - 1) // 2 + src


def tcp_port(job_id: int, src: int, dst: int) -> int:
    """TCP port rank ``src`` of job ``job_id`` binds for its connection to rank ``dst``
    (``src < dst``: it connects); ``src == dst``: the rank's listening port."""
    _checked(job_id, src, dst)
    if dst >= MAX_RANKS:  # a large job's pair or listener: unique per address
        return TCP_BIG_LO + (job_id % TCP_BIG_SLOTS) * MAX_BIG_RANKS + dst
    return _in_block(TCP_PORT_LO + (job_id % TCP_JOB_SLOTS) * _BLOCK, src, dst)


def a2a_port(job_id: int, src: int, dst: int) -> int:
    """``tcp_port`` of a job's all-to-all connections (:mod:`testbed.collectives.alltoall`,
    jobs of at most ``MAX_RANKS`` ranks): the same layout in blocks from ``TCP_BIG_LO``, which
    only larger jobs' connections use (``A2A_JOB_SLOTS`` of them)."""
    _checked(job_id, src, dst, MAX_RANKS)
    return _in_block(TCP_BIG_LO + (job_id % A2A_JOB_SLOTS) * _BLOCK, src, dst)


def tcp_tuple(job_id: int, src: int, dst: int, port_of=tcp_port) -> tuple[int, int]:
    """(source port, destination port) of the bytes rank ``src`` sends to rank ``dst``
    (``port_of``: ``tcp_port``, or ``a2a_port`` for the all-to-all's connections).

    The lower rank opened the connection: its end has port ``port_of(j, low, high)``, the
    higher rank's end is its listening port."""
    if src == dst:
        raise ValueError(f"src == dst == {src}: a rank sends nothing to itself over TCP")
    lo, hi = min(src, dst), max(src, dst)
    p_lo, p_hi = port_of(job_id, lo, hi), port_of(job_id, hi, hi)
    return (p_lo, p_hi) if src == lo else (p_hi, p_lo)


def ina_worker_port(job_id: int) -> int:
    """UDP port every INA worker of job ``job_id`` binds (20000-29999)."""
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise ValueError(f"job_id={job_id!r} must be an integer >= 0")
    return INA_PORT_BASE + job_id % INA_PORT_SPAN


#: The UET transport's spraying ports: ``UET_PORT_BASE + (job_id % UET_JOB_SLOTS) * 64 + e``.
UET_PORT_BASE = 30000
UET_MAX_ENTROPIES = 64
UET_JOB_SLOTS = (32768 - UET_PORT_BASE) // UET_MAX_ENTROPIES


def uet_port(job_id: int, entropy: int) -> int:
    """UDP source port of spraying path ``entropy`` of job ``job_id``'s UET ranks."""
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise ValueError(f"job_id={job_id!r} must be an integer >= 0")
    if not 0 <= entropy < UET_MAX_ENTROPIES:
        raise ValueError(f"entropy={entropy!r} must be 0..{UET_MAX_ENTROPIES - 1}")
    return UET_PORT_BASE + (job_id % UET_JOB_SLOTS) * UET_MAX_ENTROPIES + entropy


#: Host fallback aggregators' ports: ``FALLBACK_PORT_BASE + (job_id % FALLBACK_JOB_SLOTS) *
#: MAX_TREE_DEPTH + depth``.
FALLBACK_PORT_BASE = 42000
MAX_TREE_DEPTH = 8
FALLBACK_JOB_SLOTS = (TCP_BIG_LO - FALLBACK_PORT_BASE) // MAX_TREE_DEPTH


def fallback_port(job_id: int, depth: int) -> int:
    """UDP port the host fallback aggregators of job ``job_id``'s tree switch at ``depth``
    (0: the root) bind."""
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise ValueError(f"job_id={job_id!r} must be an integer >= 0")
    if not 0 <= depth < MAX_TREE_DEPTH:
        raise ValueError(f"depth={depth}: shared-mode trees have at most {MAX_TREE_DEPTH} "
                         "levels of switches")
    return FALLBACK_PORT_BASE + (job_id % FALLBACK_JOB_SLOTS) * MAX_TREE_DEPTH + depth
