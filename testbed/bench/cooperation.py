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

A trace with a lying tenant (a job whose ``overstate`` is not 1, e.g. ``cloud_cheater``) runs
beside its honest twin (the same trace with every job's true bytes and the liars' priority 0,
policy ``cooperative``), alternated with it repeat by repeat on the same network; one more row
per job (policy ``cooperative``) compares its median JCT lying vs honest, with each repeat's
JCTs, and one row (policy ``cooperative (honest_twin)``) has the twin's mean JCT. Targets:
the liar gains at most 5 % (lying / honest >= 0.95), the honest jobs lose at most 5 % to it
(<= 1.05). Where the claims are on probation (the trace has telemetry and does not take hints
on trust), the twin also runs with ``trust_hints`` (variant ``honest_twin_trusted``, alternated
with the others): per job and for the mean JCT, its median JCT on probation vs on trust
(``probation_vs_trusted``): what the rule that a lie buys nothing costs when nobody lies,
reported, not a target.

A trace that runs ``cooperative`` beside ``cooperative_no_congestion`` (the same policy
without congestion re-plans, e.g. ``cloud_congestion``, where another tenant's burst fills the
spine a job crosses) has one more target: its median mean-JCT below the blind policy's
(``vs_cooperative_no_congestion`` < 1): the congestion re-plans pay. Likewise a trace that runs
it beside ``cooperative_alone`` (its plans priced each alone, e.g. ``cloud_spines``): its
median mean-JCT below that one's (``vs_cooperative_alone`` < 1): pricing the jobs together
pays; and beside ``cooperative_static`` (no INA on the shared pools: a job without static
memory rings), ``vs_cooperative_static`` < 1 on some case and at most 1.05 on every one (the
pools change a plan only where a job gets no static memory and the model prices them faster):
the shared pools pay.
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
#: a repeat whose mean JCT is beyond this factor of its policy's median (either way) is an
#: outlier: its rows keep what each job ran (:func:`outlier`)
OUTLIER = 1.25
#: the cooperative policy with one of its parts switched off: what that part is worth, and
#: whether it must pay on every case run (a part that only some jobs take, e.g. the shared
#: pools where a job gets no static memory and the model prices them faster: better on some
#: case, never worse beyond WITHIN)
BASELINES = {"cooperative_no_congestion": ("congestion re-plans", True),
             "cooperative_alone": ("jobs priced together", True),
             "cooperative_static": ("INA on the shared pools", False)}
#: what a liar may gain, and an honest job lose to it (median JCT, lying vs honest twin)
LIE_GAIN = 0.05
#: the variant name of a lying trace's honest twin in :func:`run_cooperation`'s rows
TWIN = "honest_twin"
#: the honest twin with the claims ranked at once (``trust_hints``): what probation costs
TRUSTED = "honest_twin_trusted"


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
        # a trace with a liar runs beside its honest twin, repeat by repeat on one network
        lies = any(j.overstate != 1 for j in exp.jobs) and "cooperative" in exp.policies
        probation = lies and exp.telemetry_period_s > 0 and not exp.trust_hints
        variants = {TWIN: honest_twin(exp)} if lies else {}
        if probation:  # and without probation: what it costs when nobody lies
            variants[TRUSTED] = variants[TWIN].model_copy(update={"trust_hints": True})
        runs = run_cooperation(exp, None, say=lambda text: None, variants=variants)
        bw = rate or exp.topology.bw_mbps
        main = [r for r in runs if "variant" not in r]
        out = policy_rows(trace, bw, main)
        if lies:
            honest = [r for r in runs if r.get("variant") == TWIN]
            out += honesty_rows(trace, bw, main, honest)
            # the twin's own mean JCT: what every job pays when nobody lies
            out += [r | {"policy": f"{r['policy']} ({TWIN})"}
                    for r in policy_rows(trace, bw, honest)]
        if probation:
            trusted = [r for r in runs if r.get("variant") == TRUSTED]
            out += [r | {"policy": f"{r['policy']} ({TRUSTED})"}
                    for r in policy_rows(trace, bw, trusted)]
            out += probation_rows(trace, bw, honest, trusted)
        for row in out:
            emit(row)
            rows.append(row)
    return Outcome(rows, {"repeats": repeats, "traces": [str(p) for p in paths]},
                   targets(rows), ok=all(r["failed"] == 0 and r["wrong_sums"] == 0 for r in rows))


def policy_rows(trace: str, rate: float, runs: list[dict]) -> list[dict]:
    """One row per policy of a trace's runs (its per-repeat summary rows)."""
    by_policy: dict[str, list[dict]] = {}
    wrong: dict[str, int] = {}
    job_rows: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        if r["row"] == "summary":
            by_policy.setdefault(r["policy"], []).append(r)
        elif r["row"] == "job":
            job_rows.setdefault((r["policy"], r.get("repeat", 0)), []).append(r)
            if r.get("correct") is False:  # a sum numpy disagreed with
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
            "replans": replans,
            "outliers": [outlier(s, job_rows.get((policy, s.get("repeat", 0)), []))
                         for s in summaries if med and s["mean_jct_s"] is not None
                         and not 1 / OUTLIER <= s["mean_jct_s"] / med <= OUTLIER]})
    medians = {r["policy"]: r["mean_jct_median_s"] for r in out}
    for r in out:
        for other in ("tenant_only", "provider_only", "oracle", *BASELINES):
            a, b = r["mean_jct_median_s"], medians.get(other)
            r[f"vs_{other}"] = _r(a / b) if a and b else None
    return out


def outlier(summary: dict, jobs: list[dict]) -> dict:
    """What a repeat far from its policy's median ran: per job its JCT, the time it waited
    for memory, the plans it ran and when it switched (iteration), the provider's re-plans
    by reason, and whether the emulator's CPU was saturated: the measured cause of a spread.
    ``ran``: the plan each job started on, then each plan it switched to (at its iteration)."""
    def label(p: dict) -> str:
        return f"{p.get('algo')}" + (f" on {p['tree']}" if p.get("tree") else "") \
            + (f" + {p['compressor']}" if p.get("compressor") else "")

    return {"repeat": summary.get("repeat", 0), "mean_jct_s": _r(summary["mean_jct_s"]),
            "cpu_bound": bool(summary.get("cpu_bound")),
            "congestion_episodes": summary.get("congestion_episodes"),
            "jobs": [{"job": j.get("job"), "jct_s": _r(j.get("jct_s")),
                      "queued_s": _r(j.get("queued_s")),
                      "plan": label(j),
                      "ran": " -> ".join([label(j), *(f"{label(p)} (iteration {p['at']})"
                                                      for p in j.get("plan_switches") or [])]),
                      "plan_switches": j.get("plan_switches") or [],
                      "replans": j.get("replans") or {}, "cpu_bound": j.get("cpu_bound"),
                      "error": j.get("error")} for j in jobs]}


def honest_twin(exp):
    """``exp`` with every tenant honest (true bytes, and priority 0 for those that lied),
    run with the ``cooperative`` policy only: the one the lying-vs-honest rows compare."""
    return exp.model_copy(update={"policies": ["cooperative"], "jobs": [
        j if j.overstate == 1 else j.model_copy(update={"overstate": 1.0, "priority": 0})
        for j in exp.jobs]})


def honesty_rows(trace: str, rate: float, lying: list[dict], honest: list[dict]) -> list[dict]:
    """Per job of the ``cooperative`` runs: median JCT lying vs in the honest twin, with the
    provider's verdicts on its hints."""
    def jcts(runs, name):
        return [r["jct_s"] for r in runs if r["row"] == "job" and r["job"] == name
                and r["policy"] == "cooperative" and r["jct_s"] is not None]

    out = []
    names = dict.fromkeys(r["job"] for r in lying
                          if r["row"] == "job" and r["policy"] == "cooperative")
    for name in names:
        mine = [r for r in lying if r["row"] == "job" and r["job"] == name]
        lie, true = jcts(lying, name), jcts(honest, name)
        a = float(np.median(lie)) if lie else None
        b = float(np.median(true)) if true else None
        out.append({"trace": f"{trace} lying vs honest", "bw_mbps": rate,
                    "policy": f"cooperative: {name}",
                    "role": "liar" if mine[0].get("overstate", 1) != 1 else "honest",
                    "overstate": mine[0].get("overstate"), "repeats": len(lie),
                    "jct_lying_median_s": _r(a), "jct_honest_median_s": _r(b),
                    "lying_vs_honest": _r(a / b) if a and b else None,
                    "jcts_lying_s": [_r(x) for x in lie], "jcts_honest_s": [_r(x) for x in true],
                    "verdicts": [r.get("hints_check") for r in mine],
                    "hints_ratios": [r.get("hints_ratio") for r in mine],
                    "mean_jct_median_s": None, "spread": None, "failed": sum(
                        r["status"] != "ok" for r in mine),
                    "wrong_sums": sum(r.get("correct") is False for r in mine)})
    return out


def probation_rows(trace: str, rate: float, probation: list[dict], trusted: list[dict]
                   ) -> list[dict]:
    """What probation costs when nobody lies: per job of the honest twin (``cooperative``),
    its median JCT with the claims on probation vs ranked at once (``trust_hints``), paired
    repeat by repeat on one network, and one row for the twin's mean JCT. Reported, not a
    target: the issue asks that a lie buy nothing, and this is what that rule costs."""
    def jcts(runs, name):
        return [r["jct_s"] for r in runs if r["row"] == "job" and r["job"] == name
                and r["jct_s"] is not None]

    def means(runs):
        return [r["mean_jct_s"] for r in runs if r["row"] == "summary"
                and r["mean_jct_s"] is not None]

    names = list(dict.fromkeys(r["job"] for r in probation if r["row"] == "job"))
    out = []
    for name, a, b in [(n, jcts(probation, n), jcts(trusted, n)) for n in names] + [
            (None, means(probation), means(trusted))]:
        pa = float(np.median(a)) if a else None
        pb = float(np.median(b)) if b else None
        mine = [r for r in probation + trusted
                if r["row"] == "job" and (name is None or r["job"] == name)]
        out.append({"trace": f"{trace} probation vs trust", "bw_mbps": rate,
                    "policy": f"cooperative: {name}" if name else "cooperative: mean JCT",
                    "role": "probation", "repeats": len(a),
                    "jct_probation_median_s": _r(pa), "jct_trusted_median_s": _r(pb),
                    "probation_vs_trusted": _r(pa / pb) if pa and pb else None,
                    "jcts_probation_s": [_r(x) for x in a], "jcts_trusted_s": [_r(x) for x in b],
                    "mean_jct_median_s": None, "spread": None,
                    "failed": sum(r["status"] != "ok" for r in mine),
                    "wrong_sums": sum(r.get("correct") is False for r in mine)})
    return out


def targets(rows: list[dict]) -> dict[str, tuple[bool, str]]:
    """The co-operation targets over ``rows`` (name -> (met, detail))."""
    liars = [r for r in rows if r.get("role") == "liar"]
    honest = [r for r in rows if r.get("role") == "honest"]
    rows = [r for r in rows if "role" not in r]
    coop = [r for r in rows if r["policy"] == "cooperative"]
    out: dict[str, tuple[bool, str]] = {}
    if liars:
        gained = [f"{r['policy']}@{r['bw_mbps']:g}: {r['lying_vs_honest']}" for r in liars
                  if r["lying_vs_honest"] is None or r["lying_vs_honest"] < 1 - LIE_GAIN]
        lost = [f"{r['policy']}@{r['bw_mbps']:g}: {r['lying_vs_honest']}" for r in honest
                if r["lying_vs_honest"] is None or r["lying_vs_honest"] > 1 + LIE_GAIN]
        out["a liar gains <= 5 %"] = (not gained, "; ".join(gained) or
                                      f"{len(liars)} liar(s): " + ", ".join(
                                          str(r["lying_vs_honest"]) for r in liars))
        out["honest jobs lose <= 5 % to a liar"] = (not lost, "; ".join(lost) or ", ".join(
            str(r["lying_vs_honest"]) for r in honest))
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
    for baseline, (what, everywhere) in BASELINES.items():  # one part switched off
        ran = [r for r in coop if r.get(f"vs_{baseline}") is not None]
        if not ran:
            continue
        limit = 1.0 if everywhere else 1.0 + WITHIN
        ratios = [(f"{r['trace']}@{r['bw_mbps']:g}: {r[f'vs_{baseline}']:.2f}x",
                   r[f"vs_{baseline}"] < limit) for r in ran]
        met = all(ok for _t, ok in ratios) and any(r[f"vs_{baseline}"] < 1 for r in ran)
        label = f"cooperative < {baseline}" if everywhere else \
            f"cooperative < {baseline} somewhere, never beyond +{WITHIN:.0%}"
        out[f"{what} pay ({label})"] = (
            met, "; ".join(t for t, ok in ratios if not ok) or ", ".join(t for t, _ok in ratios))
    wide = [f"{r['trace']}@{r['bw_mbps']:g} {r['policy']}: {r['spread']:.2f}"
            + "".join(f" (repeat {o['repeat']}: {o['mean_jct_s']} s; " + ", ".join(
                f"{j['job']} {j['jct_s']} s on {j['ran']}" for j in o["jobs"]) + ")"
                for o in r.get("outliers", []))
            for r in rows if r["spread"] is not None and r["spread"] > MAX_SPREAD]
    if any(r["repeats"] > 1 for r in rows):
        out["spread (IQR / median) <= 0.25"] = (not wide, "; ".join(wide) or "all")
    return out


def _r(x) -> float | None:
    return None if x is None else round(float(x), 4)
