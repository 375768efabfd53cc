"""``testbed bench cooperation``: the offload policies on the shipped co-operation traces, at
several link rates, repeated, against the targets of the co-operation issue.

Each trace (a ``kind = "cooperation"`` experiment file, :mod:`testbed.experiment.cooperation`)
runs at each link rate (every link of its topology at that rate) ``repeats`` times per
policy, interleaved (repeat 0 of every policy, then repeat 1, ...) on one network per trace and
rate. One row per trace x rate x policy: the median, quartiles and interquartile range of the
mean job completion time over the repeats, its ratio to ``tenant_only``, ``provider_only``
and ``oracle`` of the same trace and rate, how many repeats failed or were CPU-bound, and the
re-plans by reason. Every training step's sum is checked against numpy by the worker pool;
a repeat with a wrong sum or a failed job makes the exit status 1.

Targets (``cooperative`` on every trace and rate): median mean-JCT at most tenant_only's and
provider_only's (traces where co-operation cannot help: within 5 %), within 10 % of oracle;
spread (IQR / median) at most 0.25 per policy. A target that is missed is reported, with the
rows it comes from; the benchmark's exit status says only whether every run was right.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.bench.protocol import Outcome, parse_ints
from testbed.experiment.cooperation import load_cooperation, run_cooperation

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
#: a trace where co-operation has nothing to gain: its target is "within 5 %", not "better"
NO_HELP = ("cloud_no_help",)
WITHIN = 0.05
ORACLE_WITHIN = 0.10
MAX_SPREAD = 0.25


def trace_path(name: str) -> Path:
    """A trace by file name in ``experiments/`` (with or without ``.toml``) or a path."""
    p = Path(name)
    for candidate in (p, EXPERIMENTS / name, EXPERIMENTS / f"{name}.toml"):
        if candidate.is_file():
            return candidate
    shipped = sorted(f.stem for f in EXPERIMENTS.glob("cloud_*.toml"))
    raise ValueError(f"--traces: no co-operation trace {name!r}; shipped: {', '.join(shipped)}")


def measure(emit, quick: bool, traces: str, rates: str, repeats: int, policies: str,
            iterations: int) -> Outcome:
    """``testbed bench cooperation`` (:mod:`testbed.bench.protocol`); ok when every job of
    every repeat completed and every sum agreed with numpy (``all_accurate``, whether the jobs
    reached their target accuracy, is reported, not required: ``--iterations`` may cut them
    short)."""
    paths = [trace_path(t.strip()) for t in traces.split(",") if t.strip()]
    rate_list = parse_ints("rates", rates) or [None]
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    experiments = []
    for path in paths:
        exp = load_cooperation(path)
        update: dict = {"repeats": repeats}
        if chosen:
            update["policies"] = chosen
        if iterations:
            exp = exp.model_copy(update={"jobs": [
                j.model_copy(update={"train": {**j.train, "iterations": iterations}})
                for j in exp.jobs]})
        for rate in rate_list:
            topo = exp.topology if rate is None else exp.topology.model_copy(
                update={"bw_mbps": float(rate)})
            # validated again: a policy name or a changed field the schema refuses says so here
            experiments.append((path.stem, rate, load_cooperation(
                exp.model_copy(update={**update, "topology": topo}).model_dump())))
    rows: list[dict] = []
    for trace, rate, exp in experiments:
        runs = run_cooperation(exp, None, say=lambda text: None)
        for row in policy_rows(trace, rate or exp.topology.bw_mbps, runs):
            emit(row)
            rows.append(row)
    return Outcome(rows, {"repeats": repeats, "traces": [str(p) for p in paths]},
                   targets(rows), ok=all(r["failed"] == 0 and r["wrong_sums"] == 0 for r in rows))


def policy_rows(trace: str, rate: float, runs: list[dict]) -> list[dict]:
    """One row per policy of a trace's runs (its per-repeat summary rows)."""
    by_policy: dict[str, list[dict]] = {}
    wrong: dict[str, int] = {}
    for r in runs:
        if r["row"] == "summary":
            by_policy.setdefault(r["policy"], []).append(r)
        elif r["row"] == "job" and r.get("correct") is False:  # a sum numpy disagreed with
            wrong[r["policy"]] = wrong.get(r["policy"], 0) + 1
    out = []
    for policy, summaries in by_policy.items():
        jcts = [s["mean_jct_s"] for s in summaries if s["mean_jct_s"] is not None]
        q1, med, q3 = (np.percentile(jcts, [25, 50, 75]) if jcts else (None,) * 3)
        replans: dict[str, int] = {}
        for s in summaries:
            for reason, count in (s.get("replans") or {}).items():
                replans[reason] = replans.get(reason, 0) + count
        out.append({
            "trace": trace, "bw_mbps": rate, "policy": policy, "repeats": len(summaries),
            "mean_jct_median_s": _r(med), "mean_jct_q1_s": _r(q1), "mean_jct_q3_s": _r(q3),
            "spread": _r((q3 - q1) / med) if jcts and med else None,
            "mean_jcts_s": [_r(x) for x in jcts],
            "failed": sum(s["failed"] for s in summaries), "wrong_sums": wrong.get(policy, 0),
            "all_accurate": all(s["all_accurate"] for s in summaries),
            "cpu_bound_runs": sum(bool(s["cpu_bound"]) for s in summaries),
            "congestion_episodes": sum(s.get("congestion_episodes") or 0 for s in summaries),
            "replans": replans})
    medians = {r["policy"]: r["mean_jct_median_s"] for r in out}
    for r in out:
        for other in ("tenant_only", "provider_only", "oracle"):
            a, b = r["mean_jct_median_s"], medians.get(other)
            r[f"vs_{other}"] = _r(a / b) if a and b else None
    return out


def targets(rows: list[dict]) -> dict[str, tuple[bool, str]]:
    """The co-operation targets over ``rows`` (name -> (met, detail))."""
    coop = [r for r in rows if r["policy"] == "cooperative"]
    out: dict[str, tuple[bool, str]] = {}
    if coop:
        worse = []
        for r in coop:
            allowed = 1 + WITHIN if r["trace"] in NO_HELP else 1.0
            for other in ("tenant_only", "provider_only"):
                ratio = r[f"vs_{other}"]
                if ratio is not None and ratio > allowed:
                    worse.append(f"{r['trace']}@{r['bw_mbps']:g}: {ratio:.2f}x {other}")
        out["cooperative <= tenant_only, provider_only"] = (
            not worse, "; ".join(worse) or f"on all {len(coop)} trace x rate cases")
        far = [f"{r['trace']}@{r['bw_mbps']:g}: {r['vs_oracle']:.2f}x" for r in coop
               if r["vs_oracle"] is not None and r["vs_oracle"] > 1 + ORACLE_WITHIN]
        if any(r["vs_oracle"] is not None for r in coop):
            out["cooperative within 10 % of oracle"] = (not far, "; ".join(far) or "all")
    wide = [f"{r['trace']}@{r['bw_mbps']:g} {r['policy']}: {r['spread']:.2f}" for r in rows
            if r["spread"] is not None and r["spread"] > MAX_SPREAD]
    if any(r["repeats"] > 1 for r in rows):
        out["spread (IQR / median) <= 0.25"] = (not wide, "; ".join(wide) or "all")
    return out


def _r(x) -> float | None:
    return None if x is None else round(float(x), 4)
