"""The co-operation experiment: one trace of training jobs, once per offload policy.

An experiment file with ``kind = "cooperation"`` (``experiments/cloud_cooperation.toml``)
names a fabric (``[topology]``, as in other experiments, with ``switch_memory`` and
``shared_pool``), the policies to compare and the jobs of the trace: each job's hosts, start
time, training settings (``[jobs.train]``: the fields of
:class:`~testbed.workloads.TrainingSpec`) and the hints its tenant gives (``tolerance``,
``error_budget``, ``priority``; the byte count per iteration, the iterations and the compute
time come from the training settings, which the tenant knows).

For each policy the trace runs on the same emulated network (:func:`run_cooperation`): a
:class:`~testbed.provider.manager.FabricManager` runs in this process (in-process: the
experiment measures the policies, not the service's transport), costs plans with the flow
model on the network's measured hop latency, admits each job when it arrives, and the job's
workers train with the admitted plan (algorithm, transport, compressor, error feedback, tree
and slots; a job whose ``transports`` include ``"uet"`` may get its ring over UET, and while
that plan runs the switch ports it crosses trim: ``testbed.provider.trimming``); when a job
ends the manager releases it and re-plans the others.

Re-plans of running jobs are applied. Every ``telemetry_period_s`` (trace time) the data-path
engines' counters are read (:class:`~testbed.provider.service.Telemetry`) and fed to
``manager.observe``, which re-plans on sustained congestion of a job's links; arrivals and
departures re-plan too. When the plan of a running job changes, the orchestrator registers
the new plan's switch configuration and the job's ranks move to it at an iteration boundary
rank 0 chooses (``testbed.workloads.replan``); the first sum under every applied plan is
checked against numpy with that plan's bound, besides the usual check iterations.

Rows (one per policy x job, ``row = "job"``): ``policy, job, jct_s, tta_s, final_accuracy,
target_accuracy, accuracy_ok, plan_changes`` (plan changes the job applied while running;
``plan_changes_logged``: the manager's re-plans of the job while admitted, applied or not;
``replans``: those by reason, ``arrival``/``departure``/``congestion``; ``plan_switches``:
iteration and communication of each applied change; ``plan_errors``: changes that could not
be applied, e.g. a switch that refused the new registration) and the plan the job started
on (``algo, transport, compressor, tree, predicted_comm_s``: its admission plan, or the joint
plan of the jobs that arrived with it; ``trimming_ports``: the switch
ports its UET plans made trim) plus the training summary (``comm_s``,
``cpu_bound``, ...). One summary
row per policy (``row = "summary"``): mean and p99 JCT, Jain fairness of slowdowns (JCT over
the model's ideal JCT: iterations x (compute + the fastest candidate plan's communication
alone on the fabric)), switch memory utilisation over time (``mem_series``: trace time and
the allocated share of the static memory) and its time-weighted mean, bytes on core links
(rx + tx at the spine switches' ports: every byte that crossed a leaf-spine link, counted
once per link), the packets the switches' ports cut (``trimmed``), whether any job was CPU-bound, the re-plans by reason (``replans``) and
the telemetry fed to the manager (``telemetry_snapshots``; ``congestion_episodes``: times a
link became sustained-congested, whether or not the policy then changed a plan). With ``repeats`` > 1 the trace runs that
many times per policy (interleaved, so a change in the machine's load hits every policy),
every row carries its ``repeat``, and one ``row = "overall"`` per policy gives the median
(and min, max) of the summary figures over the repeats.

Why one module this long: the experiment file's schema, the trace orchestration, the re-plan
loop and the summary rows share the trace's state (jobs, plans, telemetry); split, each part
would need the others' internals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from testbed.collectives.algorithms import is_offloaded
from testbed.collectives.spec import communication_of
from testbed.experiment import results
from testbed.experiment.networks import flatten_counters, port_bytes_by_role
from testbed.experiment.spec import (
    ExperimentError,
    TopologySpec,
    format_errors,
    read_experiment_file,
)
from testbed.provider.manager import (
    SUSTAINED_SNAPSHOTS,
    FabricManager,
    inventory_of,
    same_offload,
)
from testbed.provider.policies import (
    INT32_LANES,
    POLICIES,
    PlanModel,
    candidates,
    make_policy,
    plan_memory,
)
from testbed.provider.policies import FabricView as _View
from testbed.provider.schema import Hints, JobRequest, Plan
from testbed.workloads.spec import TrainingSpec

#: Aggregator memory of a switch and its shared pool when the topology does not say (the
#: data path's defaults: 16 MiB, a quarter of it shared).
DEFAULT_MEMORY = 16 << 20
#: How long a run waits for another testbed network to finish (a shared machine).
LOCK_WAIT_S = 3600.0


class CoopJob(BaseModel):
    """One job of the trace: its hosts (indices), start time, hints and training settings."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    hosts: list[int] = Field(min_length=2)
    start_s: float = Field(0.0, ge=0)
    tolerance: Literal["exact", "lossy", "lossy_ef"] | None = None
    error_budget: float | None = Field(None, gt=0, le=1)
    priority: int = Field(0, ge=0, le=7)
    hints: bool = Field(True, description="whether the tenant gives hints at all")
    overstate: float = Field(1.0, gt=0, le=1000, description="the factor by which the "
                             "tenant's hints misstate its bytes per iteration (1: honest)")
    transports: list[Literal["tcp", "uet"]] = Field(default_factory=lambda: ["tcp"],
                                                    description="what the job's workers "
                                                    "carry their ring over (Hints.transports)")
    train: dict = Field(default_factory=dict, description="TrainingSpec fields")


class Burst(BaseModel):
    """Traffic of a tenant the provider does not plan: a UDP flow (iperf3) from host ``src``
    to host ``dst`` (indices), from ``start_s`` for ``duration_s`` of trace time, at ``mbps``
    or at ``share`` of the source host's link rate (default: all of it; a share follows the
    link rate of a variant of the trace). ``via``: a switch its path must cross (its source
    port is chosen so that the fabric's ECMP hash puts it there), so that a trace can load
    one spine."""

    model_config = ConfigDict(extra="forbid")

    src: int = Field(ge=0)
    dst: int = Field(ge=0)
    start_s: float = Field(0.0, ge=0)
    duration_s: float = Field(gt=0)
    mbps: float | None = Field(None, gt=0)
    share: float | None = Field(None, gt=0, le=1)
    via: str | None = Field(None, pattern=r"^tb")

    @model_validator(mode="after")
    def _distinct(self) -> Burst:
        if self.src == self.dst:
            raise ValueError("src and dst must be different hosts")
        if self.mbps is not None and self.share is not None:
            raise ValueError("give mbps or share, not both")
        return self


class CooperationExperiment(BaseModel):
    """A ``kind = "cooperation"`` experiment file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["cooperation"]
    name: str
    description: str = ""
    seed: int = Field(0, ge=0)
    time_dilation: float = Field(1.0, ge=1, le=100)
    telemetry_period_s: float = Field(1.0, ge=0, le=60, description="seconds of trace time "
                                      "between two telemetry snapshots fed to the manager "
                                      "(0: none)")
    trust_hints: bool = Field(False, description="rank the jobs' claims at once, before "
                              "telemetry judged them (no probation; a liar is still caught "
                              "and re-planned): what probation costs honest jobs")
    lease_s: float = Field(3600.0, gt=0, le=3600)
    repeats: int = Field(1, ge=1, le=20, description="runs of the trace per policy "
                         "(interleaved: repeat 0 of every policy, then repeat 1, ...)")
    policies: list[str] = Field(default_factory=lambda: [
        n for n, c in POLICIES.items() if not c.baseline], min_length=1)
    topology: TopologySpec
    jobs: list[CoopJob] = Field(min_length=1)
    bursts: list[Burst] = Field(default_factory=list, description="cross traffic no policy "
                                "plans, in every run of the trace")

    @model_validator(mode="after")
    def _check(self) -> CooperationExperiment:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"policies {bad} unknown; choose from {sorted(POLICIES)}")
        names = [j.name for j in self.jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"job names {names} repeat; give every job its own name")
        for j in self.jobs:
            forbidden = {"hosts", "start_s", "job_id", "name", "algo", "compressor",
                         "compressor_params", "error_feedback", "placement",
                         "transport"} & set(j.train)
            if forbidden:
                raise ValueError(f"jobs.{j.name}.train: {sorted(forbidden)} are set by the "
                                 "trace (hosts, start_s, name) or by the policy's plan; "
                                 "remove them (a job's transports field says what its "
                                 "workers may run)")
            try:
                spec = self.spec(j, 0)
                spec.validate()
            except (TypeError, ValueError) as e:
                raise ValueError(f"jobs.{j.name}.train: {e}") from None
        return self

    def spec(self, job: CoopJob, index: int) -> TrainingSpec:
        """The job's training spec before any plan (ring, exact)."""
        return TrainingSpec(**{"seed": self.seed, **job.train}, name=job.name,
                            hosts=list(job.hosts), start_s=job.start_s, job_id=index + 1)


def load_cooperation(source) -> CooperationExperiment:
    """The experiment from a TOML/YAML path or a dict (:class:`ExperimentError` listing the
    problems)."""
    data = source if isinstance(source, dict) else read_experiment_file(source)
    try:
        return CooperationExperiment.model_validate(data)
    except ValidationError as e:
        raise ExperimentError("object" if isinstance(source, dict) else str(source),
                              format_errors(e)) from None


def request(job: CoopJob, spec: TrainingSpec, host_names: list[str],
            lease_s: float) -> JobRequest:
    """What the tenant tells the provider on admission: hosts and (optionally) hints."""
    hints = Hints()
    if job.hints:
        hints = Hints(collective_bytes=max(1, round(4 * spec.n_params() * job.overstate)),
                      iterations=spec.iterations,
                      compute_s=spec.compute_ms / 1000.0, tolerance=job.tolerance,
                      error_budget=job.error_budget, priority=job.priority,
                      transports=tuple(job.transports))
    return JobRequest(job=job.name, hosts=[host_names[h] for h in job.hosts], hints=hints,
                      lease_s=lease_s)


def apply_plan(spec: TrainingSpec, plan: Plan) -> TrainingSpec:
    """``spec`` with ``plan``'s communication: algorithm, compressor, error feedback, and for
    INA the tree, slots (the window) and memory mode."""
    ina = is_offloaded(plan.algo)
    return dataclasses.replace(
        spec, **communication_of(plan),
        placement={"tree": plan.tree, "slots": plan.slots, "mode": plan.mode} if ina else {},
        window=plan.slots if ina else spec.window)


def static_memory(topology: TopologySpec) -> int:
    """Bytes of static partitions per switch: its memory minus the shared pool."""
    mem, pool = _memory(topology)
    return mem - pool


def pool_entries(topology: TopologySpec) -> int:
    """Entries of the shared pool per switch (one round of 256 int32 lanes each)."""
    return _memory(topology)[1] // (4 * INT32_LANES)


def _memory(topology: TopologySpec) -> tuple[int, int]:
    """(aggregator memory, shared pool) per switch, in bytes."""
    mem = int(topology.switch_memory) if topology.switch_memory is not None else DEFAULT_MEMORY
    return mem, int(topology.shared_pool) if topology.shared_pool is not None else mem // 4


def jain(xs: list[float]) -> float | None:
    """Jain's fairness index of ``xs`` (1: all equal; 1/n: one takes everything)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None
    return float(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)))


def ideal_jct_s(req: JobRequest, spec: TrainingSpec, model: PlanModel, inv) -> float | None:
    """The model's JCT of a job alone: iterations x (compute + its fastest candidate plan's
    communication time, switch memory unconstrained)."""
    times = [model.comm_s(req, c, inv) for c in candidates(req, _View(inv))]
    times = [t for t in times if t is not None]
    if not times:
        return None
    return spec.iterations * (spec.compute_ms / 1000.0 + min(times))


#: the causes a re-plan's reason names, by how each of its parts begins
REPLAN_CAUSES = (("arrival", ("re-plan on arrival",)), ("departure", ("re-plan on departure",)),
                 ("hints", ("hints disagree", "hints confirmed")),
                 ("congestion", ("sustained congestion", "eases congestion")))


def replan_reasons(changes) -> dict[str, int]:
    """How many of the plan log's re-plans (``PlanChange`` entries with an old and a new
    plan) had which cause: ``arrival``, ``departure``, ``hints`` (judged by telemetry: found
    wrong, or confirmed while claims were on probation), ``congestion`` (else ``other``). One
    snapshot may judge hints and find congestion at once, and a re-plan for any cause that
    eases congested links names them: such a re-plan names each cause (joined by "; ") and
    counts under each."""
    out = {"arrival": 0, "departure": 0, "hints": 0, "congestion": 0, "other": 0}
    for e in changes:
        parts = e.reason.split("; ")
        causes = {cause for cause, starts in REPLAN_CAUSES
                  if any(part.startswith(starts) for part in parts)}
        for cause in causes or {"other"}:
            out[cause] += 1
    return out


def _p99(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.percentile(xs, 99)) if xs else None


class _Trace:
    """One policy's run of the trace: the manager, its clock, the memory series."""

    def __init__(self, exp: CooperationExperiment, policy: str, net, model: PlanModel, inv,
                 say):
        self.exp, self.net, self.say = exp, net, say
        names = list(net.topo.host_names)
        self.specs = [exp.spec(j, i) for i, j in enumerate(exp.jobs)]
        self.reqs = [request(j, s, names, exp.lease_s) for j, s in zip(exp.jobs, self.specs,
                                                                        strict=True)]
        kw = {"trace": self.reqs} if policy == "oracle" else {}
        # hints are judged where telemetry reads the counters: claims on probation till then
        # (unless the trace takes them on trust)
        self.manager = FabricManager(inv, make_policy(policy, model, **kw), model,
                                     probation=exp.telemetry_period_s > 0
                                     and not exp.trust_hints)
        self.policy = policy
        #: per job, the plan its workers started on: the admission plan, or the joint plan
        #: of jobs that arrived together (:meth:`on_tick` before the job's launch)
        self.launched: dict[str, Plan] = {}
        self.running: set[str] = set()
        self.mem: list[tuple[float, float]] = []
        self.total_mem = sum(s.memory_bytes for s in inv.switches) or 1
        self.sent: dict[str, Plan] = {}  # the plan each running job was last told to use
        #: per job, the specs it was told to move to with their plan versions (the manager
        #: hears which one its workers run when they do: on_switch)
        self.versions: dict[str, list[tuple[TrainingSpec, int]]] = {}
        self.checks: dict[str, dict | None] = {}  # the manager's hints check of each job
        self.telemetry = None
        self.snapshots = 0
        self.congestion_episodes = 0
        self.last_obs = 0.0
        if exp.telemetry_period_s > 0:
            # function-level import: the service module loads the HTTP stack, which only
            # co-operation runs with telemetry need
            from testbed.provider.service import Telemetry

            self.telemetry = Telemetry(net.topo.describe(),
                                       {s.name: s.memory_bytes for s in inv.switches},
                                       float(getattr(net, "time_dilation", 1.0) or 1.0))
        self.bursts = _Bursts(exp.bursts, net)
        # the ports a UET plan's ring crosses trim while it runs (function-level import: as
        # Telemetry's)
        from testbed.provider.trimming import PortTrimmer

        self.trimmer = PortTrimmer(net) if net.topo.programmable else None
        #: per job, the ports (per switch) its UET plans made trim
        self.trimmed_ports: dict[str, dict[str, set[str]]] = {}
        self.t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self.t0) / self.net.time_dilation

    def _trim(self) -> None:
        """Trimming on the ports the admitted jobs' UET plans cross, and only there."""
        if self.trimmer is not None:
            self.trimmer.sync(self.manager.plans(), self.manager.jobs())
            for job, ports in self.trimmer.by_job.items():
                mine = self.trimmed_ports.setdefault(job, {})
                for sw, p in ports.items():
                    mine.setdefault(sw, set()).update(p)

    def _record(self) -> None:
        """Memory in use by the running jobs' current plans (a re-plan counts from the moment
        the manager made it; the job applies it within an iteration or two)."""
        used = sum(sum(plan_memory(self.sent[j.job], len(j.hosts)).values())
                   for j in self.reqs if j.job in self.running)
        self.mem.append((round(self.now(), 3), used / self.total_mem))

    def on_start(self, i: int, spec: TrainingSpec) -> TrainingSpec:
        plan = self.manager.admit(self.reqs[i], now=self.now())
        self.launched[self.reqs[i].job] = plan
        self.sent[self.reqs[i].job] = plan
        self.running.add(self.reqs[i].job)
        # the job starts on the plan it was admitted with
        self.manager.renew(self.reqs[i].job, now=self.now(),
                           running=self.manager.plan_version(self.reqs[i].job))
        self._record()
        self._trim()
        self.say(f"[{self.policy}] {self.reqs[i].job}: {plan.algo}"
                 + (f"+{plan.compressor}" if plan.compressor else "")
                 + (f" on {plan.tree}" if plan.tree else "") + f" ({plan.reason})")
        return apply_plan(spec, plan)

    def on_tick(self, running: dict[int, int | None]) -> dict[int, TrainingSpec]:
        """Pass the jobs' progress (``running``: index -> last finished iteration) to the
        manager, feed it telemetry when a period has passed; return the new spec of every
        running job whose plan changed since it was last told (applied at its next iteration
        boundary by the runner)."""
        now = self.now()
        for i, it in running.items():
            if it is not None and self.reqs[i].job in self.running:
                with contextlib.suppress(ValueError):  # an earlier iteration: nothing new
                    self.manager.renew(self.reqs[i].job, now=now, iteration=it)
        pending = self.manager.hints_pending() if self.telemetry is not None else {}
        if pending:  # judged on counters read as the iterations are reported
            self.manager.check_hints(self.telemetry.uplink_bytes(
                {h for hosts in pending.values() for h in hosts}), now=now)
        self.bursts.tick(now)  # after: starting a burst's processes takes a while
        if self.telemetry is not None and now - self.last_obs >= self.exp.telemetry_period_s:
            self.last_obs = now
            self.manager.observe(self.telemetry.collect(now), now=now)
            self.snapshots += 1
            # episodes of sustained congestion (a re-plan was asked for; the policy may
            # have kept every plan)
            self.congestion_episodes += sum(
                k == SUSTAINED_SNAPSHOTS for k in self.manager.congested().values())
        plans = self.manager.plans()
        out = {}
        for i in running:
            name = self.reqs[i].job
            plan = plans.get(name)
            if plan is not None and not same_offload(plan, self.sent.get(name)):
                self.sent[name] = plan
                if running[i] is None:  # not launched yet: it starts on this plan
                    self.launched[name] = plan
                out[i] = apply_plan(self.specs[i], plan)
                self.versions.setdefault(name, []).append(
                    (out[i], self.manager.plan_version(name)))
                self.say(f"[{self.policy}] {name}: re-planned to {plan.algo}"
                         + (f"+{plan.compressor}" if plan.compressor else "")
                         + (f" on {plan.tree}" if plan.tree else "") + f" ({plan.reason})")
        if out:
            self._record()
            self._trim()
        return out

    def on_switch(self, i: int, spec: TrainingSpec) -> None:
        """Every worker of job ``i`` runs ``spec`` (one :meth:`on_tick` returned) now: the
        manager hears its plan version (its hints are judged on that plan's iterations)."""
        name = self.reqs[i].job
        told = self.versions.get(name, [])
        version = next((v for s, v in told if s is spec), None)
        self.versions[name] = [(s, v) for s, v in told if v is not None and
                               (version is None or v > version)]
        if version is not None and name in self.running:
            with contextlib.suppress(ValueError):  # released meanwhile
                self.manager.renew(name, now=self.now(), running=version)

    def close(self) -> None:
        self.bursts.close()
        if self.trimmer is not None:
            self.trimmer.close()
        if self.telemetry is not None:
            self.telemetry.close()

    def on_end(self, i: int, _res) -> None:
        job = self.manager.jobs().get(self.reqs[i].job)
        if job is not None:  # the provider's verdict on its hints, before it goes
            self.checks[self.reqs[i].job] = job["hints_check"]
        with contextlib.suppress(ValueError):  # not admitted (its start failed)
            self.manager.release(self.reqs[i].job, now=self.now())
        self.running.discard(self.reqs[i].job)
        self._record()
        self._trim()


class _Bursts:
    """The trace's bursts on ``net``: iperf3 servers from the start, each client from its
    start time to its end (:meth:`tick` with the trace time), everything stopped by
    :meth:`close`. A burst's rate is divided by the network's time dilation (a link's share
    stays that of its undilated rate)."""

    FIRST_PORT = 5401

    def __init__(self, bursts: list[Burst], net):
        self.net, self.bursts = net, bursts
        self.procs: list = []
        self.clients: dict[int, object] = {}
        self.started = 0
        hosts = net.hosts
        self.ports = []
        for k, b in enumerate(bursts):
            if max(b.src, b.dst) >= len(hosts):
                raise ValueError(f"bursts.{k}: host index {max(b.src, b.dst)} is out of range; "
                                 f"the network has {len(hosts)} hosts (0..{len(hosts) - 1})")
            dport = self.FIRST_PORT + k
            self.ports.append((self._sport(k, b, dport), dport))
        for k, b in enumerate(bursts):
            self.procs.append(hosts[b.dst].popen(["iperf3", "-s", "-p", str(self.ports[k][1])],
                                                 stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL))
        if bursts:
            time.sleep(0.3)  # the servers listen before a client connects

    def _sport(self, k: int, b: Burst, dport: int) -> int:
        """A UDP source port whose ECMP path crosses ``b.via`` (any without ``via``)."""
        from testbed.topologies import routing

        if b.via is None:
            return 40000 + k
        names = self.net.topo.host_names
        tables = routing.forwarding_tables(self.net.topo)
        for sport in range(40000, 41000):
            if b.via in routing.flow_path(self.net.topo, names[b.src], names[b.dst], sport,
                                          dport, 17, tables=tables):
                return sport
        raise ValueError(f"bursts.{k}.via: no path from {names[b.src]} to {names[b.dst]} "
                         f"crosses {b.via}")

    def _host_mbps(self, host: str) -> float:
        return next(s.bw_mbps for s in self.net.topo.link_specs
                    if host in (s.a, s.b) and s.bw_mbps) or 1000.0

    def tick(self, now: float) -> None:
        f = float(self.net.time_dilation)
        hosts = self.net.hosts
        for k, b in enumerate(self.bursts):
            if k not in self.clients and b.start_s <= now < b.start_s + b.duration_s:
                sport, dport = self.ports[k]
                mbps = b.mbps or (b.share or 1.0) * self._host_mbps(hosts[b.src].name)
                self.clients[k] = hosts[b.src].popen(
                    ["iperf3", "-c", hosts[b.dst].IP(), "-p", str(dport), "-u", "-l", "1400",
                     "-b", f"{mbps / f:g}M", "-t", "86400", "--cport", str(sport)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.started += 1
            elif k in self.clients and now >= b.start_s + b.duration_s:
                _stop([self.clients.pop(k)])  # ended: not started again, not stopped twice

    def close(self) -> None:
        _stop([*self.clients.values(), *self.procs])


def _stop(procs: list) -> None:
    # Function-level import: the incast module loads the trimming kernels (Numba).
    from testbed.experiment.incast import stop_processes

    stop_processes(procs)


def _core_roles(net) -> dict[str, str]:
    """Switch -> ``"core"`` for the switches whose ports carry the core links (spines; on a
    fabric without spines, none)."""
    roles = dict(net.topo.switch_roles)
    return {s: "core" for s, r in roles.items() if r in ("spine", "core")}


def _counters(net):
    try:
        return net.counters()
    except Exception:  # an engine that cannot answer: no byte counts, the rows say None
        return None


def run_policy(exp: CooperationExperiment, policy: str, net, model: PlanModel, inv,
               say=print, fallback_spare=None) -> tuple[list[dict], dict, list[dict]]:
    """Run the trace once under ``policy`` on ``net``: (job rows, summary row, plan log).
    ``fallback_spare``: the host fallback server kept started ahead
    (``testbed.collectives.runner.SpareFallbackServer``; default: the trace's own)."""
    from testbed.workloads import run_trace

    tr = _Trace(exp, policy, net, model, inv, say)
    before = _counters(net)
    tr.t0 = time.monotonic()
    try:
        out = run_trace(net, tr.specs, progress=say, on_start=tr.on_start, on_end=tr.on_end,
                        on_tick=tr.on_tick, on_switch=tr.on_switch,
                        fallback_spare=fallback_spare)
    finally:
        tr.close()
    after = _counters(net)
    end_s = tr.now()
    core = trimmed = None
    if before is not None and after is not None:
        b, a = flatten_counters(before), flatten_counters(after)
        delta = {k: a[k] - b.get(k, 0.0) for k in a}
        core = port_bytes_by_role(delta, _core_roles(net)).get("port_bytes_core")
        # packets the switches' shaping ports cut (ports a UET plan made trim)
        trimmed = int(sum(v for k, v in delta.items()
                          if k.endswith(".stages.shape.totals.trimmed")))
    log = [{"policy": policy, **e.to_json()} for e in tr.manager.log]
    rows = []
    for i, (job, res) in enumerate(zip(exp.jobs, out, strict=True)):
        s, req = res.summary, tr.reqs[i]
        plan = tr.launched.get(job.name)
        replans = [e for e in tr.manager.log
                   if e.job == job.name and e.old is not None and e.new is not None]
        ideal = ideal_jct_s(req, tr.specs[i], model, inv)
        target = s.get("target_accuracy")
        acc = s.get("final_accuracy")
        # JCT from the job's arrival: with the time it waited for switch memory the
        # provider had promised but another job had not yet given back
        jct = None if s.get("jct_s") is None else s["jct_s"] + (s.get("queued_s") or 0.0)
        rows.append({
            "row": "job", "policy": policy, "job": job.name, "jct_s": jct,
            "queued_s": s.get("queued_s"),
            "tta_s": s.get("tta_s"), "final_accuracy": acc, "target_accuracy": target,
            "accuracy_ok": None if target is None or acc is None else bool(acc >= target),
            "plan_changes": s.get("plan_changes_applied", 0),
            "plan_changes_logged": len(replans), "replans": replan_reasons(replans),
            "plan_switches": s.get("plan_switches", []), "plan_errors": s.get("plan_errors", []),
            "algo": plan.algo if plan else None,
            "transport": plan.transport if plan else None,
            "trimming_ports": sum(len(p) for p in tr.trimmed_ports.get(job.name, {}).values()),
            "compressor": plan.compressor if plan else None,
            "compressor_params": plan.compressor_params if plan else None,
            "error_feedback": plan.error_feedback if plan else None,
            "tree": plan.tree if plan else None, "slots": plan.slots if plan else None,
            "predicted_comm_s": plan.predicted_comm_s if plan else None,
            "plan_reason": plan.reason if plan else None,
            "tolerance": job.tolerance, "error_budget": job.error_budget,
            "priority": job.priority, "hosts": req.hosts, "arrival_s": job.start_s,
            "overstate": job.overstate,
            "hints_check": (tr.checks.get(job.name) or {}).get("verdict"),
            "hints_ratio": (tr.checks.get(job.name) or {}).get("ratio"),
            "ideal_jct_s": ideal,
            "slowdown": jct / ideal if ideal and jct else None,
            **{k: s.get(k) for k in ("iterations", "comm_s", "iter_s", "model_comm_s",
                                     "comm_fraction", "bytes", "correct", "cpu_bound",
                                     "cpu_util", "cpu_wait", "cpu_max", "cpu_engine",
                                     "start_s", "end_s", "time_dilation", "error",
                                     "checks")},
            "status": "error" if s.get("error") else "ok",
        })
    jcts = [r["jct_s"] for r in rows if r["status"] == "ok"]
    mem = tr.mem + [(round(end_s, 3), tr.mem[-1][1] if tr.mem else 0.0)]
    weighted = sum((t1 - t0) * u for (t0, u), (t1, _) in zip(mem, mem[1:], strict=False))
    span = mem[-1][0] - mem[0][0] if len(mem) > 1 else 0.0
    summary = {
        "row": "summary", "policy": policy, "job": None, "jobs": len(rows),
        "failed": sum(r["status"] != "ok" for r in rows),
        "mean_jct_s": float(np.mean(jcts)) if jcts else None, "p99_jct_s": _p99(jcts),
        "makespan_s": end_s,
        "jain_slowdown": jain([r["slowdown"] for r in rows if r["status"] == "ok"]),
        "mem_util_mean": weighted / span if span > 0 else None,
        "mem_util_max": max((u for _t, u in mem), default=None), "mem_series": mem,
        "core_bytes": core, "trimmed": trimmed,
        "all_accurate": all(r["accuracy_ok"] is not False for r in rows),
        "plan_changes": sum(r["plan_changes"] for r in rows),
        "plan_changes_logged": sum(r["plan_changes_logged"] for r in rows),
        "replans": replan_reasons([e for e in tr.manager.log
                                   if e.old is not None and e.new is not None]),
        "telemetry_snapshots": tr.snapshots, "congestion_episodes": tr.congestion_episodes,
        "bursts": tr.bursts.started,
        "cpu_bound": any(bool(r["cpu_bound"]) for r in rows),
    }
    return rows, summary, log


def build_network(exp: CooperationExperiment):
    """The (not yet started) network of the experiment's topology and switch memory."""
    from testbed.topologies import make_topology
    from testbed.topologies.net import TestbedNet
    from testbed.topologies.pipeline import DatapathOptions

    topo = make_topology(exp.topology.kind, **exp.topology.kwargs())
    return TestbedNet(topo, datapath=DatapathOptions(aggregate=exp.topology.aggregate_settings()),
                      time_dilation=exp.time_dilation)


def run_cooperation(exp: CooperationExperiment, out_dir: str | Path | None = None,
                    say=print, variants: dict[str, CooperationExperiment] | None = None
                    ) -> list[dict]:
    """Run the trace once per policy (one network for all, built here under the emulation
    lock); returns the rows, summary rows after each policy's job rows. ``out_dir``: where
    ``rows.jsonl``, ``plan_log.jsonl`` and ``metadata.json`` go (None: nowhere).

    ``variants``: other versions of the trace on the same topology (e.g. its honest twin),
    by name. Each runs its own policies after ``exp``'s in every repeat, on the same network,
    its rows marked ``"variant": name``: a comparison of the two is then paired repeat by
    repeat, not taken between two networks built minutes apart (two batches of one trace on
    a shared 2-core VM measured medians 25 % apart, each batch within 5 %)."""
    variants = variants or {}
    for name, v in variants.items():
        if v.topology != exp.topology:
            raise ValueError(f"variant {name!r}: its topology differs from the trace's; a "
                             "variant runs on the trace's network")
    from testbed.collectives.runner import SpareFallbackServer
    from testbed.netlock import emulation_lock

    rows: list[dict] = []
    logs: list[dict] = []
    meta = {"name": exp.name, "kind": "cooperation", "experiment": exp.model_dump(),
            "cpu_model": results.cpu_model(), "python": platform.python_version(),
            "uptime_before": _uptime(), "in_process_manager": True}
    t0 = time.monotonic()
    say("waiting for the emulation lock (one network at a time on this machine) ...")
    with emulation_lock(timeout=LOCK_WAIT_S):
        meta["lock_wait_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        # the host fallback server started ahead warms up while the network is built
        with SpareFallbackServer() as spare, build_network(exp) as net:
            meta["setup_s"] = round(time.monotonic() - t0, 2)
            _run_policies(exp, net, meta, rows, logs, say, spare, variants)
    meta["uptime_after"] = _uptime()
    if out_dir is not None:  # a results folder like every experiment's (Results.load reads it)
        store = results.ResultsStore(out_dir, meta | {"planned_runs": len(rows)})
        for r in rows:
            store.append(r)
        _write_jsonl(Path(out_dir) / "plan_log.jsonl", logs)
        store.finish("failed" if any(r.get("status") == "error" for r in rows)
                     else "completed")
    return rows


def _run_policies(exp: CooperationExperiment, net, meta: dict, rows: list, logs: list,
                  say, spare=None, variants: dict | None = None) -> None:
    hop = net.hop_latency_s()
    model = PlanModel(net.topo, hop_latency_s=hop)
    inv = inventory_of(net.topo, static_memory(exp.topology), pool_entries(exp.topology))
    meta.update(hop_latency_s=hop, describe=net.describe())
    runs = [(None, exp), *(variants or {}).items()]
    summaries: dict[tuple, list[dict]] = {(v, p): [] for v, e in runs for p in e.policies}
    for rep in range(exp.repeats):
        for variant, trace in runs:
            for policy in trace.policies:
                t0 = time.monotonic()
                jobs, summary, log = run_policy(trace, policy, net, model, inv, say, spare)
                summary["wall_s"] = round(time.monotonic() - t0, 2)
                for r in jobs + [summary] + log:
                    r["repeat"] = rep
                    if variant is not None:
                        r["variant"] = variant
                rows += jobs + [summary]
                logs += log
                summaries[variant, policy].append(summary)
    if exp.repeats > 1:
        rows += [overall(p, s) | ({"variant": v} if v is not None else {})
                 for (v, p), s in summaries.items()]


def overall(policy: str, summaries: list[dict]) -> dict:
    """One row per policy over its repeats: the median (and spread) of each summary figure."""
    out: dict = {"row": "overall", "policy": policy, "job": None, "repeats": len(summaries)}
    for k in ("mean_jct_s", "p99_jct_s", "jain_slowdown", "mem_util_mean", "core_bytes"):
        xs = [s[k] for s in summaries if s.get(k) is not None]
        out[k] = float(np.median(xs)) if xs else None
        out[f"{k}_min"] = min(xs) if xs else None
        out[f"{k}_max"] = max(xs) if xs else None
    out["all_accurate"] = all(s["all_accurate"] for s in summaries)
    out["failed"] = sum(s["failed"] for s in summaries)
    out["cpu_bound_runs"] = sum(bool(s["cpu_bound"]) for s in summaries)
    return out


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")


def print_results(rows: list[dict], out_dir, json_out: bool = False) -> int:
    """What ``testbed run`` prints of a co-operation run: the job and summary rows as JSON
    lines on stdout (``json_out``) or a table; exit 0 ok, 1 a job failed."""
    if json_out:
        for r in rows:
            print(json.dumps(results.strict_json(r), default=str))
        sys.stdout.flush()
    stream = sys.stderr if json_out else sys.stdout
    print(table(rows), file=stream)
    print(f"results: {out_dir}", file=stream)
    return 1 if any(r.get("status") == "error" for r in rows) else 0


def table(rows: list[dict]) -> str:
    """Plain-text tables: the jobs, then one line per policy run (and the medians over the
    repeats)."""
    def f(v, spec=".3g"):
        return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)

    def name(r):
        return r["policy"] + (f" #{r['repeat']}" if r.get("repeat") else "")

    lines = [f"{'policy':<17}{'job':<14}{'plan':<24}{'jct_s':>8}{'tta_s':>8}{'acc':>7}"
             f"{'target':>7}{'chg':>4}{'cpu':>5}"]
    for r in rows:
        if r["row"] != "job":
            continue
        plan = (r["algo"] or "-") + (f"+{r['compressor']}" if r["compressor"] else "") + (
            "+ef" if r["error_feedback"] else "") + (
            f"@{len(r['tree'])}sw" if isinstance(r["tree"], list) else "")
        lines.append(f"{name(r):<17}{r['job']:<14}{plan:<24}{f(r['jct_s']):>8}"
                     f"{f(r['tta_s']):>8}{f(r['final_accuracy']):>7}"
                     f"{f(r['target_accuracy']):>7}{r.get('plan_changes', 0):>4}"
                     f"{'yes' if r['cpu_bound'] else 'no':>5}")
    lines.append("")
    lines.append(f"{'policy':<24}{'mean_jct':>9}{'p99_jct':>9}{'jain':>7}{'mem_util':>9}"
                 f"{'core_MB':>9}{'accurate':>9}{'cpu':>5}")
    for r in rows:
        if r["row"] not in ("summary", "overall"):
            continue
        core = None if r["core_bytes"] is None else r["core_bytes"] / 1e6
        label = f"{r['policy']} (median)" if r["row"] == "overall" else name(r)
        cpu = (f"{r['cpu_bound_runs']}/{r['repeats']}" if r["row"] == "overall"
               else "yes" if r["cpu_bound"] else "no")
        lines.append(f"{label:<24}{f(r['mean_jct_s']):>9}{f(r['p99_jct_s']):>9}"
                     f"{f(r['jain_slowdown'], '.3f'):>7}{f(r['mem_util_mean'], '.2f'):>9}"
                     f"{f(core):>9}{str(r['all_accurate']):>9}{cpu:>5}")
    return "\n".join(lines)
