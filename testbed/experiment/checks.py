"""Assertions on experiment results: correctness, fidelity against the model, baselines.

Used by the pytest plugin (:mod:`testbed.experiment.pytest_plugin`) and usable directly in
notebooks. Every check raises ``AssertionError`` listing each offending run, not just the first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

#: Columns that identify a run across result sets (those present are used).
DEFAULT_KEYS = ("label", "op", "algo", "n", "bytes", "compressor", "error_feedback", "loss")
#: Relative tolerances of the default baseline comparison. Times on a shared 2-core machine
#: vary; correctness must not.
DEFAULT_TOLERANCES = {"time_s": 0.5}
DEFAULT_EXACT = ("correct",)


def _frame(results: Any):
    df = getattr(results, "df", results)
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    return df


def assert_all_ok(results: Any) -> None:
    """Every run finished (no ``status == 'error'`` rows) and every result is ``correct``."""
    df = getattr(results, "df", results)
    problems = []
    if "status" in df.columns:
        for _, r in df[df["status"] != "ok"].iterrows():
            problems.append(f"run {r.get('run')} ({r.get('label')}): {r.get('error')}")
    if "correct" in df.columns:
        ok = _frame(results)
        for _, r in ok[~ok["correct"].astype(bool)].iterrows():
            problems.append(f"run {r.get('run')} ({r.get('label')}, {r.get('bytes')} B): "
                            f"result not correct, max_abs_err={r.get('max_abs_err')}")
    if len(df) == 0:
        problems.append("no runs in the results")
    if problems:
        raise AssertionError("runs failed or incorrect:\n  " + "\n  ".join(problems))


def fidelity_runs(results: Any, skip_cpu_bound: bool = True,
                  where: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(runs whose fidelity can be judged, runs left out as ``cpu_bound``) among the finished
    runs of ``results`` that match ``where`` (column -> value)."""
    df = _frame(results)
    for col, val in (where or {}).items():
        df = df[df[col] == val]
    if skip_cpu_bound and "cpu_bound" in df.columns:
        bound = df["cpu_bound"].astype(bool)
        return df[~bound], df[bound]
    return df, df.iloc[0:0]


def assert_fidelity(results: Any, tol: float = 0.2, skip_cpu_bound: bool = True,
                    where: dict[str, Any] | None = None) -> None:
    """Each run's ``fidelity`` (measured/model) lies within ``1 ± tol`` (Mininet test_hifi: 0.2).

    ``skip_cpu_bound`` leaves out runs flagged ``cpu_bound`` (the emulator, not the network,
    was the bottleneck, so the model does not apply). ``where`` filters rows by column values.
    No run left to check fails too: a fidelity check that could not run is not a pass.
    """
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol={tol!r} must be a positive fraction, e.g. 0.2 for ±20 %")
    df, bound = fidelity_runs(results, skip_cpu_bound, where)
    if len(df) == 0 and len(bound):
        why = [w for w in bound.get("cpu_why", []) if isinstance(w, str) and w][:1]
        raise AssertionError(
            f"fidelity not checked: all {len(bound)} runs were cpu_bound"
            + (f" ({why[0]})" if why else "") + ", so the emulator, not the network, set "
            "their pace; run them dilated (time_dilation = \"auto\", or a larger factor), "
            "or on a machine that other work leaves free")
    if len(df) == 0:
        raise AssertionError("no runs to check fidelity on (all filtered out)")
    bad = []
    for _, r in df.iterrows():
        f = float(r["fidelity"])
        if not math.isfinite(f) or abs(f - 1.0) > tol:
            bad.append(f"{r.get('label')} n={r.get('n')} bytes={r.get('bytes')}: "
                       f"time {r.get('time_s'):.4g} s vs model {r.get('model_s'):.4g} s "
                       f"(fidelity {f:.3f}, allowed {1 - tol:.2f}..{1 + tol:.2f})")
    if bad:
        raise AssertionError(f"{len(bad)} of {len(df)} runs outside the model's ±{tol:.0%}:\n  "
                             + "\n  ".join(bad))


def default_keys(columns) -> list[str]:
    """Key columns among ``columns``: :data:`DEFAULT_KEYS` plus sweep paths (dotted names)."""
    cols = list(columns)
    return [k for k in DEFAULT_KEYS if k in cols] + [c for c in cols if "." in str(c)]


def summarize_for_baseline(results: Any, keys: tuple[str, ...] | list[str] | None = None,
                           metrics: list[str] | None = None):
    """One row per run key: mean of numeric metrics over repetitions, ``all()`` of booleans."""
    df = _frame(results)
    keys = [k for k in (keys or default_keys(df.columns)) if k in df.columns]
    if not keys:
        raise ValueError(f"none of the key columns {list(keys or DEFAULT_KEYS)} is in the "
                         "results; pass keys=[...] naming columns that identify a run")
    metrics = metrics or [m for m in ("time_s", "fidelity", "max_abs_err", "correct")
                          if m in df.columns]
    missing = [m for m in metrics if m not in df.columns]
    if missing:
        raise ValueError(f"metrics {missing} are not results columns")
    data = df[keys + metrics].copy()
    for k in keys:  # NaN keys (e.g. no compressor) would vanish in groupby
        data[k] = data[k].astype(object).where(data[k].notna(), "none").astype(str)
    agg = {m: ("all" if data[m].dtype == bool else "mean") for m in metrics}
    return data.groupby(keys, sort=True).agg(agg).reset_index()


def write_baseline(results: Any, path: str | Path, keys=None, metrics=None) -> Path:
    """Record ``results`` as the baseline CSV at ``path`` (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    summarize_for_baseline(results, keys, metrics).to_csv(path, index=False)
    return path


def compare_to_baseline(results: Any, path: str | Path, keys=None,
                        tolerances: dict[str, float] | None = None,
                        exact: tuple[str, ...] | list[str] = DEFAULT_EXACT,
                        atol: float = 1e-9) -> list[str]:
    """Differences between ``results`` and the baseline CSV at ``path`` (empty = same).

    ``tolerances``: metric -> allowed relative deviation (default ``time_s``: 0.5);
    ``exact``: metrics that must be equal (default ``correct``). Runs present on only one side
    are differences too.
    """
    tolerances = DEFAULT_TOLERANCES if tolerances is None else tolerances
    base = pd.read_csv(path)
    key_cols = [k for k in (keys or default_keys(base.columns)) if k in base.columns]
    metrics = [m for m in base.columns if m in (*tolerances, *exact) and m not in key_cols]
    cur = summarize_for_baseline(results, key_cols, metrics)
    for k in key_cols:
        base[k] = base[k].astype(object).where(base[k].notna(), "none").astype(str)
    merged = base.merge(cur, on=key_cols, how="outer", suffixes=("_base", ""), indicator=True)
    diffs = []
    for _, r in merged.iterrows():
        what = ", ".join(f"{k}={r[k]}" for k in key_cols)
        if r["_merge"] == "left_only":
            diffs.append(f"{what}: in the baseline but not in the results")
            continue
        if r["_merge"] == "right_only":
            diffs.append(f"{what}: in the results but not in the baseline")
            continue
        for m in metrics:
            got, want = r[m], r[f"{m}_base"]
            if m in exact:
                if _as_bool_or_value(got) != _as_bool_or_value(want):
                    diffs.append(f"{what}: {m} = {got}, baseline {want}")
                continue
            tol = tolerances[m]
            if abs(float(got) - float(want)) > tol * abs(float(want)) + atol:
                rel = (float(got) - float(want)) / float(want) if float(want) else math.inf
                diffs.append(f"{what}: {m} = {float(got):.4g}, baseline {float(want):.4g} "
                             f"({rel:+.0%}, allowed ±{tol:.0%})")
    return diffs


def _as_bool_or_value(v: Any) -> Any:
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if isinstance(v, (bool, int, float)) and not isinstance(v, bool) and v in (0, 1):
        return bool(v)
    return v
