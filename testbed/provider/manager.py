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
  snapshot when its utilisation is at least :data:`CONGESTED_UTIL` with at least
  :data:`FOREIGN_SHARE` of its rate not explained by the admitted jobs' own traffic
  (:func:`~testbed.provider.policies.own_traffic`: an allreduce fills its links itself, and
  jobs sharing a link are priced together when they are planned), or
  its drop or trim counter grew since the previous snapshot; congestion is **sustained**
  after :data:`SUSTAINED_SNAPSHOTS` consecutive congested snapshots. When a link on a job's
  paths (its hosts' access links and the links between its edge switches and the switches
  that join them) becomes sustained-congested, every job is re-planned on the new telemetry,
  once per episode (the count restarts when the link is quiet again); a policy with
  ``congestion_replans = False`` (``cooperative_no_congestion``) counts the episodes and
  keeps the plans.
* Every plan change (admission, re-plan, departure) is appended to :attr:`FabricManager.log`
  with its time, job, old and new plan and the reason, and raises the job's plan version
  (:meth:`~FabricManager.plan_version`: what a tenant waiting for a pushed plan compares).
  A change carries the iteration from which it applies (:meth:`~FabricManager.applies_at`):
  :data:`APPLY_AFTER_ITERATIONS` after the last iteration the tenant reported in a renew, so
  that every rank, reading the same number, switches at the same boundary.
* :meth:`~FabricManager.state` / :meth:`~FabricManager.restore` give and take the whole state
  (jobs, leases, plans, log) as JSON-able data: the service journals it
  (``testbed.provider.journal``) so that a restarted provider resumes its jobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from testbed.provider.policies import (
    FabricView,
    PlanModel,
    background,
    explained,
    make_policy,
    plan_memory,
)
from testbed.provider.schema import (
    HINTS_VERSION,
    FabricSnapshot,
    Hints,
    JobRequest,
    LinkState,
    Plan,
    SwitchState,
)

#: A link at or above this utilisation (0..1) in a snapshot is congested, when at least
#: FOREIGN_SHARE of its rate is traffic that the admitted jobs do not explain as their own
#: (:func:`~testbed.provider.policies.own_traffic`): an allreduce fills its links itself,
#: and jobs sharing links were priced together when they were planned, which is no reason
#: to move them; a flow no policy planned is.
CONGESTED_UTIL = 0.9
FOREIGN_SHARE = 0.2
#: Consecutive congested snapshots that make congestion sustained (a re-plan).
SUSTAINED_SNAPSHOTS = 3
#: A plan change applies this many iterations after the last one the tenant reported: one
#: iteration for the change to reach every rank, which then switch at the same boundary.
APPLY_AFTER_ITERATIONS = 2
#: Hints are judged on the bytes a job's hosts sent over this many of its iterations under
#: one plan (counters read as it reports them: an iteration of lag at either end is within
#: HINT_FACTOR's margin at this length).
CHECK_ITERATIONS = 5
#: A job whose hosts send more than this factor above or below what its hints make the model
#: expect (per iteration, under its plan) has misreported its hints.
HINT_FACTOR = 3.0


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


class QuotaExceeded(ProviderError):
    """The request goes beyond its tenant's quota (jobs, priority)."""

    status = 403


class NoFeasiblePlan(ProviderError):
    """The policy's plans do not fit the fabric (a bug of the policy, or a fabric too small)."""

    status = 503


def inventory_of(topology, memory_bytes: int | dict[str, int],
                 pool_entries: int | dict[str, int] = 0) -> FabricSnapshot:
    """The inventory of a topology (a ``TestbedTopo`` or its ``describe()`` dict): its hosts,
    every switch (programmable ones with ``memory_bytes`` of static aggregator memory and
    ``pool_entries`` entries of shared pool: one number for all, or per switch name) and both
    directions of every shaped link."""
    desc = topology if isinstance(topology, dict) else topology.describe()
    prog = set(desc.get("programmable", []))
    mem = memory_bytes if isinstance(memory_bytes, dict) else dict.fromkeys(prog, memory_bytes)
    pool = pool_entries if isinstance(pool_entries, dict) else dict.fromkeys(prog,
                                                                              pool_entries)
    switches = [SwitchState(name=n, memory_bytes=int(mem.get(n, 0)) if n in prog else 0,
                            pool_entries=int(pool.get(n, 0)) if n in prog else 0,
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

    @classmethod
    def from_json(cls, d: dict) -> PlanChange:
        """The entry :meth:`to_json` gave."""
        return cls(float(d["time_s"]), d["job"],
                   None if d["old"] is None else Plan.model_validate(d["old"]),
                   None if d["new"] is None else Plan.model_validate(d["new"]), d["reason"])


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold (None: no limit), as SHARP reservations bound a tenant's
    trees: ``jobs`` admitted at once, ``priority`` the highest its hints may claim,
    ``memory_bytes`` static aggregator memory per switch over its jobs, ``trees_per_switch``
    its INA jobs registered on one switch. A plan beyond the memory or tree quota is not
    refused: the tenant's newest jobs that overrun it run on the hosts (ring) instead."""

    jobs: int | None = None
    priority: int | None = None
    memory_bytes: int | None = None
    trees_per_switch: int | None = None

    def __post_init__(self):
        for name in ("jobs", "priority", "memory_bytes", "trees_per_switch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"quota {name} must be an integer >= 0 or None, got {v!r}")


@dataclass
class _Lease:
    req: JobRequest
    admitted_s: float
    expires_s: float
    iteration: int | None = None  # the last iteration the tenant reported (renew)
    #: the request with the figures telemetry observed, once its hints were found wrong
    effective: JobRequest | None = None
    #: the hints check: declared and observed bytes, their ratio, the verdict
    check: dict | None = None
    #: (bytes its hosts had sent, iteration, plan version) when its counters were first read
    #: under its current plan
    baseline: tuple[int, int, int] | None = None
    #: the plan version the job said all its workers run (renew ``running``), if it says
    running: int | None = None
    #: (plan version, iteration) of the job's first report under a plan it was given before
    #: it reported any iteration: that plan is in force from a few iterations later
    first_seen: tuple[int, int] | None = None

    @property
    def planned(self) -> JobRequest:
        """What the policy plans with: the request, or its observed figures."""
        return self.effective or self.req

    @property
    def tenant(self) -> str:
        return tenant_of(self.req)


def tenant_of(req: JobRequest) -> str:
    """The tenant a request belongs to (a job without one is a tenant of its own)."""
    return req.tenant or req.job


def same_offload(a: Plan | None, b: Plan | None) -> bool:
    """Whether two plans configure the same offload (reason and prediction aside)."""
    if a is None or b is None:
        return a is b
    skip = {"reason", "predicted_comm_s"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


def uplink_bytes(snapshot: FabricSnapshot, view: FabricView) -> dict[str, int]:
    """Per host, the bytes its uplink (host -> edge switch) carried so far in ``snapshot``
    (a host telemetry cannot read is left out)."""
    up = {(lk.src, lk.dst): lk.bytes for lk in snapshot.links}
    return {h: up[(h, e)] for h, e in view.edge.items() if (h, e) in up}


class FabricManager:
    """Admission, plans, leases and telemetry of one fabric (see the module docstring).

    ``inventory``: the fabric (hosts, switches with their static aggregator memory, links
    with their rates). ``policy``: a policy object or its name
    (:data:`testbed.provider.policies.POLICIES`). ``model``: the flow model plans are costed
    with (:class:`~testbed.provider.policies.PlanModel`; None: no predictions), handed to a
    policy given by name and used to fill ``predicted_comm_s`` a policy left empty.

    ``probation``: the caller judges hints against telemetry (:meth:`check_hints` or
    :meth:`observe`), so a job's claims rank it for static memory only once they were judged
    (:meth:`unverified`): until then a policy that honours probation (``policy.probation``)
    hands static memory out in admission order, whatever the claims say. A claim nobody
    checked yet is worth nothing against another job: with it, a tenant claiming ten times
    its bytes and the top priority held the partition an honest job arriving with it would
    have had until the lie was caught, and the honest job lost 13 % of its completion time
    (``testbed bench cooperation --traces cloud_cheater --rates 50``).
    """

    def __init__(self, inventory: FabricSnapshot, policy, model: PlanModel | None = None,
                 quotas: dict[str, Quota] | None = None, probation: bool = False):
        if not isinstance(inventory, FabricSnapshot):
            raise TypeError(f"inventory must be a FabricSnapshot, got {type(inventory).__name__}")
        self.inventory = inventory
        self.model = model
        #: per tenant (``"*"``: every tenant without its own entry)
        self.quotas = {t: q if isinstance(q, Quota) else Quota(**q)
                       for t, q in (quotas or {}).items()}
        self.policy = make_policy(policy, model) if isinstance(policy, str) else policy
        self.probation = probation
        self.snapshot = inventory
        self.log: list[PlanChange] = []
        self._jobs: dict[str, _Lease] = {}
        self._plans: dict[str, Plan] = {}
        self._hot: dict[tuple[str, str], int] = {}
        self._switches = {s.name: s for s in inventory.switches}
        self._hosts = set(inventory.hosts)
        #: raised by every change of jobs, leases or plans (what the service journals)
        self.version = 0
        self._plan_versions: dict[str, int] = {}
        self._applies_at: dict[str, int | None] = {}

    # ---------------------------------------------------------------- queries

    def plans(self) -> dict[str, Plan]:
        """Current plan per admitted job."""
        return dict(self._plans)

    def plan_version(self, job: str) -> int:
        """How many times ``job``'s plan changed since admission (1: the first plan); 0 for a
        job that is not admitted. Read without the service's lock by waiting tenants."""
        return self._plan_versions.get(job, 0)

    def applies_at(self, job: str) -> int | None:
        """The iteration from which ``job``'s current plan applies (None: from the next
        iteration boundary, the tenant reported no iteration)."""
        self._lease(job)
        return self._applies_at.get(job)

    def jobs(self) -> dict[str, dict]:
        """Admitted jobs: hosts, hints, lease times."""
        return {name: {"hosts": list(ls.req.hosts),
                       "hints": ls.req.hints.model_dump(mode="json"),
                       "lease_s": ls.req.lease_s, "admitted_s": ls.admitted_s,
                       "expires_s": ls.expires_s, "iteration": ls.iteration,
                       "plan_version": self._plan_versions.get(name, 0),
                       "applies_at": self._applies_at.get(name), "tenant": ls.tenant,
                       "hints_check": ls.check,
                       "planned_hints": ls.planned.hints.model_dump(mode="json")}
                for name, ls in self._jobs.items()}

    def quota(self, tenant: str) -> Quota:
        """The quota of ``tenant`` (its own, else ``"*"``'s, else none)."""
        return self.quotas.get(tenant, self.quotas.get("*", Quota()))

    def tenants(self) -> dict[str, dict]:
        """Per tenant with a job: its jobs, static memory and INA jobs per switch, quota."""
        alloc = self._allocations(self._plans)
        out: dict[str, dict] = {}
        for name, ls in self._jobs.items():
            t = out.setdefault(ls.tenant, {"jobs": [], "memory_bytes": {},
                                           "trees_per_switch": {},
                                           "quota": vars(self.quota(ls.tenant))})
            t["jobs"].append(name)
            for sw, jobs in alloc.items():
                if name in jobs:
                    t["memory_bytes"][sw] = t["memory_bytes"].get(sw, 0) + jobs[name]
                    t["trees_per_switch"][sw] = t["trees_per_switch"].get(sw, 0) + 1
        return out

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
                                pool_entries=s.pool_entries, programmable=s.programmable,
                                allocated_bytes=dict(alloc.get(s.name, {})))
                    for s in self.inventory.switches]
        return self.snapshot.model_copy(update={"switches": switches})

    def planning_fabric(self) -> FabricSnapshot:
        """What a policy plans on: :meth:`fabric` with each link's utilisation less what the
        admitted jobs' own traffic explains (:func:`~testbed.provider.policies.background`;
        the policies price those jobs themselves, together)."""
        snap = self.fabric()
        return snap if self.model is None else background(self.model, self._running(), snap)

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
        tenant, quota = tenant_of(req), self.quota(tenant_of(req))
        if quota.priority is not None and req.hints.priority > quota.priority:
            raise QuotaExceeded(f"hints.priority {req.hints.priority} is above tenant "
                                f"{tenant!r}'s quota of {quota.priority}")
        mine = sorted(n for n, ls in self._jobs.items() if ls.tenant == tenant)
        if quota.jobs is not None and len(mine) >= quota.jobs:
            raise QuotaExceeded(f"tenant {tenant!r} holds {len(mine)} job(s) {mine}, its quota "
                                f"is {quota.jobs}; release one first")
        reqs = self._requests() + [req]
        new = self._compute(reqs)
        self._jobs[req.job] = _Lease(req, now, now + req.lease_s)
        self._commit(new, now, {req.job: "admitted"}, f"re-plan on arrival of {req.job}")
        return self._plans[req.job]

    def renew(self, job: str, now: float | None = None, iteration: int | None = None,
              running: int | None = None) -> float:
        """Extend ``job``'s lease to ``now + lease_s``; returns the new expiry time.
        ``iteration``: the last iteration the job finished (plan changes then apply
        :data:`APPLY_AFTER_ITERATIONS` later). ``running``: the plan version every worker
        of the job runs now (its hints are then judged only on iterations of the plan
        version they run)."""
        now = time.monotonic() if now is None else float(now)
        ls = self._lease(job)
        if running is not None:
            if isinstance(running, bool) or not isinstance(running, int) or \
                    not 1 <= running <= self._plan_versions.get(job, 0):
                raise BadRequest(f"running={running!r}: job {job!r} has had plan versions 1 "
                                 f"to {self._plan_versions.get(job, 0)}")
            ls.running = running
        if iteration is not None:
            if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
                raise BadRequest(f"iteration must be an integer >= 0, got {iteration!r}")
            if ls.iteration is not None and iteration < ls.iteration:
                raise BadRequest(f"iteration {iteration} of job {job!r} is before the last one "
                                 f"reported ({ls.iteration})")
            ls.iteration = iteration
        ls.expires_s = now + ls.req.lease_s
        self.version += 1
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
        # the share of each link the jobs' own bytes explain
        own = explained(self.model, self._running(), snapshot) if self.model is not None else {}
        for lk in snapshot.links:
            key = (lk.src, lk.dst)
            p = prev.get(key)
            grew = p is not None and (lk.drops > p.drops or lk.trims > p.trims)
            full = lk.utilisation >= CONGESTED_UTIL and \
                lk.utilisation - own.get(key, 0.0) >= FOREIGN_SHARE
            if full or grew:
                hot[key] = self._hot.get(key, 0) + 1
                if hot[key] == SUSTAINED_SNAPSHOTS:
                    newly.append(key)
        self._hot = hot
        self.snapshot = snapshot
        reasons = []
        judged = self._judged_reason(
            self._judge_hints(uplink_bytes(snapshot, FabricView(self.inventory))))
        if judged:
            reasons.append(judged)
        hit = sorted({name for name, ls in self._jobs.items()
                      for key in newly if key in self._job_links(ls.req)})
        if not getattr(self.policy, "congestion_replans", True):
            hit = []  # counted as episodes (congested()), never a reason to re-plan
        if hit:
            links = ", ".join(f"{a}->{b}" for a, b in newly)
            reasons.append(f"sustained congestion on {links} ({SUSTAINED_SNAPSHOTS} snapshots "
                           f"at >= {CONGESTED_UTIL:.0%} or with drops), links of "
                           f"{', '.join(hit)}")
        if not reasons:
            return []
        return self._replan(now, "; ".join(reasons))

    def update_hints(self, job: str, hints: dict, reason: str,
                     now: float | None = None) -> list[str]:
        """Replace fields of ``job``'s hints with ``hints`` (e.g. what its launcher measured
        of its first iterations) and re-plan every job on them, logged with ``reason``; the
        running plans stay when the policy finds none that fits. Returns the jobs whose plan
        changed."""
        now = time.monotonic() if now is None else float(now)
        ls = self._lease(job)
        try:
            merged = Hints(**{**ls.req.hints.model_dump(), **hints})
        except ValueError as e:
            raise BadRequest(f"hints of {job!r}: {e}") from None
        ls.req = ls.req.model_copy(update={"hints": merged})
        self.version += 1
        return self._replan(now, reason)

    def hints_pending(self) -> dict[str, list[str]]:
        """Jobs whose hints the manager would judge on fresh counters now (each reported an
        iteration, declared its bytes, has a plan and was not judged yet): job -> its hosts,
        whose uplink counters :meth:`check_hints` wants."""
        return {name: list(ls.req.hosts) for name, ls in self._jobs.items()
                if ls.check is None and ls.iteration is not None and name in self._plans
                and ls.req.hints.collective_bytes is not None}

    def check_hints(self, sent: dict[str, int], now: float | None = None) -> list[str]:
        """Judge hints on ``sent`` (per host, the bytes its uplink carried so far, read now:
        e.g. when a job reported an iteration) and re-plan every job when one is caught
        (logged as a disagreement with telemetry) or, on :attr:`probation`, when one is
        judged at all (its claims now rank it). Returns the jobs whose plan changed."""
        now = time.monotonic() if now is None else float(now)
        reason = self._judged_reason(self._judge_hints(sent))
        return self._replan(now, reason) if reason else []

    def _replan(self, now: float, reason: str) -> list[str]:
        """Re-plan every job, logged with ``reason``; the running plans stay when the policy
        finds none that fits (they fit: a re-plan that does not is no gain). Returns the jobs
        whose plan changed."""
        before = dict(self._plans)
        try:
            new = self._compute(self._requests())
        except NoFeasiblePlan:
            return []
        self._commit(new, now, {}, reason)
        return [j for j in self._plans if not same_offload(before.get(j), self._plans[j])]

    def unverified(self, reqs: list[JobRequest] | None = None) -> list[str]:
        """The jobs of ``reqs`` (default: the admitted ones; a request not admitted yet
        included) on probation: they declared their bytes and were not judged yet. In the
        order they may take static memory: those whose plan holds some first (no other
        unchecked claim takes it from them), then in admission order."""
        out = [r.job for r in (self._requests() if reqs is None else reqs)
               if r.hints.collective_bytes is not None
               and (r.job not in self._jobs or self._jobs[r.job].check is None)]
        holds = {j for j in out if j in self._plans and plan_memory(
            self._plans[j], len(self._jobs[j].req.hosts))}
        return sorted(out, key=lambda j: j not in holds)

    def _probation(self) -> bool:
        return self.probation and getattr(self.policy, "probation", False)

    def _judged_reason(self, judged: list[str]) -> str:
        """Why the verdicts just reached on ``judged`` re-plan, '' when they change nothing the
        policy plans on: a job caught misreporting, or any verdict while claims on probation
        rank nothing."""
        caught = [j for j in judged if self._jobs[j].check["verdict"] == "misreported"]
        kept = [j for j in judged if j not in caught]
        parts = []
        if caught:
            parts.append("hints disagree with telemetry: " + "; ".join(
                f"{j} declared {self._jobs[j].check['declared_bytes']:,} B/iteration, "
                f"observed {self._jobs[j].check['observed_bytes']:,} "
                f"({self._jobs[j].check['ratio']:.3g}x), re-planned on the observed "
                "figures with priority 0" for j in caught))
        if kept and self._probation():
            parts.append("hints confirmed by telemetry: " + "; ".join(
                f"{j} ({self._jobs[j].check['ratio']:.3g}x its declared bytes)"
                for j in kept) + ", its claims now rank it for switch memory")
        return "; ".join(parts)

    def _judge_hints(self, sent_by_host: dict[str, int]) -> list[str]:
        """Judge the hints of every job that reported :data:`CHECK_ITERATIONS` iterations
        under its current plan since its counters were first read (``sent_by_host``: per
        host, the bytes its uplink carried so far): the bytes its hosts sent per iteration
        against what the model expects of its declared ``collective_bytes`` under that plan.
        The count starts again when the plan changes (its bytes differ), from the iteration
        the new plan applies at. A job off by more than :data:`HINT_FACTOR` either way is
        re-planned on the observed figures (``collective_bytes`` scaled by the ratio) with
        priority 0: nothing observable backs a priority claim of a job shown to misreport.
        Returns the jobs judged now (``check["verdict"]`` says how); each job is judged
        once."""
        if self.model is None:
            return []
        judged = []
        for name, hosts in self.hints_pending().items():
            ls = self._jobs[name]
            if any(h not in sent_by_host for h in hosts):
                continue  # an uplink telemetry cannot read: no check
            sent = sum(int(sent_by_host[h]) for h in hosts)
            version = self._plan_versions.get(name, 0)
            if ls.running is not None and ls.running != version:
                ls.baseline = None  # it says it runs another plan still
                continue
            start = 0 if ls.running is not None else self._applies_at.get(name)
            if start is None and version > 1:  # changed before the job reported an
                # iteration: in force a few iterations after its first report
                if ls.first_seen is None or ls.first_seen[0] != version:
                    ls.first_seen = (version, ls.iteration)
                start = ls.first_seen[1] + APPLY_AFTER_ITERATIONS
            if start is None:
                start = 0  # the plan it was admitted with: its first from the start
            if ls.iteration < start:
                ls.baseline = None  # (maybe) still under the previous plan
                continue
            if ls.baseline is None or len(ls.baseline) < 3 or sent < ls.baseline[0] \
                    or ls.baseline[2] != version:  # first look, counters reset, a new plan
                ls.baseline = (sent, ls.iteration, version)
                continue
            iters = ls.iteration - ls.baseline[1]
            if iters < CHECK_ITERATIONS:
                continue
            declared = ls.req.hints.collective_bytes
            expected = self.model.sent_bytes(ls.req, self._plans[name], declared)
            if not expected or sum(expected.values()) <= 0:
                continue
            ratio = (sent - ls.baseline[0]) / iters / sum(expected.values())
            observed = max(1, round(declared * ratio))
            ls.check = {"declared_bytes": declared, "observed_bytes": observed,
                        "ratio": round(ratio, 4), "iterations": iters,
                        "verdict": "consistent" if 1 / HINT_FACTOR <= ratio <= HINT_FACTOR
                        else "misreported"}
            if ls.check["verdict"] == "misreported":
                hints = ls.req.hints.model_copy(update={"collective_bytes": observed,
                                                        "priority": 0})
                ls.effective = ls.req.model_copy(update={"hints": hints})
            judged.append(name)
        if judged:
            self.version += 1
        return judged

    # ---------------------------------------------------------------- internals

    def _requests(self) -> list[JobRequest]:
        """The admitted jobs' requests as the policy plans them (observed figures where the
        hints were found wrong), in admission order."""
        return [ls.planned for ls in self._jobs.values()]

    def _lease(self, job: str) -> _Lease:
        if job not in self._jobs:
            raise UnknownJob(f"no admitted job {job!r} (admitted: {sorted(self._jobs)})")
        return self._jobs[job]

    def _remove(self, names: list[str], now: float, why: str) -> None:
        for name in names:
            old = self._plans.pop(name, None)
            del self._jobs[name]
            self._plan_versions.pop(name, None)
            self._applies_at.pop(name, None)
            self.log.append(PlanChange(now, name, old, None, why))
        self.version += 1
        # the remaining plans fitted before and still do if the policy finds none now
        self._replan(now, f"re-plan on departure of {', '.join(names)}")

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
        snap = self.planning_fabric()
        try:
            if self._probation():
                plans = self.policy.plan(list(reqs), snap, unverified=self.unverified(reqs))
            else:
                plans = self.policy.plan(list(reqs), snap)
        except (ValueError, KeyError) as e:
            raise NoFeasiblePlan(f"policy {self.policy.name!r} failed: {e}") from None
        names = {r.job for r in reqs}
        if set(plans) != names or any(plans[n].job != n for n in names):
            raise NoFeasiblePlan(f"policy {self.policy.name!r} planned {sorted(plans)} for "
                                 f"jobs {sorted(names)}")
        plans = self._within_quotas(reqs, plans)
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

    def _running(self) -> list[tuple[JobRequest, Plan]]:
        """Every admitted job with a plan: its request and that plan."""
        return [(ls.req, self._plans[n]) for n, ls in self._jobs.items() if n in self._plans]

    def _within_quotas(self, reqs: list[JobRequest], plans: dict[str, Plan]) -> dict[str, Plan]:
        """``plans`` with every job that takes its tenant beyond its memory or tree quota
        on a switch moved to the hosts (ring), the tenant's earliest jobs keeping theirs."""
        out = dict(plans)
        used: dict[tuple[str, str], list[int]] = {}  # (tenant, switch) -> [bytes, trees]
        for r in reqs:
            tenant, q = tenant_of(r), self.quota(tenant_of(r))
            mem = plan_memory(out[r.job], len(r.hosts))
            over = []
            for sw, b in mem.items():
                u = used.get((tenant, sw), [0, 0])
                if q.memory_bytes is not None and u[0] + b > q.memory_bytes:
                    over.append(f"{sw}: {u[0] + b:,} B > its {q.memory_bytes:,} B")
                if q.trees_per_switch is not None and u[1] + 1 > q.trees_per_switch:
                    over.append(f"{sw}: {u[1] + 1} trees > its {q.trees_per_switch}")
            if over:
                out[r.job] = Plan(job=r.job, algo="ring", reason=f"tenant {tenant!r} quota "
                                  f"({'; '.join(over)}): ring on the hosts")
                continue
            for sw, b in mem.items():
                u = used.setdefault((tenant, sw), [0, 0])
                u[0], u[1] = u[0] + b, u[1] + 1
        return out

    def _commit(self, new: dict[str, Plan], now: float, first: dict[str, str],
                reason: str) -> None:
        for name, plan in new.items():
            old = self._plans.get(name)
            if name in first:
                self.log.append(PlanChange(now, name, None, plan,
                                           f"{first[name]}: {plan.reason}"))
            elif not same_offload(old, plan):
                why = "; ".join(filter(None, (reason, self._eased(name, old, plan, reason))))
                self.log.append(PlanChange(now, name, old, plan, f"{why}: {plan.reason}"))
            else:
                self._plans[name] = plan  # a new prediction or reason is not a change
                continue
            self._plans[name] = plan
            it = self._jobs[name].iteration
            self._applies_at[name] = None if it is None else it + APPLY_AFTER_ITERATIONS
            self._plan_versions[name] = self._plan_versions.get(name, 0) + 1
        self.version += 1

    def _eased(self, name: str, old: Plan, new: Plan, reason: str) -> str:
        """The congestion a job's new plan eases, '' when none: links congested in the
        latest snapshots on which it puts fewer bytes than its old plan did. The policy
        prices telemetry's load whatever asked for the re-plan, so a hints verdict reached
        while a burst is on a job's links may be what moves it off them; named here, such a
        move counts as a congestion re-plan whichever signal came first."""
        if self.model is None or "sustained congestion" in reason or \
                not getattr(self.policy, "congestion_replans", True):
            return ""
        req = self._jobs[name].req
        before, after = self.model.link_bytes(req, old), self.model.link_bytes(req, new) or {}
        eased = sorted(k for k in self._hot if (before or {}).get(k, 0) > after.get(k, 0))
        return "eases congestion on " + ", ".join(
            f"{a}->{b} ({self._hot[(a, b)]} snapshots)" for a, b in eased) if eased else ""

    # ---------------------------------------------------------------- persistence

    def state(self) -> dict:
        """Jobs (request, lease, last iteration), plans with their versions, and the log, as
        JSON-able data (:meth:`restore` takes it back)."""
        return {"topology": self.inventory.topology, "hosts": sorted(self._hosts),
                "jobs": {n: {"request": ls.req.model_dump(), "admitted_s": ls.admitted_s,
                             "expires_s": ls.expires_s, "iteration": ls.iteration,
                             "effective": None if ls.effective is None
                             else ls.effective.model_dump(),
                             "check": ls.check, "baseline": ls.baseline,
                             "running": ls.running}
                         for n, ls in self._jobs.items()},
                "plans": {n: p.model_dump() for n, p in self._plans.items()},
                "plan_versions": dict(self._plan_versions),
                "applies_at": dict(self._applies_at),
                "log": [c.to_json() for c in self.log]}

    def restore(self, state: dict) -> None:
        """Take the state :meth:`state` gave (a restarted provider's journal), replacing this
        manager's. ``ValueError`` naming the problem when it is not of this fabric (other
        hosts, a job without a plan): nothing changes then."""
        if state.get("topology") != self.inventory.topology or \
                set(state.get("hosts", ())) != self._hosts:
            raise ValueError(f"the journal is of fabric {state.get('topology')!r} with hosts "
                             f"{state.get('hosts')}, not of this one "
                             f"({self.inventory.topology!r}, {sorted(self._hosts)})")
        jobs = {n: _Lease(JobRequest.model_validate(j["request"]), float(j["admitted_s"]),
                          float(j["expires_s"]), j.get("iteration"),
                          None if j.get("effective") is None
                          else JobRequest.model_validate(j["effective"]),
                          j.get("check"),
                          None if j.get("baseline") is None else tuple(j["baseline"]),
                          j.get("running"))
                for n, j in state["jobs"].items()}
        plans = {n: Plan.model_validate(p) for n, p in state["plans"].items()}
        if set(plans) != set(jobs):
            raise ValueError(f"the journal's plans {sorted(plans)} are not those of its jobs "
                             f"{sorted(jobs)}")
        self._jobs, self._plans = jobs, plans
        self._plan_versions = {n: int(v) for n, v in state.get("plan_versions", {}).items()}
        self._applies_at = dict(state.get("applies_at", {}))
        self.log = [PlanChange.from_json(c) for c in state.get("log", [])]
        self._hot = {}
        self.version += 1
