"""``testbed bench tenancy``: aggregation trees and tenants sharing switch memory, measured
against their targets in one run.

Two experiments from ``experiments/`` (run by the experiment runner, results kept under the
results root):

* ``hierarchical_ina.toml`` - 16 workers on a fat-tree k=4: INA at one core switch against
  the lowest common ancestor tree. Targets: the tree's bytes on core links (``port_bytes_core``,
  from the switches' port counters) at most 1/4 of the single switch's, and its time at most
  the single switch's.
* ``multitenant_ina.toml`` - two concurrent 4-worker jobs on a leaf-spine whose switches hold
  memory for one: both static (one is refused at admission and runs as ring) against both
  shared (the pool, overflow summed by each job's host aggregator). Targets: every row exact,
  and the sum of the two jobs' times in shared mode at most the sum with one refused.

``--quick``: 4 MiB on the fat-tree and 1 MiB per tenant (a few minutes). Times are only
comparable within one run; a ``cpu_bound`` row measured the emulator (the note says so).
``time_dilation`` (a factor or ``"auto"``, default the experiment files' 8) runs both networks
that many times slower (:mod:`testbed.collectives.dilation`) so that the emulator's CPU is not
what the times measure; every row records its factor. Each row's ``port_bytes_core`` counts
every byte on a core link (retransmissions included: they really cross it).
"""

from __future__ import annotations

import os
from pathlib import Path

from testbed.bench.protocol import Outcome, parse_dilation
from testbed.experiment import load_experiment
from testbed.experiment import run as run_experiment

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
COLUMNS = ("experiment", "label", "modes", "algo", "bytes", "time_s", "model_s", "correct",
           "cpu_bound", "time_dilation", "placement_mode", "tree_depth", "in_network_fraction",
           "host_fallback_chunks", "switch_mem_bytes", "port_bytes_core")


def _load(name: str, nbytes: int, time_dilation: float | str | None = None):
    exp = load_experiment(EXPERIMENTS / name)
    data = exp.model_dump()
    for job in data["jobs"]:
        job["nbytes"] = nbytes
    if time_dilation is not None:
        data["time_dilation"] = time_dilation
    return type(exp).model_validate(data)


def _rows(name: str, res) -> list[dict]:
    out = []
    sweep = list(res.metadata.get("sweep_columns", []))
    for r in res.df.to_dict("records"):
        tree = r.get("tree")
        out.append({"experiment": name, "label": r.get("label"),
                    "modes": "/".join(str(r.get(c)) for c in sweep) or "-",
                    **{k: r.get(k) for k in COLUMNS if k not in ("experiment", "label", "modes",
                                                                 "tree_depth")},
                    "tree_depth": len(tree) if isinstance(tree, list) else None})
    return out


def targets(rows: list[dict]) -> dict[str, tuple[bool, str]]:
    """Each target: (met, the measured figures)."""
    out: dict[str, tuple[bool, str]] = {}
    h = {r["label"]: r for r in rows if r["experiment"] == "hierarchical"}
    if {"ina-core", "ina-tree"} <= set(h):
        core, tree = h["ina-core"], h["ina-tree"]
        ratio = tree["port_bytes_core"] / core["port_bytes_core"] if core["port_bytes_core"] \
            else float("nan")
        out["core_bytes_tree/single <= 1/4"] = (ratio <= 0.25, f"{ratio:.3f}")
        t = tree["time_s"] / core["time_s"]
        out["time_tree/single <= 1"] = (t <= 1.0, f"{t:.2f} (cpu_bound: single "
                                        f"{core['cpu_bound']}, tree {tree['cpu_bound']})")
    m = [r for r in rows if r["experiment"] == "multitenant"]
    if m:
        sums = {}
        for modes in ("static/static", "shared/shared"):
            sel = [r for r in m if r["modes"] == modes]
            sums[modes] = sum(r["time_s"] for r in sel) if sel else float("nan")
        refused = [r for r in m if r["modes"] == "static/static"
                   and r["placement_mode"] == "refused"]
        out["two tenants: every row exact"] = (all(r["correct"] for r in m),
                                              f"{sum(bool(r['correct']) for r in m)}/{len(m)}")
        out["sum shared <= sum static (one refused -> ring)"] = (
            sums["shared/shared"] <= sums["static/static"],
            f"{sums['shared/shared']:.2f} s vs {sums['static/static']:.2f} s "
            f"({len(refused)} refused)")
    return out


#: the experiments of the bench, in the order they run (``--only`` picks some)
NAMES = ("hierarchical", "multitenant")


def _check_only(only: tuple[str, ...]) -> None:
    if not only or set(only) - set(NAMES):
        raise ValueError(f"only: choose from {', '.join(NAMES)}, got {list(only)}")


def run(quick: bool = False, emit=None, time_dilation: float | str | None = None,
        only: tuple[str, ...] = NAMES) -> list[dict]:
    """Run both experiments (or those named in ``only``); return the rows (``emit(row)`` as
    each experiment finishes). ``time_dilation``: see the module docstring."""
    _check_only(only)
    rows: list[dict] = []
    for name, file, size in (("hierarchical", "hierarchical_ina.toml", (4 if quick else 16) << 20),
                             ("multitenant", "multitenant_ina.toml", (1 if quick else 4) << 20)):
        if name not in only:
            continue
        res = run_experiment(_load(file, size, time_dilation), progress=False, doctor=False)
        for r in _rows(name, res):
            rows.append(r)
            if emit:
                emit(r)
    return rows


def measure(emit, quick: bool, time_dilation: str | None, only: str) -> Outcome:
    """``testbed bench tenancy`` (:mod:`testbed.bench.protocol`); ok when every row is
    correct."""
    names = tuple(n.strip() for n in only.split(",") if n.strip())
    _check_only(names)
    rows = run(quick, emit, parse_dilation(time_dilation), names)
    notes = {"time_dilation": time_dilation or "the files'", "load_avg": os.getloadavg()[0]}
    if any(r["cpu_bound"] for r in rows):
        notes["caution"] = ("some runs were CPU-bound: their times measured the emulator, not "
                            "the network; compare bytes, and times only between rows that "
                            "were not")
    return Outcome(rows, notes, targets(rows), ok=all(r["correct"] for r in rows))
