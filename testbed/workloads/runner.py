"""Run training jobs on an emulated network: one job (:func:`run_training`) or a trace of jobs
arriving over time on their own hosts and sharing the fabric (:func:`run_trace`).

``net`` is a started ``testbed.topologies.TestbedNet`` (or anything with its handles: ``hosts``,
``topo``, ``hop_latency_s()``, ``bottleneck_bps()``, and for INA ``aggregator``,
``ina_members()``, ``switch_client()``). Each job runs in its own pool process
(``python -m testbed.workloads.pool``, see pool.py) started at the job's ``start_s`` (times
its ``time_dilation``); an INA job is registered with the aggregating switch while its plan is
in force (``testbed.collectives.runner.offload_job``: the same control plane as a single
collective), and a job given a new plan while it runs (``run_trace(on_tick=...)``) moves to it
at an iteration boundary (``testbed.workloads.replan``).
Every job yields a :class:`TrainingResult`: per-iteration rows and a summary row
(:mod:`testbed.workloads.rows`) with the flow-level model's time of one gradient allreduce
(``model_comm_s``), the CPU-saturation signal over the job, and the checks of the pool.

A job that fails (a worker died, a timeout, a check failed to run) gets ``error`` set in its
result and summary; the other jobs of a trace go on. Ctrl-C kills every pool and gives every
switch partition back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from testbed.cleanup import job_dir
from testbed.collectives import flowmodel, trimmed
from testbed.collectives.algorithms import is_offloaded
from testbed.collectives.runner import (  # the collective runner's process handling
    MAX_ENGINE_RESTARTS,
    RUN_DIR,
    AdmissionRefused,
    SpareFallbackServer,
    _engine_pids,
    _restart,
    _wait_group_gone,
    kill_pool,
    net_bandwidth,
    offload_job,
    require_local_namespaces,
)
from testbed.collectives.spec import FieldError
from testbed.collectives.transport import CollectiveError
from testbed.collectives.worker import ControlLine
from testbed.workloads.replan import MAX_SWITCHES, epoch_job_id
from testbed.workloads.rows import collective_trace, iteration_rows, summary_row
from testbed.workloads.spec import TrainingSpec

_seq = itertools.count()
#: how often the runner looks at the pools and the data-path engines (s)
POLL_S = 0.1
#: How long (s, times the job's time dilation) a job whose INA registration a switch refuses
#: for lack of memory keeps retrying, at its start or at a plan change: a provider hands out
#: memory that another job gives back only once it has moved to its own new plan, at its next
#: iteration boundary. After that the start fails (or the plan change is not applied).
ADMISSION_WAIT_S = 60.0


class TrainingError(CollectiveError):
    """A training job failed (its message names the job and the cause)."""


@dataclass
class TrainingResult:
    """One job's outcome: ``summary`` (one row), ``iterations`` (one row per iteration),
    ``error`` (None when it ran), ``trace`` (every worker's allreduces:
    :func:`~testbed.workloads.rows.collective_trace`)."""

    spec: TrainingSpec
    summary: dict
    iterations: list[dict] = field(default_factory=list)
    error: str | None = None
    trace: list[dict] = field(default_factory=list)


def run_training(net, spec: TrainingSpec) -> TrainingResult:
    """Run one training job on ``net``; raises :class:`TrainingError` when it fails."""
    res = run_trace(net, [spec])[0]
    if res.error is not None:
        raise TrainingError(f"training job {spec.label()!r}: {res.error}")
    return res


def check_trace(specs: list[TrainingSpec], n_hosts: int) -> None:
    """Validate every job against the net and against each other: jobs of a trace run on
    disjoint hosts and have distinct ``job_id`` values (switch partitions, ports)."""
    owner: dict[int, int] = {}
    ids: dict[int, int] = {}
    for k, s in enumerate(specs):
        try:
            s.validate(n_hosts)
        except ValueError as e:
            raise FieldError(getattr(e, "field", ""), f"job {k} ({s.label()}): {e}",
                             job=k, reason=str(e)) from None
        for h in s.host_indices(n_hosts):
            if h in owner:
                why = (f"TrainingSpec.hosts: host {h} is already used by job {owner[h]}; jobs of "
                       "a trace need disjoint hosts")
                raise FieldError("hosts", f"job {k} ({s.label()}): {why}", job=k, reason=why)
            owner[h] = k
        if s.job_id in ids:
            why = (f"TrainingSpec.job_id={s.job_id} is also job {ids[s.job_id]}'s; give every "
                   "job its own job_id")
            raise FieldError("job_id", f"job {k} ({s.label()}): {why}", job=k, reason=why)
        ids[s.job_id] = k


#: One BLAS thread per worker: the workers of a job compute at the same moment, so more
#: threads only oversubscribe the cores (measured here: a 512-unit MLP step took ~40 ms with
#: OpenBLAS's default threads on 4 workers and 2 busy cores, against ~1 ms alone).
BLAS_ENV = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def pool_env() -> dict:
    """Environment of a training pool: this one with :data:`BLAS_ENV` (set before numpy loads
    its BLAS, which then keeps its thread count across the fork)."""
    return {**os.environ, **BLAS_ENV}


class _Job:
    """One launched pool: its spec, hosts, job file, process and control-plane state."""

    def __init__(self, index: int, spec: TrainingSpec, net):
        dilation = getattr(net, "time_dilation", None)  # a dilated network: its factor
        if spec.time_dilation == 1.0 and isinstance(dilation, int | float) and dilation > 1:
            spec = dataclasses.replace(spec, time_dilation=float(dilation))
        self.index, self.spec, self.net = index, spec, net
        require_local_namespaces(net)
        self.hosts = [net.hosts[i] for i in spec.host_indices(len(net.hosts))]
        self.cspec = spec.collective()
        self.stack = contextlib.ExitStack()
        self.proc: subprocess.Popen | None = None
        self.jobdir = job_dir(RUN_DIR, "train", next(_seq))
        self.t_start = 0.0
        self.t_end = 0.0
        self.offset_s = 0.0
        self.limit_s = 600 + spec.iterations * (1.0 + spec.compute_ms / 1000.0) \
            * spec.time_dilation
        # plan changes (replan.py): the channel to the pool, the plan offered and not yet
        # switched to, the next one wanted, each plan's control plane (epoch -> its stack)
        self.channel: ControlLine | None = None
        self.replan = False
        self.epoch = 0
        #: the trace's fallback server started ahead (None: none kept)
        self.spare: SpareFallbackServer | None = None
        #: (epoch, spec as offered, spec as asked for: what on_switch is given)
        self.offered: tuple[int, TrainingSpec, TrainingSpec] | None = None
        self.wanted: TrainingSpec | None = None
        self.current = spec
        #: engines restarted while it ran ([node, exit status, seconds] each)
        self.engine_restarts: list[list] = []
        self.planes: dict[int, contextlib.ExitStack] = {}
        self.switches: list[dict] = []
        #: specs asked for (on_tick) that every rank now runs, not yet passed to on_switch
        self.in_force: list[TrainingSpec] = []
        self.plan_errors: list[str] = []
        self.iteration: int | None = None  # the last one rank 0 reported finished
        self.queued_s = 0.0  # waiting for switch memory before the start (s, wall clock)
        self.refused_since: float | None = None  # the wanted plan's first refusal

    def _job_dict(self, spec: TrainingSpec) -> dict:
        """The pool's view of the job under ``spec``'s plan (before its registration)."""
        ranks = [{"host": h.name, "pid": int(h.pid), "ip": h.IP(),
                  "intf": h.defaultIntf().name} for h in self.hosts]
        try:
            bw = net_bandwidth(self.net, self.hosts, spec.collective().algo)
        except ValueError:  # unshaped links: nothing in a training job needs the rate
            bw = None
        return {"train": spec.to_json(), "spec": spec.collective().to_json(),
                "n": len(ranks), "m": 0, "ranks": ranks, "bw_bps": bw,
                "time_dilation": spec.time_dilation}

    def _plane(self, epoch: int, spec: TrainingSpec, job: dict) -> None:
        """Register the control plane of ``spec``'s plan (its INA job on the switches) as
        plan ``epoch``; released by :meth:`_drop_plane` or when the job ends."""
        plane = contextlib.ExitStack()
        plane.enter_context(offload_job(
            self.net, spec.collective(), job, self.hosts,
            fallback_server=self.spare.take if self.spare is not None else None))
        self.stack.enter_context(plane)
        self.planes[epoch] = plane

    def _drop_plane(self, epoch: int) -> None:
        plane = self.planes.pop(epoch, None)
        if plane is not None:
            try:
                plane.close()
            except CollectiveError as e:  # a switch that cannot answer: say so in the row
                self.plan_errors.append(f"releasing plan {epoch}: {e}")

    def launch(self, t0: float, replan: bool = False) -> None:
        """Register the job's control plane, write the job file and start the pool;
        ``replan``: open the plan channel (:meth:`want` moves the running job to a new
        plan)."""
        job = {**self._job_dict(self.spec), "extra_pids": _engine_pids(self.net)}
        self._plane(0, self.spec, job)
        os.makedirs(self.jobdir, exist_ok=True)
        path = os.path.join(self.jobdir, "job.json")
        self.t_start = time.monotonic()
        job["t_popen"] = self.t_start
        ranks = job["ranks"]
        theirs = None
        self.replan = replan
        if replan:
            ours, theirs = socket.socketpair()
            self.channel = ControlLine(ours)
            job["plan_fd"] = theirs.fileno()
        with open(path, "w") as f:
            json.dump(job, f)
        cmd = [sys.executable, "-m", "testbed.workloads.pool", "--job", path] + [
            f"testbed-node={r['host']}" for r in ranks]
        try:
            with open(os.path.join(self.jobdir, "pool.log"), "wb") as log:
                self.proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env=pool_env(), pass_fds=() if theirs is None else (theirs.fileno(),))
        finally:
            if theirs is not None:
                theirs.close()
        self.offset_s = self.t_start - t0

    def want(self, spec: TrainingSpec) -> None:
        """Move the running job to ``spec``'s communication (algorithm, compressor, tree,
        slots) at an iteration boundary its ranks agree on; the latest wish wins. Its
        control plane is registered here, by the orchestrator, never by the ranks."""
        self.wanted = spec
        self.poll()

    def poll(self) -> None:
        """Read the pool's reports (a switch done: the old plan's control plane goes) and
        offer the wanted plan once no other offer is outstanding."""
        if self.channel is None:
            return
        try:
            msgs = self.channel.ready()
        except (EOFError, OSError):
            msgs = []
            self.channel = None
        for m in msgs:
            if m["type"] == "progress":
                self.iteration = int(m["iteration"])
            if m["type"] == "switched" and self.offered and m["epoch"] == self.offered[0]:
                old = max(e for e in self.planes if e != m["epoch"]) if len(self.planes) > 1 \
                    else None
                self.current = self.offered[1]
                self.in_force.append(self.offered[2])
                self.switches.append({"epoch": m["epoch"], "at": m["at"],
                                      "t_s": time.monotonic() - self.t_start})
                self.offered = None
                if old is not None:
                    self._drop_plane(old)
        if self.offered is None and self.wanted is not None and self.channel is not None:
            self._offer()

    def _offer(self) -> None:
        asked = spec = self.wanted
        self.wanted = None
        spec = dataclasses.replace(spec, job_id=self.current.job_id,
                                   time_dilation=self.spec.time_dilation)
        if spec.collective().to_json() == self.current.collective().to_json():
            self.in_force.append(asked)
            return  # the plan in force already
        if self.epoch >= MAX_SWITCHES:
            self.plan_errors.append(f"plan change {self.epoch + 1} not applied: at most "
                                    f"{MAX_SWITCHES} per job")
            return
        epoch = self.epoch + 1
        spec = dataclasses.replace(spec, job_id=epoch_job_id(self.spec.job_id, epoch))
        try:
            spec.validate(len(self.net.hosts))
            job = self._job_dict(spec)
            self._plane(epoch, spec, job)
        except AdmissionRefused as e:  # memory not given back yet: retry while it may come
            now = time.monotonic()
            since = self.refused_since = self.refused_since or now
            if now - since <= ADMISSION_WAIT_S * self.spec.time_dilation:
                if self.wanted is None:  # a newer wish wins
                    self.wanted = asked
                return
            self.refused_since = None
            self.plan_errors.append(f"plan change to {spec.label()} ({spec.algo}) not "
                                    f"applied: refused for {now - since:.0f} s: {e}")
            return
        except (CollectiveError, ValueError, RuntimeError) as e:
            self.plan_errors.append(f"plan change to {spec.label()} ({spec.algo}) not "
                                    f"applied: {e}")
            return
        self.refused_since = None
        try:
            self.channel.send({"type": "plan", "epoch": epoch, "job": {
                k: job[k] for k in ("train", "spec", "ranks", "bw_bps", "time_dilation", "seq0",
                                    "tree", "fallbacks") if k in job}})
        except OSError:  # the pool has ended (its result says how): nobody to switch
            self.channel = None
            self._drop_plane(epoch)
            self.plan_errors.append(f"plan change to {spec.label()} ({spec.algo}) not "
                                    "applied: the job's pool had ended")
            return
        self.epoch = epoch
        self.offered = (epoch, spec, asked)

    def finished(self) -> bool:
        """Whether the pool exited (its process group is reaped by then)."""
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        """Kill the pool's process group and give the control plane back (never raises)."""
        if self.proc is not None:
            kill_pool(self.proc)
        with contextlib.suppress(Exception):
            self.stack.close()
        shutil.rmtree(self.jobdir, ignore_errors=True)

    def result(self) -> TrainingResult:
        """Read the pool's result, give the control plane back, build the rows."""
        self.t_end = time.monotonic()
        _wait_group_gone(self.proc.pid)
        try:
            self.stack.close()
            with open(os.path.join(self.jobdir, "result.json")) as f:
                res = json.load(f)
        except OSError:
            with open(os.path.join(self.jobdir, "pool.log"), "rb") as f:
                out = f.read().decode(errors="replace")[-2000:]
            res = {"error": f"pool exited {self.proc.returncode} without a result:\n{out}",
                   "logs": [], "checks": []}
        except CollectiveError as e:
            res = {"error": str(e), "logs": [], "checks": []}
        finally:
            shutil.rmtree(self.jobdir, ignore_errors=True)
        return self._rows(res)

    def _rows(self, res: dict) -> TrainingResult:
        spec = self.spec
        head = {"job": self.index, "label": spec.label(), "job_id": spec.job_id}
        its = iteration_rows(spec, res["logs"]) if res.get("logs") else []
        summary = {**head, **_context(spec, self), **summary_row(spec, its)}
        summary["model_comm_s"] = _model_s(self.net, spec, self.cspec, self.hosts)
        cpu = res.get("cpu", {})
        checks = res.get("checks", [])
        summary.update({
            "correct": bool(checks) and all(c["correct"] for c in checks)
            and bool(res.get("replicas_agree")),
            "max_abs_err": max((c["max_abs_err"] for c in checks), default=float("nan")),
            "checked_iterations": [c["iteration"] for c in checks],
            "replicas_agree": res.get("replicas_agree"),
            "cpu_bound": cpu.get("cpu_bound"), "cpu_util": cpu.get("cpu_util"),
            "cpu_max": cpu.get("cpu_max"), "cpu_wait": cpu.get("cpu_wait"),
            "cpu_engine": cpu.get("cpu_engine"), "setup_s": res.get("setup_s"),
            "mem_mb": res.get("mem_mb"),
            "start_s": self.offset_s / spec.time_dilation,
            "queued_s": self.queued_s / spec.time_dilation,
            "end_s": (self.t_end - self.t_start + self.offset_s) / spec.time_dilation,
            "error": res.get("error"),
            "plan_changes_applied": len(res.get("plan_switches") or []),
            "engine_restarts": list(self.engine_restarts),
        })
        if self.replan:  # the plans in force and the collective each check was held to
            summary.update(plan_switches=res.get("plan_switches") or [],
                           plan_errors=list(self.plan_errors),
                           checks=[{k: c.get(k) for k in ("iteration", "algo", "compressor",
                                                          "correct", "max_abs_err")}
                                   for c in checks])
        stats = res["logs"][0].get("comm_stats", {}) if res.get("logs") else {}
        if stats.get("packets"):  # the trimmed exchange, counted at rank 0
            summary["trimmed_frac"] = stats["trimmed"] / stats["packets"]
            summary["nacks"] = stats["nacks"]
        rows = [{**head, **r} for r in its]
        return TrainingResult(spec, summary, rows, res.get("error"),
                              collective_trace(spec, res.get("logs") or []))


def _context(spec: TrainingSpec, job: _Job) -> dict:
    """Columns that say what the job was."""
    return {"model": spec.model, "dataset": spec.dataset, "algo": spec.algo,
            "compressor": spec.compressor, "error_feedback": spec.error_feedback,
            "n": len(job.hosts), "hosts": ",".join(h.name for h in job.hosts),
            "params": spec.n_params(), "bytes": 4 * spec.n_params(),
            "batch_size": spec.batch_size, "compute_ms": spec.compute_ms,
            "time_dilation": spec.time_dilation, "loss": spec.loss, "seed": spec.seed}


def _model_s(net, spec: TrainingSpec, cspec, hosts: list) -> float | None:
    """The flow-level model's time of one gradient allreduce alone on the fabric; for the
    trimmed exchange, the incast into rank 0's port (:func:`flowmodel.incast_s`, with that
    port's trim stage when it has one) plus the broadcast. None where the model does not
    apply (e.g. unshaped links)."""
    try:
        t = flowmodel.predict(net.routed_topo, cspec, workers=[h.name for h in hosts],
                              hop_latency_s=net.hop_latency_s(),
                              impairments=net.link_impairments()).time_s
        if spec.algo != "trim" or t is None:
            return t
        inc = _incast_s(net, spec, [h.name for h in hosts])
        return None if inc is None else inc + t
    except (ValueError, AttributeError, KeyError):
        return None  # the model does not apply (e.g. unshaped links): say so by a null


def _incast_s(net, spec: TrainingSpec, hosts: list[str]) -> float | None:
    """The model's time of the trimmed exchange's incast: every worker but rank 0 pushes its
    frames into rank 0's switch port, which drains at its trim stage's rate (threshold, mode)
    or, without one, at the link rate through the kernel's queue."""
    link = next(s for s in net.topo.link_specs if hosts[0] in (s.a, s.b))
    if link.bw_mbps is None:
        return None
    node, port = (link.b, link.port_b) if link.a == hosts[0] else (link.a, link.port_a)
    stage = dict(net.programs_plan().get(node, [])).get("trim")
    rate, threshold, mode = float(link.bw_mbps), 0.0, None
    if stage is not None:
        def at_port(v):
            return v.get(f"{node}-eth{port}") if isinstance(v, dict) else v

        rate = float(at_port(stage["rate_mbps"]) or rate)
        threshold, mode = float(at_port(stage["threshold_bytes"])), stage["mode"]
    frames, full, head = trimmed.frame_sizes(spec.n_params(), spec.bits)
    return flowmodel.incast_s(senders=len(hosts) - 1, frames=frames, frame_bytes=full,
                              trimmed_bytes=head, access_mbps=float(link.bw_mbps),
                              port_mbps=rate, threshold_bytes=threshold, mode=mode).time_s


def run_trace(net, specs: list[TrainingSpec], progress=None, on_start=None,
              on_end=None, on_tick=None, on_switch=None,
              fallback_spare: SpareFallbackServer | None = None) -> list[TrainingResult]:
    """Run every job of ``specs`` on ``net``, each started ``start_s`` after the trace began
    on its own hosts; returns their results in the order of ``specs``.

    ``progress(text)``: called when a job starts and ends. ``on_start(index, spec)``: called
    when a job's start time comes; the spec it returns is the one launched (e.g. a provider's
    plan for the job; an exception fails the job's start). ``on_end(index, result)``: called
    once a job ended or failed to start. ``on_tick(running)``: called every
    :data:`POLL_S` with ``{index: last finished iteration or None}`` of the running jobs
    (rank 0 reports each iteration; read just before the call, so that a provider reading
    the network's counters in it pairs them with the iterations they carried); it returns
    ``{index: spec}`` for the jobs to move to a new plan (communication fields of ``spec``),
    which they apply at an
    iteration boundary (``replan.py``; without ``on_tick`` a job keeps its plan). Jobs whose
    start time comes in the same poll all pass through ``on_start`` before any is launched,
    then through ``on_tick`` (iteration None): a spec it returns for one of them is the one
    launched (an earlier arrival's plan may have changed with a later one's).
    ``on_switch(index, spec)``: called when every rank of a running job moved to the plan of
    ``spec`` (one ``on_tick`` returned), before the next ``on_tick``. A job whose
    INA registration a switch refuses for memory waits for it (retried every :data:`POLL_S`,
    up to :data:`ADMISSION_WAIT_S` times its dilation; ``queued_s`` in its summary) while the
    others run, and fails to start with the switch's refusal after that. Shared-pool INA
    plans start host fallbacks from ``fallback_spare`` (a :class:`SpareFallbackServer` the
    caller keeps across traces; by default, with ``on_tick`` on a programmable fabric, the
    trace keeps its own), so that neither the job nor the loop re-planning the others waits
    for a Python process to start. Raises
    ``ValueError`` for bad specs (nothing is started then)."""
    check_trace(specs, len(net.hosts))
    say = progress or (lambda text: None)
    jobs = [_Job(k, s, net) for k, s in enumerate(specs)]
    waiting = sorted(jobs, key=lambda j: j.spec.start_s * j.spec.time_dilation)
    queued: list[tuple[_Job, float]] = []  # refused by a switch for memory: (job, arrival)
    refused: set[int] = set()
    running: list[_Job] = []
    results: dict[int, TrainingResult] = {}
    restarts: list[list] = []  # engines started again during the trace
    t0 = time.monotonic()

    def fail(job: _Job, e: Exception) -> None:
        job.kill()
        results[job.index] = job._rows({"error": f"start failed: {e}"})
        say(f"job {job.index} ({job.spec.label()}) failed to start: {e}")
        if on_end is not None:
            on_end(job.index, results[job.index])

    # shared-pool INA plans start host fallbacks, which a job (and the loop that re-plans
    # running jobs) would wait for: one fallback server is kept started ahead
    spares = contextlib.ExitStack()
    keep = fallback_spare
    if keep is None and on_tick is not None and \
            getattr(getattr(net, "topo", None), "programmable", False):
        keep = spares.enter_context(SpareFallbackServer())

    def start(job: _Job, arrival: float) -> None:
        job.spare = keep
        try:
            job.launch(t0, replan=on_tick is not None)
        except AdmissionRefused as e:
            job.kill()  # nothing started; the same handle tries again
            waited = time.monotonic() - arrival
            if waited > ADMISSION_WAIT_S * job.spec.time_dilation:
                fail(job, CollectiveError(f"{e} (refused for {waited:.0f} s)"))
                return
            if job.index not in refused:
                refused.add(job.index)
                say(f"job {job.index} ({job.spec.label()}) waits for switch memory: {e}")
            queued.append((job, arrival))
            return
        except (CollectiveError, ValueError, RuntimeError, OSError) as e:
            fail(job, e)
            return
        running.append(job)
        if job.index in refused:
            job.queued_s = job.t_start - arrival
        say(f"job {job.index} ({job.spec.label()}) started on "
            f"{', '.join(h.name for h in job.hosts)}"
            + (f" after waiting {job.queued_s:.2f} s for switch memory" if job.queued_s else ""))

    try:
        while waiting or running or queued:
            retry, queued[:] = list(queued), []
            for job, arrival in retry:
                start(job, arrival)
            now = time.monotonic()
            due: list[_Job | None] = []
            while waiting and now - t0 >= waiting[0].spec.start_s * waiting[0].spec.time_dilation:
                job = waiting.pop(0)
                try:
                    if on_start is not None:
                        spec = on_start(job.index, job.spec)
                        spec.validate(len(net.hosts))
                        job = _Job(job.index, spec, net)
                except (CollectiveError, ValueError, RuntimeError, OSError) as e:
                    fail(job, e)
                    continue
                due.append(job)
            if on_tick is not None and len(due) > 1:
                # jobs arriving together are planned together: a later one's admission may
                # have changed an earlier one's plan, and launched on the old one that job
                # would hold (e.g. switch memory) what its newer plan gave away
                for job in running:
                    job.poll()
                wanted = on_tick({**{j.index: j.iteration for j in running},
                                  **{j.index: None for j in due}}) or {}
                for job in running:
                    if job.index in wanted:
                        job.want(wanted[job.index])
                for k, job in enumerate(due):
                    if job.index in wanted:
                        try:
                            wanted[job.index].validate(len(net.hosts))
                            due[k] = _Job(job.index, wanted[job.index], net)
                        except ValueError as e:
                            fail(job, e)
                            due[k] = None
                            continue
                        if on_switch is not None:  # it starts on that plan
                            on_switch(job.index, wanted[job.index])
            for job in due:
                if job is not None:
                    start(job, time.monotonic())
            for job in [j for j in running if j.finished()]:
                running.remove(job)
                results[job.index] = res = job.result()
                if on_end is not None:
                    on_end(job.index, res)
                say(f"job {job.index} ({job.spec.label()}) "
                    + (f"failed: {res.error}" if res.error else
                       f"done: accuracy {res.summary['final_accuracy']}, "
                       f"{res.summary['jct_s']:.3g} s"))
            if on_tick is not None and running:
                for job in running:  # may register a plan or drop one: slow at times
                    job.poll()
                for job in running:  # so again: the iterations reported up to the tick
                    job.poll()
                    while job.in_force:
                        applied = job.in_force.pop(0)
                        if on_switch is not None:
                            on_switch(job.index, applied)
                wanted = on_tick({j.index: j.iteration for j in running}) or {}
                for job in running:
                    if job.index in wanted:
                        job.want(wanted[job.index])
            dead = getattr(net, "dead_engines", dict)()
            if dead:
                what = ", ".join(f"{node} (exit status {code})"
                                 for node, code in sorted(dead.items()))
                ina = [j.spec.label() for j in running if is_offloaded(j.current.algo)]
                if ina or not hasattr(net, "restart_engine") or \
                        len(restarts) >= MAX_ENGINE_RESTARTS:
                    why = (f"; {ina} aggregate in the network, whose rounds died with it"
                           if ina else "")
                    raise TrainingError(f"the data-path engine of {what} died during "
                                        f"training{why}")
                # TCP jobs ride it out (their connections retransmit): start it again
                done = _restart(net, dead)
                restarts += done
                for job in running:
                    job.engine_restarts += done
                say(f"engine of {what} restarted; the jobs go on")
            for job in running:
                if time.monotonic() - job.t_start > job.limit_s:
                    raise TrainingError(f"job {job.index} ({job.spec.label()}) did not "
                                        f"finish within {job.limit_s:.0f} s")
            time.sleep(POLL_S)
    except BaseException:  # Ctrl-C included: no pool and no switch partition survives
        for job in running + [q for q, _ in queued]:
            job.kill()
        raise
    finally:
        spares.close()
    return [results[k] for k in range(len(jobs))]
