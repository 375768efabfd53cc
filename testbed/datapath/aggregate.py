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

import time

import numpy as np

from testbed.datapath.aggkernel import (
    COUNTER_NAMES,
    DONE,
    HOST,
    MAX_ELEMS_MTU,
    MAX_JOBS,
    MAX_WORKERS,
    OPEN,
    SEQ_MOD,
    SHARED,
    STATIC,
    THC_MAX_ELEMS,
    UP,
    Aggregator,
    Batch4,
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
#: Aggregator memory of a switch unless configured: SwitchML's 8192 slots x 2 sets x 256 int32
#: (16 MiB), in the range of one Tofino pipeline's register SRAM.
DEFAULT_MEMORY_BYTES = 16 << 20
#: Slots of metadata (round, bitmap, ...) a switch keeps, whatever their values' memory.
DEFAULT_MAX_SLOTS = 16384
#: int32 registers per set of a slot unless a job says otherwise (SwitchML's 256 per packet).
DEFAULT_LANES = 256
#: Bytes of small registers per slot (round, state, bitmap, missing, ...) on top of its values.
SLOT_METADATA_BYTES = 2 * 32


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


def _peer(job_id: int, what: str, spec, ports: list[str], keys: tuple[str, ...]) -> dict:
    """A checked parent/fallback record: mac bytes, ip int, egress index, and ``keys``."""
    who = f"aggregate: job {job_id}: {what}"
    if not isinstance(spec, dict):
        raise ValueError(f"{who}: expected {{'mac', 'ip', 'egress', ...}}, got {spec!r}")
    missing = {"mac", "ip", "egress", *keys} - set(spec)
    if missing:
        raise ValueError(f"{who}: missing {sorted(missing)}")
    out = {"mac": mac_to_int(spec["mac"]).to_bytes(6, "big"), "ip": ip_to_int(spec["ip"]),
           "egress": port_index(ports, spec["egress"], who)}
    for k in keys:
        out[k] = int(spec[k])
    return out


def _free_range(used: list[tuple[int, int]], lo: int, hi: int, size: int) -> int:
    """First offset in ``lo..hi`` where ``size`` units fit between the ``(start, size)`` ranges
    in ``used``, or -1."""
    base = lo
    for b, n in sorted(used):
        if b - base >= size:
            return base
        base = max(base, b + n)
    return base if hi - base >= size else -1


class AggregateStage(Stage):
    """In-network aggregation (program name ``aggregate``); see the module docstring and
    ``docs/protocol.md``.

    Settings: ``agg_ip``, ``agg_mac`` (this switch's aggregator identity), ``memory_bytes``
    (aggregator memory, default :data:`DEFAULT_MEMORY_BYTES`), ``pool_bytes`` (the part of it
    that is the shared pool for jobs in shared mode, default 0) and ``pool_lanes`` (lanes per set
    of a pool entry, default 256), ``pool_slots`` (slots of metadata, default
    :data:`DEFAULT_MAX_SLOTS`), ``max_elems`` (int32 lanes per packet at most), ``codecs``
    (summable payload codecs, default INT32 and THC), ``results_via`` (``"ingress"``: a RESULT
    leaves by the member's registered port; ``"forward"``: a later ``forward`` stage routes it)
    and ``jobs`` ``{job_id: {...}}``, each with

    * ``slots``, ``seq0`` (first round), ``lanes`` (int32 registers per set: the elements of
      one packet, default 256; THC jobs 1024 or 512), ``members`` (``[{"worker", "mac", "ip",
      "port", "ingress"}, ...]``: workers ``0..n-1``, or the child switches of a tree);
    * ``mode``: ``"static"`` (default: a reserved partition of memory, or refused at admission
      with the free memory in the error) or ``"shared"`` (slots claim pool entries by hash on
      their first round, first come first served; a slot whose entry another job holds sends its
      rounds to the job's ``fallback`` aggregator on a host: ``{"mac", "ip", "port", "egress"}``);
    * ``parent`` (tree nodes below the root): ``{"mac", "ip", "egress", "index"}``: the parent
      switch's aggregator identity, the port towards it and this switch's member id there.
      A completed round's partial sum goes up; the parent's RESULT comes down to the members.
    """

    name = "aggregate"
    #: emitted packets per received packet at most (the engine sizes the batch with it)
    max_expansion = 1 + MAX_WORKERS

    def __init__(self, ports: list[str] | None = None, agg_ip: str = DEFAULT_AGG_IP,
                 agg_mac: str = DEFAULT_AGG_MAC, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 pool_bytes: int = 0, pool_lanes: int = DEFAULT_LANES,
                 pool_slots: int = DEFAULT_MAX_SLOTS, max_elems: int = MAX_ELEMS_MTU,
                 jobs: dict | None = None, codecs: list | None = None,
                 results_via: str = "ingress"):
        memory_bytes, pool_bytes = int(memory_bytes), int(pool_bytes)
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
        self.max_slots, self.max_elems = max_slots, max_elems
        self.memory_words = memory_bytes // 4
        self.pool_lanes = pool_lanes
        self.pool_entries = pool_bytes // (8 * pool_lanes)
        self.pool_words = self.pool_entries * 2 * pool_lanes
        self.static_words = self.memory_words - self.pool_words
        self.regs = new_registers(max_slots, self.memory_words, self.pool_entries)
        self.jobs_arr = new_jobs()
        self.counters_arr = np.zeros(len(COUNTER_NAMES), np.int64)
        self.jobs: dict[int, dict] = {}
        self._agg = {"mac": np.zeros(6, np.uint8), "ip": 0, "codec_ok": np.zeros(256, np.bool_),
                     "via_ingress": True, "max_elems": max_elems, "thc_max": THC_MAX_ELEMS,
                     "pool_base": self.static_words, "pool_lanes": pool_lanes}
        self.agg = Aggregator(**self._agg)
        self._rate = (time.monotonic(), 0)
        self.configure(agg_ip=agg_ip, agg_mac=agg_mac, codecs=codecs or list(DEFAULT_CODECS),
                       jobs=jobs or {}, results_via=results_via)

    # --- control -----------------------------------------------------------------------------
    def configure(self, agg_ip: str | None = None, agg_mac: str | None = None,
                  jobs: dict | None = None, remove_jobs: list | None = None,
                  codecs: list | None = None, results_via: str | None = None,
                  **unknown) -> None:
        """Change the aggregator identity, summable codecs, or add/remove jobs (a job added
        again with its id is replaced). A job that does not fit is refused with a
        ``ValueError`` saying how much memory and how many slots are free."""
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
        self.agg = Aggregator(**a)
        for jid in remove_jobs or []:
            self.remove_job(int(jid))
        for jid, spec in (jobs or {}).items():
            if not isinstance(spec, dict):
                raise ValueError(f"aggregate: job {jid}: expected {{'slots': k, 'seq0': r, "
                                 "'members': [...]}")
            keys = {"slots", "seq0", "members", "lanes", "mode", "parent", "fallback"}
            unknown_keys = set(spec) - keys
            if unknown_keys:
                raise ValueError(f"aggregate: job {jid}: unknown keys {sorted(unknown_keys)}; "
                                 f"use {sorted(keys)}")
            self.add_job(int(jid), int(spec.get("slots", 0)), spec.get("members") or [],
                         int(spec.get("seq0", 0)), lanes=int(spec.get("lanes", DEFAULT_LANES)),
                         mode=spec.get("mode", "static"), parent=spec.get("parent"),
                         fallback=spec.get("fallback"))

    def free_slots(self) -> int:
        """Slots of metadata no job holds."""
        return self.max_slots - sum(j["slots"] for j in self.jobs.values())

    def free_memory_bytes(self) -> int:
        """Bytes of static aggregator memory no job holds (outside the shared pool)."""
        return 4 * (self.static_words - sum(j["words"] for j in self.jobs.values()))

    def add_job(self, job_id: int, slots: int, members: list[dict], seq0: int = 0, *,
                lanes: int = DEFAULT_LANES, mode: str = "static", parent: dict | None = None,
                fallback: dict | None = None) -> None:
        """Register ``job_id`` (see the class docstring); refused when it does not fit."""
        who = f"aggregate: job {job_id}"
        if not 0 <= job_id < 1 << 16:
            raise ValueError(f"aggregate: job_id must be 0..65535, got {job_id}")
        if not 1 <= slots <= 1 << 16:
            raise ValueError(f"{who}: slots must be 1..65536, got {slots}")
        if not 0 <= seq0 < SEQ_MOD:
            raise ValueError(f"{who}: seq0 must be 0..2**32-1, got {seq0}")
        if not 1 <= lanes <= THC_MAX_ELEMS:
            raise ValueError(f"{who}: lanes must be 1..{THC_MAX_ELEMS}, got {lanes}")
        if mode not in ("static", "shared"):
            raise ValueError(f"{who}: mode must be 'static' or 'shared', got {mode!r}")
        rows = [_member_row(job_id, m, self.ports) for m in members]
        n = len(rows)
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"{who}: needs 1..{MAX_WORKERS} members, got {n}")
        if sorted(r[0] for r in rows) != list(range(n)):
            raise ValueError(f"{who}: member workers must be 0..{n - 1}, each once; got "
                             f"{sorted(r[0] for r in rows)}")
        up = None if parent is None else _peer(job_id, "parent", parent, self.ports, ("index",))
        fb = None if fallback is None else _peer(job_id, "fallback", fallback, self.ports,
                                                 ("port",))
        if mode == "shared":
            if fb is None:
                raise ValueError(f"{who}: shared mode needs a 'fallback' host aggregator")
            if self.pool_entries == 0:
                raise ValueError(f"{who}: shared mode, but this switch has no shared pool "
                                 "(pool_bytes = 0)")
            if lanes > self.pool_lanes:
                raise ValueError(f"{who}: lanes {lanes} > the pool's {self.pool_lanes}")
        if job_id in self.jobs:
            self.remove_job(job_id)
        idx = next((k for k in range(MAX_JOBS)
                    if k not in {j["index"] for j in self.jobs.values()}), -1)
        if idx < 0:
            raise ValueError(f"aggregate: at most {MAX_JOBS} jobs at once; remove one first")
        base = _free_range([(j["base"], j["slots"]) for j in self.jobs.values()], 0,
                           self.max_slots, slots)
        if base < 0:
            raise ValueError(f"{who} asks for {slots} slots but only {self.free_slots()} are "
                             f"free (contiguous) of {self.max_slots}; ask for fewer or remove "
                             "a job")
        words = slots * 2 * lanes if mode == "static" else 0
        vbase = _free_range([(j["vbase"], j["words"]) for j in self.jobs.values() if j["words"]],
                            0, self.static_words, words) if words else 0
        if vbase < 0:
            raise ValueError(f"{who} needs {4 * words} B of aggregator memory ({slots} slots x 2 "
                             f"sets x {lanes} lanes x 4 B) but only {self.free_memory_bytes()} B "
                             f"are free (contiguous) of {4 * self.static_words} B static memory; "
                             "ask for fewer slots, use shared mode, or fall back to the hosts")
        self.jobs[job_id] = {"index": idx, "base": base, "slots": slots, "n_workers": n,
                             "seq0": seq0, "lanes": lanes, "mode": mode, "vbase": vbase,
                             "words": words, "parent": parent is not None}
        J, R = self.jobs_arr, self.regs
        J.base[idx], J.slots[idx], J.n_workers[idx], J.lanes[idx] = base, slots, n, lanes
        J.mode[idx] = SHARED if mode == "shared" else STATIC
        J.ingress[idx] = -1
        for w, mac, ip, port, ingress in rows:
            J.mac[idx, w] = np.frombuffer(mac, np.uint8)
            J.ip[idx, w], J.port[idx, w], J.ingress[idx, w] = ip, port, ingress
        J.up_egress[idx], J.fb_egress[idx] = -1, -1
        if up is not None:
            J.up_mac[idx] = np.frombuffer(up["mac"], np.uint8)
            J.up_ip[idx], J.up_egress[idx], J.up_index[idx] = up["ip"], up["egress"], up["index"]
        if fb is not None:
            J.fb_mac[idx] = np.frombuffer(fb["mac"], np.uint8)
            J.fb_ip[idx], J.fb_port[idx], J.fb_egress[idx] = fb["ip"], fb["port"], fb["egress"]
        if mode == "static":
            R.val_off[base:base + slots] = vbase + np.arange(slots) * 2 * lanes
        else:
            R.val_off[base:base + slots] = -1
        init_rounds(R, base, base + slots, seq0)
        J.row[job_id] = idx

    def remove_job(self, job_id: int) -> None:
        """Forget ``job_id``, free its slots, memory and shared-pool entries (packets for it
        then drop ``UNKNOWN_JOB``)."""
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        j = self.jobs.pop(job_id)
        self.jobs_arr.row[job_id] = -1
        lo, hi = j["base"], j["base"] + j["slots"]
        owner = self.regs.pool_owner
        owner[(owner >= lo) & (owner < hi)] = -1
        self.regs.val_off[lo:hi] = -1

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
        """Aggregate the contributions in ``batch``; append the packets it emits."""
        b = Batch4(batch.buf, batch.length, batch.in_port, batch.out_port, batch.reason)
        batch.n = aggregate_kernel(b, batch.n, self.regs, self.jobs_arr, self.agg,
                                   self.counters_arr)

    def counters(self) -> dict:
        """Protocol counters; per job its slots, memory, mode and rounds by where they were
        aggregated; memory configured/allocated/in use; completed rounds per second."""
        out = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr, strict=True)}
        R = self.regs
        jobs, in_use = {}, 0
        for jid, j in self.jobs.items():
            lo, hi = j["base"], j["base"] + j["slots"]
            st = R.state[lo:hi]
            held = int(np.count_nonzero(R.val_off[lo:hi] >= 0))
            open_sets = int(np.count_nonzero((st == OPEN) | (st == UP)))
            in_use += open_sets * j["lanes"] * 4
            jobs[str(jid)] = {
                "slots": j["slots"], "n_workers": j["n_workers"], "base": j["base"],
                "lanes": j["lanes"], "mode": j["mode"], "tree_child": j["parent"],
                "memory_bytes": 4 * (j["words"] if j["mode"] == "static"
                                     else held * 2 * self.pool_lanes),
                "slots_in_memory": held, "slots_at_host": int(np.count_nonzero(
                    (st == HOST).any(axis=1) & (R.val_off[lo:hi] < 0))),
                "open_sets": open_sets, "up_sets": int(np.count_nonzero(st == UP)),
                "done_sets": int(np.count_nonzero(st == DONE))}
        now, done = time.monotonic(), int(self.counters_arr[COUNTER_NAMES.index("completed")])
        t0, done0 = self._rate
        out["aggregations_per_s"] = round((done - done0) / (now - t0), 1) if now > t0 else 0.0
        self._rate = (now, done)
        out["jobs"] = jobs
        out["free_slots"] = self.free_slots()
        out["memory"] = {"configured_bytes": 4 * self.memory_words,
                         "pool_bytes": 4 * self.pool_words,
                         "pool_entries": self.pool_entries,
                         "pool_entries_held": int(np.count_nonzero(R.pool_owner >= 0)),
                         "allocated_bytes": 4 * sum(j["words"] for j in self.jobs.values()),
                         "free_bytes": self.free_memory_bytes(), "in_use_bytes": in_use,
                         "slot_metadata_bytes": SLOT_METADATA_BYTES * self.max_slots}
        return out
