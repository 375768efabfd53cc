"""The ``aggregate`` program: exactly-once in-network aggregation (SwitchML lineage).

The protocol and its invariants are written down in ``docs/protocol.md``; this module is the
switch side's stage (configuration, jobs, counters), :mod:`testbed.kernels.aggregation` its
data path, :mod:`testbed.collectives.inakernel` the worker side.

Jobs are added by the control plane with their *members*: per worker id the MAC, IPv4 address,
UDP port and switch ingress port. Nothing is learned from data packets: DATA from any other
(address, port, ingress) is dropped ``NOT_MEMBER``, and RESULTs go only to registered
addresses.

Per contribution of member ``w`` for job slot ``k`` in round ``r`` (set ``s = r & 1``), with
``c`` the round set ``s`` of the slot holds (serial-number arithmetic on 32 bits):

* ``r == c``: ``w`` already counted -> a complete round answers it (unicast RESULT from the
  registers: SwitchML's shadow copy), an incomplete one drops it ``DUPLICATE``; ``w`` not
  counted -> added (int32, wrapping like a switch ALU; exponent max-combined); the last missing
  contribution completes the round: one RESULT per member;
* ``r == c + 2``: the next use of set ``s``; valid only when set ``s`` is complete and set
  ``1 - s`` holds round ``r - 1``, complete (a worker sends round ``r`` only after it received
  round ``r - 1``'s result). The first contribution overwrites the registers (no zeroing pass);
* ``r`` behind ``c``: a late packet of a finished round -> ``STALE``; anything else -> ``BAD_SEQ``.

So duplicates, reordering, late retransmissions and strangers can never add twice, start a
round early or wedge a slot; a lost RESULT is recovered by the worker's retransmission.
An absorbed contribution is marked ``PORT_HELD`` (kept in the registers: neither sent nor a
drop). The aggregator answers ARP requests for its IP. Packets not addressed to the aggregator's
MAC/IP fall through (``PORT_UNSET``) to later stages.
"""

from __future__ import annotations

import time

import numpy as np

from testbed.datapath.batch import Batch, Stage
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.datapath.trim import port_index
from testbed.kernels.aggregation import (
    COUNTER_NAMES,
    MAX_ELEMS_MTU,
    MAX_JOBS,
    MAX_WORKERS,
    THC_MAX_ELEMS,
    Aggregation,
    Batch4,
    Member,
    Peer,
    result_lane,
)
from testbed.kernels.wire import Codec

__all__ = ["COUNTER_NAMES", "DEFAULT_AGG_IP", "DEFAULT_AGG_MAC", "DEFAULT_CODECS",
           "MAX_ELEMS_MTU", "MAX_JOBS", "MAX_WORKERS", "THC_MAX_ELEMS", "AggregateStage",
           "parse_members", "parse_peer", "result_lane"]

DEFAULT_AGG_IP = "10.0.0.254"
DEFAULT_AGG_MAC = "02:54:42:00:00:fe"
#: Summable codecs an aggregate stage accepts unless configured otherwise.
DEFAULT_CODECS = ("INT32", "THC")
#: Aggregator memory of a switch unless configured: SwitchML's 8192 slots x 2 sets x 256 int32
#: (16 MiB), in the range of one Tofino pipeline's register SRAM.
DEFAULT_MEMORY_BYTES = 16 << 20
#: The shared pool's part of the aggregator memory unless configured (1/POOL_SHARE).
POOL_SHARE = 4
#: Slots of metadata (round, bitmap, ...) an aggregator keeps, whatever their values' memory.
DEFAULT_MAX_SLOTS = 16384
#: int32 registers per set of a slot unless a job says otherwise (SwitchML's 256 per packet).
DEFAULT_LANES = 256


def _mac(value) -> bytes:
    return mac_to_int(value).to_bytes(6, "big")


def parse_members(job_id: int, members: list, ports: list[str]) -> list[Member]:
    """Member records from ``[{"worker", "mac", "ip", "port", "ingress"}, ...]`` (ingress: a
    port name of ``ports`` or an index); ``ValueError`` naming the bad one."""
    out = []
    for m in members:
        who = f"aggregate: job {job_id}: member {m!r}"
        if not isinstance(m, dict):
            raise ValueError(f"{who}: expected {{'worker', 'mac', 'ip', 'port', 'ingress'}}")
        missing = {"worker", "mac", "ip", "port", "ingress"} - set(m)
        if missing:
            raise ValueError(f"{who}: missing {sorted(missing)}")
        port = int(m["port"])
        if not 1 <= port <= 0xFFFF:
            raise ValueError(f"{who}: port must be 1..65535")
        out.append(Member(int(m["worker"]), _mac(m["mac"]), ip_to_int(m["ip"]), port,
                          port_index(ports, m["ingress"], who)))
    return out


def parse_peer(job_id: int, what: str, spec, ports: list[str], key: str) -> Peer:
    """A parent (``key="index"``) or fallback (``key="port"``) record: ``{"mac", "ip",
    "egress", key}`` plus, for a parent, the optional ``ingress`` its RESULTs arrive on
    (default: the egress port)."""
    who = f"aggregate: job {job_id}: {what}"
    if not isinstance(spec, dict):
        raise ValueError(f"{who}: expected {{'mac', 'ip', 'egress', {key!r}}}, got {spec!r}")
    missing = {"mac", "ip", "egress", key} - set(spec)
    if missing:
        raise ValueError(f"{who}: missing {sorted(missing)}")
    egress = port_index(ports, spec["egress"], who)
    ingress = port_index(ports, spec["ingress"], who) if "ingress" in spec else egress
    return Peer(_mac(spec["mac"]), ip_to_int(spec["ip"]), egress, ingress, int(spec[key]))


class AggregateStage(Stage):
    """In-network aggregation (program name ``aggregate``); see the module docstring and
    ``docs/protocol.md``.

    Settings: ``agg_ip``, ``agg_mac`` (this switch's aggregator identity), ``memory_bytes``
    (aggregator memory, default :data:`DEFAULT_MEMORY_BYTES`), ``pool_bytes`` (the part of it
    that is the shared pool for jobs in shared mode, default a quarter; the rest is for static
    partitions) and ``pool_lanes`` (lanes of a pool entry, one register set: a round's
    values; default 256), ``pool_slots`` (slots of metadata, default
    :data:`DEFAULT_MAX_SLOTS`), ``max_elems`` (int32 lanes per packet at most), ``codecs``
    (summable payload codecs, default INT32 and THC), ``results_via`` (``"ingress"``: a RESULT
    leaves by the member's registered port; ``"forward"``: a later ``forward`` stage routes it),
    ``pool_fair_share`` (default True: the control plane caps a shared job's window at its fair
    share of the pool, :func:`testbed.collectives.ina.fair_share_slots`; False: a shared job
    keeps the window it asks for, and the overflow goes to its host fallback) and ``jobs``
    ``{job_id: {...}}``, each with

    * ``slots``, ``seq0`` (first round), ``lanes`` (int32 registers per set: the elements of
      one packet, default 256; THC jobs 1024 or 512), ``members`` (``[{"worker", "mac", "ip",
      "port", "ingress"}, ...]``: workers ``0..n-1``, or the child switches of a tree);
    * ``mode``: ``"static"`` (default: a reserved partition of memory, or refused at admission
      with the free memory in the error), ``"shared"`` (each round claims a pool entry by hash
      when it starts and gives it back once every member has its result; a round whose entries
      are all held sends its contributions to the job's ``fallback`` aggregator on a host:
      ``{"mac", "ip", "port", "egress"}``, or a list of them: slot ``s`` goes to the
      ``s % len``-th, spreading the overflow) or ``"fallback"`` (this aggregator is such a host
      fallback: it sees only the rounds its switch forwarded);
    * ``parent`` (tree nodes below the root): ``{"mac", "ip", "egress", "index"}`` and
      optionally ``"ingress"``: the parent switch's aggregator identity, the port towards it,
      this switch's member id there, and the port its RESULTs arrive on. A completed round's
      partial sum goes up; the parent's RESULT comes down to the members.
    """

    name = "aggregate"
    #: emitted packets per received packet at most (the engine sizes the batch with it)
    max_expansion = 1 + MAX_WORKERS

    def __init__(self, ports: list[str] | None = None, agg_ip: str = DEFAULT_AGG_IP,
                 agg_mac: str = DEFAULT_AGG_MAC, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 pool_bytes: int | None = None, pool_lanes: int = DEFAULT_LANES,
                 pool_slots: int = DEFAULT_MAX_SLOTS, max_elems: int = MAX_ELEMS_MTU,
                 jobs: dict | None = None, codecs: list | None = None,
                 results_via: str = "ingress", pool_fair_share: bool = True):
        memory_bytes = int(memory_bytes)
        pool_bytes = memory_bytes // POOL_SHARE if pool_bytes is None else int(pool_bytes)
        pool_lanes, max_slots, max_elems = int(pool_lanes), int(pool_slots), int(max_elems)
        if not 1 <= max_slots <= 1 << 20:
            raise ValueError(f"aggregate: pool_slots must be 1..{1 << 20}, got {max_slots}")
        if not 1 <= max_elems <= MAX_ELEMS_MTU:
            raise ValueError(f"aggregate: max_elems must be 1..{MAX_ELEMS_MTU}, got {max_elems}")
        if not 0 < memory_bytes <= 1 << 32:
            raise ValueError(f"aggregate: memory_bytes must be 1..4 GiB, got {memory_bytes}")
        if not 0 <= pool_bytes <= memory_bytes:
            raise ValueError(f"aggregate: pool_bytes must be 0..memory_bytes ({memory_bytes}), "
                             f"got {pool_bytes}")
        if not 1 <= pool_lanes <= THC_MAX_ELEMS:
            raise ValueError(f"aggregate: pool_lanes must be 1..{THC_MAX_ELEMS}, got {pool_lanes}")
        self.ports = [str(p) for p in ports] if ports is not None else []
        self.table = Aggregation(memory_bytes, pool_bytes // (4 * pool_lanes), pool_lanes,
                                 max_slots, max_elems)
        self._rate = (time.monotonic(), 0)
        self._arrays: tuple | None = None  # the batch's arrays as the kernel takes them
        self.configure(agg_ip=agg_ip, agg_mac=agg_mac, codecs=codecs or list(DEFAULT_CODECS),
                       jobs=jobs or {}, results_via=results_via, pool_fair_share=pool_fair_share)

    @property
    def regs(self):
        """The aggregation registers (for tests and telemetry)."""
        return self.table.regs

    @property
    def jobs(self) -> dict[int, dict]:
        """Registered jobs: id -> their allocation."""
        return self.table.jobs

    # --- control -----------------------------------------------------------------------------
    def configure(self, agg_ip: str | None = None, agg_mac: str | None = None,
                  jobs: dict | None = None, remove_jobs: list | None = None,
                  codecs: list | None = None, results_via: str | None = None,
                  pool_fair_share: bool | None = None, **unknown) -> None:
        """Change the aggregator identity, summable codecs, the pool's window policy, or
        add/remove jobs (a job added again with its id is replaced). A job that does not fit is
        refused with a ``ValueError`` saying how much memory and how many slots are free."""
        if unknown:
            raise ValueError(f"aggregate: unknown settings {sorted(unknown)}; use agg_ip, "
                             "agg_mac, jobs, remove_jobs, codecs, results_via, pool_fair_share")
        if pool_fair_share is not None:
            if not isinstance(pool_fair_share, bool):
                raise ValueError(f"aggregate: pool_fair_share must be true or false, got "
                                 f"{pool_fair_share!r}")
            self.pool_fair_share = pool_fair_share
        if results_via is not None and results_via not in ("ingress", "forward"):
            raise ValueError(f"aggregate: results_via must be 'ingress' or 'forward', got "
                             f"{results_via!r}")
        ok = None
        if codecs is not None:
            ok = np.zeros(256, np.bool_)
            for c in codecs:
                try:
                    ok[int(Codec[c]) if isinstance(c, str) else int(Codec(c))] = True
                except (KeyError, ValueError):
                    raise ValueError(f"aggregate: unknown codec {c!r}; choose from "
                                     f"{[m.name for m in Codec]}") from None
        self.table.set_identity(mac=None if agg_mac is None else _mac(agg_mac),
                                ip=None if agg_ip is None else ip_to_int(agg_ip), codec_ok=ok,
                                via_ingress=None if results_via is None
                                else results_via == "ingress")
        for jid in remove_jobs or []:
            self.table.remove_job(int(jid))
        for jid, spec in (jobs or {}).items():
            self.add_job(int(jid), spec)

    def add_job(self, job_id: int, spec: dict) -> None:
        """Register one job from its settings (see the class docstring)."""
        if not isinstance(spec, dict):
            raise ValueError(f"aggregate: job {job_id}: expected {{'slots': k, 'seq0': r, "
                             "'members': [...]}")
        keys = {"slots", "seq0", "members", "lanes", "mode", "parent", "fallback"}
        unknown = set(spec) - keys
        if unknown:
            raise ValueError(f"aggregate: job {job_id}: unknown keys {sorted(unknown)}; use "
                             f"{sorted(keys)}")
        mode = spec.get("mode", "static")
        if mode not in ("static", "shared", "fallback"):
            raise ValueError(f"aggregate: job {job_id}: mode must be 'static', 'shared' or "
                             f"'fallback', got {mode!r}")
        parent = spec.get("parent")
        fallback = spec.get("fallback")
        self.table.add_job(
            job_id, int(spec.get("slots", 0)),
            parse_members(job_id, spec.get("members") or [], self.ports),
            int(spec.get("seq0", 0)), lanes=int(spec.get("lanes", DEFAULT_LANES)),
            shared=mode == "shared", fallback_host=mode == "fallback",
            parent=None if parent is None else parse_peer(job_id, "parent", parent, self.ports,
                                                          "index"),
            fallback=None if fallback is None else [
                parse_peer(job_id, "fallback", fb, self.ports, "port")
                for fb in (fallback if isinstance(fallback, list) else [fallback])])

    def free_slots(self) -> int:
        """Slots of metadata no job holds."""
        return self.table.free_slots()

    def free_memory_bytes(self) -> int:
        """Bytes of static aggregator memory no job holds."""
        return self.table.free_memory_bytes()

    def remove_job(self, job_id: int) -> None:
        """Forget ``job_id`` and free what it held (its packets then drop ``UNKNOWN_JOB``)."""
        self.table.remove_job(job_id)

    def reset_job(self, job_id: int, seq0: int | None = None) -> None:
        """Start ``job_id`` afresh at round ``seq0`` (default: its first round): for a job
        whose worker died mid-aggregation; other jobs are never affected."""
        self.table.reset_job(job_id, seq0)

    # --- data path ---------------------------------------------------------------------------
    def process(self, batch: Batch, now_ns: int) -> None:
        """Aggregate the contributions in ``batch``; append the packets it emits."""
        b = self._arrays
        if b is None or b[0] is not batch.buf:  # built once: a batch keeps its arrays
            b = self._arrays = tuple(Batch4(batch.buf, batch.length, batch.in_port,
                                            batch.out_port, batch.reason))
        batch.n = self.table.process(b, batch.n)

    def counters(self) -> dict:
        """The aggregation's counters (see :meth:`Aggregation.counters`) and completed rounds
        per second since the previous call."""
        out = self.table.counters()
        out["memory"]["pool_fair_share"] = self.pool_fair_share
        now, done = time.monotonic(), out["completed"]
        t0, done0 = self._rate
        out["aggregations_per_s"] = round((done - done0) / (now - t0), 1) if now > t0 else 0.0
        self._rate = (now, done)
        return out
