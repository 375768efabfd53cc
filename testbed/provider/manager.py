"""The fabric manager's state: admitted jobs, their leases and plans, switch memory, the log.

:class:`FabricManager` is plain in-process state with no HTTP and no threads (the service
wraps it and serialises calls; the cooperation experiment drives it directly). Time is an
argument of every call (``now``, seconds on any monotonic clock), so tests and traces replay
exactly.

* :meth:`~FabricManager.admit` validates a :class:`~testbed.provider.schema.JobRequest`
  (hints version, hosts of the inventory, hosts not held by another job, job name unused),
  asks the policy for every job's plan with the newcomer included, checks the plans (one per
  job, static switch memory within each switch's configured memory) and only then changes
  state. Every refusal raises a :class:`ProviderError` whose ``status`` is the HTTP code the
  service answers (404 unknown job, 409 conflict, 422 bad request, 503 the policy gave no
  feasible plan) and leaves the state exactly as it was.
* :meth:`~FabricManager.release` and :meth:`~FabricManager.expire` (leases that ran out: a
  tenant that vanished) remove jobs, reclaim their memory and re-plan the others;
  :meth:`~FabricManager.renew` extends a lease by the job's ``lease_s``.
* :meth:`~FabricManager.observe` takes telemetry. A directed link is **congested** in a
  snapshot when its utilisation is at least :data:`CONGESTED_UTIL` or its drop or trim
  counter grew since the previous snapshot; congestion is **sustained** after
  :data:`SUSTAINED_SNAPSHOTS` consecutive congested snapshots. When a link on a job's paths
  (its hosts' access links and the links between its edge switches and the switches that
  join them) becomes sustained-congested, every job is re-planned on the new telemetry,
  once per episode (the count restarts when the link is quiet again).
* Every plan change (admission, re-plan, departure) is appended to :attr:`FabricManager.log`
  with its time, job, old and new plan and the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from testbed.provider.policies import FabricView, PlanModel, make_policy, plan_memory
from testbed.provider.schema import (
    HINTS_VERSION,
    FabricSnapshot,
    JobRequest,
    LinkState,
    Plan,
    SwitchState,
)

#: A link at or above this utilisation (0..1) in a snapshot is congested.
CONGESTED_UTIL = 0.9
#: Consecutive congested snapshots that make congestion sustained (a re-plan).
SUSTAINED_SNAPSHOTS = 3


class ProviderError(ValueError):
    """A request the manager refused; nothing changed. ``status``: the HTTP code for it."""

    status = 400


class UnknownJob(ProviderError):
    """No admitted job has this name."""

    status = 404


class Conflict(ProviderError):
    """The job name is taken, or a host belongs to another job."""

    status = 409


class BadRequest(ProviderError):
    """The request names hosts the fabric lacks or a hints version the manager cannot read."""

    status = 422


class NoFeasiblePlan(ProviderError):
    """The policy's plans do not fit the fabric (a bug of the policy, or a fabric too small)."""

    status = 503


def inventory_of(topology, memory_bytes: int | dict[str, int]) -> FabricSnapshot:
    """The inventory of a topology (a ``TestbedTopo`` or its ``describe()`` dict): its hosts,
    every switch (programmable ones with ``memory_bytes`` of static aggregator memory: one
    number for all, or per switch name) and both directions of every shaped link."""
    desc = topology if isinstance(topology, dict) else topology.describe()
    prog = set(desc.get("programmable", []))
    mem = memory_bytes if isinstance(memory_bytes, dict) else dict.fromkeys(prog, memory_bytes)
    switches = [SwitchState(name=n, memory_bytes=int(mem.get(n, 0)) if n in prog else 0,
                            programmable=n in prog) for n in desc["switches"]]
    links = []
    for s in desc["links"]:
        if s.get("bw_mbps"):
            links += [LinkState(src=s["a"], dst=s["b"], rate_mbps=s["bw_mbps"]),
                      LinkState(src=s["b"], dst=s["a"], rate_mbps=s["bw_mbps"])]
    return FabricSnapshot(topology=desc["kind"], hosts=list(desc["hosts"]), switches=switches,
                          links=links)


@dataclass(frozen=True)
class PlanChange:
    """One entry of the plan log: at ``time_s`` job ``job`` went from ``old`` to ``new``
    (None: not admitted / gone) because of ``reason``."""

    time_s: float
    job: str
    old: Plan | None
    new: Plan | None
    reason: str

    def to_json(self) -> dict:
        """Plain dict (the plans as dicts)."""
        return {"time_s": self.time_s, "job": self.job, "reason": self.reason,
                "old": None if self.old is None else self.old.model_dump(),
                "new": None if self.new is None else self.new.model_dump()}


@dataclass
class _Lease:
    req: JobRequest
    admitted_s: float
    expires_s: float


def same_offload(a: Plan | None, b: Plan | None) -> bool:
    """Whether two plans configure the same offload (reason and prediction aside)."""
    if a is None or b is None:
        return a is b
    skip = {"reason", "predicted_comm_s"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


class FabricManager:
    """Admission, plans, leases and telemetry of one fabric (see the module docstring).

    ``inventory``: the fabric (hosts, switches with their static aggregator memory, links
    with their rates). ``policy``: a policy object or its name
    (:data:`testbed.provider.policies.POLICIES`). ``model``: the flow model plans are costed
    with (:class:`~testbed.provider.policies.PlanModel`; None: no predictions), handed to a
    policy given by name and used to fill ``predicted_comm_s`` a policy left empty.
    """

    def __init__(self, inventory: FabricSnapshot, policy, model: PlanModel | None = None):
        if not isinstance(inventory, FabricSnapshot):
            raise TypeError(f"inventory must be a FabricSnapshot, got {type(inventory).__name__}")
        self.inventory = inventory
        self.model = model
        self.policy = make_policy(policy, model) if isinstance(policy, str) else policy
        self.snapshot = inventory
        self.log: list[PlanChange] = []
        self._jobs: dict[str, _Lease] = {}
        self._plans: dict[str, Plan] = {}
        self._hot: dict[tuple[str, str], int] = {}
        self._switches = {s.name: s for s in inventory.switches}
        self._hosts = set(inventory.hosts)

    # ---------------------------------------------------------------- queries

    def plans(self) -> dict[str, Plan]:
        """Current plan per admitted job."""
        return dict(self._plans)

    def jobs(self) -> dict[str, dict]:
        """Admitted jobs: hosts, hints, lease times."""
        return {name: {"hosts": list(ls.req.hosts), "hints": ls.req.hints.model_dump(),
                       "lease_s": ls.req.lease_s, "admitted_s": ls.admitted_s,
                       "expires_s": ls.expires_s} for name, ls in self._jobs.items()}

    def memory(self) -> dict[str, dict]:
        """Per switch: ``configured`` bytes, ``allocated`` bytes per job, ``free`` bytes."""
        alloc = self._allocations(self._plans)
        return {name: {"configured": s.memory_bytes, "allocated": dict(alloc.get(name, {})),
                       "free": s.memory_bytes - sum(alloc.get(name, {}).values())}
                for name, s in self._switches.items()}

    def congested(self) -> dict[str, int]:
        """Links congested in the latest snapshots: ``"src->dst"`` -> consecutive snapshots
        (:data:`SUSTAINED_SNAPSHOTS` or more: sustained)."""
        return {f"{a}->{b}": k for (a, b), k in sorted(self._hot.items())}

    def fabric(self) -> FabricSnapshot:
        """The latest snapshot with this manager's allocations in each switch's state."""
        alloc = self._allocations(self._plans)
        switches = [SwitchState(name=s.name, memory_bytes=s.memory_bytes,
                                programmable=s.programmable,
                                allocated_bytes=dict(alloc.get(s.name, {})))
                    for s in self.inventory.switches]
        return self.snapshot.model_copy(update={"switches": switches})

    # ---------------------------------------------------------------- changes

    def admit(self, req: JobRequest, now: float | None = None) -> Plan:
        """Admit ``req`` and return its plan (other jobs may be re-planned and logged).
        Raises a :class:`ProviderError` with nothing changed when it cannot."""
        now = time.monotonic() if now is None else float(now)
        if not isinstance(req, JobRequest):
            raise BadRequest(f"expected a JobRequest, got {type(req).__name__}")
        if req.hints.version != HINTS_VERSION:
            raise BadRequest(f"hints version {req.hints.version} is not supported; send "
                             f"version {HINTS_VERSION}")
        if req.job in self._jobs:
            raise Conflict(f"job {req.job!r} is already admitted; release it first or pick "
                           "another name")
        unknown = [h for h in req.hosts if h not in self._hosts]
        if unknown:
            raise BadRequest(f"hosts {unknown} are not hosts of fabric "
                             f"{self.inventory.topology!r} (it has {sorted(self._hosts)})")
        if len(set(req.hosts)) != len(req.hosts):
            raise BadRequest(f"hosts {req.hosts} name a host twice")
        held = {h: name for name, ls in self._jobs.items() for h in ls.req.hosts}
        busy = sorted({h for h in req.hosts if h in held})
        if busy:
            raise Conflict(f"hosts {busy} belong to job(s) "
                           f"{sorted({held[h] for h in busy})}; a job needs hosts of its own")
        reqs = [ls.req for ls in self._jobs.values()] + [req]
        new = self._compute(reqs)
        self._jobs[req.job] = _Lease(req, now, now + req.lease_s)
        self._commit(new, now, {req.job: "admitted"}, f"re-plan on arrival of {req.job}")
        return self._plans[req.job]

    def renew(self, job: str, now: float | None = None) -> float:
        """Extend ``job``'s lease to ``now + lease_s``; returns the new expiry time."""
        now = time.monotonic() if now is None else float(now)
        ls = self._lease(job)
        ls.expires_s = now + ls.req.lease_s
        return ls.expires_s

    def release(self, job: str, now: float | None = None) -> None:
        """Remove ``job``, reclaim its switch memory and re-plan the others."""
        now = time.monotonic() if now is None else float(now)
        self._lease(job)
        self._remove([job], now, "released")

    def expire(self, now: float | None = None) -> list[str]:
        """Remove every job whose lease ran out by ``now`` (its memory reclaimed, the others
        re-planned); returns their names."""
        now = time.monotonic() if now is None else float(now)
        gone = [name for name, ls in self._jobs.items() if ls.expires_s <= now]
        if gone:
            self._remove(gone, now, "lease expired")
        return gone

    def observe(self, snapshot: FabricSnapshot, now: float | None = None) -> list[str]:
        """Take a telemetry snapshot; re-plan when congestion on a job's links becomes
        sustained. Returns the jobs whose plan changed."""
        now = time.monotonic() if now is None else float(now)
        if not isinstance(snapshot, FabricSnapshot):
            raise BadRequest(f"expected a FabricSnapshot, got {type(snapshot).__name__}")
        prev = {(lk.src, lk.dst): lk for lk in self.snapshot.links}
        newly: list[tuple[str, str]] = []
        hot: dict[tuple[str, str], int] = {}
        for lk in snapshot.links:
            key = (lk.src, lk.dst)
            p = prev.get(key)
            grew = p is not None and (lk.drops > p.drops or lk.trims > p.trims)
            if lk.utilisation >= CONGESTED_UTIL or grew:
                hot[key] = self._hot.get(key, 0) + 1
                if hot[key] == SUSTAINED_SNAPSHOTS:
                    newly.append(key)
        self._hot = hot
        self.snapshot = snapshot
        if not newly or not self._jobs:
            return []
        hit = sorted({name for name, ls in self._jobs.items()
                      for key in newly if key in self._job_links(ls.req)})
        if not hit:
            return []
        links = ", ".join(f"{a}->{b}" for a, b in newly)
        reason = (f"sustained congestion on {links} ({SUSTAINED_SNAPSHOTS} snapshots at "
                  f">= {CONGESTED_UTIL:.0%} or with drops), links of {', '.join(hit)}")
        before = dict(self._plans)
        try:
            new = self._compute([ls.req for ls in self._jobs.values()])
        except NoFeasiblePlan:
            return []  # keep the running plans: they fit, a re-plan that does not is no gain
        self._commit(new, now, {}, reason)
        return [j for j in self._plans if not same_offload(before.get(j), self._plans[j])]

    # ---------------------------------------------------------------- internals

    def _lease(self, job: str) -> _Lease:
        if job not in self._jobs:
            raise UnknownJob(f"no admitted job {job!r} (admitted: {sorted(self._jobs)})")
        return self._jobs[job]

    def _remove(self, names: list[str], now: float, why: str) -> None:
        for name in names:
            old = self._plans.pop(name, None)
            del self._jobs[name]
            self.log.append(PlanChange(now, name, old, None, why))
        try:
            new = self._compute([ls.req for ls in self._jobs.values()])
        except NoFeasiblePlan:
            return  # the remaining plans fitted before and still do
        self._commit(new, now, {}, f"re-plan on departure of {', '.join(names)}")

    def _job_links(self, req: JobRequest) -> set[tuple[str, str]]:
        """Directed links a job's traffic may cross: its hosts' access links and the links
        between its edge switches and the switches adjacent to all of them."""
        view = FabricView(self.inventory)
        nodes = set(req.hosts) | {view.edge[h] for h in req.hosts if h in view.edge}
        for tree in view.trees(req.hosts):
            nodes |= set(tree)
        return {(lk.src, lk.dst) for lk in self.inventory.links
                if lk.src in nodes and lk.dst in nodes}

    def _allocations(self, plans: dict[str, Plan]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for name, plan in plans.items():
            n = len(self._jobs[name].req.hosts) if name in self._jobs else 2
            for sw, b in plan_memory(plan, n).items():
                out.setdefault(sw, {})[name] = b
        return out

    def _compute(self, reqs: list[JobRequest]) -> dict[str, Plan]:
        """The policy's plans for ``reqs``, checked; raises :class:`NoFeasiblePlan`."""
        if not reqs:
            return {}
        snap = self.fabric()
        try:
            plans = self.policy.plan(list(reqs), snap)
        except (ValueError, KeyError) as e:
            raise NoFeasiblePlan(f"policy {self.policy.name!r} failed: {e}") from None
        names = {r.job for r in reqs}
        if set(plans) != names or any(plans[n].job != n for n in names):
            raise NoFeasiblePlan(f"policy {self.policy.name!r} planned {sorted(plans)} for "
                                 f"jobs {sorted(names)}")
        used: dict[str, int] = {}
        for r in reqs:
            for sw, b in plan_memory(plans[r.job], len(r.hosts)).items():
                if sw not in self._switches:
                    raise NoFeasiblePlan(f"plan of {r.job!r} uses switch {sw!r}, not a switch "
                                         "of the fabric")
                used[sw] = used.get(sw, 0) + b
        over = {sw: b for sw, b in used.items() if b > self._switches[sw].memory_bytes}
        if over:
            raise NoFeasiblePlan(f"policy {self.policy.name!r} reserves more than the memory "
                                 f"of {sorted(over)}: " + ", ".join(
                                     f"{sw} {b} B > {self._switches[sw].memory_bytes} B"
                                     for sw, b in sorted(over.items())))
        by = {r.job: r for r in reqs}
        if self.model is not None:
            plans = {n: p if p.predicted_comm_s is not None else p.model_copy(update={
                "predicted_comm_s": self.model.comm_s(by[n], p, snap)}) for n, p in plans.items()}
        return plans

    def _commit(self, new: dict[str, Plan], now: float, first: dict[str, str],
                reason: str) -> None:
        for name, plan in new.items():
            old = self._plans.get(name)
            if name in first:
                self.log.append(PlanChange(now, name, None, plan,
                                           f"{first[name]}: {plan.reason}"))
            elif not same_offload(old, plan):
                self.log.append(PlanChange(now, name, old, plan, f"{reason}: {plan.reason}"))
            self._plans[name] = plan
