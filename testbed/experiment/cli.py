"""``testbed run FILE``: run an experiment file, print its table, write its results folder."""

from __future__ import annotations

import sys
from pathlib import Path


def run_file(path: str, out: str = "results", progress: bool = True) -> int:
    """Run the experiment in ``path``; results under ``out/<name>-<timestamp>/``.

    Exit codes: 0 all runs ok, 1 some runs failed (recorded in the results), 2 the file is
    invalid (each bad field printed with its allowed values), 130 interrupted (Ctrl-C).
    """
    from rich.console import Console

    from testbed.experiment.spec import ExperimentError, load_experiment

    err = Console(stderr=True)
    try:
        exp = load_experiment(path)
    except ExperimentError as e:
        err.print(f"[red]error:[/] invalid experiment file {e.source}", highlight=False)
        for p in e.problems:
            err.print(f"  - {p}", highlight=False, markup=False)
        return 2
    from testbed.experiment.runner import RunAborted, default_out_dir, run

    out_dir = default_out_dir(exp, out)
    try:
        res = run(exp, out_dir=out_dir, progress=progress and sys.stderr.isatty())
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
    res.print_table(title=f"{exp.name} ({len(res.df)} rows)")
    if len(res.ok):
        try:
            _plots(res)
        except Exception as e:  # a plot problem must not hide measured results
            err.print(f"[yellow]plot skipped:[/] {e}")
    print(f"results: {Path(out_dir)}")
    return 1 if res.failures else 0


def _plots(res) -> None:
    from testbed.experiment.plots import plot_bars, plot_overview

    df = res.ok
    path = res.path
    if df["bytes"].nunique() > 1:
        plot_overview(df, x="bytes", out=path / "overview_vs_bytes.png", title=res.metadata["name"])
    if "n" in df.columns and df["n"].nunique() > 1:
        plot_overview(df, x="n", out=path / "overview_vs_n.png", title=res.metadata["name"])
    plot_bars(df, y="time_s", out=path / "time_by_label.png", title=res.metadata["name"])
