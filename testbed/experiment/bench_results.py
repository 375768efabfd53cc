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

#: benchmark name -> what its rows compare, for the metadata and the plot title
BENCHES = {
    "kernels": "Numba kernels against numpy anchors (GB/s ratio)",
    "datapath": "data-path programs against Linux bridge / OVS userspace / Python (kpps ratio)",
    "collectives": "allreduce algorithms on a 100 Mb/s star against the alpha-beta model",
    "torch": "the testbed process-group backend against gloo with an unmodified script",
}


def save_bench(name: str, rows: list[dict], root: str | Path,
               notes: dict[str, Any] | None = None) -> Path:
    """Store ``rows`` of benchmark ``name`` under ``root``; return the new folder."""
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; one of {', '.join(BENCHES)}")
    out = unique_folder(root, f"bench-{name}")
    store = ResultsStore(out, {
        "name": f"bench-{name}", "description": BENCHES[name], "bench": name,
        "planned_runs": len(rows), "git": git_revision(), "packages": package_versions(),
        "machine": machine_info(), "notes": notes or {}})
    for r in rows:
        store.append(r)
    try:
        store.metadata["plots"] = [plot_bench(name, rows, out).name]
    except Exception as e:  # noqa: BLE001 - the rows on disk matter more than their picture
        store.metadata["plot_error"] = f"{type(e).__name__}: {e}"
    store.finish("completed")
    return out


def plot_bench(name: str, rows: list[dict], folder: Path) -> Path:
    """The benchmark's PNG in ``folder`` (headless backend outside Jupyter)."""
    use_headless()
    import matplotlib.pyplot as plt  # after use_headless() chose the backend

    df = pd.DataFrame(rows)
    png = folder / f"bench_{name}.png"
    if name == "collectives":
        df["case"] = [f"{r.algo} n={r.n} {r.bytes / 2**20:g}MiB" for r in df.itertuples()]
        fig = plot_bars(df, y="time_s", hue="case", out=png, title=BENCHES[name])
    elif name == "torch":
        if "ratio" not in df:
            df["ratio"] = float("nan")
        fig = plot_ratios(df, label="case", out=png, title=BENCHES[name], anchor="anchor")
    elif name == "datapath":
        df["case"] = [f"{r.program} {r.packet_bytes}B vs {r.anchor}" for r in df.itertuples()]
        fig = plot_ratios(df, label="case", out=png, title=BENCHES[name], anchor="anchor")
    else:
        df["case"] = [f"{r.kernel} vs {r.anchor}" for r in df.itertuples()]
        fig = plot_ratios(df, label="case", out=png, title=BENCHES[name], anchor="anchor")
    plt.close(fig)
    return png


def print_rows(rows: list[dict], title: str, columns: tuple[str, ...] | None = None) -> None:
    """The rows as one rich table (``columns``, default every column the rows have)."""
    cols = list(columns or dict.fromkeys(k for r in rows for k in r))
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(escape(_fmt(r.get(c))) for c in cols))
    Console(width=max(160, Console().width)).print(table)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
