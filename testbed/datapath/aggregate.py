"""The ``aggregate`` program: exactly-once in-network aggregation (SwitchML lineage).

The protocol and its invariants are written down in ``docs/protocol.md``; this module is the
switch side's stage (configuration, jobs, counters), :mod:`testbed.datapath.aggkernel` its
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

import numpy as np

from testbed.datapath.aggkernel import (
    COUNTER_NAMES,
    MAX_ELEMS_MTU,
    MAX_JOBS,
    MAX_WORKERS,
    SEQ_MOD,
    THC_MAX_ELEMS,
    Aggregator,
    aggregate_kernel,
    init_rounds,
    new_jobs,
    new_registers,
    result_lane,
)
from testbed.datapath.batch import Batch, Stage
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.datapath.trim import port_index
from testbed.kernels.wire import Codec

__all__ = ["COUNTER_NAMES", "DEFAULT_AGG_IP", "DEFAULT_AGG_MAC", "DEFAULT_CODECS",
           "MAX_ELEMS_MTU", "MAX_JOBS", "MAX_WORKERS", "THC_MAX_ELEMS", "AggregateStage",
           "result_lane"]

DEFAULT_AGG_IP = "10.0.0.254"
DEFAULT_AGG_MAC = "02:54:42:00:00:fe"
#: Summable codecs an aggregate stage accepts unless configured otherwise.
DEFAULT_CODECS = ("INT32", "THC")


def _member_row(job_id: int, m: dict, ports: list[str]) -> tuple:
    """(worker, mac bytes, ip int, udp port, ingress index) of one member spec."""
    who = f"aggregate: job {job_id}: member {m!r}"
    if not isinstance(m, dict):
        raise ValueError(f"{who}: expected {{'worker', 'mac', 'ip', 'port', 'ingress'}}")
    missing = {"worker", "mac", "ip", "port", "ingress"} - set(m)
    if missing:
        raise ValueError(f"{who}: missing {sorted(missing)}")
    port = int(m["port"])
    if not 1 <= port <= 0xFFFF:
        raise ValueError(f"{who}: port must be 1..65535")
    return (int(m["worker"]), mac_to_int(m["mac"]).to_bytes(6, "big"), ip_to_int(m["ip"]), port,
            port_index(ports, m["ingress"], who))


class AggregateStage(Stage):
    """In-network aggregation (program name ``aggregate``); see the module docstring.

    Settings: ``agg_ip``, ``agg_mac``, ``pool_slots`` (default 4096), ``max_elems`` (per
    packet, default and max a full 1500-byte MTU of int32), ``jobs`` ``{job_id: {"slots": k,
    "seq0": first round, "members": [{"worker", "mac", "ip", "port", "ingress"}, ...]}}``
    (workers ``0..n-1``, each once; ``ingress`` a port name or index of this node),
    ``codecs`` (names or numbers of summable payload codecs, default INT32 and THC: int8
    lanes, up to ``THC_MAX_ELEMS`` per packet, results in the narrowest lane that holds the
    sums, see :func:`result_lane`), ``results_via``: ``"ingress"`` (default: a RESULT leaves
    by the member's registered ingress port) or ``"forward"`` (left for a later ``forward``
    stage to route by the member's MAC/IP).
    """

    name = "aggregate"
    #: results emitted per received packet at most (the engine sizes the batch with it)
    max_expansion = 1 + MAX_WORKERS

    def __init__(self, ports: list[str] | None = None, agg_ip: str = DEFAULT_AGG_IP,
                 agg_mac: str = DEFAULT_AGG_MAC, pool_slots: int = 4096,
                 max_elems: int = MAX_ELEMS_MTU, jobs: dict | None = None,
                 codecs: list | None = None, results_via: str = "ingress"):
        pool_slots = int(pool_slots)
        max_elems = int(max_elems)
        if not 1 <= pool_slots <= 1 << 20:
            raise ValueError(f"aggregate: pool_slots must be 1..{1 << 20}, got {pool_slots}")
        if not 1 <= max_elems <= MAX_ELEMS_MTU:
            raise ValueError(f"aggregate: max_elems must be 1..{MAX_ELEMS_MTU}, got {max_elems}")
        self.ports = [str(p) for p in ports] if ports is not None else []
        self.pool_slots = pool_slots
        self.max_elems = max_elems
        self.regs = new_registers(pool_slots, max_elems)
        self.jobs_arr = new_jobs()
        self.counters_arr = np.zeros(len(COUNTER_NAMES), np.int64)
        self.jobs: dict[int, dict] = {}  # job_id -> {index, base, slots, n_workers, seq0}
        self._agg = {"mac": np.zeros(6, np.uint8), "ip": 0, "codec_ok": np.zeros(256, np.bool_),
                     "via_ingress": True, "max_elems": max_elems,
                     "thc_max": min(THC_MAX_ELEMS, max_elems)}
        self.agg = Aggregator(**self._agg)
        self.configure(agg_ip=agg_ip, agg_mac=agg_mac, codecs=codecs or list(DEFAULT_CODECS),
                       jobs=jobs or {}, results_via=results_via)

    # --- control -----------------------------------------------------------------------------
    def configure(self, agg_ip: str | None = None, agg_mac: str | None = None,
                  jobs: dict | None = None, remove_jobs: list | None = None,
                  codecs: list | None = None, results_via: str | None = None,
                  **unknown) -> None:
        """Change the aggregator address, summable codecs, or add/remove jobs.

        A job added with ``jobs={job_id: {...}}`` (see the class docstring) gets a contiguous,
        exclusive partition of the pool or a ``ValueError`` saying how many slots are free;
        adding an existing job id replaces it. ``remove_jobs=[job_id, ...]`` frees partitions.
        """
        if unknown:
            raise ValueError(f"aggregate: unknown settings {sorted(unknown)}; use agg_ip, "
                             "agg_mac, jobs, remove_jobs, codecs, results_via")
        a = self._agg
        if results_via is not None:
            if results_via not in ("ingress", "forward"):
                raise ValueError(f"aggregate: results_via must be 'ingress' or 'forward', got "
                                 f"{results_via!r}")
            a["via_ingress"] = results_via == "ingress"
        if agg_ip is not None:
            a["ip"] = ip_to_int(agg_ip)
        if agg_mac is not None:
            a["mac"] = np.frombuffer(mac_to_int(agg_mac).to_bytes(6, "big"), np.uint8).copy()
        if codecs is not None:
            ok = np.zeros(256, np.bool_)
            for c in codecs:
                try:
                    ok[int(Codec[c]) if isinstance(c, str) else int(Codec(c))] = True
                except (KeyError, ValueError):
                    raise ValueError(f"aggregate: unknown codec {c!r}; choose from "
                                     f"{[m.name for m in Codec]}") from None
            a["codec_ok"] = ok
            if ok[Codec.THC] and self.regs.values.shape[2] < THC_MAX_ELEMS:
                grown = np.zeros((self.pool_slots, 2, THC_MAX_ELEMS), np.int32)
                grown[:, :, :self.regs.values.shape[2]] = self.regs.values
                self.regs = self.regs._replace(values=grown)
            a["thc_max"] = min(THC_MAX_ELEMS, self.regs.values.shape[2])
        self.agg = Aggregator(**a)
        for jid in remove_jobs or []:
            self.remove_job(int(jid))
        for jid, spec in (jobs or {}).items():
            if not isinstance(spec, dict):
                raise ValueError(f"aggregate: job {jid}: expected {{'slots': k, 'seq0': r, "
                                 "'members': [...]}")
            unknown_keys = set(spec) - {"slots", "seq0", "members"}
            if unknown_keys:
                raise ValueError(f"aggregate: job {jid}: unknown keys {sorted(unknown_keys)}; "
                                 "use slots, seq0, members")
            self.add_job(int(jid), int(spec.get("slots", 0)), spec.get("members") or [],
                         int(spec.get("seq0", 0)))

    def _free_base(self, slots: int) -> int:
        used = sorted((j["base"], j["slots"]) for j in self.jobs.values())
        base = 0
        for b, s in used:
            if b - base >= slots:
                return base
            base = b + s
        if self.pool_slots - base >= slots:
            return base
        return -1

    def free_slots(self) -> int:
        """Slots not owned by any job."""
        return self.pool_slots - sum(j["slots"] for j in self.jobs.values())

    def add_job(self, job_id: int, slots: int, members: list[dict], seq0: int = 0) -> None:
        """Give ``job_id`` an exclusive partition of ``slots`` slots for its ``members`` (one
        ``{"worker", "mac", "ip", "port", "ingress"}`` per worker id ``0..n-1``); its first
        round is ``seq0``."""
        if not 0 <= job_id < 1 << 16:
            raise ValueError(f"aggregate: job_id must be 0..65535, got {job_id}")
        if not 1 <= slots <= 1 << 16:
            raise ValueError(f"aggregate: job {job_id}: slots must be 1..65536, got {slots}")
        if not 0 <= seq0 < SEQ_MOD:
            raise ValueError(f"aggregate: job {job_id}: seq0 must be 0..2**32-1, got {seq0}")
        rows = [_member_row(job_id, m, self.ports) for m in members]
        n = len(rows)
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"aggregate: job {job_id}: needs 1..{MAX_WORKERS} members, got {n}")
        if sorted(r[0] for r in rows) != list(range(n)):
            raise ValueError(f"aggregate: job {job_id}: member workers must be 0..{n - 1}, each "
                             f"once; got {sorted(r[0] for r in rows)}")
        if job_id in self.jobs:
            self.remove_job(job_id)
        idx = next((k for k in range(MAX_JOBS)
                    if k not in {j["index"] for j in self.jobs.values()}), -1)
        if idx < 0:
            raise ValueError(f"aggregate: at most {MAX_JOBS} jobs at once; remove one first")
        base = self._free_base(slots)
        if base < 0:
            raise ValueError(f"aggregate: job {job_id} asks for {slots} slots but only "
                             f"{self.free_slots()} are free (contiguous) of {self.pool_slots}; "
                             "ask for fewer or remove a job (host-side fallback)")
        self.jobs[job_id] = {"index": idx, "base": base, "slots": slots, "n_workers": n,
                             "seq0": seq0}
        J = self.jobs_arr
        J.base[idx], J.slots[idx], J.n_workers[idx] = base, slots, n
        J.ingress[idx] = -1
        for w, mac, ip, port, ingress in rows:
            J.mac[idx, w] = np.frombuffer(mac, np.uint8)
            J.ip[idx, w], J.port[idx, w], J.ingress[idx, w] = ip, port, ingress
        init_rounds(self.regs, base, base + slots, seq0)
        J.row[job_id] = idx

    def remove_job(self, job_id: int) -> None:
        """Forget ``job_id`` and free its slots (packets for it then drop ``UNKNOWN_JOB``)."""
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        self.jobs_arr.row[job_id] = -1
        del self.jobs[job_id]

    def reset_job(self, job_id: int, seq0: int | None = None) -> None:
        """Start ``job_id`` afresh at round ``seq0`` (default: the job's first round): every
        round of its partition is forgotten. For a job whose worker died mid-aggregation;
        other jobs are never affected (disjoint partitions)."""
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        j = self.jobs[job_id]
        if seq0 is not None:
            j["seq0"] = int(seq0) % SEQ_MOD
        init_rounds(self.regs, j["base"], j["base"] + j["slots"], j["seq0"])

    # --- data path ---------------------------------------------------------------------------
    def process(self, batch: Batch, now_ns: int) -> None:
        """Aggregate the contributions in ``batch``; append RESULT packets to it."""
        batch.n = aggregate_kernel(batch.buf, batch.length, batch.in_port, batch.out_port,
                                   batch.reason, batch.n, self.regs, self.jobs_arr, self.agg,
                                   self.counters_arr)

    def counters(self) -> dict:
        """Protocol counters, plus jobs and free slots."""
        out = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr, strict=True)}
        out["jobs"] = {str(k): {"slots": v["slots"], "n_workers": v["n_workers"],
                                "base": v["base"]} for k, v in self.jobs.items()}
        out["free_slots"] = self.free_slots()
        return out
