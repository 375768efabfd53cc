"""Training jobs in experiments: running them, their per-iteration rows, tables and plots.

The experiment runner treats a training job (``[[training]]`` in an experiment file) as one
run with one summary row (``op = "train"``), or, with ``trace = true``, all training jobs of
a point as one run with one summary row per job (they run at once, each from its
``start_s`` on its own hosts: :func:`testbed.workloads.run_trace`). Per-iteration rows go to
``iterations.jsonl`` in the results folder (one JSON object per iteration, with the run,
point, job and label columns of its summary row); :func:`load_iterations` reads them back.

Plots: :func:`plot_accuracy` draws held-out accuracy against training time (or iteration)
per job, the curves time-to-accuracy is read from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.table import Table

#: File of the per-iteration rows in a results folder.
ITERATIONS_FILE = "iterations.jsonl"
#: Columns of the training table ``testbed run`` prints.
TABLE_COLUMNS = ("label", "n", "params", "final_accuracy", "tta_s", "iterations", "jct_s",
                 "iter_s", "comm_s", "model_comm_s", "comm_fraction", "correct", "cpu_bound")


def plan_items(point) -> list[tuple[int | None, Any]]:
    """The runs of ``point``'s training jobs: ``[(index, TrainJob), ...]``, or one
    ``(None, [jobs])`` item for a trace."""
    if not point.training:
        return []
    if point.trace:
        return [(None, list(point.training))]
    return list(enumerate(point.training))


def run_item(net, point, index: int | None, item, progress=None
             ) -> list[tuple[dict, list, list]]:
    """Run one training item of ``point`` on ``net``: ``[(summary row, iteration rows,
    allreduce trace), ...]`` per job (a failed job's summary has ``error`` set; the trace:
    ``TrainingResult.trace``)."""
    # here, not at the top: the training layer takes about 0.6 s to import (its models, data
    # sets and trimming codec); experiments without training jobs never need it
    from testbed.workloads import run_trace

    jobs = item if index is None else [item]
    first = 0 if index is None else index
    specs = [job.training_spec(first + k, point.seed) for k, job in enumerate(jobs)]
    results = run_trace(net, specs, progress=progress)
    out = []
    for k, res in enumerate(results):
        summary = {"op": "train", **res.summary, "job": first + k}
        its = [{**r, "job": first + k} for r in res.iterations]
        out.append((summary, its, res.trace))
    return out


def append_iterations(out_dir: Path, base: dict, rows: list[dict]) -> None:
    """Append ``rows`` (one job's iterations) to the results folder's iterations file, each
    with the run columns of ``base`` (run, point, label, sweep values)."""
    with open(Path(out_dir) / ITERATIONS_FILE, "a") as f:
        for r in rows:
            f.write(json.dumps({**base, **r}, default=float) + "\n")


def load_iterations(path: str | Path):
    """The per-iteration rows of a results folder (or a :class:`Results`) as a DataFrame
    (empty when it has no training jobs)."""
    path = Path(getattr(path, "path", path))
    f = path / ITERATIONS_FILE
    if not f.exists():
        return pd.DataFrame()
    return pd.DataFrame([json.loads(line) for line in f.read_text().splitlines()
                         if line.strip()])


def training_rows(df):
    """The summary rows of training jobs in a results table."""
    if "op" not in df.columns:
        return df.iloc[0:0]
    return df[df["op"] == "train"]


def print_training_table(df, title: str | None = None) -> None:
    """Print the training summaries of ``df`` (a results table) as a rich table."""
    rows = training_rows(df)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title=title)
    cols = [c for c in TABLE_COLUMNS if c in rows.columns]
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for _, r in rows.iterrows():
        table.add_row(*[_fmt(r[c]) for c in cols])
    console.print(table)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "-" if v != v else f"{v:.3g}"
    if type(v).__name__ in ("bool", "bool_"):
        return "yes" if v else "no"
    return str(v)


def plot_accuracy(iters, x: str = "time_s", out: str | Path | None = None,
                  title: str | None = None, hue: str = "label"):
    """Held-out accuracy against ``x`` (``time_s``: training time, or ``iteration``), one
    curve per ``hue`` value (per run when labels repeat across sweep points)."""
    import matplotlib.pyplot as plt  # on first use: results readers need no matplotlib

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if len(iters) and "accuracy" in iters.columns:
        ev = iters[iters["accuracy"].notna()]
        keys = ["run", hue] if "run" in ev.columns else [hue]
        for key, g in ev.groupby(keys, sort=False):
            name = key[-1] if isinstance(key, tuple) else key
            g = g.sort_values(x)
            ax.plot(g[x], g["accuracy"], marker=".", label=str(name))
    ax.set_xlabel("training time (s)" if x == "time_s" else x)
    ax.set_ylabel("held-out accuracy")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig
