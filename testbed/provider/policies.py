"""Offload policies: who decides a job's plan, and from what (one small class each).

Every policy answers the same question (:class:`~testbed.provider.schema.Policy`): given the
admitted jobs, in admission order, and the fabric snapshot, what plan does each job get? They
differ in what they may look at:

* :class:`TenantOnly`: the provider exposes nothing; each tenant runs a ring allreduce without
  compression (what NCCL would do on a fabric it cannot see).
* :class:`ProviderOnly`: the provider sees the fabric but no hints: in-network aggregation
  first come, first served while switch memory lasts (a static partition on the job's
  lowest common ancestor switch), no compression (the tolerance is unknown), ring otherwise.
* :class:`Cooperative`: hints, telemetry and the flow model: for every job the candidate plans
  its tolerance allows (ring; ring with a summable compressor, with error feedback for
  ``lossy_ef``; INA on a one-switch or hierarchical tree; INA + THC), each costed by the
  flow-level model on the fabric's rates minus the load telemetry shows; switch memory goes
  to the jobs whose total communication time it shortens most (time saved per iteration x
  iterations x (1 + priority)), the others take their best plan that needs no memory. Then
  the plans are priced **together** (the jobs' allreduces sharing the links at once,
  :meth:`PlanModel.joint_s`) and each job in turn moves to the candidate that lowers every
  job's weighted time most: a plan priced alone does not see what it costs the jobs beside
  it (INA through the spine a ring's flows take shares an uplink with them; through the
  other spine it does not). Where the manager judges hints against telemetry, claims not
  judged yet rank nothing (probation: such jobs take memory after the judged ones, in
  admission order, at priority 0).
* :class:`CooperativeAlone`: the cooperative policy with every job's plans priced alone (no
  joint refinement): the baseline pricing the jobs together is measured against.
* :class:`CooperativeNoCongestion`: the cooperative policy without congestion re-plans (the
  manager counts the episodes and keeps the plans): the baseline congestion re-plans are
  measured against.
* :class:`Oracle`: the best static plan per job, found offline: it knows every job of the
  trace in advance and searches every combination of candidate plans that fits the switches'
  memory for the smallest total communication time, the jobs priced together; it never
  re-plans.

Every policy's ``predicted_comm_s`` is the joint price: each job's time while all the jobs it
is planned with run at once. The snapshot a :class:`~testbed.provider.manager.FabricManager`
gives a policy is its telemetry less what the admitted jobs' own traffic explains
(:func:`background`): the jobs are modelled themselves, so their bytes are not counted twice.

Shared pools: where a tree's switches have a shared pool (``SwitchState.pool_entries``), the
cooperative policy and the oracle may also plan INA in shared mode (ATP's best-effort
aggregation): it takes no static memory, so it competes with the memory-free plans (ring,
compression) on its predicted time; its window is the fair share of the smallest pool on its
tree beside the other shared-mode jobs there (:func:`shared_windows`, the cap the data path's
registration applies), and it is priced as the flow model's INA with that window times
:data:`SHARED_MARGIN` (what the model misses of a small window and the host fallback's
rounds, measured).

A compressor is "within the error budget" when its relative L2 error, measured here on a
standard normal vector (:func:`compressor_error`), is at most the job's ``error_budget``
(default :data:`DEFAULT_BUDGET` of its tolerance).

Trimming: a job whose tenant says its workers run the UET-like transport
(``Hints.transports``) may get its ring over UET, with trimming on the programmable switch
ports its packets cross (:mod:`testbed.provider.trimming` turns those ports into UET trimming
ports while the plan runs). The sum stays exact (a cut packet is NACKed and resent), so any
tolerance allows it; the model prices the ring's packets sprayed over every ECMP path (where
a TCP ring's flows may collide on one), times :data:`UET_MARGIN`. The trimmed exchange
(``trim_head_bits``, trimming as lossy compression) is not planned: through one port it moves
every worker's gradient and loses to the ring for every job the policies see.

The topology view (which switch each host hangs off, which switches join them) is read from
the snapshot's links, so it holds for any fabric: a job's trees are rooted at the switches
nearest to all of its edge switches (a leaf-spine's spines, a fat-tree's core switches for a
job across pods), each alone or above the edge switches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Collection

import numpy as np

from testbed.collectives import flowmodel
from testbed.collectives.algorithms import is_offloaded
from testbed.collectives.spec import CollectiveSpec, communication_of
from testbed.provider.schema import FabricSnapshot, Hints, JobRequest, Plan
from testbed.topologies.base import LinkImpairment

#: Aggregator slots a policy reserves per tree switch (the job's INA window).
SLOTS = 32
#: int32 lanes per slot set of a plain INA job (256 elements per packet).
INT32_LANES = 256
#: Error budget (relative L2 error of one allreduce) assumed when a tolerant job gives none:
#: error feedback keeps the residual, so ``lossy_ef`` tolerates a coarser compressor.
DEFAULT_BUDGET = {"lossy": 0.05, "lossy_ef": 0.25}
#: Ring compressors a tolerant job may get (all summable: reduced on the ring in their wire
#: type), coarsest first; INA compresses with THC only.
RING_COMPRESSORS = (("thc", {"granularity": 16}), ("thc", {"granularity": 32}),
                    ("thc", {"granularity": 64}), ("bf16", {}), ("fp16", {}))
INA_COMPRESSORS = (("thc", {"granularity": 16}), ("thc", {"granularity": 32}),
                   ("thc", {"granularity": 64}))
#: A link's residual rate never drops below this share of its rate (telemetry may report a
#: link as full; the model needs a positive rate).
MIN_RESIDUAL = 0.05
#: A joint prediction (:meth:`PlanModel.joint_s`) runs every job's allreduce over and over
#: until each job has ended this many.
JOINT_REPEATS = 2
#: A job moves to another plan in the joint refinement only when that lowers the weighted
#: total time of every job by more than this share (ties keep the plan priced alone best).
JOINT_GAIN = 0.02
#: A shared-mode INA plan is priced at the flow model's time times this. The model
#: underestimates a small INA allreduce (measured 1.28x at 150 packets on a 3-switch tree),
#: and a shared plan's window (a fair share of a small pool: a few slots) meets round trips
#: under load longer than the idle hop latency the model takes, plus the host fallback's
#: rounds. Without it, on ``cloud_cheater`` at 50 Mb/s a shared plan the model priced even
#: with the ring measured 1.20x the ring's JCT (``bench cooperation``).
SHARED_MARGIN = 1.3
#: A ring over the UET-like transport is priced at the flow model's time times this: its
#: sender is Python, packet by packet, and on these 2-core machines it runs CPU-bound
#: (measured 1.20-1.24x the model on a 4:1 leaf-spine of 8 hosts at dilation 4, where TCP's
#: ring measured 1.06-1.08x), so a UET plan must win by more than that to be chosen.
UET_MARGIN = 1.25
#: A link's queue drops (``LinkState.drop_rate``) are priced as loss from this share of its
#: packets on (fewer are noise: a burst that overflowed once).
MIN_DROP_RATE = 1e-4
#: Predictions a PlanModel keeps (then it starts afresh).
CACHE_ENTRIES = 20_000


@functools.lru_cache(maxsize=64)
def compressor_error(name: str, params: tuple = (), elems: int = 4096, seed: int = 0) -> float:
    """Relative L2 error of compressing then decompressing a standard normal vector of
    ``elems`` float32 with compressor ``name`` and ``params`` (sorted (key, value) pairs)."""
    # Function-level import: the compressors load Numba kernels; a policy that never
    # compresses (and the schema users) should not pay for them.
    from testbed.kernels.compressors import get_compressor

    comp = get_compressor(name, **dict(params))
    x = np.random.default_rng(seed).standard_normal(elems).astype(np.float32)
    payload, ctx = comp.compress(x, 0)
    y = comp.decompress(payload, ctx)
    return float(np.linalg.norm(y - x) / np.linalg.norm(x))


def budget(hints: Hints) -> float | None:
    """The relative error a job tolerates, or None when it must be exact (or said nothing)."""
    if hints.tolerance in (None, "exact"):
        return None
    return hints.error_budget if hints.error_budget is not None else DEFAULT_BUDGET[
        hints.tolerance]


def slot_lanes(plan: Plan, n: int) -> int:
    """Registers per slot set the data path reserves for ``plan`` with ``n`` workers: 256
    int32 lanes, or THC's int8 lanes per packet."""
    if plan.compressor is None:
        return INT32_LANES
    # Function-level import: the INA client loads Numba kernels.
    from testbed.collectives.ina import thc_elems

    return thc_elems(n, int(plan.compressor_params.get("granularity", 16)))


def plan_memory(plan: Plan, n: int) -> dict[str, int]:
    """Aggregator bytes ``plan`` reserves on each switch of its tree (static mode:
    ``slots x 2 sets x lanes x 4`` bytes, as the data path's admission counts them)."""
    if not is_offloaded(plan.algo) or plan.mode != "static" or not isinstance(plan.tree,
                                                                               list):
        return {}
    each = plan.slots * 2 * slot_lanes(plan, n) * 4
    return dict.fromkeys(plan.tree, each)


class FabricView:
    """The topology as a snapshot shows it: each host's edge switch, switch adjacency, and
    the candidate aggregation trees of a set of hosts."""

    def __init__(self, snapshot: FabricSnapshot):
        self.snapshot = snapshot
        self.switches = {s.name: s for s in snapshot.switches}
        hosts = set(snapshot.hosts)
        self.edge: dict[str, str] = {}
        self.adj: dict[str, set[str]] = {}
        for link in snapshot.links:
            if link.src in hosts and link.dst in self.switches:
                self.edge[link.src] = link.dst
            elif link.src in self.switches and link.dst in self.switches:
                self.adj.setdefault(link.src, set()).add(link.dst)

    def trees(self, hosts: list[str], pool: bool = False) -> list[list[str]]:
        """Candidate trees of ``hosts``, each root first (as the data path takes a list of
        switches, :mod:`testbed.topologies.aggtree`): their one edge switch; else for each
        root, that switch alone and the hierarchical tree (it, then the other edge switches,
        whose partial sums cross any switch between unchanged). The roots are the switches
        that every edge switch reaches in the fewest hops: on a leaf-spine the spines
        (adjacent to all), on a fat-tree the aggregation switches of one pod's job, the core
        switches of a job across pods, on a dumbbell either edge switch. Only programmable
        switches with static memory (with ``pool``: with a shared pool)."""
        if any(h not in self.edge for h in hosts):
            return []
        edges = sorted({self.edge[h] for h in hosts})
        ok = {n for n, s in self.switches.items()
              if s.programmable and (s.pool_entries if pool else s.memory_bytes) > 0}
        if len(edges) == 1:
            return [edges] if edges[0] in ok else []
        far = self._farthest_edge(edges)
        reach = {r: far[r] for r in ok if r in far}
        nearest = min(reach.values(), default=None)
        roots = sorted(r for r, d in reach.items() if d == nearest)
        out = [[r] for r in roots]
        if all(e in ok for e in edges):
            out += [[r, *(e for e in edges if e != r)] for r in roots]
        return out

    def _farthest_edge(self, edges: list[str]) -> dict[str, int]:
        """Switch -> hops to the farthest of ``edges`` (switches some edge cannot reach are
        left out)."""
        dist: dict[str, int] = {}
        reached: dict[str, int] = {}
        for e in edges:  # breadth-first from each edge switch
            seen, frontier = {e: 0}, [e]
            while frontier:
                nxt = []
                for f in frontier:
                    for n in self.adj.get(f, ()):
                        if n not in seen:
                            seen[n] = seen[f] + 1
                            nxt.append(n)
                frontier = nxt
            for n, k in seen.items():
                dist[n] = max(dist.get(n, 0), k)
                reached[n] = reached.get(n, 0) + 1
        return {n: k for n, k in dist.items() if reached[n] == len(edges)}

    def can_trim(self, hosts: list[str]) -> bool:
        """Whether a UET ring of ``hosts`` may be planned: one rank per host (the transport's
        receive port is the host's) and every host's edge switch programmable (its ports can
        trim; a fabric switch that cannot only forwards the sprayed packets)."""
        return len(set(hosts)) == len(hosts) and all(
            h in self.edge and self.switches[self.edge[h]].programmable for h in hosts)

    def free(self, taken: dict[str, int]) -> dict[str, int]:
        """Static memory left per switch once ``taken`` (switch -> bytes) is reserved."""
        return {n: s.memory_bytes - taken.get(n, 0) for n, s in self.switches.items()}


def shared_slots(view: FabricView, tree: list[str], sharers: int) -> int:
    """The window a shared-mode INA plan on ``tree`` gets with ``sharers`` shared-mode jobs on
    its busiest switch, this one counted: the fair share of the smallest pool
    (:func:`testbed.collectives.ina.fair_share_slots`, the cap the data path's registration
    applies too)."""
    # Function-level import: the INA client loads Numba kernels.
    from testbed.collectives.ina import fair_share_slots

    return min(fair_share_slots(SLOTS, view.switches[s].pool_entries, sharers - 1)
               for s in tree)


def shared_windows(plans: dict[str, Plan], snapshot: FabricSnapshot) -> dict[str, Plan]:
    """``plans`` with each shared-mode INA plan's window at its fair share of the pools beside
    the other shared-mode plans on its switches (a candidate is priced as if it shared with
    one other job; once the plans are chosen their number is known)."""
    shared = [p for p in plans.values() if _shared(p) and isinstance(p.tree, list)]
    if not shared:
        return plans
    view = FabricView(snapshot)
    on = {s: sum(s in p.tree for p in shared) for s in view.switches}
    out = dict(plans)
    for p in shared:
        slots = min(shared_slots(view, [s], on[s]) for s in p.tree)
        if slots != p.slots:
            out[p.job] = p.model_copy(update={"slots": slots, "reason": p.reason + (
                f"; window {slots}: its fair share of the pools beside "
                f"{max(on[s] for s in p.tree) - 1} other shared job(s)")})
    return out


def _add(taken: dict[str, int], mem: dict[str, int]) -> dict[str, int]:
    out = dict(taken)
    for k, v in mem.items():
        out[k] = out.get(k, 0) + v
    return out


def _fits(view: FabricView, taken: dict[str, int], mem: dict[str, int]) -> bool:
    free = view.free(taken)
    return all(free.get(k, -1) >= v for k, v in mem.items())


class PlanModel:
    """The flow-level model of plans on the fabric: one iteration's communication time of a
    job alone (:meth:`comm_s`, :func:`flowmodel.predict`) or of jobs running at once and
    sharing links (:meth:`joint_s`, :func:`flowmodel.predict_concurrent`), on the link rates
    minus the utilisation the snapshot's telemetry shows (the busier direction of each link)
    and with the loss, duplication and reordering it shows (``LinkState.impairment``) and the
    share of packets its queues drop (``LinkState.drop_rate``, priced as loss: a TCP ring
    through a dropping queue stalls, a UET ring through trimming ports does not: its packets
    are cut and resent within a round trip, ``LinkImpairment.cuts_trimmable``; an ``impair``
    stage's random loss stalls either).
    :meth:`link_bytes` says where a plan's bytes go, which :func:`own_traffic` turns into
    what a job's own traffic explains of each link and :func:`background` takes out of a
    snapshot, so that jobs priced together are not also counted as telemetry's load."""

    def __init__(self, topology, hop_latency_s: float | None = None):
        from testbed.topologies import routing

        topo = routing.as_topology(topology)
        self.describe = topology if isinstance(topology, dict) else topo.describe()
        self.hop_latency_s = hop_latency_s
        self._cache: dict = {}

    def _desc(self, snapshot: FabricSnapshot | None) -> tuple[dict, tuple, list]:
        """(the topology with each link's rate less its telemetry's utilisation, a key of
        that load for the cache, the links' impairments)."""
        util: dict[frozenset, float] = {}
        links_now = snapshot.links if snapshot is not None else []
        for link in links_now:
            if link.utilisation > 0:
                k = frozenset((link.src, link.dst))
                util[k] = max(util.get(k, 0.0), min(link.utilisation, 1.0))
        imps = [lk.impairment for lk in links_now if lk.impairment is not None]
        # a queue that drops loses packets as an impairment does (the model combines the
        # records of a link; its direction kept, so the impairment's duplicates count alike)
        imps += [LinkImpairment(lk.src, lk.dst, loss=lk.drop_rate, direction=getattr(
            lk.impairment, "direction", "egress"), cuts_trimmable=True) for lk in links_now
            if lk.drop_rate >= MIN_DROP_RATE]
        ikey = tuple(sorted(dataclasses.astuple(i) for i in imps))
        if not util:
            return self.describe, ikey, imps
        links = []
        for s in self.describe["links"]:
            u = util.get(frozenset((s["a"], s["b"])), 0.0)
            bw = s["bw_mbps"]
            links.append({**s, "bw_mbps": bw if bw is None else bw * max(1 - u, MIN_RESIDUAL)})
        key = tuple(sorted((tuple(sorted(k)), round(v, 3)) for k, v in util.items()))
        return {**self.describe, "links": links}, key + ikey, imps

    def _spec(self, req: JobRequest, plan: Plan, nbytes: int, job_id: int = 1,
              repetitions: int = 1) -> CollectiveSpec:
        """The collective one iteration of ``req`` runs under ``plan``: an allreduce of
        ``nbytes`` (rounded up to whole float32), ``repetitions`` times back to back."""
        place = _placement(plan)
        return CollectiveSpec(op="allreduce", nbytes=4 * -(-int(nbytes) // 4),
                              **communication_of(plan), placement=place, job_id=job_id,
                              repetitions=repetitions,
                              window=max(plan.slots, 1) if place else 64)

    @staticmethod
    def _plan_key(req: JobRequest, plan: Plan) -> tuple:
        return (tuple(req.hosts), req.hints.collective_bytes, plan.algo, str(plan.tree),
                plan.slots, plan.mode, plan.compressor,
                tuple(sorted(plan.compressor_params.items())), plan.error_feedback,
                plan.transport)

    def comm_s(self, req: JobRequest, plan: Plan, snapshot: FabricSnapshot | None = None,
               job_id: int = 1) -> float | None:
        """Predicted seconds of one iteration's allreduce of ``req`` under ``plan`` alone on
        the fabric; None when the job gave no ``collective_bytes`` or the model does not
        apply."""
        nbytes = req.hints.collective_bytes
        if nbytes is None:
            return None
        desc, key, imps = self._desc(snapshot)
        pkey = (self._plan_key(req, plan), job_id, key)
        if pkey in self._cache:
            return self._cache[pkey]
        try:
            t = flowmodel.predict(desc, self._spec(req, plan, nbytes, job_id),
                                  workers=list(req.hosts), hop_latency_s=self.hop_latency_s,
                                  impairments=imps).time_s
        except (ValueError, KeyError):
            t = None  # the model does not apply to this plan here (e.g. unshaped links)
        t = _margin(plan, t)
        self._keep(pkey, t)
        return t

    def joint_s(self, pairs: list[tuple[JobRequest, Plan]],
                snapshot: FabricSnapshot | None = None) -> list[float | None]:
        """Predicted seconds of one iteration's allreduce of each job of ``pairs`` (its
        request and plan) while they all run at once and share the fabric's links
        (:func:`flowmodel.predict_concurrent`, on the link rates less the utilisation of
        ``snapshot``: traffic no job of ``pairs`` explains). The steady state of jobs that
        each run allreduce after allreduce: every job starts its allreduce over until each
        has ended :data:`JOINT_REPEATS` of them, and a job's time is the mean of those that
        ended until then (all of them ran beside every other job). A job without bytes
        (or where the model does not apply) is left out of the others' traffic and gets
        None; a job alone gets :meth:`comm_s`."""
        alone = [self.comm_s(req, plan, snapshot) for req, plan in pairs]
        idx = [i for i, t in enumerate(alone) if t is not None and t > 0]
        if len(idx) < 2:
            return alone
        desc, key, imps = self._desc(snapshot)
        jkey = ("joint", tuple(self._plan_key(*pairs[i]) for i in idx), key)
        if jkey not in self._cache:
            try:
                # job id 1 each, as comm_s and link_bytes: the provider does not know the
                # ports a tenant binds, and one job's ECMP paths must not change with the
                # jobs it is priced beside
                jobs = [flowmodel.ConcurrentJob(
                    self._spec(pairs[i][0], pairs[i][1], pairs[i][0].hints.collective_bytes),
                    list(pairs[i][0].hosts)) for i in idx]
                ends: list[list[float]] = []
                flowmodel.predict_concurrent(desc, jobs, hop_latency_s=self.hop_latency_s,
                                             rep_ends=ends, until_each=JOINT_REPEATS,
                                             impairments=imps)
                # until every job ended JOINT_REPEATS allreduces, every job was sending
                stop = max(e[min(JOINT_REPEATS, len(e)) - 1] for e in ends)
                self._keep(jkey, [_margin(pairs[i][1], inside[-1] / len(inside))
                                  for i, e in zip(idx, ends, strict=True)
                                  for inside in [[x for x in e if x <= stop * (1 + 1e-9)]]])
            except (ValueError, KeyError):
                self._keep(jkey, [alone[i] for i in idx])  # priced alone, as a last resort
        out = list(alone)
        for i, t in zip(idx, self._cache[jkey], strict=True):
            out[i] = t
        return out

    def _alone(self, req: JobRequest, plan: Plan, nbytes: int):
        """The model's prediction of one allreduce of ``nbytes`` by ``req``'s hosts under
        ``plan`` on the idle fabric (None where the model does not apply)."""
        try:
            return flowmodel.predict(self.describe, self._spec(req, plan, nbytes),
                                     workers=list(req.hosts),
                                     hop_latency_s=self.hop_latency_s)
        except (ValueError, KeyError):
            return None

    def link_bytes(self, req: JobRequest, plan: Plan) -> dict[tuple[str, str], float] | None:
        """Wire bytes one allreduce of the job's ``collective_bytes`` under ``plan`` puts on
        each directed link, as the model routes it (data, and TCP ACKs on their own path);
        None without bytes or where the model does not apply."""
        nbytes = req.hints.collective_bytes
        key = ("links", self._plan_key(req, plan))
        if key not in self._cache:  # asked at every telemetry snapshot, for every job
            self._keep(key, self._link_bytes(req, plan, nbytes) if nbytes else None)
        return self._cache[key]

    def _keep(self, key, value) -> None:
        # keyed by plans and telemetry, which change all the time in a long-running service
        if len(self._cache) >= CACHE_ENTRIES:
            self._cache.clear()
        self._cache[key] = value

    def _link_bytes(self, req: JobRequest, plan: Plan, nbytes: int):
        pred = self._alone(req, plan, nbytes)
        return None if pred is None else pred.link_bytes()

    def sent_bytes(self, req: JobRequest, plan: Plan, nbytes: int) -> dict[str, float] | None:
        """Wire bytes each host of ``req`` sends in one allreduce of ``nbytes`` under
        ``plan``, as the model has it (None where the model does not apply)."""
        pred = self._alone(req, plan, nbytes)
        if pred is None:
            return None
        sent = pred.sent_bytes()
        return {h: sent.get(h, 0.0) for h in req.hosts}


def own_traffic(model: PlanModel, jobs: list[tuple[JobRequest, Plan]],
                snapshot: FabricSnapshot) -> dict[str, dict[tuple[str, str], float]]:
    """Per job of ``jobs`` (its request and the plan it runs), the share of each directed
    link's rate its own traffic explains in ``snapshot``: the model's bytes per link of one
    allreduce under its plan (:meth:`PlanModel.link_bytes`), times the allreduces per second
    its hosts' uplinks carry now (their utilisation x rate over the model's bytes on them; a
    host belongs to one job). A job whose hosts send nothing now, or that gives no bytes,
    explains nothing."""
    links = {(lk.src, lk.dst): lk for lk in snapshot.links}
    out = {}
    for req, plan in jobs:
        per = model.link_bytes(req, plan)
        up = [k for k in (per or {}) if k[0] in req.hosts and k in links]
        model_sent = sum(per[k] for k in up) if per else 0.0
        now_sent = sum(links[k].utilisation * links[k].rate_mbps for k in up)  # Mb/s
        if model_sent <= 0 or now_sent <= 0:
            continue
        per_s = now_sent * 1e6 / 8 / model_sent  # allreduces a second, as the uplinks show
        out[req.job] = {k: b * per_s * 8 / 1e6 / links[k].rate_mbps
                        for k, b in per.items() if k in links}
    return out


def explained(model: PlanModel, jobs: list[tuple[JobRequest, Plan]],
              snapshot: FabricSnapshot) -> dict[tuple[str, str], float]:
    """Per directed link, the share of its rate the own traffic of ``jobs`` (each job's
    request and the plan it runs) explains together in ``snapshot`` (:func:`own_traffic`)."""
    out: dict[tuple[str, str], float] = {}
    for shares in own_traffic(model, jobs, snapshot).values():
        for k, v in shares.items():
            out[k] = out.get(k, 0.0) + v
    return out


def background(model: PlanModel, jobs: list[tuple[JobRequest, Plan]],
               snapshot: FabricSnapshot) -> FabricSnapshot:
    """``snapshot`` with each link's utilisation less what the own traffic of ``jobs``
    explains (:func:`explained`, never below 0): the load of everything else (another
    provider's tenants, bursts, jobs that gave no bytes), on which :meth:`PlanModel.joint_s`
    prices ``jobs`` together."""
    explained_ = explained(model, jobs, snapshot)
    if not explained_:
        return snapshot
    links = [lk.model_copy(update={"utilisation": max(
        0.0, lk.utilisation - explained_.get((lk.src, lk.dst), 0.0))}) for lk in snapshot.links]
    return snapshot.model_copy(update={"links": links})


def _placement(plan: Plan) -> dict:
    """``CollectiveSpec.placement`` of an offloaded plan (empty for the others)."""
    if not is_offloaded(plan.algo):
        return {}
    return {"tree": plan.tree if plan.tree is not None else "single",
            "slots": max(plan.slots, 1), "mode": plan.mode}


def _ring(job: str, reason: str) -> Plan:
    return Plan(job=job, algo="ring", reason=reason)


class _Base:
    """Shared by the policies: the model (optional) and predicted times on plans."""

    name = ""
    #: the cooperative policy with one of its parts switched off, for comparison (not run by
    #: a co-operation trace that names no policies)
    baseline = False

    def __init__(self, model: PlanModel | None = None):
        self.model = model

    def predicted(self, req: JobRequest, plan: Plan, snapshot: FabricSnapshot | None) -> Plan:
        """``plan`` with the model's ``predicted_comm_s`` (None without a model)."""
        t = self.model.comm_s(req, plan, snapshot) if self.model is not None else None
        return plan.model_copy(update={"predicted_comm_s": t})

    def together(self, jobs: list[JobRequest], plans: dict[str, Plan],
                 snapshot: FabricSnapshot | None) -> dict[str, Plan]:
        """``plans`` (one per job of ``jobs``) with the model's times of the jobs running at
        once (:meth:`PlanModel.joint_s`) as ``predicted_comm_s``."""
        plans = shared_windows(plans, snapshot)
        if self.model is None:
            return {j.job: plans[j.job] for j in jobs}
        times = self.model.joint_s([(j, plans[j.job]) for j in jobs], snapshot)
        return {j.job: plans[j.job].model_copy(update={"predicted_comm_s": t})
                for j, t in zip(jobs, times, strict=True)}

    def weighted_s(self, jobs: list[JobRequest], plans: dict[str, Plan],
                   snapshot: FabricSnapshot | None) -> float:
        """The jobs' total communication time under ``plans`` priced together: each job's
        joint time x its weight (iterations x (1 + priority)); a job with bytes whose plan
        the model cannot price costs infinity, one without bytes nothing."""
        priced = [j for j in jobs if j.hints.collective_bytes is not None]
        times = self.model.joint_s([(j, plans[j.job]) for j in priced], snapshot)
        return sum(_cost(t) * _weight(j) for j, t in zip(priced, times, strict=True))


class TenantOnly(_Base):
    """Ring allreduce, no compression, for every job: the tenant sees no fabric."""

    name = "tenant_only"

    def plan(self, jobs: list[JobRequest], snapshot: FabricSnapshot) -> dict[str, Plan]:
        """Ring for every job."""
        return self.together(jobs, {j.job: _ring(j.job, "tenant default: ring, no compression")
                                    for j in jobs}, snapshot)


class ProviderOnly(_Base):
    """INA first come, first served while switch memory lasts; no compression; else ring."""

    name = "provider_only"

    def plan(self, jobs: list[JobRequest], snapshot: FabricSnapshot) -> dict[str, Plan]:
        """In admission order: the first candidate tree (one switch, the lowest common
        ancestor) that still has memory, else ring."""
        view = FabricView(snapshot)
        taken: dict[str, int] = {}
        out = {}
        for j in jobs:
            plan = _ring(j.job, "switch memory full: ring")
            for tree in view.trees(j.hosts)[:1]:
                cand = Plan(job=j.job, algo="ina", tree=tree, slots=SLOTS,
                            reason="first come, first served: INA while memory lasts")
                mem = plan_memory(cand, len(j.hosts))
                if _fits(view, taken, mem):
                    taken, plan = _add(taken, mem), cand
                    break
            out[j.job] = plan
        return self.together(jobs, out, snapshot)


def candidates(req: JobRequest, view: FabricView) -> list[Plan]:
    """Every plan a job's hints allow: ring; ring over UET with trimming where its workers run
    that transport and its edge switches are programmable; ring with each summable compressor
    within its error budget (error feedback for ``lossy_ef``), over UET too where the plain
    ring may be; INA on each candidate tree;
    INA + THC within the budget; INA on the shared pools of each tree whose switches have one
    (no static memory: its window is a fair share of the pools, the rounds they cannot hold go
    to the job's host fallbacks; priced as INA with that window)."""
    job, b = req.job, budget(req.hints)
    ef = req.hints.tolerance == "lossy_ef"
    out = [_ring(job, "ring")]
    uet = "uet" in req.hints.transports and view.can_trim(req.hosts)
    if uet:
        out.append(Plan(job=job, algo="ring", transport="uet", reason="ring over UET, "
                        "trimming on the ports its packets cross (sprayed over every path)"))
    for name, params in RING_COMPRESSORS if b is not None else ():
        err = compressor_error(name, tuple(sorted(params.items())))
        if err <= b:
            why = f"ring + {name} {params} (error {err:.3g} <= budget {b:g})"
            out.append(Plan(job=job, algo="ring", compressor=name, compressor_params=params,
                            error_feedback=ef, reason=why))
            if uet:
                out.append(Plan(job=job, algo="ring", compressor=name,
                                compressor_params=params, error_feedback=ef, transport="uet",
                                reason=f"{why} over UET, trimming on its ports"))
    for tree in view.trees(req.hosts):
        out.append(Plan(job=job, algo="ina", tree=tree, slots=SLOTS, reason=f"INA on {tree}"))
        for name, params in INA_COMPRESSORS if b is not None else ():
            err = compressor_error(name, tuple(sorted(params.items())))
            if err <= b:
                lanes = slot_lanes(Plan(job=job, compressor=name, compressor_params=params),
                                   len(req.hosts))
                slots = max(1, SLOTS * INT32_LANES // lanes)  # the same bytes in flight
                out.append(Plan(job=job, algo="ina", tree=tree, slots=slots, compressor=name,
                                compressor_params=params, reason=f"INA + {name} {params} on "
                                f"{tree} (error {err:.3g} <= budget {b:g})"))
    for tree in view.trees(req.hosts, pool=True):
        out.append(Plan(job=job, algo="ina", tree=tree, mode="shared",
                        slots=shared_slots(view, tree, 2),
                        reason=f"INA on the shared pools of {tree} (no static memory; "
                        "rounds the pools cannot hold: host fallback)"))
    return out


def _cost(t: float | None) -> float:
    return math.inf if t is None else t


def _key(plan: Plan) -> tuple[float, float]:
    """Order of preference: predicted time, then (equal times) the smaller compression error."""
    err = 0.0 if plan.compressor is None else compressor_error(
        plan.compressor, tuple(sorted(plan.compressor_params.items())))
    return _cost(plan.predicted_comm_s), err


def _margin(plan: Plan, t: float | None) -> float | None:
    """The model's time ``t`` of ``plan`` as a policy prices it (:data:`SHARED_MARGIN`,
    :data:`UET_MARGIN`)."""
    if t is None:
        return t
    if _shared(plan):
        return t * SHARED_MARGIN
    return t * UET_MARGIN if plan.transport == "uet" else t


def _shared(plan: Plan) -> bool:
    """Whether ``plan`` aggregates on the shared pools (the tier after static memory)."""
    return is_offloaded(plan.algo) and plan.mode == "shared"


def _weight(req: JobRequest) -> float:
    """How much a second of a job's iteration is worth: its iterations x (1 + priority)."""
    return (req.hints.iterations or 1) * (1 + req.hints.priority)


class Cooperative(_Base):
    """Hints + telemetry + the flow model: memory to the jobs it helps most, compression only
    within a job's error budget (see the module docstring)."""

    name = "cooperative"
    #: refine the plans priced together (:meth:`_refine`)
    joint = True
    #: plan INA on the shared pools where a job gets no static memory
    pools = True
    #: honours the manager's probation (``plan(..., unverified=)``)
    probation = True

    def plan(self, jobs: list[JobRequest], snapshot: FabricSnapshot,
             unverified: Collection[str] = ()) -> dict[str, Plan]:
        """Best memory-free plan per job; then, by weighted time saved, the best plan that
        needs memory, where it still fits. ``unverified``: jobs on probation (their hints
        not judged against telemetry yet), in the order they may take memory
        (:meth:`~testbed.provider.manager.FabricManager.unverified`): after every judged
        job, whatever their claims say, and their priority counts as 0."""
        if unverified:
            jobs = [j.model_copy(update={"hints": j.hints.model_copy(update={"priority": 0})})
                    if j.job in unverified else j for j in jobs]
        view = FabricView(snapshot)
        best_free: dict[str, Plan] = {}
        best_mem: dict[str, Plan] = {}
        every: dict[str, list[Plan]] = {}
        for j in jobs:
            cands = every[j.job] = [self.predicted(j, c, snapshot) for c in candidates(j, view)
                                    if self.pools or not _shared(c)]
            free = [c for c in cands if not plan_memory(c, len(j.hosts)) and not _shared(c)]
            best_free[j.job] = min(free, key=_key)
            mem = sorted((c for c in cands if plan_memory(c, len(j.hosts))), key=_key)
            if mem and _cost(mem[0].predicted_comm_s) < _cost(best_free[j.job].predicted_comm_s):
                best_mem[j.job] = mem  # type: ignore[assignment]
        by_job = {j.job: j for j in jobs}

        def saving(name: str) -> float:
            gain = _cost(best_free[name].predicted_comm_s) - _cost(
                best_mem[name][0].predicted_comm_s)  # type: ignore[index]
            return (gain if math.isfinite(gain) else 0.0) * _weight(by_job[name])

        taken: dict[str, int] = {}
        out = dict(best_free)
        order = sorted((n for n in best_mem if n not in unverified), key=saving, reverse=True)
        for name in order + [n for n in unverified if n in best_mem]:
            for c in best_mem[name]:  # type: ignore[union-attr]
                if _cost(c.predicted_comm_s) >= _cost(best_free[name].predicted_comm_s):
                    break
                mem = plan_memory(c, len(by_job[name].hosts))
                if _fits(view, taken, mem):
                    taken, out[name] = _add(taken, mem), c
                    break
        for name, p in out.items():
            if name in best_mem and out[name] is best_free[name]:
                out[name] = p.model_copy(update={"reason": p.reason + "; no switch memory "
                                                 "left for its INA plans"})
        for name, p in list(out.items()):  # no static memory: the shared pools, if faster
            if not plan_memory(p, len(by_job[name].hosts)):
                pooled = sorted((c for c in every[name] if _shared(c)), key=_key)
                if pooled and _cost(pooled[0].predicted_comm_s) < _cost(p.predicted_comm_s):
                    out[name] = pooled[0]
        return self.together(jobs, self._refine(jobs, out, every, view, snapshot), snapshot)

    def _refine(self, jobs: list[JobRequest], out: dict[str, Plan], cands: dict[str, list[Plan]],
                view: FabricView, snapshot: FabricSnapshot) -> dict[str, Plan]:
        """Each job in turn (heaviest first, twice over) takes the candidate that lowers the
        jobs' weighted total time priced together (:meth:`weighted_s`) most, where it fits
        the memory the others hold, if by more than :data:`JOINT_GAIN`: plans priced alone
        miss what one job's plan costs the others sharing its links (INA or compression
        takes its bytes off a shared core)."""
        if not self.joint or self.model is None or sum(
                j.hints.collective_bytes is not None for j in jobs) < 2:
            return out
        by_job = {j.job: j for j in jobs}
        best = self.weighted_s(jobs, out, snapshot)
        for _ in range(2):
            moved = False
            for j in sorted(jobs, key=_weight, reverse=True):
                if j.hints.collective_bytes is None:
                    continue
                taken: dict[str, int] = {}
                for other, p in out.items():
                    if other != j.job:
                        taken = _add(taken, plan_memory(p, len(by_job[other].hosts)))
                pick, pick_cost = None, best * (1 - JOINT_GAIN)
                for c in cands[j.job]:
                    if c.predicted_comm_s is None or c == out[j.job] or \
                            not _fits(view, taken, plan_memory(c, len(j.hosts))):
                        continue
                    cost = self.weighted_s(jobs, {**out, j.job: c}, snapshot)
                    if cost < pick_cost:
                        pick, pick_cost = c, cost
                if pick is not None:
                    out = {**out, j.job: pick.model_copy(update={
                        "reason": pick.reason + f"; priced with the jobs sharing its links "
                        f"(weighted total {best:.4g} s -> {pick_cost:.4g} s)"})}
                    best, moved = pick_cost, True
            if not moved:
                break
        return out


class CooperativeAlone(Cooperative):
    """The cooperative policy that prices each job's plans alone (no joint refinement): the
    baseline that shows what pricing the jobs together is worth."""

    name = "cooperative_alone"
    joint = False
    baseline = True


class CooperativeStatic(Cooperative):
    """The cooperative policy without the shared pools (static memory or none): the baseline
    that shows what planning INA on the pools is worth."""

    name = "cooperative_static"
    pools = False
    baseline = True


class CooperativeNoCongestion(Cooperative):
    """The cooperative policy that does not re-plan on congestion (arrivals, departures and
    hints it still does): the baseline that shows what congestion re-plans are worth."""

    name = "cooperative_no_congestion"
    congestion_replans = False
    baseline = True


class Oracle(_Base):
    """The best static plan per job of a known trace (see the module docstring): computed
    once, on the first call, over every job of ``trace`` as if they all overlapped."""

    name = "oracle"

    def __init__(self, model: PlanModel | None = None, trace: list[JobRequest] | None = None):
        super().__init__(model)
        self.trace = list(trace or [])
        self._plans: dict[str, Plan] | None = None

    def _search(self, jobs: list[JobRequest], snapshot: FabricSnapshot) -> dict[str, Plan]:
        view = FabricView(snapshot)
        options = []
        for j in jobs:
            cands = [self.predicted(j, c, snapshot) for c in candidates(j, view)]
            free = min((c for c in cands if not plan_memory(c, len(j.hosts))
                        and not _shared(c)), key=_key)
            better = sorted((c for c in cands if _cost(c.predicted_comm_s)
                             < _cost(free.predicted_comm_s)), key=_key)
            mem = [c for c in better if plan_memory(c, len(j.hosts))]
            options.append([free] + mem[:4] + [c for c in better if _shared(c)][:1])
        best, best_cost = None, math.inf
        for combo in itertools.product(*options):
            taken: dict[str, int] = {}
            ok = True
            for j, c in zip(jobs, combo, strict=True):
                mem = plan_memory(c, len(j.hosts))
                if not _fits(view, taken, mem):
                    ok = False
                    break
                taken = _add(taken, mem)
            if not ok:
                continue
            plans = {j.job: c for j, c in zip(jobs, combo, strict=True)}
            cost = self.weighted_s(jobs, plans, snapshot) if self.model is not None else 0.0
            if cost < best_cost:
                best, best_cost = combo, cost
        chosen = best if best is not None else tuple(o[0] for o in options)
        return {j.job: c.model_copy(update={"reason": "oracle: best static plan of the "
                                            "trace; " + c.reason})
                for j, c in zip(jobs, chosen, strict=True)}

    def plan(self, jobs: list[JobRequest], snapshot: FabricSnapshot) -> dict[str, Plan]:
        """The precomputed static plans (jobs outside the trace: searched among themselves)."""
        if self._plans is None:
            self._plans = self._search(self.trace or list(jobs), snapshot)
        missing = [j for j in jobs if j.job not in self._plans]
        if missing:
            self._plans.update(self._search(missing, snapshot))
        return self.together(jobs, self._plans, snapshot)


#: Policies by name.
POLICIES = {c.name: c for c in (TenantOnly, ProviderOnly, Cooperative, CooperativeAlone,
                                 CooperativeStatic, CooperativeNoCongestion, Oracle)}


def make_policy(name: str, model: PlanModel | None = None, **kw):
    """The policy called ``name`` (:data:`POLICIES`), with the flow model ``model``."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](model, **kw)
