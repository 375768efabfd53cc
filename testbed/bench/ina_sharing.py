"""``testbed bench ina-sharing``: INA and a TCP ring job sharing a thin link, with and without
the INA congestion response (``CollectiveSpec.ina_cc``).

``testbed bench ina-sharing [--quick] [--mbps 10] [--ring-kib 64] [--window 64] [--repeats 3]
[--json]``

Network: a dumbbell (two programmable switches, the aggregator on the left one ``tbs1``)
whose bottleneck runs at ``--mbps``; host links at ``--host-mbps``. The INA job's workers are
``tbh1`` (left) and ``tbh3`` (right), so ``tbh3``'s contributions and results cross the
bottleneck both ways; the ring job's are ``tbh2`` (left) and ``tbh4`` (right), whose two
directions cross it too. Each repeat runs, for each INA setting (``ina_cc`` None, then
"delay", alternating): the ring alone, the INA job alone, then both, the ring started
``--ring-delay`` seconds after the INA job so that it runs inside the INA job's transfer.

Reported per setting (medians over the repeats): each job's time alone and shared (the
rows' ``time_s``: the collective only), the ring's slowdown, the INA job's share of the
bottleneck while both run (``1 - ring alone / ring shared``: the ring's rate fell by the
share the INA job took), and the flow model's times of the two sharing the fabric max-min
fairly (:func:`testbed.collectives.flowmodel.predict_concurrent`: ``fair_ring_s`` per ring
allreduce, ``fair_ina_s``) with the measured ones against them. ``all_overlapped`` says
whether every shared run's ring allreduces fell inside the INA job's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from testbed.bench.protocol import Outcome
from testbed.collectives import CollectiveSpec, run_collective


def _specs(args, ina_cc):
    ina = CollectiveSpec(algo="ina", nbytes=int(args.ina_mib * (1 << 20)), hosts=[0, 2],
                         window=args.window, job_id=1, seed=1, timeout_s=120, ina_cc=ina_cc)
    ring = CollectiveSpec(algo="ring", nbytes=int(args.ring_kib * 1024), hosts=[1, 3],
                          job_id=2, seed=2, timeout_s=120, repetitions=args.ring_reps)
    return ina, ring


def together(net, ina, ring, delay_s, ends: dict | None = None):
    """Run both at once (the ring ``delay_s`` later); rows of each. ``ends``: gets each
    job's ``time.monotonic()`` at return ("ina", "ring")."""
    out: dict[str, object] = {}
    ends = {} if ends is None else ends

    def go(name, spec, wait):
        time.sleep(wait)
        try:
            out[name] = run_collective(net, spec)
        except BaseException as e:  # noqa: BLE001 - reported below
            out[name] = e
        ends[name] = time.monotonic()

    ts = [threading.Thread(target=go, args=("ina", ina, 0.0)),
          threading.Thread(target=go, args=("ring", ring, delay_s))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for v in out.values():
        if isinstance(v, BaseException):
            raise v
    return out["ina"], out["ring"]


def overlapped(ends: dict, ina_row: dict, ring_rows: list[dict]) -> bool:
    """Whether the ring's allreduces (from ``ends``, :func:`together`'s, back by their summed
    times) ran inside the INA job's: else the shared times compare nothing."""
    ring_from = ends["ring"] - sum(r["time_s"] for r in ring_rows)
    return ends["ina"] - ina_row["time_s"] < ring_from < ends["ring"] < ends["ina"]


def _median_row(rows: list[dict]) -> dict:
    """The ring's repetition of median time (each is one allreduce)."""
    return sorted(rows, key=lambda r: r["time_s"])[len(rows) // 2]


def run(args) -> dict:
    from testbed.topologies import Dumbbell, TestbedNet

    topo = Dumbbell(2, 2, bw_mbps=args.host_mbps, bottleneck_mbps=args.mbps,
                    switch="programmable", queue_ms=args.queue_ms)
    res: dict[str, dict[str, list]] = {}
    with TestbedNet(topo) as net:
        for rep in range(args.repeats):
            for cc in (None, "delay"):
                ina, ring = _specs(args, cc)
                r = res.setdefault(str(cc), {k: [] for k in (
                    "ina_alone", "ring_alone", "ina_shared", "ring_shared", "ina_model",
                    "ring_model", "ina_model_shared", "ring_model_shared", "correct",
                    "overlap")})
                ras = run_collective(net, ring)
                ia = run_collective(net, ina)[0]
                ends: dict = {}
                ish, rshs = together(net, ina, ring, args.ring_delay, ends)
                ish = ish[0]
                r["overlap"].append(overlapped(ends, ish, rshs))
                ra, rsh = _median_row(ras), _median_row(rshs)
                r["ring_alone"].append(ra["time_s"])
                r["ina_alone"].append(ia["time_s"])
                r["ina_shared"].append(ish["time_s"])
                r["ring_shared"].append(rsh["time_s"])
                r["ina_model"].append(ia["model_s"])
                r["ring_model"].append(ra["model_s"])
                shared = _model_shared(net, ina, ring, args.ring_delay)
                r["ina_model_shared"].append(shared[0])
                r["ring_model_shared"].append(shared[1] / ring.repetitions)
                r["correct"].append(all(x["correct"] for x in [ia, ish, *ras, *rshs]))
                print(f"rep {rep} ina_cc={cc}: ring alone {ra['time_s']:.2f} s, shared "
                      f"{rsh['time_s']:.2f} s; ina alone {ia['time_s']:.2f} s, shared "
                      f"{ish['time_s']:.2f} s", file=sys.stderr, flush=True)
    return {"args": vars(args), "runs": res, "summary": summarize(res)}


def _model_shared(net, ina, ring, delay_s: float) -> list[float]:
    """The flow model's times of the two jobs run as :func:`together` runs them, sharing
    the fabric max-min fairly (:func:`flowmodel.predict_concurrent`): INA's, the ring's
    (all its repetitions)."""
    from testbed.collectives import flowmodel as fm

    names = net.topo.host_names
    return fm.predict_concurrent(
        net.topo, [fm.ConcurrentJob(ina, [names[h] for h in ina.hosts]),
                   fm.ConcurrentJob(ring, [names[h] for h in ring.hosts], start_s=delay_s)],
        hop_latency_s=net.hop_latency_s(), time_dilation=net.time_dilation)


def summarize(res: dict) -> dict:
    """Medians per INA setting, the derived ratios and the model's times of the two jobs
    sharing the link."""
    out = {}
    for cc, r in res.items():
        med = {k: statistics.median(v) for k, v in r.items() if k not in ("correct", "overlap")}
        out[cc] = {
            **{k: round(v, 3) for k, v in med.items()},
            "ring_slowdown": round(med["ring_shared"] / med["ring_alone"], 2),
            "ina_slowdown": round(med["ina_shared"] / med["ina_alone"], 2),
            "ina_share": round(1 - med["ring_alone"] / med["ring_shared"], 2),
            "fair_ring_s": round(med["ring_model_shared"], 3),
            "fair_ina_s": round(med["ina_model_shared"], 3),
            "ring_vs_fair": round(med["ring_shared"] / med["ring_model_shared"], 2),
            "ina_vs_fair": round(med["ina_shared"] / med["ina_model_shared"], 2),
            "all_correct": all(r["correct"]),
            "all_overlapped": all(r["overlap"]),
        }
    return out


def measure(emit, quick: bool, mbps: float, ring_kib: float, window: int, repeats: int,
            ina_mib: float) -> Outcome:
    """``testbed bench ina-sharing`` (:mod:`testbed.bench.protocol`): one row per INA
    setting (``ina_cc`` off, ``delay``); ok when every sum was right."""
    if mbps <= 0 or ring_kib <= 0 or window < 1 or repeats < 1 or ina_mib <= 0:
        raise ValueError("mbps, ring_kib and ina_mib > 0; window and repeats >= 1")
    args = argparse.Namespace(mbps=mbps, host_mbps=100.0, queue_ms=None, ina_mib=ina_mib,
                              ring_kib=ring_kib, ring_reps=10, window=window,
                              ring_delay=2.0 * ina_mib / 8 * 10 / mbps, repeats=repeats)
    out = run(args)
    rows = []
    for cc, summary in out["summary"].items():
        row = {"ina_cc": None if cc == "None" else cc, "bottleneck_mbps": mbps,
               "ring_kib": ring_kib, "window": window, **summary}
        emit(row)
        rows.append(row)
    ok = all(r["all_correct"] for r in rows)
    by = {r["ina_cc"]: r for r in rows}
    targets = {"every shared run overlapped (else it measured no sharing)": (
        all(r["all_overlapped"] for r in rows),
        ", ".join(f"{r['ina_cc']}: {r['all_overlapped']}" for r in rows))}
    if None in by and "delay" in by:
        targets["the response keeps a sharing ring's slowdown below half of without it"] = (
            by["delay"]["ring_slowdown"] - 1 <= 0.5 * (by[None]["ring_slowdown"] - 1),
            f"ring slowdown {by[None]['ring_slowdown']} -> {by['delay']['ring_slowdown']}")
        targets["INA and the ring share within 15 % of the fair share (model)"] = (
            abs(by["delay"]["ina_vs_fair"] - 1) <= 0.15
            and abs(by["delay"]["ring_vs_fair"] - 1) <= 0.15,
            f"ring {by['delay']['ring_vs_fair']}x, INA {by['delay']['ina_vs_fair']}x fair")
    return Outcome(rows, {"repeats": repeats}, targets, ok=ok)
