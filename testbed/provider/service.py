"""The fabric manager as a long-running service: HTTP/JSON over a Unix socket (or TCP).

:class:`ProviderService` wraps one :class:`~testbed.provider.manager.FabricManager` (plain
in-process state) for concurrent tenants: one lock serialises every call into it, so a
request sees and leaves a consistent state, and a request the manager refuses changes
nothing (its :class:`~testbed.provider.manager.ProviderError` becomes a 4xx answer naming the
problem; a body the schema rejects is a 422 before the manager is called). Two background
threads keep it honest while nobody asks:

* the **lease reaper** calls ``manager.expire(now)`` every ``reap_period_s``: a tenant that
  vanished (no renew within its ``lease_s``) loses its job, its switch memory is reclaimed
  and its aggregation job is removed from the switches;
* the **telemetry collector** (:class:`Telemetry`) reads every data-path engine's counters
  every ``telemetry_period_s`` (port rates, queue depths, drops, trims, aggregator memory and
  occupancy) into a :class:`~testbed.provider.schema.FabricSnapshot` for ``manager.observe``,
  which re-plans on sustained congestion.

Only the service configures switches (:class:`SwitchConfigurator`, given the running
:class:`~testbed.topologies.net.TestbedNet`): after every change of plans it registers the
INA jobs of the new plans on their tree switches (members, slot partitions) and removes the
jobs whose INA plan is gone. The engines' control channels are reachable from the root
network namespace only (``testbed.datapath.control``), where this service runs; tenants in
the emulated hosts reach the service through its Unix socket (``docs/provider.md``).

API (``/v1``; bodies and answers are the schema's models as JSON):

=========================  ====================================================================
GET  /v1/health            policy, job count, time
GET  /v1/inventory         the fabric: hosts, switches with aggregator memory, links with rates
GET  /v1/telemetry         the latest snapshot (+ per-engine figures and collection errors)
GET  /v1/memory            per switch: configured, allocated per job, free bytes
GET  /v1/tenants           per tenant: jobs, switch memory and trees per switch, quota
GET  /v1/jobs              admitted jobs with their lease, current plan and hints check
POST /v1/jobs              JobRequest -> Plan (201); 409 name or hosts taken, 422 bad request,
                           403 beyond the tenant's quota (jobs, priority)
GET  /v1/jobs/{job}        one job: lease, plan, and its switch registration (INA plans)
GET  /v1/jobs/{job}/plan   the current plan (workers poll it at iteration boundaries)
GET  /v1/jobs/{job}/plan/next?after=V&wait_s=T
                           long poll: the plan once its version exceeds V (or after T s), with
                           its version and the iteration it applies from
POST /v1/jobs/{job}/renew  extend the lease by the job's lease_s (?iteration=K: the last
                           iteration the job finished, from which changes are scheduled;
                           ?running=V: the plan version every worker runs, see
                           SwitchConfigurator)
POST /v1/jobs/{job}/hints  MeasuredHints: what the tenant measured of its running job (bytes,
                           times) replaces those hints, and the jobs are re-planned on them
DELETE /v1/jobs/{job}      release the job (memory back, switches cleared, others re-planned)
GET  /v1/log               every plan change with its time and reason
GET  /v1/plan?policy=P     dry run: the plans policy P would give the admitted jobs now
=========================  ====================================================================

Why one module this long: the HTTP routes, the lease reaper, the telemetry collector and the
switch configurator all act on the one locked manager; keeping them in one file keeps the
locking rule (every call into the manager under the one lock) checkable by reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from testbed.collectives.algorithms import is_offloaded
from testbed.datapath.control import RUN_DIR, ControlError, DatapathClient
from testbed.provider.journal import Journal
from testbed.provider.manager import (
    BadRequest,
    FabricManager,
    NoFeasiblePlan,
    ProviderError,
    UnknownJob,
)
from testbed.provider.policies import POLICIES, make_policy
from testbed.provider.schema import (
    FabricSnapshot,
    JobRequest,
    LinkState,
    MeasuredHints,
    Plan,
    SwitchState,
)
from testbed.topologies import routing
from testbed.topologies.base import LinkImpairment, link_impairments

#: Where tenants find the service: a Unix socket in the run directory, which every emulated
#: host sees (hosts share the file system), while the switches' control channels stay in the
#: root network namespace.
DEFAULT_SOCKET = os.path.join(RUN_DIR, "provider.sock")
#: Seconds between two telemetry collections / two lease checks, by default.
DEFAULT_TELEMETRY_PERIOD_S = 1.0
DEFAULT_REAP_PERIOD_S = 0.25
#: Job ids the service gives the INA jobs it registers on switches (16-bit, clear of the ids
#: tests and experiments pick for their own collectives). A restarted provider removes the ids
#: of this range that no journaled job owns (registrations of a provider that died).
FIRST_JOB_ID = 1000
LAST_JOB_ID = 1999
#: Longest wait of a tenant's long poll for a plan change, and how often it looks.
MAX_WAIT_S = 300.0
WAIT_POLL_S = 0.05
JOB_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
JobName = Annotated[str, Path(pattern=JOB_NAME, description="the job's name")]


# ---------------------------------------------------------------------------------------------
# telemetry

def _port_map(desc: dict) -> dict[tuple[str, str], tuple[str, str, float]]:
    """``(src, dst) -> (node, port name, rate)`` for every direction of every shaped link
    with a programmable end: the port whose counters measure that direction (the source's
    egress port when the source is programmable, else the destination's ingress port)."""
    prog = set(desc.get("programmable", []))
    out: dict[tuple[str, str], tuple[str, str, float]] = {}
    for s in desc.get("links", []):
        if not s.get("bw_mbps"):
            continue
        ends = ((s["a"], s["port_a"], s["b"]), (s["b"], s["port_b"], s["a"]))
        for node, port, peer in ends:
            if node in prog:
                out[(node, peer)] = (node, f"{node}-eth{port}", float(s["bw_mbps"]))
                out.setdefault((peer, node), (node, f"{node}-eth{port}", float(s["bw_mbps"])))
    return out


class Telemetry:
    """Reads the data-path engines of a running fabric into a :class:`FabricSnapshot`.

    ``desc``: the topology's ``describe()`` dict (hosts, switches, programmable nodes, links
    with their ports and rates); ``memory_bytes``: static aggregator memory per switch the
    inventory declares; ``time_dilation``: the network's factor (links run at their rate
    divided by it, so utilisation is measured against the dilated rate). Each
    :meth:`collect` asks every programmable node for its counters; link utilisation is the
    byte-counter delta since the previous collection over the interval and the link rate; queue
    depth and queue drops come from a ``trim`` or ``shape`` stage on the source's egress port
    (trims from the former), drops from the port's drop counters, ``bytes`` from its byte
    counter; a link's impairment from the ``impair`` stages at its ends (what they do now
    beyond the topology's own ``loss_pct``, :func:`testbed.topologies.base.link_impairments`);
    a switch's allocated memory per job from its ``aggregate`` stage. A node that does not
    answer is reported in :attr:`errors` and contributes nothing (its links read as idle).
    """

    def __init__(self, desc: dict, memory_bytes: dict[str, int], time_dilation: float = 1.0):
        if not (isinstance(time_dilation, (int, float)) and time_dilation >= 1):
            raise ValueError(f"time_dilation must be a number >= 1, got {time_dilation!r}")
        self.desc = desc
        self.time_dilation = float(time_dilation)
        self.memory_bytes = dict(memory_bytes)
        self.nodes = sorted(desc.get("programmable", []))
        self.ports = _port_map(desc)
        self.link_specs = routing.as_topology(desc).link_specs
        self._clients: dict[str, Any] = {}
        self._prev: dict[str, tuple[float, dict]] = {}
        #: per directed link measured at its source's egress queue: (engine pid, queue drops,
        #: packets sent) at the previous collection
        self._prev_drops: dict[tuple[str, str], tuple[int, int, int]] = {}
        self.errors: dict[str, str] = {}
        #: one question at a time on the control connections (the service's collector and
        #: its hints checks run in different threads)
        self._lock = threading.Lock()
        self.engines: dict[str, dict] = {}
        self.jobs_held: dict[str, set[int]] = {}
        self.collected_s: float | None = None

    def _counters(self, node: str) -> dict | None:
        with self._lock:
            c = self._clients.get(node)
            try:
                if c is None:
                    c = self._clients[node] = DatapathClient(node)
                data = c.counters()
            except (ControlError, OSError) as e:
                self._clients.pop(node, None)
                self.errors[node] = str(e)
                return None
            self.errors.pop(node, None)
            return data

    def collect(self, now: float | None = None) -> FabricSnapshot:
        """One snapshot of the fabric now (``now``: the snapshot's time, default monotonic)."""
        now = time.monotonic() if now is None else float(now)
        counters: dict[str, dict] = {}
        rates: dict[str, dict[str, tuple[float, float]]] = {}
        for node in self.nodes:
            data = self._counters(node)
            if data is None:
                continue
            counters[node] = data
            t1 = time.monotonic()
            prev = self._prev.get(node)
            rates[node] = {}
            if prev is not None and t1 > prev[0]:
                for port, p in data.get("ports", {}).items():
                    q = prev[1].get(port)
                    if q is not None:
                        rates[node][port] = (
                            max(p["tx_bytes"] - q["tx_bytes"], 0) * 8 / (t1 - prev[0]),
                            max(p["rx_bytes"] - q["rx_bytes"], 0) * 8 / (t1 - prev[0]))
            self._prev[node] = (t1, data.get("ports", {}))
        impaired = {(i.src, i.dst): i for i in link_impairments(
            self.link_specs, counters,
            own_loss_applied=self.desc.get("impairments") == "datapath")}
        links = [self._link(src, dst, rate, counters, rates, impaired.get((src, dst)))
                 for (src, dst), (_n, _p, rate) in sorted(self.ports.items())]
        switches = []
        for name in self.desc.get("switches", {}):
            agg = counters.get(name, {}).get("stages", {}).get("aggregate", {})
            alloc = {str(j): int(v.get("memory_bytes", 0))
                     for j, v in agg.get("jobs", {}).items()}
            switches.append(SwitchState(name=name, memory_bytes=self.memory_bytes.get(name, 0),
                                        allocated_bytes=alloc,
                                        programmable=name in self.nodes))
        self.engines = {node: _engine_summary(data) for node, data in counters.items()}
        #: per answering node with an aggregate stage, the job ids it holds now
        self.jobs_held = {node: {int(j) for j in data["stages"]["aggregate"].get("jobs", {})}
                          for node, data in counters.items()
                          if "aggregate" in data.get("stages", {})}
        self.collected_s = now
        return FabricSnapshot(topology=str(self.desc.get("kind", "")), time_s=now,
                              switches=switches, links=links,
                              hosts=list(self.desc.get("hosts", [])))

    def uplink_bytes(self, hosts) -> dict[str, int]:
        """Per host of ``hosts``, the bytes its uplink carried so far, read now (the counter
        :meth:`collect` reports as the link's ``bytes``), asking only the engines of those
        uplinks: what the manager judges hints on when a job reports an iteration. A host
        whose uplink no answering engine counts is left out."""
        hosts = set(hosts)
        where = {src: (node, port) for (src, _dst), (node, port, _r) in self.ports.items()
                 if src in hosts and node != src}
        counters = {node: self._counters(node) for node in {n for n, _p in where.values()}}
        out = {}
        for h, (node, port) in where.items():
            carried = (counters[node] or {}).get("ports", {}).get(port, {}).get("rx_bytes")
            if carried is not None:
                out[h] = int(carried)
        return out

    def _link(self, src: str, dst: str, rate_mbps: float, counters: dict, rates: dict,
              impairment: LinkImpairment | None) -> LinkState:
        node, port, _ = self.ports[(src, dst)]
        data = counters.get(node)
        if data is None:
            return LinkState(src=src, dst=dst, rate_mbps=rate_mbps, impairment=impairment)
        egress = node == src  # the counters are the source's egress port
        tx_bps, rx_bps = rates.get(node, {}).get(port, (0.0, 0.0))
        bps = tx_bps if egress else rx_bps
        queue = drops = trims = qdrops = 0
        stages = data.get("stages", {})
        trim = stages.get("trim", {}).get("ports", {}).get(port)
        if egress and trim is not None:
            queue = int(trim.get("depth_bytes", 0))
            trims = int(trim.get("trimmed", 0))
            qdrops += int(trim.get("dropped", 0))
        shape = stages.get("shape", {}).get("ports", {}).get(port)
        if egress and shape is not None:  # a port its engine shapes queues there
            queue += int(shape.get("depth_bytes", 0))
            trims += int(shape.get("trimmed", 0))  # a port a UET plan made trim
            qdrops += int(shape.get("dropped", 0))
        drops += qdrops
        drop_rate = 0.0
        if egress:  # of the packets that reached the queue since the last collection
            sent = int(data.get("ports", {}).get(port, {}).get("tx_packets", 0))
            now = (int(data.get("pid", 0)), qdrops, sent)
            prev = self._prev_drops.get((src, dst))
            self._prev_drops[(src, dst)] = now
            if prev is not None and prev[0] == now[0]:  # the same engine: deltas hold
                d, n = max(qdrops - prev[1], 0), max(sent - prev[2], 0)
                drop_rate = round(d / (d + n), 6) if d else 0.0
        if not egress:  # packets that arrived over this link and were dropped at its end
            drops += sum(int(v) for v in data.get("ports", {}).get(port, {})
                         .get("drops", {}).values())
        carried = data.get("ports", {}).get(port, {}).get("tx_bytes" if egress else "rx_bytes")
        return LinkState(src=src, dst=dst, rate_mbps=rate_mbps,
                         utilisation=round(bps * self.time_dilation / (rate_mbps * 1e6), 4),
                         queue_bytes=queue, drops=drops, trims=trims, bytes=int(carried or 0),
                         drop_rate=drop_rate, impairment=impairment)

    def close(self) -> None:
        """Close the control connections."""
        for c in self._clients.values():
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()


def _engine_summary(data: dict) -> dict:
    """The figures of one engine the telemetry endpoint shows beside the snapshot."""
    agg = data.get("stages", {}).get("aggregate")
    out = {"cpu": data.get("cpu"), "cpu_max": data.get("cpu_max"),
           "drops": data.get("drops", {}), "uptime_s": data.get("uptime_s")}
    if agg is not None:
        out["aggregator"] = {"memory": agg.get("memory", {}), "free_slots": agg.get("free_slots"),
                             "jobs": {j: {k: v.get(k) for k in ("slots", "n_workers",
                                                                "memory_bytes", "open_sets")}
                                      for j, v in agg.get("jobs", {}).items()}}
    trim = data.get("stages", {}).get("trim")
    if trim is not None:
        out["trim"] = trim.get("totals", {})
    return out


# ---------------------------------------------------------------------------------------------
# switch configuration

class SwitchConfigurator:
    """Puts the manager's plans on the switches of a running :class:`TestbedNet`.

    :meth:`sync` after every change: a job whose plan is in-network aggregation (``ina`` or
    ``nic`` with a tree) is registered on its tree switches with its members and a static or
    shared slot partition (``testbed.collectives.runner.register_ina_job``, the same control
    plane the collective runner uses); a job whose INA configuration changed is registered
    again (a new prediction or reason alone leaves it alone); a
    job that left or no longer aggregates in the network is removed from its switches.
    :attr:`registrations` holds, per job, what its workers need to take part (job id, UDP
    port, member ids, aggregator address, the plan ``version`` it is for), served by
    ``GET /v1/jobs/{job}``. A registration a switch refuses is kept in :attr:`errors` (the
    job's workers then run their collective on the hosts) and retried at the next change.

    A job whose tenant reports the plan version its workers run (:meth:`running`, from
    ``POST /v1/jobs/{job}/renew?running=V``; ``testbed launch --provider`` does) keeps its old
    registration through a plan change: the new one goes beside it under a job id of its own,
    and the old one (:attr:`retiring`) goes once every worker runs the new plan, for they may
    be in a collective of the old one when the change comes. A tenant that never reports it
    switches at the boundary the service gives it, and its registration is replaced at once.

    A job whose plan runs its ring over UET gets trimming on the ports its packets cross
    (:attr:`trimmer`, :class:`~testbed.provider.trimming.PortTrimmer`), at every sync; the
    ports go back to drop-tail when no such plan needs them.
    """

    def __init__(self, net):
        # function-level import: see _register
        from testbed.provider.trimming import PortTrimmer

        self.net = net
        self.trimmer = PortTrimmer(net)
        self.handles: dict[str, tuple[Plan, Any, dict]] = {}
        self.registrations: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.registered_again: dict[str, int] = {}
        #: per job, the plan version its workers run (jobs whose tenant reports it)
        self.following: dict[str, int] = {}
        #: per job, the registrations of plans it is leaving: (the plan version that replaced
        #: it, handle, job id)
        self.retiring: dict[str, list[tuple[int, Any, int]]] = {}
        self._ids: dict[str, int] = {}
        self._last_id = FIRST_JOB_ID - 1

    def _job_id(self, job: str) -> int:
        if job not in self._ids:
            used = set(self._ids.values()) | {jid for held in self.retiring.values()
                                              for _v, _h, jid in held}
            # in turn from the last one given: an id just let go is the last to come back, so
            # a late packet of a removed registration never meets a new job of the same id
            span = LAST_JOB_ID - FIRST_JOB_ID + 1
            free = (i for i in (FIRST_JOB_ID + (self._last_id + 1 - FIRST_JOB_ID + k) % span
                                for k in range(span)) if i not in used)
            self._ids[job] = next(free, None)
            if self._ids[job] is None:
                del self._ids[job]
                raise RuntimeError(f"every job id of the provider's range {FIRST_JOB_ID}.."
                                   f"{LAST_JOB_ID} is in use")
            self._last_id = self._ids[job]
        return self._ids[job]

    def sync(self, plans: dict[str, Plan], jobs: dict[str, dict],
             versions: dict[str, int] | None = None) -> None:
        """Make the switches hold exactly the INA jobs of ``plans`` (``jobs``: the manager's
        job table, for the hosts; ``versions``: each job's plan version), and the
        registrations of the plans their workers may still run (:attr:`retiring`)."""
        versions = versions or {}
        for job in list(self.handles):
            plan = plans.get(job)
            if plan is None or not _in_network(plan) or \
                    _switch_config(plan) != _switch_config(self.handles[job][0]):
                if plan is not None and job in self.following:
                    self._stage(job, versions.get(job, 0))
                else:
                    self._remove(job)
        for job, plan in plans.items():
            if _in_network(plan) and job not in self.handles:
                self._register(job, plan, list(jobs[job]["hosts"]), jobs[job]["hints"],
                               versions.get(job, 0))
        for job in list(self._ids):
            if job not in plans:
                del self._ids[job]
                self.errors.pop(job, None)
        for job in [j for j in self.retiring if j not in plans]:  # the job ended: all go
            self._retire(job, None)
        for job in [j for j in self.following if j not in plans]:
            del self.following[job]
        self.trimmer.sync(plans, jobs)

    def running(self, job: str, version: int) -> bool:
        """Every worker of ``job`` runs its plan ``version`` now: the registrations of the
        plans before it go. Returns whether any went (memory a refused registration may
        take: :meth:`sync` again)."""
        self.following[job] = max(version, self.following.get(job, 0))
        return self._retire(job, version)

    def _stage(self, job: str, version: int) -> None:
        """Move ``job``'s registration to :attr:`retiring` (its workers may still use it);
        its next one gets a job id of its own."""
        _plan, handle, _entry = self.handles.pop(job)
        self.registrations.pop(job, None)
        self.retiring.setdefault(job, []).append((version, handle, self._ids.pop(job)))
        if self.following.get(job, 0) >= version:
            self._retire(job, self.following[job])

    def _retire(self, job: str, version: int | None) -> bool:
        """Remove ``job``'s retiring registrations replaced at ``version`` or before (None:
        all of them)."""
        held = self.retiring.pop(job, [])
        keep = [h for h in held if version is not None and h[0] > version]
        for _v, handle, _jid in (h for h in held if h not in keep):
            self._release(job, handle)
        if keep:
            self.retiring[job] = keep
        return len(keep) < len(held)

    def _spec(self, job: str, plan: Plan, hints: dict):
        from testbed.collectives.spec import CollectiveSpec, communication_of  # see _register

        return CollectiveSpec(
            op="allreduce", nbytes=4 * -(-int(hints.get("collective_bytes") or 1 << 20) // 4),
            **communication_of(plan), job_id=self._job_id(job),
            placement={"tree": plan.tree if plan.tree is not None else "single",
                       "slots": max(plan.slots, 1), "mode": plan.mode})

    def _register(self, job: str, plan: Plan, hosts: list[str], hints: dict,
                  version: int = 0) -> None:
        # Function-level imports: the collective runner loads the kernels (Numba), which only
        # a service that configures a running network needs.
        from testbed.collectives.ina import ina_lanes
        from testbed.collectives.runner import CollectiveError, register_ina_job

        nodes = [self.net.mininet.get(h) for h in hosts]
        entry = {"n": len(nodes), "ranks": [{"host": h.name, "pid": int(h.pid), "ip": h.IP()}
                                           for h in nodes]}
        try:
            spec = self._spec(job, plan, hints)
            handle = register_ina_job(self.net, spec, entry, nodes)
        except (CollectiveError, ValueError, RuntimeError) as e:
            self.errors[job] = str(e)
            return
        self.errors.pop(job, None)
        self.handles[job] = (plan, handle, entry)
        self.registrations[job] = {"job_id": spec.job_id, "tree": entry.get("tree"),
                                   "seq0": entry.get("seq0"), "ranks": entry["ranks"],
                                   "fallbacks": entry.get("fallbacks", []),
                                   "slots": handle.spec.slots, "mode": plan.mode,
                                   "lanes": ina_lanes(spec, len(nodes)), "version": version}

    def reconcile(self, held: dict[str, set[int]], plans: dict[str, Plan],
                  jobs: dict[str, dict], versions: dict[str, int] | None = None) -> list[str]:
        """Register again, under the same job id, every job a switch of its tree no longer
        holds (``held``: per switch, the job ids it holds now; a switch whose engine was
        restarted holds none): a new first round, which ``GET /v1/jobs/{job}`` shows.
        Returns those jobs (:attr:`registered_again` counts them per job)."""
        lost = [job for job, (_p, _h, _e) in self.handles.items()
                if any(sw in held and self._ids[job] not in held[sw]
                       for sw in (self.registrations[job].get("tree") or []))]
        for job in lost:
            self._remove(job)  # from the switches that still hold it
            if job in plans:
                self._register(job, plans[job], list(jobs[job]["hosts"]), jobs[job]["hints"],
                               (versions or {}).get(job, 0))
            self.registered_again[job] = self.registered_again.get(job, 0) + 1
        return lost

    # -- a restarted provider ---------------------------------------------------------------
    def saved(self) -> dict[str, dict]:
        """What the journal keeps per job (``Journal.save``): the job id, plan and
        registration of the plan it runs, the registrations of the plans it is leaving
        (``retiring``) and the plan version its workers run (``following``)."""
        out: dict[str, dict] = {
            job: {"job_id": self.registrations[job]["job_id"], "plan": _switch_config(plan),
                  "registration": self.registrations[job]}
            for job, (plan, _h, _e) in self.handles.items()}
        for job, held in self.retiring.items():
            out.setdefault(job, {})["retiring"] = [
                {"job_id": jid, "version": v, "registration": _registration_of(handle)}
                for v, handle, jid in held]
        for job, version in self.following.items():
            out.setdefault(job, {})["following"] = version
        return out

    def _handle(self, reg: dict, spec=None):
        """A handle on the switches of a registration an earlier provider made (its
        journal's ``reg``), with ``spec`` (None: one that knows only its job id, enough to
        release it)."""
        from testbed.collectives.runner import InaJob  # see _register
        from testbed.collectives.spec import CollectiveSpec

        if spec is None:
            spec = CollectiveSpec(op="allreduce", algo="ina", nbytes=4,
                                  job_id=int(reg["job_id"]))
        clients = {sw: self.net.switch_client(sw) for sw in reg["tree"]}
        return InaJob(spec, SimpleNamespace(tree=list(reg["tree"])), clients,
                      reg.get("fallbacks", []))

    def _on_switches(self) -> dict[str, set[int]]:
        """Per programmable switch, the job ids its aggregate stage holds."""
        out = {}
        for sw, client in self.net.datapath_clients().items():
            agg = client.counters().get("stages", {}).get("aggregate")
            if agg is not None:
                out[sw] = {int(j) for j in agg.get("jobs", {})}
        return out

    def adopt(self, saved: dict[str, dict], plans: dict[str, Plan],
              jobs: dict[str, dict], versions: dict[str, int] | None = None
              ) -> dict[str, list]:
        """Reconcile the switches with a journal (a restarted provider): a saved registration
        of a job whose plan still asks for it and which every switch of its tree still holds
        is adopted as is (its workers go on undisturbed); one a switch lost is registered
        again (a new registration); the service's job ids on the switches that no adopted
        job owns are removed (stale). The registrations of plans a job's workers may still
        run (:attr:`retiring`) are adopted too while its tree holds them, with the plan
        version they reported (:attr:`following`). Returns what was ``adopted`` (jobs),
        ``retiring`` (``[job, job id]`` adopted), ``restored`` and ``removed``
        (``[switch, job id]``)."""
        held = self._on_switches()
        out: dict[str, list] = {"adopted": [], "retiring": [], "restored": [], "removed": []}
        for job, s in sorted(saved.items()):
            if job not in plans:
                continue
            if s.get("following") is not None:
                self.following[job] = int(s["following"])
            for x in s.get("retiring", ()):  # plans its workers may still run
                reg = x["registration"]
                if reg["tree"] and all(x["job_id"] in held.get(sw, ()) for sw in reg["tree"]):
                    self.retiring.setdefault(job, []).append(
                        (int(x["version"]), self._handle(reg), int(x["job_id"])))
                    self._last_id = max(self._last_id, int(x["job_id"]))
                    out["retiring"].append([job, int(x["job_id"])])
            if s.get("registration") is None:
                continue
            plan = plans[job]
            reg = s["registration"]
            tree = list(reg.get("tree") or [])
            if not _in_network(plan) or _switch_config(plan) != s["plan"] \
                    or not tree or any(s["job_id"] not in held.get(sw, ()) for sw in tree):
                continue
            self._ids[job] = int(s["job_id"])
            self._last_id = max(self._last_id, self._ids[job])
            self.handles[job] = (plan, self._handle(reg, self._spec(job, plan, jobs[job]["hints"])),
                                 {"n": len(reg["ranks"]), "ranks": reg["ranks"], "tree": tree})
            self.registrations[job] = reg
            out["adopted"].append(job)
        owned = {self._ids[j] for j in self.handles} | {
            jid for held_ in self.retiring.values() for _v, _h, jid in held_}
        for sw, ids in sorted(held.items()):
            for jid in sorted(ids):
                if FIRST_JOB_ID <= jid <= LAST_JOB_ID and jid not in owned:
                    self.net.switch_client(sw).configure("aggregate", remove_jobs=[jid])
                    out["removed"].append([sw, jid])
        missing = {j for j, p in plans.items() if _in_network(p) and j not in self.handles}
        self.sync(plans, jobs, versions)
        out["restored"] = sorted(j for j in missing if j in self.handles)
        return out

    def _remove(self, job: str) -> None:
        _plan, handle, _entry = self.handles.pop(job)
        self.registrations.pop(job, None)
        self._release(job, handle)

    def _release(self, job: str, handle) -> None:
        """Take one of ``job``'s registrations off its switches (a failure goes to
        :attr:`errors`)."""
        from testbed.collectives.runner import CollectiveError  # see _register

        try:
            handle.release()
        except CollectiveError as e:
            self.errors[job] = str(e)

    def close(self) -> None:
        """Remove every job this configurator registered, and every port's trimming."""
        for job in list(self.handles):
            self._remove(job)
        for job in list(self.retiring):
            self._retire(job, None)
        self.trimmer.close()


def _registration_of(handle) -> dict:
    """What a journal keeps of a retiring registration: enough to adopt and release it."""
    return {"job_id": int(handle.spec.job_id), "tree": list(handle.tree),
            "fallbacks": list(handle.fallbacks)}


def _in_network(plan: Plan) -> bool:
    return is_offloaded(plan.algo) and plan.tree is not None


def _switch_config(plan: Plan) -> dict:
    """What of a plan the switches hold (a new prediction or reason changes nothing there)."""
    return plan.model_dump(exclude={"reason", "predicted_comm_s"})


# ---------------------------------------------------------------------------------------------
# the service

class ProviderService:
    """One manager, its lock, its background threads, and optionally telemetry and switches.

    ``manager``: the :class:`FabricManager`; ``telemetry``: a :class:`Telemetry` (None: the
    service sees only its inventory); ``switches``: a :class:`SwitchConfigurator` (None: plans
    are computed and served but no switch is configured); ``clock``: seconds, monotonic;
    ``journal``: a :class:`~testbed.provider.journal.Journal` (None: the state lives in this
    process only). A journal that holds a state is resumed: jobs, leases and plans restored,
    the switches reconciled with its registrations (:attr:`resumed` says what was adopted,
    restored and removed), and every later change is saved to it.
    """

    def __init__(self, manager: FabricManager, telemetry: Telemetry | None = None,
                 switches: SwitchConfigurator | None = None,
                 telemetry_period_s: float = DEFAULT_TELEMETRY_PERIOD_S,
                 reap_period_s: float = DEFAULT_REAP_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic, journal: Journal | None = None):
        for name, v in (("telemetry_period_s", telemetry_period_s),
                        ("reap_period_s", reap_period_s)):
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        self.manager = manager
        self.telemetry = telemetry
        self.switches = switches
        self.telemetry_period_s = float(telemetry_period_s)
        self.reap_period_s = float(reap_period_s)
        self.clock = clock
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.last_error: str | None = None  # the latest failure of a background loop
        #: set when the server stops: tenants' long polls answer at once
        self.closing = threading.Event()
        self.journal = journal
        self.resumed: dict | None = None
        self._saved: tuple = (-1, None)
        saved = journal.load() if journal is not None else None
        if saved is not None:
            state, _regs = saved
            self.manager.restore(state)
            # leases ran on while no provider did: those that ran out end now, before the
            # switches are reconciled
            expired = self.manager.expire(self.clock())
            self.resumed = {"jobs": sorted(set(state["jobs"]) - set(expired)),
                            "expired": expired}
        if switches is not None:
            # registrations of a provider that died are adopted (journaled) or removed
            adopted = switches.adopt(saved[1] if saved else {}, self.manager.plans(),
                                     self.manager.jobs(), self._versions())
            if self.resumed is not None or adopted["removed"]:
                self.resumed = {**(self.resumed or {"jobs": [], "expired": []}), **adopted}
        self._save()

    def _versions(self) -> dict[str, int]:
        return {job: self.manager.plan_version(job) for job in self.manager.plans()}

    def sync_switches(self) -> None:
        """Bring the switches in line with the plans (call under :attr:`lock`)."""
        if self.switches is not None:
            self.switches.sync(self.manager.plans(), self.manager.jobs(), self._versions())

    def _save(self) -> None:
        """Journal the state when it changed since the last save."""
        if self.journal is None:
            return
        regs = self.switches.saved() if self.switches is not None else {}
        mark = (self.manager.version, regs)
        if mark != self._saved:
            self.journal.save(self.manager.state(), regs)
            self._saved = mark

    # -- calls into the manager, serialised ---------------------------------------------------
    def call(self, fn: Callable[[FabricManager, float], Any]) -> Any:
        """Run ``fn(manager, now)`` under the lock; afterwards bring the switches in line
        with the plans when they changed, and journal what changed."""
        with self.lock:
            before = self.manager.plans()
            try:
                return fn(self.manager, self.clock())
            finally:
                if self.manager.plans() != before:
                    self.sync_switches()
                self._save()

    def check_hints(self) -> list[str]:
        """Judge the hints of the jobs awaiting a check (:meth:`FabricManager.hints_pending`)
        on their hosts' uplink counters read now (outside the lock), as a job reports an
        iteration: a job is judged after CHECK_ITERATIONS of its own iterations, not at
        the collector's pace. Returns the jobs whose plan changed."""
        if self.telemetry is None:
            return []
        with self.lock:
            pending = self.manager.hints_pending()
        if not pending:
            return []
        sent = self.telemetry.uplink_bytes({h for hosts in pending.values() for h in hosts})
        return self.call(lambda m, now: m.check_hints(sent, now))

    def reap(self) -> list[str]:
        """Expire the jobs whose lease ran out now; returns their names."""
        return self.call(lambda m, now: m.expire(now))

    def observe(self) -> list[str]:
        """Collect one telemetry snapshot and hand it to the manager (outside the lock: the
        engines answer at their own pace)."""
        if self.telemetry is None:
            return []
        snap = self.telemetry.collect(self.clock())
        changed = self.call(lambda m, now: m.observe(snap, now))
        if self.switches is not None:
            with self.lock:  # a switch whose engine restarted lost its jobs: register them
                if self.switches.reconcile(self.telemetry.jobs_held, self.manager.plans(),
                                           self.manager.jobs(), self._versions()):
                    self._save()
        return changed

    # -- background ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the lease reaper and (with telemetry) the collector."""
        if self._threads:
            return
        self._stop.clear()
        loops = [(self.reap, self.reap_period_s)]
        if self.telemetry is not None:
            loops.append((self.observe, self.telemetry_period_s))
        for fn, period in loops:
            t = threading.Thread(target=self._loop, args=(fn, period), daemon=True,
                                 name=f"provider-{fn.__name__}")
            t.start()
            self._threads.append(t)

    def _loop(self, fn: Callable[[], Any], period: float) -> None:
        while not self._stop.wait(period):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a background failure must not end the loop
                self.last_error = f"{fn.__name__}: {type(e).__name__}: {e}"

    def stop(self) -> None:
        """Stop the background threads. Without a journal, remove the service's jobs from
        the switches; with one they stay registered, journaled, for the next start to adopt
        (a provider restarted for an upgrade does not stop its tenants' jobs)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []
        with self.lock:
            if self.switches is not None and self.journal is None:
                self.switches.close()
            if self.journal is not None:
                self.journal.close()
        if self.telemetry is not None:
            self.telemetry.close()


def create_app(service: ProviderService) -> FastAPI:
    """The HTTP API of ``service`` (see the module docstring)."""
    app = FastAPI(title="testbed fabric manager", version="1",
                  description="Tenant hints in, offload plans out (docs/provider.md).")

    @app.exception_handler(ProviderError)
    async def _refused(_req: Request, exc: ProviderError) -> JSONResponse:
        return JSONResponse(status_code=exc.status,
                            content={"error": type(exc).__name__, "detail": str(exc)})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""),
                     "type": e.get("type", "")} for e in exc.errors()]
        text = "; ".join(f"{'.'.join(str(x) for x in p['loc'])}: {p['msg']}" for p in problems)
        return JSONResponse(status_code=422, content={"error": "invalid request",
                                                      "detail": text, "problems": problems})

    def job_view(m: FabricManager, now: float, name: str, info: dict) -> dict:
        out = {"job": name, **info, "expires_in_s": round(info["expires_s"] - now, 3),
               "plan": m.plans().get(name)}
        sw = service.switches
        if sw is not None:
            out["registration"] = sw.registrations.get(name)
            out["registered_again"] = sw.registered_again.get(name, 0)
            # registrations of plans the job is leaving, kept until its workers left them
            out["retiring"] = [jid for _v, _h, jid in sw.retiring.get(name, [])]
            if name in sw.errors:
                out["registration_error"] = sw.errors[name]
            if name in sw.trimmer.by_job:  # a UET plan: the ports that trim its packets
                out["trimming"] = sw.trimmer.by_job[name]
        return out

    def one_job(m: FabricManager, now: float, name: str) -> dict:
        jobs = m.jobs()
        if name not in jobs:
            raise UnknownJob(f"no admitted job {name!r} (admitted: {sorted(jobs)})")
        return job_view(m, now, name, jobs[name])

    @app.get("/v1/health")
    def health() -> dict:
        return service.call(lambda m, now: {
            "ok": True, "policy": m.policy.name, "jobs": len(m.jobs()), "time_s": now,
            "telemetry": service.telemetry is not None,
            "configures_switches": service.switches is not None,
            "background_error": service.last_error})

    @app.get("/v1/inventory")
    def inventory() -> FabricSnapshot:
        return service.manager.inventory

    @app.get("/v1/telemetry")
    def telemetry() -> dict:
        t = service.telemetry
        snap = service.call(lambda m, now: m.fabric())
        return {"snapshot": snap, "period_s": service.telemetry_period_s if t else None,
                "collected_s": t.collected_s if t else None,
                "engines": dict(t.engines) if t else {}, "errors": dict(t.errors) if t else {}}

    @app.get("/v1/memory")
    def memory() -> dict:
        return service.call(lambda m, now: m.memory())

    @app.get("/v1/tenants")
    def tenants() -> dict:
        return service.call(lambda m, now: m.tenants())

    @app.get("/v1/jobs")
    def jobs() -> dict:
        return service.call(lambda m, now: {n: job_view(m, now, n, i)
                                            for n, i in m.jobs().items()})

    @app.post("/v1/jobs", status_code=201)
    def admit(req: JobRequest) -> Plan:
        def do(m: FabricManager, now: float) -> Plan:
            plan = m.admit(req, now)
            # the lease runs from the answer: planning may take seconds (a policy that
            # measures compressors compiles their kernels on first use)
            m.renew(req.job, service.clock())
            return plan
        return service.call(do)

    @app.get("/v1/jobs/{job}")
    def job(job: JobName) -> dict:
        return service.call(lambda m, now: one_job(m, now, job))

    @app.get("/v1/jobs/{job}/plan")
    def plan(job: JobName) -> Plan:
        return service.call(lambda m, now: one_job(m, now, job)["plan"])

    @app.get("/v1/jobs/{job}/plan/next")
    async def next_plan(
            job: JobName,
            after: Annotated[int, Query(ge=0, description="the plan version the tenant has")] = 0,
            wait_s: Annotated[float, Query(gt=0, le=MAX_WAIT_S,
                                           description="longest wait for a change")] = 30.0
    ) -> dict:
        # A long poll (not server-sent events): one plain request per change, which every HTTP
        # client and proxy handles, and a tenant that missed a change while reconnecting gets
        # it at once (it names the version it has). Waiting is a coroutine: a thousand waiting
        # tenants hold no thread of the server.
        deadline = time.monotonic() + wait_s
        m = service.manager
        while 0 < m.plan_version(job) <= after and time.monotonic() < deadline \
                and not service.closing.is_set():
            await asyncio.sleep(WAIT_POLL_S)

        def pushed(m: FabricManager, now: float) -> dict:
            plan = one_job(m, now, job)["plan"]
            version = m.plan_version(job)
            return {"job": job, "version": version, "changed": version > after, "plan": plan,
                    "applies_at": m.applies_at(job)}
        return await asyncio.to_thread(service.call, pushed)

    @app.post("/v1/jobs/{job}/renew")
    def renew(job: JobName, iteration: Annotated[
            int | None, Query(ge=0, description="the last iteration the job finished: plan "
                              "changes apply from a later one")] = None,
              running: Annotated[
            int | None, Query(ge=1, description="the plan version every worker of the job "
                              "runs now: the switch registrations of older plans go (a job "
                              "that reports it keeps them through a plan change until then)")
              ] = None) -> dict:
        def do(m: FabricManager, now: float) -> dict:
            expires = m.renew(job, now, iteration, running)
            if running is not None and service.switches is not None and \
                    service.switches.running(job, running):
                service.sync_switches()  # a registration refused for memory may fit now
            return {"job": job, "expires_s": expires, "expires_in_s": round(expires - now, 3)}
        out = service.call(do)
        if iteration is not None:
            service.check_hints()
        return out

    @app.post("/v1/jobs/{job}/hints")
    def measured(job: JobName, body: MeasuredHints) -> dict:
        def do(m: FabricManager, now: float) -> dict:
            figures = body.model_dump(exclude={"reason"}, exclude_none=True)
            if not figures:
                raise BadRequest("give at least one of collective_bytes, iterations, "
                                 "iteration_s, compute_s")
            changed = m.update_hints(job, figures, body.reason, now)
            return {"job": job, "hints": m.jobs()[job]["hints"], "replanned": changed,
                    "version": m.plan_version(job)}
        return service.call(do)

    @app.delete("/v1/jobs/{job}")
    def release(job: JobName) -> dict:
        def do(m: FabricManager, now: float) -> dict:
            m.release(job, now)
            return {"job": job, "released": True}
        return service.call(do)

    @app.get("/v1/log")
    def log(since: Annotated[int, Query(ge=0, description="first entry to return")] = 0
            ) -> list[dict]:
        return service.call(lambda m, now: [c.to_json() for c in m.log[since:]])

    @app.get("/v1/plan")
    def dry_run(policy: Annotated[str, Query(description=f"one of {sorted(POLICIES)}")]
                ) -> dict:
        if policy not in POLICIES:
            raise ProviderError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        pol = make_policy(policy, service.manager.model)

        def do(m: FabricManager, now: float) -> dict:
            reqs = [JobRequest(job=n, hosts=i["hosts"], hints=i["hints"], lease_s=i["lease_s"])
                    for n, i in m.jobs().items()]
            try:
                plans = pol.plan(reqs, m.planning_fabric()) if reqs else {}
            except (ValueError, KeyError) as e:
                raise NoFeasiblePlan(f"policy {policy!r} failed: {e}") from None
            return {"policy": policy, "plans": plans, "current": m.plans()}
        return service.call(do)

    return app


# ---------------------------------------------------------------------------------------------
# serving

class Server:
    """The API of a :class:`ProviderService` served by uvicorn in a thread of this process,
    on a Unix socket (``socket_path``) or TCP (``host``/``port``; port 0 picks a free one).
    A context manager: the service's background threads run while it is open."""

    def __init__(self, service: ProviderService, socket_path: str | None = DEFAULT_SOCKET,
                 host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.service = service
        self.socket_path = socket_path if port is None else None
        kw: dict = {"uds": self.socket_path} if self.socket_path else {"host": host,
                                                                        "port": port}
        self.config = uvicorn.Config(create_app(service), log_level=log_level,
                                     lifespan="off", **kw)
        self.server = uvicorn.Server(self.config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``unix:PATH`` or ``http://HOST:PORT`` (the client's ``address``)."""
        if self.socket_path:
            return f"unix:{self.socket_path}"
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> Server:
        """Start serving; return once the socket accepts connections."""
        if self.socket_path:
            os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)  # a stale socket of a service that crashed
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       name="provider-http")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the provider service did not start on "
                                   f"{self.socket_path or self.config.port}")
            time.sleep(0.01)
        if self.socket_path:
            os.chmod(self.socket_path, 0o666)  # tenants need not be the provider's user
        self.service.start()
        return self

    def stop(self) -> None:
        """Stop serving and the service's background threads."""
        self.service.closing.set()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.service.stop()
        if self.socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_memory(net) -> tuple[dict[str, int], dict[str, int]]:
    """Per switch of a running ``TestbedNet``, as its engines' ``aggregate`` stages report it
    (one query each): the static aggregator memory (configured minus the shared pool) and
    the shared pool's entries; switches without that stage are left out."""
    static, pool = {}, {}
    for name, client in sorted(net.datapath_clients().items()):
        agg = client.counters().get("stages", {}).get("aggregate")
        if agg is not None:
            mem = agg["memory"]
            static[name] = int(mem["configured_bytes"]) - int(mem["pool_bytes"])
            pool[name] = int(mem["pool_entries"])
    return static, pool


def make_service(topology, memory_bytes: int | dict[str, int] | None,
                 policy: str = "cooperative",
                 net=None, telemetry_period_s: float = DEFAULT_TELEMETRY_PERIOD_S,
                 reap_period_s: float = DEFAULT_REAP_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic,
                 journal: str | os.PathLike | None = None,
                 quotas: dict | None = None, probation: bool | None = None) -> ProviderService:
    """A service for ``topology`` (a ``TestbedTopo``, a ``TestbedNet`` or a ``describe()``
    dict) whose programmable switches have ``memory_bytes`` of static aggregator memory each
    (or per switch; None: what the engines of ``net`` report, :func:`engine_memory`),
    planning with ``policy`` and the flow model. With ``net`` (a running ``TestbedNet``, or
    the ``AttachedNet`` of a network another process runs) it collects telemetry from its
    engines and configures its switches. ``journal``: an SQLite file the service keeps its
    state in and resumes from (``testbed.provider.journal``). ``quotas``: per tenant (``"*"``
    for every other one), a :class:`~testbed.provider.manager.Quota` or its fields.
    ``probation``: claims rank a job for switch memory only once telemetry judged them
    (:class:`~testbed.provider.manager.FabricManager`); default: where there is telemetry to
    judge them with (``net``); False takes hints on trust."""
    # Function-level import: the manager and policies load the flow model and its kernels.
    from testbed.provider.manager import inventory_of
    from testbed.provider.policies import PlanModel

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
    if memory_bytes is None and net is None:
        raise ValueError("memory_bytes: give the switches' aggregator memory, or a running "
                         "network (net=) whose engines report it")
    static, pool = engine_memory(net) if net is not None else ({}, 0)
    topo = getattr(topology, "topo", topology)
    desc = topo if isinstance(topo, dict) else topo.describe()
    inventory = inventory_of(desc, static if memory_bytes is None else memory_bytes, pool)
    try:
        model = PlanModel(desc)
    except (ValueError, KeyError, TypeError):
        model = None  # e.g. unshaped links: plans without predictions
    # hints are judged on a network's counters: there, claims are on probation till then
    manager = FabricManager(inventory, policy, model, quotas,
                            probation=net is not None if probation is None else probation)
    mem = {s.name: s.memory_bytes for s in inventory.switches}
    telemetry = Telemetry(desc, mem, float(getattr(net, "time_dilation", 1.0) or 1.0)) \
        if net is not None else None
    switches = SwitchConfigurator(net) if net is not None else None
    return ProviderService(manager, telemetry, switches, telemetry_period_s, reap_period_s,
                           clock, None if journal is None else Journal(journal))
