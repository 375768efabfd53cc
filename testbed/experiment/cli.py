"""``testbed run FILE``: run an experiment file, print its table, write its results folder."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from rich.console import Console

from testbed.experiment.plots import plot_bars, plot_overview, use_headless
from testbed.experiment.results import results_root, strict_json
from testbed.experiment.runner import RunAborted, default_out_dir, load_any, run
from testbed.experiment.spec import ExperimentError, with_overrides
from testbed.experiment.train import (
    load_iterations,
    plot_accuracy,
    print_training_table,
    training_rows,
)


def run_file(path: str, out: str | Path | None = None, progress: bool = True,
             time_dilation: float | str | None = None, json_out: bool = False,
             executor: str | None = None, scheduler: str | None = None) -> int:
    """Run the experiment in ``path``; results under ``out/<name>-<timestamp>/``.

    ``time_dilation`` (a factor or ``"auto"``) replaces the file's ``time_dilation``.
    ``json_out``: print one JSON object per summary row (every run's row; a training job's
    summary row) on stdout, and the tables and messages on stderr, for scripts.
    ``executor``: ``"local"`` (here, the default without ``scheduler``) or ``"dask"`` (each
    sweep point on a worker of the Dask cluster whose scheduler is at ``scheduler``, see
    :mod:`testbed.experiment.distributed`).

    ``out`` defaults to the results root (``$TESTBED_RESULTS``, see
    :func:`testbed.experiment.results.results_root`). Exit codes: 0 all runs ok, 1 some runs
    failed (recorded in the results; how many is printed), 2 the file is invalid (each problem
    printed with its field and what is allowed; nothing is built), 130 interrupted (Ctrl-C).
    """
    err = Console(stderr=True, soft_wrap=True)  # whole lines: logs and greps read them
    executor = executor or ("dask" if scheduler else "local")
    if executor not in ("local", "dask") or (executor == "dask") != bool(scheduler):
        err.print(f"[red]error:[/] {_executor_problem(executor, scheduler)}", highlight=False)
        return 2
    try:
        exp = load_any(path)
        if time_dilation is not None:
            exp = _dilated(exp, time_dilation)
    except ExperimentError as e:
        err.print(f"[red]error:[/] invalid experiment {e.source} ({len(e.problems)} "
                  f"problem{'s' if len(e.problems) != 1 else ''}; nothing was run)",
                  highlight=False)
        for p in e.problems:
            err.print(f"  - {p}", highlight=False, markup=False)
        return 2
    if exp.kind == "cooperation" and executor != "local":
        err.print("[red]error:[/] a cooperation trace runs its policies one after the other "
                  "on one fabric; run it without --executor/--scheduler", highlight=False)
        return 2

    out_dir = default_out_dir(exp, results_root() if out is None else out)
    show = progress and sys.stderr.isatty()
    try:
        if exp.kind == "cooperation":  # its lines on stderr as it goes
            res = run(exp, out_dir=out_dir, progress=True)
        elif executor == "dask":
            # imported here: dask.distributed is an optional dependency ([distributed] extra)
            from testbed.experiment.distributed import run_distributed

            res = run_distributed(exp, scheduler, out_dir=out_dir, progress=show)
        else:
            res = run(exp, out_dir=out_dir, progress=show)
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]; finished runs are in {out_dir}")
        return 130
    except RunAborted as e:
        err.print(f"[red]stopped:[/] {e}; finished runs are in {out_dir}", markup=True)
        return 1
    except Exception as e:  # a failure outside any single run (e.g. the lock); no traceback
        err.print(f"[red]error:[/] {type(e).__name__}: {e}", highlight=False)
        err.print(f"finished runs (if any) are in {out_dir}")
        return 1
    if exp.kind == "cooperation":  # its own table: jobs and policies
        from testbed.experiment.cooperation import print_results

        return print_results(res.records(), out_dir, json_out)
    failed = len(res.failures)
    if json_out:
        print_json_rows(res)
    with contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext():
        if len(res.ok):
            print_tables(res, exp.name)
            try:
                write_plots(res)
            except Exception as e:  # a plot problem must not hide measured results
                err.print(f"[yellow]plot skipped:[/] {e}")
        else:  # nothing measured: the failures are the whole story
            for f in res.failures:
                err.print(f"[red]run {f.get('run')} ({f.get('label')}) failed:[/] "
                          f"{f.get('error')}", highlight=False)
        print(f"results: {Path(out_dir)}")
        fabric = sorted((Path(out_dir) / "fabric").glob("run*.png"))
        if fabric:
            print(f"bytes per link of each run: {fabric[0].parent}/ ({len(fabric)} pictures)")
    if failed:
        total = res.metadata.get("planned_runs", len(res.df))
        err.print(f"[red]{failed} of {total} runs failed[/] (see 'failures' in "
                  f"{Path(out_dir) / 'metadata.json'})", highlight=False)
        return 1
    return 0


def _dilated(exp, time_dilation: float | str):
    """``exp`` with ``time_dilation`` replacing its file's (a factor or 'auto'; a co-operation
    trace takes a factor only)."""
    if exp.kind != "cooperation":
        return with_overrides(exp, {"time_dilation": time_dilation})
    if time_dilation == "auto":
        raise ExperimentError("--time-dilation", ["time_dilation: 'auto' is not supported by "
                                                  "cooperation experiments; give a factor"])
    try:
        return exp.model_copy(update={"time_dilation": float(time_dilation)})
    except ValueError:
        raise ExperimentError("--time-dilation", [f"time_dilation: {time_dilation!r} is not a "
                                                  "number"]) from None


def _executor_problem(executor: str, scheduler: str | None) -> str:
    if executor not in ("local", "dask"):
        return f"--executor {executor!r}: give 'local' (here) or 'dask' (a Dask cluster)"
    if executor == "dask":
        return ("--executor dask needs --scheduler tcp://HOST:8786, the address 'dask "
                "scheduler' prints")
    return f"--scheduler {scheduler} is for --executor dask, not local"


def print_json_rows(res) -> None:
    """Every row of ``res`` (a run's summary) as one JSON object per line on stdout; NaN and
    infinities become null (strict JSON, as ``jq`` and other readers want)."""
    for row in res.records():
        print(json.dumps(strict_json(row), default=str))
    sys.stdout.flush()


def print_tables(res, name: str) -> None:
    """The collective runs' table and the training jobs' table, whichever there are."""

    df = res.ok
    trained = training_rows(df)
    if len(trained) < len(df):
        res.print_table(title=f"{name} ({len(df) - len(trained)} runs)")
    if len(trained):
        print_training_table(df, title=f"{name}: training ({len(trained)} jobs)")


def write_plots(res) -> list[Path]:
    """The standard PNGs of a results folder (overviews against bytes and n, bars by label).

    Selects the headless backend (outside Jupyter) and closes each figure once written.
    """

    use_headless()
    import matplotlib.pyplot as plt  # after use_headless(): pyplot fixes the backend on import


    path = res.path
    name = res.metadata["name"]
    written = []
    if len(training_rows(res.ok)):
        iters = load_iterations(path)
        for x in ("time_s", "iteration"):
            out = path / f"accuracy_vs_{'time' if x == 'time_s' else x}.png"
            plt.close(plot_accuracy(iters, x=x, out=out, title=name))
            written.append(out)
    df = res.ok
    if "op" in df.columns:
        df = df[df["op"] != "train"]
    if not len(df):
        return written
    plots = []
    if df["bytes"].nunique() > 1:
        plots.append((plot_overview, {"x": "bytes"}, path / "overview_vs_bytes.png"))
    if "n" in df.columns and df["n"].nunique() > 1:
        plots.append((plot_overview, {"x": "n"}, path / "overview_vs_n.png"))
    plots.append((plot_bars, {"y": "time_s"}, path / "time_by_label.png"))
    for fn, kw, out in plots:
        plt.close(fn(df, out=out, title=name, **kw))
    return written + [out for _, _, out in plots]
