"""``testbed bench faults``: one row per fault kind and algorithm, each against the same
algorithm without a fault, measured in one run on one network.

A leaf-spine (2 leaves x 2 hosts, 2 spines, programmable switches) runs ring, halving-doubling
and INA (a tree, ``placement.tree = "auto"``) through the experiment runner, once per case
(a sweep over the experiment's ``faults``):

* ``none`` - the baseline;
* ``link_down`` - tbl1 loses its uplink to tbsp1 at 0 s for the whole run (routes, INA tree
  and model on the degraded fabric);
* ``link_flap`` - the same uplink fails ``at_s`` into the run and returns ``down_s`` later;
* ``engine_kill`` - tbl1's engine (every path of two hosts crosses it) is SIGKILLed mid-run:
  the collective restarts it (``placement.engine_death = "restart"``), TCP rides it out, INA
  registers again and reruns from its start;
* ``worker_kill`` - the worker of host rank 2 is SIGKILLed mid-run: the run must fail with an
  error naming its host (the others are stopped, the next run goes on).

Targets: every row of the first four cases exact; every killed worker named; the switch back
(``switch_back_s``: an INA rerun's ``fallback_s``, a TCP collective's engine restart) within
2 s undilated after an engine kill; INA after the restart aggregates
in the network again (``in_network_fraction`` 1). A rerun's ``time_s`` counts the attempt
given up (``aborted_s``) too. Times are only comparable within one run; undilated on two
cores most rows are ``cpu_bound`` (the notes list them): ``--time-dilation`` helps.
"""

from __future__ import annotations

import tempfile

from testbed.bench.protocol import Outcome
from testbed.experiment import run as run_experiment
from testbed.experiment.spec import parse_experiment

MiB = 1 << 20
UPLINK = "tbl1-tbsp1"

def cases(at_s: float, down_s: float) -> dict[str, list[dict]]:
    """Case name -> the experiment's ``faults`` for it."""
    return {"none": [],
            "link_down": [{"link": UPLINK}],
            "link_flap": [{"link": UPLINK, "at_s": at_s, "down_s": down_s}],
            "engine_kill": [{"switch": "tbl1", "at_s": at_s}],
            "worker_kill": [{"worker": 2, "at_s": at_s}]}


def experiment(nbytes: int, at_s: float, down_s: float, time_dilation: float) -> dict:
    """The benchmark's experiment (a dict the experiment runner takes)."""
    return {"name": "bench-faults",
            "topology": {"kind": "leaf_spine", "leaves": 2, "spines": 2, "hosts_per_leaf": 2,
                         "bw_mbps": 100, "switch": "programmable"},
            "time_dilation": time_dilation,
            "jobs": [{"algo": "ring", "nbytes": nbytes, "timeout_s": 30},
                     {"algo": "hd", "nbytes": nbytes, "timeout_s": 30},
                     {"algo": "ina", "nbytes": nbytes, "timeout_s": 30,
                      "placement": {"tree": "auto"}}],
            "sweep": {"faults": list(cases(at_s, down_s).values())}}


def _switch_back_s(r: dict) -> float | None:
    """How long the killed switch was away: an INA rerun's ``fallback_s`` (death to the
    rerun's start), else the longest engine restart a TCP collective rode out."""
    fb = r.get("fallback_s")
    if isinstance(fb, int | float) and fb == fb:  # not NaN
        return round(float(fb), 3)
    restarts = r.get("engine_restarts")
    if isinstance(restarts, list) and restarts:
        return max(float(x[2]) for x in restarts)
    return None


def _row(case: str, r: dict, base: dict) -> dict:
    events = r.get("fault_events")
    events = events if isinstance(events, list) else []  # a run without faults: NaN
    t = r.get("time_s") if r.get("status") == "ok" else None
    aborted = r.get("aborted_s")
    if t is not None and isinstance(aborted, int | float) and aborted == aborted:
        t += aborted  # a rerun: the attempt given up counts too
    b = base.get(r["algo"])
    return {"case": case, "algo": r["algo"], "bytes": r.get("bytes"), "status": r.get("status"),
            "correct": bool(r.get("correct")) if r.get("status") == "ok" else False,
            "time_s": t, "baseline_s": b,
            "slowdown": round(t / b, 3) if t and b else None, "model_s": r.get("model_s"),
            "fallback_s": r.get("fallback_s"), "rerun": r.get("rerun"),
            "aborted_s": aborted if t is not None and aborted == aborted else None,
            "switch_back_s": _switch_back_s(r),
            "in_network_fraction": r.get("in_network_fraction"),
            "fired": [f"{e['kind']} {e['target']} @{e['t_s']}s" + (f" ({e['error']})"
                                                                   if e["error"] else "")
                      for e in events],
            "error": (r.get("error") or "")[:300] or None}


def measure(emit, quick: bool, mib: float = 8.0, at_s: float = 0.3, down_s: float = 1.0,
            time_dilation: float = 1.0) -> Outcome:
    """``testbed bench faults`` (:mod:`testbed.bench.protocol`)."""
    if mib <= 0 or at_s < 0 or down_s <= 0:
        raise ValueError("--mib and --down-s must be > 0, --at-s >= 0")
    nbytes = int(mib * MiB) // 4 * 4
    exp = parse_experiment(experiment(nbytes, at_s, down_s, time_dilation), "bench faults")
    names = list(cases(at_s, down_s))
    with tempfile.TemporaryDirectory(prefix="tb-bench-faults-") as tmp:
        res = run_experiment(exp, out_dir=f"{tmp}/r", progress=False, doctor=False)
    records = res.df.to_dict("records")
    base = {r["algo"]: r["time_s"] for r in records
            if r["point"] == 0 and r.get("status") == "ok"}
    rows = []
    for r in records:
        row = _row(names[int(r["point"])], r, base)
        rows.append(row)
        emit(row)
    exact = [r for r in rows if r["case"] != "worker_kill"]
    wrong = [f"{r['case']}/{r['algo']}" for r in exact if not r["correct"]]
    killed = [r for r in rows if r["case"] == "worker_kill"]
    unnamed = [r["algo"] for r in killed
               if not (r["status"] == "error" and "tbh3" in (r["error"] or ""))
               and r["fired"]]  # a run that ended before the kill was due is not a miss
    engine = [r for r in rows if r["case"] == "engine_kill"]
    slow = [r["algo"] for r in engine if r["switch_back_s"] is None or r["switch_back_s"] > 2.0]
    ina_back = [r for r in engine if r["algo"] == "ina"]
    targets = {
        "exact": (not wrong, f"{len(exact) - len(wrong)} of {len(exact)} rows exact across "
                             f"link failures and engine kills{': not ' + str(wrong) if wrong else ''}"),
        "killed worker named": (not unnamed, f"{len(killed) - len(unnamed)} of {len(killed)} "
                                             "runs with a killed worker failed naming tbh3"),
        "switch back within 2 s": (bool(engine) and not slow,
                                   "switch back after the engine kill: " + ", ".join(
                                       f"{r['algo']} {r['switch_back_s']} s" for r in engine)),
        "INA in the network after the restart": (
            bool(ina_back) and all(r["in_network_fraction"] == 1.0 for r in ina_back),
            f"in_network_fraction {[r['in_network_fraction'] for r in ina_back]}"),
    }
    notes = {"quick": quick, "bytes": nbytes, "at_s": at_s, "down_s": down_s,
             "time_dilation": time_dilation,
             "cpu_bound": sorted(f"{names[int(r['point'])]}/{r['algo']}" for r in records
                                 if r.get("cpu_bound") is True)}
    return Outcome(rows, notes=notes, targets=targets,
                   ok=all(met for met, _ in targets.values()))
