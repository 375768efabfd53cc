"""Benchmark rows kept like an experiment's results: ``testbed bench NAME --out DIR``.

Each benchmark gets a folder ``DIR/bench-<name>-<UTC time>/`` written by the same store as an
experiment (``rows.jsonl``, ``results.csv``, ``results.parquet``, ``metadata.json`` with git
revision, package versions, the full environment, machine and CPU model, plus the benchmark's
own notes) and one PNG: the ratio of each measurement to its anchor (kernels, data path) or the
measured time beside the α-β model (collectives). ``Results.load(folder)`` reads it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from testbed.experiment.plots import plot_bars, plot_ratios, use_headless
from testbed.experiment.results import (
    ResultsStore,
    git_revision,
    machine_info,
    package_versions,
    unique_folder,
)


def save_bench(bench, rows: list[dict], root: str | Path,
               notes: dict[str, Any] | None = None) -> Path:
    """Store ``rows`` of ``bench`` (a :class:`~testbed.bench.Benchmark`) under ``root``;
    return the new folder."""
    out = unique_folder(root, f"bench-{bench.name}")
    store = ResultsStore(out, {
        "name": f"bench-{bench.name}", "description": bench.summary, "bench": bench.name,
        "planned_runs": len(rows), "git": git_revision(), "packages": package_versions(),
        "machine": machine_info(), "notes": notes or {}})
    for r in rows:
        store.append(r)
    try:
        if rows:
            store.metadata["plots"] = [plot_bench(bench, rows, out).name]
    except Exception as e:  # noqa: BLE001 - the rows on disk matter more than their picture
        store.metadata["plot_error"] = f"{type(e).__name__}: {e}"
    store.finish("completed" if not (notes or {}).get("error") else "failed",
                 (notes or {}).get("error"))
    return out


def plot_bench(bench, rows: list[dict], folder: Path) -> Path:
    """The benchmark's PNG in ``folder`` (headless backend outside Jupyter): each row's ratio
    to its anchor when the rows have one, else its time beside the model's."""
    use_headless()
    import matplotlib.pyplot as plt  # after use_headless() chose the backend

    df = pd.DataFrame(rows)
    png = folder / f"bench_{bench.name}.png"
    case = [c for c in bench.case if c in df] or list(df.columns[:1])
    df["case"] = [" ".join(str(v) for v in vals) for vals in df[case].itertuples(index=False)]
    if "ratio" in df and df["ratio"].notna().any():
        fig = plot_ratios(df, label="case", out=png, title=bench.summary,
                          anchor="anchor")
    else:
        y = next((c for c in ("time_s", "measured_s", "ns_per_packet") if c in df), None)
        if y is None:
            raise ValueError("no ratio and no time column to plot")
        fig = plot_bars(df, y=y, hue="case", out=png, title=bench.summary)
    plt.close(fig)
    return png


def print_rows(rows: list[dict], title: str, columns: tuple[str, ...] | None = None,
               file=None) -> None:
    """The rows as one rich table (``columns``, default every column the rows have)."""
    cols = list(columns or dict.fromkeys(k for r in rows for k in r))
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(escape(_fmt(r.get(c))) for c in cols))
    Console(width=max(160, Console().width), file=file).print(table)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
