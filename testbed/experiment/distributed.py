"""Distributed sweeps: the sweep points of an experiment run on the machines of a Dask cluster.

``testbed run FILE --executor dask --scheduler tcp://HOST:8786`` (:func:`run_distributed`)
sends each sweep point to a Dask worker. There it runs as a normal local experiment of one
point (:func:`testbed.experiment.runner.run_point`) under that machine's emulation lock, into a
temporary folder; its rows and files (counters, captures, training iterations) come back into
the results folder on this machine as each point finishes. Every row says where it ran
(``worker_host``, ``worker_cpu``) and how often its point was started (``attempts``); the
metadata has each point's machine, code revision and lock wait (``machines``). Rows keep the
run numbers, point indices and seeds of a local run of the same file, so the two results
folders line up row by row; the rows are put back in run order when the sweep ends.

Failures are never silent. A point whose worker dies (machine, process, connection) is started
again on another worker by the Dask scheduler, up to its ``allowed-failures`` setting (Dask's
default: 3 deaths); past that, or when a point raises, each of its runs that has no row gets a
failed row saying why. Before a point builds its network the worker removes what a dead
predecessor left on that machine (``testbed cleanup``, under the emulation lock, where
whatever is left belongs to a dead run), so a retry on the same machine can build its network.

Why Dask (``dask.distributed``) and not Ray: a sweep point is a coarse, independent task of
seconds to minutes whose result is a few rows and small files. Both engines schedule that;
Dask does it in pure Python (one ``pip install`` per machine, the same venv as the testbed, no
native runtime, object store or dashboard processes that would compete with the emulator for
the cores), re-runs the task of a dead worker by itself, streams results back as they finish
(``as_completed``), and its ``LocalCluster`` runs the same code path on one machine for the
tests. Ray's strengths (actors, a shared-memory object store, GPU scheduling) serve nothing here.

Run one worker process with one thread per emulation machine (``dask worker tcp://HOST:8786
--nworkers 1 --nthreads 1``; one network per machine runs at a time anyway) and start the
scheduler with ``DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION=1.0`` so that a point waits at
the scheduler, not behind another point on a busy machine; see ``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from testbed import describe_error
from testbed.cleanup import cleanup, leftovers
from testbed.experiment.results import Results, ResultsStore, machine_info
from testbed.experiment.runner import (
    RunAborted,
    default_out_dir,
    error_rows,
    final_status,
    plan_runs,
    progress_reporter,
    run,
    run_metadata,
    run_point,
)
from testbed.experiment.spec import Experiment, expand_sweep, load_experiment
from testbed.experiment.train import ITERATIONS_FILE
from testbed.netlock import emulation_lock

try:  # the optional [distributed] extra; run_distributed says how to install it when missing
    import dask
    from distributed import Client, LocalCluster, as_completed, get_worker
    from distributed.scheduler import KilledWorker
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    _MISSING: ImportError | None = _e
else:
    _MISSING = None

#: Seconds to wait for the scheduler to answer, and for a first worker to join it.
CONNECT_TIMEOUT_S = 20.0
WORKER_WAIT_S = 60.0
#: Seconds a point waits for its machine's emulation lock (someone else's network) before it
#: fails with ``EmulationBusy``.
LOCK_WAIT_S = 3600.0
#: Files of a point's folder that the results folder rebuilds itself (not copied back).
_STORE_FILES = ("rows.jsonl", "results.csv", "results.parquet", "metadata.json")
#: Files that several points append to (copied back by appending).
_APPENDED_FILES = (ITERATIONS_FILE,)
#: Columns every distributed row gets.
PROVENANCE_COLUMNS = ("worker_host", "worker_cpu", "attempts")


class DistributedError(RuntimeError):
    """The Dask cluster cannot run the sweep (scheduler unreachable, no worker, no extra)."""


# -- on the worker --------------------------------------------------------------------------------

_POINT_LOCK = threading.Lock()  # a worker with several threads still runs one point at a time


def run_point_here(experiment: dict, index: int, topic: str | None = None,
                   doctor: bool = False) -> dict[str, Any]:
    """Run sweep point ``index`` of ``experiment`` on this machine (the Dask task).

    Returns ``{"rows", "files", "metadata", "worker", "stale_removed", "error"}``: the point's
    rows as its ``rows.jsonl`` records them, its other files (relative path -> bytes), its
    metadata, where it ran, what a dead predecessor had left, and the error that stopped the
    point early (``None`` when it ran to the end; failed runs are rows, not this error).
    """
    machine = machine_info()
    where: dict[str, Any] = {"host": machine["hostname"], "cpu_model": machine["cpu_model"],
                             "pid": os.getpid()}
    with contextlib.suppress(ValueError):  # ValueError: not inside a Dask worker
        worker = get_worker()
        where["address"] = worker.address
        if topic:  # the client counts a point's starts from these events
            worker.log_event(topic, {"point": index, **where, "time": time.time()})
    t0 = time.monotonic()
    with _POINT_LOCK, emulation_lock(timeout=LOCK_WAIT_S):
        where["lock_wait_s"] = round(time.monotonic() - t0, 2)
        stale = _remove_stale()
        tmp = Path(tempfile.mkdtemp(prefix="testbed-point-"))
        try:
            error = None
            try:
                run_point(experiment, index, tmp, progress=False, doctor=doctor)
            except Exception as e:  # noqa: BLE001 - the client records it against the runs
                error = describe_error(e)
            return {"rows": _read_rows(tmp), "files": _read_files(tmp),
                    "metadata": _read_json(tmp / "metadata.json"), "worker": where,
                    "stale_removed": stale, "error": error}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale() -> dict[str, list[str]]:
    """Remove what a dead run left on this machine (the caller holds the emulation lock)."""
    if os.geteuid() != 0:
        return {}
    left = leftovers()
    if not any(left.values()):
        return {}
    removed = cleanup()
    return {k: v for k, v in removed.items() if v}


def _read_rows(folder: Path) -> list[dict]:
    path = folder / "rows.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _read_files(folder: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in _STORE_FILES and not rel.endswith(".tmp"):
            out[rel] = path.read_bytes()
    return out


# -- on the client --------------------------------------------------------------------------------

def run_distributed(experiment: Experiment | str | Path | dict, scheduler: Any,
                    out_dir: str | Path | None = None, progress: bool = True,
                    doctor: bool = True, results_root: str | Path | None = None) -> Results:
    """Run ``experiment``'s sweep points on the workers of a Dask cluster; rows stream into
    ``out_dir`` (default ``<results root>/<name>-<timestamp>``) as points finish.

    ``scheduler``: the scheduler's address (``tcp://HOST:8786``), a ``distributed.Client`` or
    a cluster object (``LocalCluster``). ``doctor``: each point's worker stores its ``testbed
    doctor`` summary in ``machines``. Returns the :class:`Results` of the whole sweep, as
    :func:`testbed.experiment.run` does; raises :class:`RunAborted` when ``stop_on_error``
    stopped it (finished points are kept) and :class:`DistributedError` when no cluster can run
    it (nothing is written then).
    """
    if _MISSING is not None:
        raise DistributedError(f"distributed sweeps need dask.distributed ({_MISSING}): "
                               "install the testbed's [distributed] extra, pip install -e "
                               "'.[distributed]' (make setup installs it)")
    exp = load_experiment(experiment)
    points = expand_sweep(exp)
    plan = plan_runs(points)
    client, owned = _connect(scheduler)
    try:
        try:
            client.wait_for_workers(1, timeout=WORKER_WAIT_S)
        except TimeoutError:
            raise DistributedError(
                f"no Dask worker joined the scheduler {client.scheduler.address} within "
                f"{WORKER_WAIT_S:.0f} s: start one on each emulation machine with 'dask "
                f"worker {client.scheduler.address} --nthreads 1'") from None
        out = Path(out_dir) if out_dir is not None else default_out_dir(exp, results_root)
        meta = run_metadata(exp, plan, doctor=False)  # the client builds no network
        meta["executor"] = {"kind": "dask", "scheduler": client.scheduler.address,
                            "workers_at_start": len(client.scheduler_info()["workers"])}
        meta["machines"] = []
        store = ResultsStore(out, meta)
        _Sweep(client, exp, plan, store, doctor).run(progress)
    finally:
        if owned:
            client.close()
    return Results.load(out)


def _connect(scheduler: Any) -> tuple[Any, bool]:
    """A client for ``scheduler`` and whether it is ours to close."""
    if isinstance(scheduler, Client):
        return scheduler, False
    try:
        if hasattr(scheduler, "scheduler_address"):  # a cluster object
            return Client(scheduler, set_as_default=False), True
        return Client(str(scheduler), timeout=CONNECT_TIMEOUT_S, set_as_default=False), True
    except (OSError, TimeoutError) as e:
        raise DistributedError(
            f"could not reach the Dask scheduler at {scheduler} ({type(e).__name__}: {e}): "
            "start one with 'dask scheduler' and give the address it prints") from None


class _Sweep:
    """One distributed sweep: submits the points, files what comes back, keeps the status."""

    def __init__(self, client, exp: Experiment, plan: list[tuple], store: ResultsStore,
                 doctor: bool):
        self.client, self.exp, self.store, self.doctor = client, exp, store, doctor
        self.parts: dict[int, list[tuple]] = {}
        self.first: dict[int, int] = {}
        for k, entry in enumerate(plan):
            self.parts.setdefault(entry[0], []).append(entry)
            self.first.setdefault(entry[0], k)
        self.total = len(plan)
        self.topic = f"testbed-sweep-{uuid.uuid4().hex[:12]}"
        self.git = store.metadata.get("git", {}).get("commit")

    def run(self, progress: bool) -> None:
        payload = self.exp.model_dump(mode="json")
        futures = {}

        def wind_up() -> None:
            # A cancelled point that already started runs to its end on its worker (a thread
            # cannot be stopped); its result is dropped.
            self.client.cancel([f for f in futures if not f.done()])
            self.store.sort_rows("run")

        with final_status(self.store, wind_up):
            for pi in self.parts:
                fut = self.client.submit(run_point_here, payload, pi, self.topic, self.doctor,
                                         key=f"{self.topic}-point-{pi}", pure=False)
                futures[fut] = pi
            with progress_reporter(progress, self.total, self.exp.name) as advance:
                for fut in as_completed(list(futures), loop=self.client.loop):
                    rows = self._collect(futures[fut], fut)
                    for row in {r["run"]: r for r in rows}.values():
                        advance(_text(row))
                    failed = [r for r in rows if r.get("status") != "ok"]
                    if failed and self.exp.stop_on_error:
                        raise RunAborted(f"run {failed[0]['run']} failed: {failed[0]['error']}")

    def _starts(self, pi: int) -> list[dict]:
        """Where point ``pi`` was started, oldest first (from the workers' events)."""
        try:
            events = self.client.get_events(self.topic)
        except Exception:  # noqa: BLE001 - attempts are provenance, never a reason to fail
            return []
        return [msg for _, msg in events if isinstance(msg, dict) and msg.get("point") == pi]

    def _collect(self, pi: int, fut) -> list[dict]:
        """File point ``pi``'s outcome: its rows, a failed row for every run without one, its
        files and machine; returns the rows appended."""
        starts = self._starts(pi)
        if fut.status == "finished":
            got = fut.result()
            where, rows, error = got["worker"], got["rows"], got["error"]
            self._copy_files(got["files"])
            self._note_machine(pi, got, len(starts))
        else:
            where = starts[-1] if starts else {}
            rows, error = [], _explain(fut.exception(), starts)
        have = {r.get("run") for r in rows}
        for k, entry in enumerate(self.parts[pi]):
            run_idx = self.first[pi] + k
            if run_idx not in have:
                why = error or "the point ended without a row for this run"
                rows += error_rows([entry], run_idx, why)
        for row in sorted(rows, key=lambda r: r["run"]):
            row.update(worker_host=where.get("host"), worker_cpu=where.get("cpu_model"),
                       attempts=max(len(starts), 1))
            self.store.append(row)
        return rows

    def _copy_files(self, files: dict[str, bytes]) -> None:
        for rel, data in files.items():
            path = self.store.path / rel
            if not path.resolve().is_relative_to(self.store.path.resolve()):
                continue  # a path that leaves the results folder is no file of ours
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab" if rel in _APPENDED_FILES else "wb") as f:
                f.write(data)

    def _note_machine(self, pi: int, got: dict, attempts: int) -> None:
        meta, where = got["metadata"], got["worker"]
        commit = (meta.get("git") or {}).get("commit")
        entry = {"point": pi, **where, "attempts": max(attempts, 1),
                 "machine": meta.get("machine"), "git": meta.get("git"),
                 "packages": meta.get("packages"), "doctor": meta.get("doctor"),
                 "stale_removed": got["stale_removed"], "status": meta.get("status")}
        md = self.store.metadata
        md["machines"].append(entry)
        md["networks"] += [{**n, "host": where.get("host")} for n in meta.get("networks", [])]
        if commit and self.git and commit != self.git:
            md.setdefault("warnings", []).append(
                f"point {pi} ran on {where.get('host')} at revision {commit[:12]}, this "
                f"machine is at {self.git[:12]}: its rows may come from other code")
        self.store.write_metadata()


def _explain(exc: BaseException | None, starts: list[dict]) -> str:
    hosts = ", ".join(dict.fromkeys(str(s.get("host")) for s in starts)) or "unknown"
    if isinstance(exc, KilledWorker):
        return (f"WorkerDied: the worker running this point died {len(starts) or 'too many'} "
                f"time(s) (on {hosts}) and the scheduler gave up on it ({exc})")
    return f"{type(exc).__name__}: {exc} (on {hosts})"


def _text(row: dict) -> str:
    where = f"on {row.get('worker_host')}"
    if row.get("status") != "ok":
        return f"{row.get('label')} {row.get('bytes')} B {where}: FAILED {row.get('error')}"
    return (f"{row.get('label')} n={row.get('n')} {row.get('bytes')} B {where}: "
            f"{row.get('time_s', float('nan')):.4g} s correct={row.get('correct')}")


# -- the same rows as a local run -----------------------------------------------------------------

#: A 6-point sweep (3 algorithms x 2 star sizes) that :func:`compare_with_local` runs both ways.
SIX_POINTS = {"name": "distributed-check", "seed": 5,
              "topology": {"kind": "star", "n_hosts": 2, "bw_mbps": 100,
                           "switch": "programmable"},
              "jobs": [{"algo": "ring", "nbytes": "256KiB"}],
              "sweep": {"topology.n_hosts": [2, 3], "jobs.0.algo": ["ring", "hd", "ina"]}}
#: Columns that do not depend on timing: equal in a local and a distributed run of one file.
SAME_COLUMNS = ("run", "point", "job", "label", "op", "algo", "n", "bytes", "count", "seed",
                "correct", "max_abs_err", "status")


def compare_with_local(experiment: Experiment | str | Path | dict = SIX_POINTS,
                       scheduler: Any = None, workers: int = 2,
                       out: str | Path | None = None) -> dict[str, Any]:
    """Run ``experiment`` here, then through the Dask executor, and compare their rows.

    ``scheduler``: a running cluster's address; ``None`` starts a ``LocalCluster`` of
    ``workers`` processes on this machine (they take turns at its emulation lock). Returns
    the comparison: whether the timing-free columns (:data:`SAME_COLUMNS` and the sweep
    columns) are equal, how many rows are correct, both wall times and their ratio, the CPU.
    """
    exp = load_experiment(experiment)
    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="testbed-compare-"))
    t0 = time.monotonic()
    local = run(exp, out_dir=root / "local", progress=False, doctor=False)
    t_local = time.monotonic() - t0
    cluster = None
    if scheduler is None:
        with dask.config.set({"distributed.scheduler.worker-saturation": 1.0}):
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   dashboard_address=None)
        scheduler = cluster
    try:
        t0 = time.monotonic()
        dist = run_distributed(exp, scheduler, out_dir=root / "distributed", progress=False,
                               doctor=False)
        t_dist = time.monotonic() - t0
    finally:
        if cluster is not None:
            cluster.close()
    cols = [c for c in (*SAME_COLUMNS, *exp.sweep) if c in local.df.columns]
    missing = [c for c in cols if c not in dist.df.columns]
    return {"points": len(expand_sweep(exp)), "rows_local": len(local.df),
            "rows_distributed": len(dist.df),
            "same_rows": not missing and local.df[cols].equals(dist.df[cols]),
            "columns_compared": cols,
            "correct_local": int(local.df.get("correct", []).sum()),
            "correct_distributed": int(dist.df.get("correct", []).sum()),
            "workers": sorted({m.get("address") or m.get("host") for m in
                               dist.metadata["machines"]}),
            "wall_local_s": round(t_local, 1), "wall_distributed_s": round(t_dist, 1),
            "wall_ratio": round(t_dist / t_local, 2), "cpu_model": machine_info()["cpu_model"],
            "folders": [str(local.path), str(dist.path)]}


def main(argv: list[str] | None = None) -> int:
    """``python -m testbed.experiment.distributed [FILE] [--scheduler ADDR] [--workers N]``:
    :func:`compare_with_local` on FILE (default the built-in 6-point sweep), as JSON."""
    ap = argparse.ArgumentParser(prog="python -m testbed.experiment.distributed",
                                 description=main.__doc__)
    ap.add_argument("file", nargs="?", help="experiment file (default: a 6-point sweep)")
    ap.add_argument("--scheduler", help="a running Dask scheduler (default: a LocalCluster)")
    ap.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes")
    ap.add_argument("--out", help="folder for both results folders (default: a temporary one)")
    args = ap.parse_args(argv)
    report = compare_with_local(args.file or SIX_POINTS, args.scheduler, args.workers, args.out)
    print(json.dumps(report, indent=1))
    return 0 if report["same_rows"] else 1


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy: Dask sends run_point_here to
    # the workers by reference to its module, which a __main__ function has not.
    from testbed.experiment.distributed import main as _main

    raise SystemExit(_main())
