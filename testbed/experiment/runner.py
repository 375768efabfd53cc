"""Run an experiment: build the network(s), run every job of every sweep point, tear down.

``run(experiment, out_dir=None, progress=True) -> Results``. Consecutive sweep points that
describe the same network (topology, impairments, trimming, codec, cross traffic, capture)
share one built network, so a size or algorithm sweep pays the set-up once. Each finished run
is on disk (see :mod:`testbed.experiment.results`) before the next one starts; a failed run is
recorded as a row with ``status='error'`` and the runner goes on (unless ``stop_on_error``).
The jobs of a ``concurrent`` point run at the same time, each in a thread (tenants of one
fabric); each gets its own rows, with ``concurrent_jobs`` (1 for a job run alone).
The network is torn down on every exit path, Ctrl-C included (``TestbedNet`` does it in its
``__exit__``; cross traffic and captures are stopped in ``finally`` blocks here). A caller's
``stop`` event (the live view's Stop button) ends the experiment the same way between two runs,
and ``run`` returns the runs done so far (status ``stopped``).

A network of an experiment with ``time_dilation = "auto"`` is calibrated once, right after
it is built, with the collectives its runs will do (:func:`testbed.collectives.dilation.
calibrate`); the factor and the calibration runs are in the metadata (``networks``), the
factor in every row (``time_dilation``).

Why one module this long: the experiment life cycle (plan, networks, batches of concurrent jobs,
training items, rows, teardown on errors and Ctrl-C) whose error paths must be read together;
measurement helpers live in their own modules.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from testbed import at_once, describe_error
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.dilation import calibrate
from testbed.collectives.spec import communication_of
from testbed.experiment import results, train
from testbed.experiment.faults import FaultSchedule
from testbed.experiment.incast import run_incast
from testbed.experiment.networks import flatten_counters, network_for, port_bytes_by_role
from testbed.experiment.results import (
    Results,
    ResultsStore,
    doctor_summary,
    git_revision,
    machine_info,
    package_versions,
)
from testbed.experiment.spec import (
    Experiment,
    JobSpec,
    expand_sweep,
    experiment_kind,
    load_experiment,
    parse_experiment,
    read_experiment_file,
)
from testbed.kernels.wire import Flags, MsgType
from testbed.netlock import emulation_lock

#: The "size" of a launched script's run in a plan (see :func:`plan_runs`).
LAUNCH = "launch"
#: The "size" of a point's replayed traces' run (all its ``[[replay]]`` at once).
REPLAY = "replay"


class RunAborted(RuntimeError):
    """Raised by :func:`run` when ``stop_on_error`` stopped the experiment at a failure."""


class RunStopped(Exception):
    """The caller's ``stop`` event was set: the experiment ends before its next run."""


def default_out_dir(exp: Experiment, root: str | Path | None = None) -> Path:
    """``<root>/<name>-<UTC timestamp>`` (unique), ``root`` by default the results root
    (``TESTBED_RESULTS``, see :func:`testbed.experiment.results.results_root`)."""
    return results.unique_folder(results.results_root() if root is None else root, exp.name)


def load_any(source) -> Any:
    """The experiment in ``source`` (a path, a dict, or an experiment object) of whichever
    kind it declares (:data:`~testbed.experiment.spec.EXPERIMENT_KINDS`): an
    :class:`Experiment` or a :class:`~testbed.experiment.cooperation.CooperationExperiment`;
    :class:`ExperimentError` listing the problems."""
    from testbed.experiment.cooperation import CooperationExperiment, load_cooperation

    if isinstance(source, Experiment | CooperationExperiment):
        return load_experiment(source) if isinstance(source, Experiment) else source
    data = source if isinstance(source, dict) else read_experiment_file(source)
    name = "object" if isinstance(source, dict) else str(source)
    if experiment_kind(data, name) == "cooperation":
        return load_cooperation(data if isinstance(source, dict) else source)
    return parse_experiment(data, name)


def run(experiment, out_dir: str | Path | None = None, progress: bool = True,
        doctor: bool = True, results_root: str | Path | None = None,
        stop: threading.Event | None = None) -> Results:
    """Run ``experiment`` (object, dict or TOML/YAML path, of any kind: see :func:`load_any`)
    and return its :class:`Results`.

    ``out_dir``: results folder (default ``<results root>/<name>-<timestamp>``). ``progress``: show a
    progress bar (a co-operation trace: its lines on stderr). ``doctor``: store ``testbed
    doctor``'s summary in the metadata. ``stop``: an event (e.g. set from another thread);
    once set, no further run starts, the network is torn down, and the results hold the runs
    done so far with the status ``stopped`` (a co-operation trace ignores it).
    """
    exp = load_any(experiment)
    out = Path(out_dir) if out_dir is not None else default_out_dir(exp, results_root)
    if exp.kind == "cooperation":  # the trace once per policy, on one network
        from testbed.experiment.cooperation import run_cooperation

        run_cooperation(exp, out, say=(lambda text: print(text, file=sys.stderr, flush=True))
                        if progress else (lambda text: None))
        return Results.load(out)
    plan = plan_runs(expand_sweep(exp))
    store = ResultsStore(out, run_metadata(exp, plan, doctor))
    _run_into(exp, plan, store, out, progress, stop=stop)
    return Results.load(out)


def run_point(experiment: Experiment | str | Path | dict, index: int, out_dir: str | Path,
              progress: bool = False, doctor: bool = False) -> Results:
    """Run only sweep point ``index`` of ``experiment`` into the results folder ``out_dir``.

    Its rows carry the run numbers, point index and sweep values they have in the whole
    experiment, and its files (counters, captures) the same run numbers, so points run apart,
    on other machines (:mod:`testbed.experiment.distributed`), merge into the folder a local
    run of the whole sweep writes. The metadata says which point (``point``) and from which
    run on (``first_run``).
    """
    exp = load_experiment(experiment)
    plan = plan_runs(expand_sweep(exp))
    part = [entry for entry in plan if entry[0] == index]
    if not part:
        raise ValueError(f"sweep point {index} does not exist: the experiment has points "
                         f"0..{plan[-1][0]}")
    first = plan.index(part[0])
    meta = run_metadata(exp, part, doctor)
    meta.update(point=index, first_run=first)
    store = ResultsStore(out_dir, meta)
    _run_into(exp, part, store, Path(out_dir), progress, first_run=first)
    return Results.load(out_dir)


def plan_runs(points: list[tuple[dict[str, Any], Experiment]]) -> list[tuple]:
    """Every run of an expanded sweep, in the order they run and are numbered:
    ``(point index, sweep values, point, job index, job, size)``; a training item has the
    item (a job, or a trace's list of jobs) as its job and ``None`` as its size, a launched
    script :data:`LAUNCH`, the point's replayed traces (one run, as tenants: their list as its
    job, ``None`` as its index) :data:`REPLAY`."""
    return [(pi, params, point, ji, job, size)
            for pi, (params, point) in enumerate(points)
            for ji, job, size in [(ji, job, size) for ji, job in enumerate(point.jobs)
                                  for size in job.sizes()]
            + [(ti, item, None) for ti, item in train.plan_items(point)]
            + [(li, job, LAUNCH) for li, job in enumerate(point.launch)]
            + ([(None, list(point.replay), REPLAY)] if point.replay else [])]


def run_metadata(exp: Experiment, plan: list[tuple], doctor: bool) -> dict[str, Any]:
    """The provenance a results folder starts with: the experiment, the code, the machine."""
    return {
        "name": exp.name,
        "description": exp.description,
        "seed": exp.seed,
        "experiment": exp.model_dump(mode="json"),
        "sweep_columns": list(exp.sweep),
        "time_dilation": exp.time_dilation,
        "planned_runs": len(plan),
        "git": git_revision(),
        "packages": package_versions(),
        "machine": machine_info(),
        "doctor": doctor_summary() if doctor else {"skipped": True},
        "networks": [],
    }


def _run_into(exp: Experiment, plan: list[tuple], store: ResultsStore, out: Path,
              progress: bool, first_run: int = 0, stop: threading.Event | None = None) -> None:
    """Run ``plan`` into ``store``, recording the final status on every exit path; a set
    ``stop`` ends it between two runs (status ``stopped``), without an exception."""
    with contextlib.suppress(RunStopped), ctrl_c_remembered() as ctrl_c, final_status(store), \
            progress_reporter(progress, len(plan), exp.name) as advance:
        _execute(exp, plan, store, out, advance, first_run, ctrl_c,
                 stop.is_set if stop is not None else (lambda: False))
        if ctrl_c():
            raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_remembered():
    """Yield ``ctrl_c()``: whether a Ctrl-C (SIGINT) came during the block. It still raises
    KeyboardInterrupt where it lands, but Python drops an exception raised inside a weakref
    callback or ``__del__`` ("Exception ignored in ..."), and a Ctrl-C landing there would be
    lost; the runner asks between runs. Off the main thread (no signals there) it never fires."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit.is_set
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored (SIG_IGN) or default: nothing of ours to chain
        yield hit.is_set
        return

    def remember(signum, frame):
        hit.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, remember)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def final_status(store: ResultsStore, before_finish=None):
    """Record how the block ended in ``store`` (completed, completed_with_errors, failed,
    interrupted, stopped, with the error), whatever ends it; ``before_finish()`` runs just
    before."""
    status, error = "completed", None
    try:
        yield
    except KeyboardInterrupt:
        status, error = "interrupted", "KeyboardInterrupt"
        raise
    except RunStopped:
        status, error = "stopped", "stopped on request"
        raise
    except RunAborted as e:
        status, error = "failed", str(e)
        raise
    except BaseException as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        if before_finish is not None:
            before_finish()
        if status == "completed" and store.metadata["failures"]:
            status = "completed_with_errors"
        store.finish(status, error)


def error_rows(entries: list[tuple], first_run: int, err: str) -> list[dict]:
    """Failed rows for the plan ``entries`` (see :func:`plan_runs`), numbered from
    ``first_run``: what a run that never ran, or whose result was lost, leaves."""
    rows = []
    for k, (pi, params, pt, ji, job, size) in enumerate(entries):
        jobs = job if isinstance(job, list) else [job]  # a trace: its jobs share one run
        for m, one in enumerate(jobs):
            rows.append(_error_row(first_run + k, pi, params, pt, m if ji is None else ji,
                                   one, size, err))
    return rows


def _execute(exp: Experiment, plan: list, store: ResultsStore, out: Path, advance,
             first_run: int = 0, ctrl_c=lambda: False, stopped=lambda: False) -> None:
    run_idx = first_run
    t0 = time.monotonic()
    # One lock for the whole experiment: no one else's network can interleave with ours.
    with emulation_lock():
        store.metadata["lock_wait_s"] = round(time.monotonic() - t0, 2)
        i = 0
        while i < len(plan):
            if stopped():
                raise RunStopped
            point = plan[i][2]
            key = point.network_key()
            j = i
            while j < len(plan) and plan[j][2].network_key() == key:
                j += 1
            group = plan[i:j]
            with contextlib.ExitStack() as stack:
                try:
                    net, desc = _open_network(stack, point)
                    cal = _calibrate(net, group)
                    store.metadata["networks"].append({
                        "points": sorted({g[0] for g in group}), "describe": desc,
                        "timings": dict(getattr(net, "timings", {})),
                        "time_dilation": net.time_dilation,
                        "calibration": cal.to_json() if cal is not None else None})
                    store.write_metadata()
                    xt = _start_cross_traffic(stack, net, point)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as e:  # the network failed: every run of the group fails
                    if _interrupted(e):
                        raise KeyboardInterrupt from e
                    err = describe_error(e)
                    rows = error_rows(group, run_idx, err)
                    for row in rows:
                        store.append(row)
                    for row in {r["run"]: r for r in rows}.values():  # one step per run
                        advance(f"{row['label']} {row['bytes']} B: network failed")
                    run_idx += len(group)
                    if exp.stop_on_error:
                        raise RunAborted(f"network set-up failed: {err}") from e
                    i = j
                    continue
                for batch in _batches(group):
                    if ctrl_c():  # one that landed where Python drops exceptions
                        raise KeyboardInterrupt
                    if stopped():
                        raise RunStopped
                    if batch[0][5] == REPLAY:  # the point's traces, tenants of the fabric
                        pi, params, pt, _, jobs, _ = batch[0]
                        _run_replay(store, net, out, run_idx, pi, params, pt, jobs)
                        failed = [r for r in store.rows[-len(jobs):] if r["status"] != "ok"]
                        if exp.stop_on_error and failed:
                            raise RunAborted(f"run {run_idx} failed: {failed[0]['error']}")
                        run_idx += 1
                        advance(_replay_text(store.rows[-len(jobs):], params))
                        continue
                    if batch[0][5] == LAUNCH:  # a user's script, alone on the fabric
                        pi, params, pt, ji, job, _ = batch[0]
                        _run_launch(store, net, out, run_idx, pi, params, pt, ji, job)
                        if exp.stop_on_error and store.rows[-1].get("status") != "ok":
                            raise RunAborted(f"run {run_idx} failed: {store.rows[-1]['error']}")
                        run_idx += 1
                        advance(f"{store.rows[-1]['label']}: {store.rows[-1]['status']}")
                        continue
                    if batch[0][5] is None:  # training: one job alone, or a trace of them
                        pi, params, pt, ji, job, _ = batch[0]
                        _run_training(store, net, out, run_idx, pi, params, pt, ji, job)
                        if exp.stop_on_error and store.rows[-1].get("status") != "ok":
                            raise RunAborted(f"run {run_idx} failed: {store.rows[-1]['error']}")
                        run_idx += 1
                        advance(_train_text(store.rows[-1], params))
                        continue
                    pt = batch[0][2]
                    outcomes, fault_cols = _run_batch(net, pt, [(g[4], g[5]) for g in batch],
                                                      out, run_idx, xt)
                    failed = None
                    for (pi, params, pt, ji, job, size), outcome in zip(batch, outcomes,
                                                                        strict=True):
                        if isinstance(outcome, BaseException):
                            if isinstance(outcome, (KeyboardInterrupt, SystemExit)) or \
                                    _interrupted(outcome):
                                raise KeyboardInterrupt from outcome
                            err = describe_error(outcome)
                            row = _error_row(run_idx, pi, params, pt, ji, job, size, err)
                            store.append({**row, **fault_cols})
                            failed = failed or (run_idx, err, outcome)
                        else:
                            for r in outcome:
                                store.append(_ok_row(run_idx, pi, params, pt, ji, job, size,
                                                     r))
                        run_idx += 1
                        advance(_run_text(store.rows[-1], params))
                    if failed is not None and exp.stop_on_error:
                        raise RunAborted(f"run {failed[0]} failed: {failed[1]}") from failed[2]
            i = j


def _batches(group: list) -> list[list]:
    """The runs of a network group in the order they run: one at a time, or all the jobs of a
    ``concurrent`` point at once (training items always alone: a trace shares the fabric its own
    way)."""
    out: list[list] = []
    for g in group:
        if (out and isinstance(g[5], int) and isinstance(out[-1][0][5], int)
                and g[2].concurrent and out[-1][0][0] == g[0]):
            out[-1].append(g)
        else:
            out.append([g])
    return out


def _run_training(store: ResultsStore, net, out: Path, run_idx: int, pi, params,
                  point: Experiment, index, item) -> None:
    """One training run (``train.plan_items``): a summary row per job (errors recorded as
    rows), the per-iteration rows in the iterations file. A job run alone also gets the data
    path's counters (``dp_*``); a trace's jobs share the fabric, so its rows have none."""
    jobs = item if index is None else [item]
    first = 0 if index is None else index
    before = _counters(net) if index is not None else None
    try:
        results = train.run_item(net, point, index, item)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        _record_failure(store, e, run_idx, pi, params, point, jobs, first)
        return
    dp_cols = _counter_deltas(before, _counters(net), out, run_idx, net=net) if before else {}
    for k, (job, (summary, its, trace)) in enumerate(zip(jobs, results, strict=True)):
        row = _ok_row(run_idx, pi, params, point, first + k, job, summary["bytes"],
                      {**summary, **dp_cols})
        if summary.get("error"):
            row["status"], row["error"] = "error", summary["error"]
        elif job.chakra_out and trace:  # what it ran, as a Chakra trace replay takes
            from testbed.workloads.chakra import export  # needs the [traces] extra: only when asked

            name = re.sub(r"[^A-Za-z0-9_.+-]", "_", job.label())
            prefix = Path(job.chakra_out) / f"{name}-run{run_idx:04d}"
            export(trace, prefix, 1 + max(r["rank"] for r in trace))
            row["chakra"] = str(prefix)
        store.append(row)
        train.append_iterations(out, {"run": run_idx, "point": pi, **params}, its)


def _run_launch(store: ResultsStore, net, out: Path, run_idx: int, pi, params,
                point: Experiment, index: int, job) -> None:
    """One launched script (``testbed.launch.run_script``): a row with its exit status, the
    time from the first rank's start to the last one's end, its collectives (how many, their
    time and the model's on rank 0); the trace and the ranks' output under
    ``launch/run<NNNN>/``."""
    # needs torch only when one runs
    from testbed.launch import backend_settings, planned_job, run_script

    folder = out / "launch" / f"run{run_idx:04d}"
    plan = plans = None
    try:
        if job.algo == "auto":
            tj, plan, _, plans = planned_job(net, job.hosts, job.hints, job.policy, 1 + index,
                                             job.label(), folder)
        else:
            tj = backend_settings(**communication_of(job), job_id=1 + index)
        done = run_script(net, job.script, job.args, tj, folder, hosts=job.hosts,
                          nproc_per_host=job.nproc_per_host,
                          timeout_s=job.timeout_s, echo=lambda line: None, plans=plans,
                          extra={"plan": plan.model_dump(), "policy": job.policy,
                                 "hints": job.hints} if plan else None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        _record_failure(store, e, run_idx, pi, params, point, [job], index)
        return
    mine = [r for r in done.trace if r["rank"] == 0]
    offloaded = [r for r in mine if r["path"].startswith("testbed:")]
    modelled = [r["model_s"] for r in offloaded if r.get("model_s")]
    report = {"op": "launch", "algo": tj.algo if tj is not None else "gloo",
              "compressor": tj.compressor if tj is not None else None,
              "error_feedback": bool(tj and tj.error_feedback), "n": len(done.returncodes),
              "planned_by": job.policy if plan else None,
              "plan_reason": plan.reason if plan else None,
              "replans": done.replans,
              "script": job.script, "returncode": done.returncode, "time_s": done.time_s,
              "collectives": len(mine), "offloaded_collectives": len(offloaded),
              "comm_s": sum(r["time_s"] for r in offloaded) if tj is not None else None,
              "model_comm_s": sum(modelled) if modelled else None,
              "correct": done.returncode == 0, "time_dilation": net.time_dilation}
    row = _ok_row(run_idx, pi, params, point, index, job, None, report)
    if done.returncode != 0:
        row["status"], row["error"] = "error", " | ".join(done.failures)[:2000]
    store.append(row)


def _run_replay(store: ResultsStore, net, out: Path, run_idx: int, pi, params,
                point: Experiment, jobs: list) -> None:
    """A point's replayed traces at once (``testbed.replay.replay_on``): a row per trace with
    its hosts, start and end on the run's clock, JCT against the model's for the trace alone,
    the provider's plan, whether every allreduce was exact; each trace's node, collective and
    validation tables and timeline under ``replay/run<NNNN>/<name>/``."""
    # needs torch and the [traces] extra only when one runs
    from testbed.replay import Tenant, replay_on

    folder = out / "replay" / f"run{run_idx:04d}"
    tenants = [Tenant(job.trace, arrival_s=job.arrival_s, algo=job.algo,
                      hints=job.hints or None, groups=job.comm_groups, scale=job.scale,
                      name=job.label()) for job in jobs]
    policies = [job.policy for job in jobs if job.algo == "auto"]
    try:
        done = replay_on(net, tenants, folder, timeout_s=max(job.timeout_s for job in jobs),
                         echo=lambda line: None,
                         policy=policies[0] if policies else "cooperative")
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        _record_failure(store, e, run_idx, pi, params, point, jobs)
        return
    for k, (job, t) in enumerate(zip(jobs, done.tenants, strict=True)):
        exact = t.get("max_abs_err") in (None, 0.0)
        report = {"op": "replay", "algo": (t.get("plan") or {}).get("algo") or job.algo
                  or "gloo", "compressor": (t.get("plan") or {}).get("compressor"),
                  "error_feedback": False, "n": t["ranks"], "trace": job.trace,
                  "hosts": ",".join(t["hosts"]), "arrival_s": t["arrival_s"],
                  "start_s": t.get("start_s"), "end_s": t.get("end_s"),
                  "time_s": t.get("jct_s"), "model_s": t.get("model_jct_s"),
                  "slowdown": t.get("slowdown"), "geomean_error_pct": t.get("geomean_error_pct"),
                  "collectives": t.get("collectives"), "max_abs_err": t.get("max_abs_err"),
                  "planned_by": job.policy if job.algo == "auto" else None,
                  "plan_reason": (t.get("plan") or {}).get("reason"),
                  "replans": t.get("replans"),
                  "correct": not t["failed"] and exact, "folder": t.get("folder"),
                  "time_dilation": net.time_dilation}
        row = _ok_row(run_idx, pi, params, point, k, job, None, report)
        if t["failed"]:
            row["status"], row["error"] = "error", t.get("error") or "failed"
        elif not exact:
            row["status"], row["error"] = "error", (f"an allreduce was off the exact sum by "
                                                    f"{t['max_abs_err']:g}")
        store.append(row)


def _replay_text(rows: list[dict], params: dict) -> str:
    sweep = " ".join(f"{k}={v}" for k, v in params.items())
    return "; ".join(
        f"{r.get('label')} {sweep}: FAILED {r.get('error')}" if r.get("status") != "ok" else
        f"{r.get('label')} {sweep}: JCT {r['time_s']:.4g} s (model "
        f"{r['model_s'] if r.get('model_s') is None else format(r['model_s'], '.4g')} s)"
        for r in rows)


def _record_failure(store: ResultsStore, e: Exception, run_idx: int, pi, params,
                    point: Experiment, jobs: list, first: int = 0) -> None:
    """A run of ``jobs`` (numbered from ``first``) that raised ``e``: an error row for each,
    or a KeyboardInterrupt when ``e`` came while a Ctrl-C was being handled."""
    if _interrupted(e):
        raise KeyboardInterrupt from e
    err = describe_error(e)
    for k, job in enumerate(jobs):
        store.append(_error_row(run_idx, pi, params, point, first + k, job, None, err))


def _train_text(row: dict, params: dict) -> str:
    sweep = " ".join(f"{k}={v}" for k, v in params.items())
    if row.get("status") != "ok":
        return f"{row.get('label')} {sweep}: FAILED {row.get('error')}"
    tta = row.get("tta_s")
    return (f"{row.get('label')} {sweep}: accuracy {row.get('final_accuracy'):.3f} after "
            f"{row.get('iterations')} iterations, {row.get('jct_s'):.3g} s"
            + (f" (target at {tta:.3g} s)" if tta is not None else ""))


def _run_text(row: dict, params: dict) -> str:
    sweep = " ".join(f"{k}={v}" for k, v in params.items())
    if row.get("status") != "ok":
        return f"{row.get('label')} {row.get('bytes')} B {sweep}: FAILED {row.get('error')}"
    return (f"{row.get('label')} n={row.get('n')} {row.get('bytes')} B {sweep}: "
            f"{row.get('time_s', float('nan')):.4g} s (model {row.get('model_s', float('nan')):.4g}"
            f" s) correct={row.get('correct')}")


def _interrupted(e: BaseException) -> bool:
    """Whether ``e`` was raised while a Ctrl-C was being handled (it must not hide it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__context__
    return False


def _base_row(run_idx, pi, params, point: Experiment, ji: int, job: JobSpec) -> dict:
    return {"run": run_idx, "point": pi, "job": ji, "label": job.label(), **params,
            "topology": point.topology.kind, "bw_mbps": point.topology.bw_mbps}


def _ok_row(run_idx, pi, params, point, ji, job, size, report: dict) -> dict:
    row = _base_row(run_idx, pi, params, point, ji, job)
    row.update(report)
    row.setdefault("bytes", size)
    row["status"], row["error"] = "ok", ""
    return row


def _error_row(run_idx, pi, params, point, ji, job, size, err: str) -> dict:
    row = _base_row(run_idx, pi, params, point, ji, job)
    row.update({"op": getattr(job, "op", "train"), "algo": job.algo, "bytes": size,
                "compressor": getattr(job, "compressor", None),
                "error_feedback": getattr(job, "error_feedback", False), "status": "error",
                "error": err})
    return row


# -- network ------------------------------------------------------------------------------------

def _calibrate(net, group: list):
    """Calibrate a network built with ``time_dilation = "auto"`` with the group's collectives
    (a ring allreduce over every host stands in for incasts); None for a fixed factor."""
    if net.time_dilation_requested != "auto":
        return None

    specs = [_collective_spec(job, size, pt) for (_pi, _params, pt, _ji, job, size) in group
             if isinstance(size, int) and job.op != "incast"]  # training, scripts: a ring
    return calibrate(net, specs or [CollectiveSpec(algo="ring", nbytes=4 << 20)], run_collective)


def _open_network(stack: contextlib.ExitStack, point: Experiment):
    net = stack.enter_context(network_for(point))
    try:
        desc = net.describe()
    except Exception as e:  # describe() is provenance only
        desc = {"error": str(e)}
    return net, desc


def _start_cross_traffic(stack: contextlib.ExitStack, net, point: Experiment) -> list:
    """Start every iperf3 flow of ``point``; return ``[(client process, src host), ...]``."""
    hosts = net.hosts
    flows = []
    for k, ct in enumerate(point.cross_traffic):
        if max(ct.src, ct.dst) >= len(hosts):
            raise ValueError(f"cross_traffic.{k}: host index {max(ct.src, ct.dst)} out of "
                             f"range; the network has {len(hosts)} hosts (0..{len(hosts) - 1})")
        port = 5301 + k
        src, dst = hosts[ct.src], hosts[ct.dst]
        server = dst.popen(["iperf3", "-s", "-p", str(port)])
        stack.callback(_stop, server)
        time.sleep(0.3)  # let the server listen before the client connects
        cmd = ["iperf3", "-c", dst.IP(), "-p", str(port), "-t", "86400", "-i", "0"]
        if ct.protocol == "udp":
            cmd += ["-u", "-b", f"{ct.bw_mbps or point.topology.bw_mbps}M"]
        elif ct.bw_mbps:
            cmd += ["-b", f"{ct.bw_mbps}M"]
        client = src.popen(cmd)
        stack.callback(_stop, client)
        flows.append((client, src))
    if point.cross_traffic and point.settle_s:
        time.sleep(point.settle_s)
    return flows


def _tx_bytes(host) -> int | None:
    """Bytes sent so far by ``host``'s interface (read inside its namespace)."""
    out = host.cmd(f"ip -s -j link show dev {host.defaultIntf().name}")
    try:
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _cross_traffic_cols(xt: list, before: list, seconds: float) -> dict[str, Any]:
    """Per flow k: ``xt<k>_mbps`` (its source's send rate during the run) and
    ``xt<k>_running`` (the iperf3 client was still running at the end)."""
    cols: dict[str, Any] = {}
    for k, ((client, src), b) in enumerate(zip(xt, before, strict=True)):
        a = _tx_bytes(src)
        cols[f"xt{k}_mbps"] = (a - b) * 8 / seconds / 1e6 if None not in (a, b) else None
        cols[f"xt{k}_running"] = client.poll() is None
    return cols


def _stop(proc, sig: int = signal.SIGTERM, wait_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=wait_s)
    except Exception:
        proc.kill()
        proc.wait(timeout=wait_s)


# -- one run ------------------------------------------------------------------------------------

def _collective_spec(job: JobSpec, size: int, point: Experiment):
    extra: dict[str, Any] = {}
    if job.hosts is not None:
        extra["hosts"] = list(job.hosts)
    if job.placement is not None:
        extra["placement"] = job.placement.as_dict()
    if point.concurrent:  # tenants of one fabric: distinct job ids (switch partitions, ports)
        extra["job_id"] = point.jobs.index(job) + 1
    return CollectiveSpec(op=job.op, nbytes=size, dtype=job.dtype, **communication_of(job),
                          servers=job.servers,
                          timeout_s=job.timeout_s,
                          seed=point.seed if job.seed is None else job.seed,
                          repetitions=job.repetitions, **{**extra, **job.options})


def _run_job(net, point: Experiment, job: JobSpec, size: int) -> list[dict]:
    if job.op == "incast":
        return _run_incast(net, point, job, size)
    return run_collective(net, _collective_spec(job, size, point))


def _run_batch(net, point: Experiment, runs: list[tuple[JobSpec, int]], out: Path,
               run_idx: int, xt: list | None = None
               ) -> tuple[list[list[dict] | BaseException], dict]:
    """Run ``runs`` (one, or the concurrent jobs of a point, each in its thread); per run its
    rows (with the data-path counter deltas, capture and cross-traffic columns of the whole
    batch, ``concurrent_jobs`` and ``fault_events``) or the exception it raised, and the
    ``fault_events`` column alone (for the rows of the runs that failed)."""
    xt = xt or []
    xt_before = [_tx_bytes(src) for _, src in xt]
    t0 = time.monotonic()
    before = _counters(net)
    outcomes: list[list[dict] | BaseException | None] = [None] * len(runs)

    def one(k: int) -> None:
        try:
            outcomes[k] = _run_job(net, point, *runs[k])
        except BaseException as e:  # noqa: BLE001 - reported per run by the caller
            outcomes[k] = e

    with contextlib.ExitStack() as stack:
        captures = _start_captures(stack, net, point, out, run_idx)
        # entered last, left first: the links are back before the captures stop
        faults = stack.enter_context(FaultSchedule(net, point.faults)) if point.faults \
            else None
        at_once(one, len(runs), "job")
        stack.close()  # stop tcpdump before reading its files
        cap_cols = _summarise_captures(captures, out, run_idx)
    after = _counters(net)
    roles = dict(getattr(getattr(net, "topo", None), "switch_roles", {}) or {})
    dp_cols = _counter_deltas(before, after, out, run_idx, roles, net,
                              time.monotonic() - t0)
    xt_cols = _cross_traffic_cols(xt, xt_before, time.monotonic() - t0) if xt else {}
    fault_cols = {"fault_events": faults.events} if faults is not None else {}
    extra = {**dp_cols, **cap_cols, **xt_cols, "concurrent_jobs": len(runs), **fault_cols}
    return [o if isinstance(o, BaseException) else [{**r, **extra} for r in o]
            for o in outcomes], fault_cols


def _run_incast(net, point: Experiment, job: JobSpec, size: int) -> list[dict]:
    seed = point.seed if job.seed is None else job.seed
    f = float(getattr(net, "time_dilation", 1.0))
    rows = []
    for rep in range(job.repetitions):
        # on a dilated network the receiver's idle timeout stretches, and the row reports
        # undilated time (its model already speaks of the undilated rates)
        row = run_incast(net, size, bits=int(job.options.get("bits", 1)), seed=seed + rep,
                         timeout_s=job.timeout_s * f,
                         idle_ms=float(job.options.get("idle_ms", 30.0)) * f)
        row.update(rep=rep, time_s=row["time_s"] / f, algbw=row["algbw"] * f,
                   busbw=row["busbw"] * f, fidelity=row["fidelity"] / f, time_dilation=f)
        rows.append(row)
    return rows


# -- data-path counters -------------------------------------------------------------------------

def _counter_deltas(before, after, out: Path, run_idx: int, roles: dict | None = None,
                    net=None, wall_s: float | None = None) -> dict[str, float]:
    """The run's counter changes: kept in ``counters/runNNNN.json``, drawn on the fabric in
    ``fabric/runNNNN.png`` (with ``net``; utilisation over ``wall_s``), summed into columns."""
    if before is None or after is None:
        return {}
    b, a = flatten_counters(before), flatten_counters(after)
    delta = {k: a[k] - b.get(k, 0.0) for k in a if a[k] != b.get(k, 0.0)}
    cdir = out / "counters"
    cdir.mkdir(exist_ok=True)
    (cdir / f"run{run_idx:04d}.json").write_text(json.dumps(delta, indent=1, sort_keys=True))
    if net is not None:
        _fabric_picture(net, delta, out, run_idx, wall_s)
    return {**summarize_counters(delta, a), **port_bytes_by_role(delta, roles or {})}


def _fabric_picture(net, delta: dict, out: Path, run_idx: int, wall_s: float | None) -> None:
    """``fabric/runNNNN.png``: the fabric with each link's bytes over the run; a picture
    that cannot be drawn is reported, never a reason to lose the run's rows."""
    from testbed.experiment import plots

    try:
        plots.use_headless()
        f = float(getattr(net, "time_dilation", 1.0))
        (out / "fabric").mkdir(exist_ok=True)
        fig = plots.plot_fabric(net.describe(), delta, seconds=wall_s / f if wall_s else None,
                                out=out / "fabric" / f"run{run_idx:04d}.png",
                                title=f"run {run_idx}: bytes per link")
        plots._pyplot().close(fig)
    except Exception as e:  # noqa: BLE001 - a picture, not a result
        print(f"testbed: could not draw the fabric of run {run_idx}: {e}", file=sys.stderr)


def _counters(net) -> dict | None:
    try:
        return net.counters()
    except Exception:
        return None


def summarize_counters(delta: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Row columns from flattened data-path counters, summed over nodes.

    ``dp_<stage>_<counter>`` from each stage's totals (or its per-port counters summed when it
    has no totals), ``dp_drops_<REASON>`` from the engines' drop reasons. High-water marks
    (``*hwm*``) are the largest value at the end of the run, not a difference.
    """
    totals: dict[tuple[str, str, str], float] = {}
    ports: dict[tuple[str, str, str], float] = {}
    cols: dict[str, float] = {}
    for path, v in delta.items():
        parts = path.split(".")
        if len(parts) < 4 or parts[0] != "datapath":
            continue
        node, rest = parts[1], parts[2:]
        if rest[0] == "drops" and len(rest) == 2:
            key = f"dp_drops_{rest[1]}"
            cols[key] = cols.get(key, 0.0) + v
        elif rest[0] == "stages" and len(rest) >= 3:
            stage, tail = rest[1], rest[2:]
            if "cpu" in tail[-1] or "hwm" in tail[-1]:
                continue
            if tail[0] == "totals" and len(tail) == 2:
                totals[(node, stage, tail[1])] = v
            elif tail[0] == "ports" and len(tail) == 3:
                k = (node, stage, tail[2])
                ports[k] = ports.get(k, 0.0) + v
            elif len(tail) == 1:
                totals[(node, stage, tail[0])] = v
    for k, v in ports.items():
        totals.setdefault(k, v)
    for (_node, stage, name), v in totals.items():
        key = f"dp_{stage}_{name}"
        cols[key] = cols.get(key, 0.0) + v
    for path, v in after.items():
        parts = path.split(".")
        if parts[0] == "datapath" and "stages" in parts and "hwm" in parts[-1]:
            key = f"dp_{parts[3]}_{parts[-1]}"
            cols[key] = max(cols.get(key, 0.0), v)
    return cols


# -- packet capture -----------------------------------------------------------------------------

def _node_of_interface(net, iface: str):
    name = iface.rsplit("-", 1)[0]
    try:
        return net.mininet.get(name)
    except KeyError:
        raise ValueError(f"capture.interfaces: {iface!r} does not belong to a node of this "
                         f"network (node {name!r} unknown)") from None


def _start_captures(stack, net, point: Experiment, out: Path, run_idx: int) -> list:
    if point.capture is None:
        return []
    pdir = out / "pcap"
    pdir.mkdir(exist_ok=True)
    caps = []
    for iface in point.capture.interfaces:
        node = _node_of_interface(net, iface)
        path = pdir / f"run{run_idx:04d}-{iface}.pcap"
        # --immediate-mode: without it the last buffered block (often the whole run) is lost
        # when the capture is stopped
        proc = node.popen(["tcpdump", "--immediate-mode", "-i", iface, "-s",
                           str(point.capture.snaplen),
                           "-c", str(point.capture.max_packets), "-U", "-w", str(path)])
        stack.callback(_stop, proc, signal.SIGINT)
        caps.append((iface, path))
    time.sleep(0.5)  # tcpdump needs a moment to attach before traffic starts
    return caps


def _summarise_captures(caps: list, out: Path, run_idx: int) -> dict[str, Any]:
    cols: dict[str, Any] = {}
    for iface, path in caps:
        s = summarize_pcap(path)
        (path.with_suffix(".json")).write_text(json.dumps(s, indent=1))
        tag = iface.replace("-", "_")
        cols[f"cap_{tag}_packets"] = s["packets"]
        cols[f"cap_{tag}_testbed"] = s["testbed_packets"]
        cols[f"cap_{tag}_trimmed"] = s["trimmed"]
    return cols


def summarize_pcap(path: str | Path) -> dict[str, Any]:
    """Count packets of a pcap with the scapy layer: total, testbed by message type, trimmed."""
    # here, not at the top: scapy's layers take over a second to import; only captures need them
    from scapy.utils import PcapReader

    from testbed.datapath import scapy_layer

    layer = getattr(scapy_layer, "TestbedHeader", None)
    summary: dict[str, Any] = {"packets": 0, "bytes": 0, "testbed_packets": 0,
                               "by_type": {}, "trimmed": 0, "dissector": bool(layer)}
    if not Path(path).exists():
        summary["error"] = "no capture file"
        return summary
    with PcapReader(str(path)) as reader:
        for pkt in reader:
            summary["packets"] += 1
            summary["bytes"] += len(pkt)
            if layer is None or layer not in pkt:
                continue
            h = pkt[layer]
            summary["testbed_packets"] += 1
            try:
                t = MsgType(int(h.msg_type)).name
            except ValueError:
                t = str(h.msg_type)
            summary["by_type"][t] = summary["by_type"].get(t, 0) + 1
            if int(h.flags) & Flags.TRIMMED:
                summary["trimmed"] += 1
    return summary


# -- progress -----------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    """``42 s``, ``3 min``, ``1.5 h``: a time left, as precise as an estimate is."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


@contextlib.contextmanager
def progress_reporter(enabled: bool, total: int, name: str):
    """Yield ``advance(text)``: a rich bar on a terminal, one printed line per run elsewhere
    (notebooks, logs), nothing when disabled; both say the time left, from the mean time of
    the runs done so far."""
    if not enabled:
        yield lambda text="": None
        return
    if _in_notebook() or not sys.stderr.isatty():
        done = [0]
        t0 = time.monotonic()

        def line(text: str = "") -> None:
            done[0] += 1
            spent = time.monotonic() - t0
            left = spent / done[0] * (total - done[0])
            print(f"[{name} {done[0]}/{total} {spent:6.1f} s, ~{_duration(left)} left] {text}",
                  flush=True)

        yield line
        return

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  transient=False) as bar:
        task = bar.add_task(name, total=total)
        yield lambda text="": bar.advance(task)
