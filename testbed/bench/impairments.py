"""``testbed bench impairments``: collectives under seeded loss, duplication and reordering at
a switch, measured against the flow model with the impairments priced and without.

The switch's ``impair`` stage acts at ingress on every port (so on every flow that crosses
it, ACKs and RESULTs included), configured at run time; the model reads what it does now
(``TestbedNet.link_impairments``) and prices it (:mod:`testbed.collectives.flowmodel`:
duplicates on the links after the copy, INA's losses and held frames, TCP's loss recovery).
Networks: ``star4`` (4 hosts at 100 Mb/s, dilation 4, the impairment at ``tbs1``) and
``leafspine`` (2 leaves of 2 hosts under one spine at 50 Mb/s, dilation 2, at ``tbl1``: a
ring's flows cross it but one, and INA aggregates on the tree). Every row is checked against
the numpy sum of the inputs.

Rows: ``network``, ``algo``, ``mib``, ``loss_pct``, ``dup_pct``, ``reorder_pct``, ``time_s``
(median of the repeats), ``model_s`` (priced), ``unpriced_s`` (the model without the
impairments), ``ratio`` / ``unpriced_ratio`` (measured over each), ``lost`` / ``duplicated``
/ ``reordered`` (what the stage did), ``correct``, ``cpu_bound``, ``cpu_model``.
"""

from __future__ import annotations

import statistics

from testbed.bench.protocol import Outcome

NETWORKS = ("star4", "leafspine")
#: (loss %, duplication %, reordering %) of the full run; the first is the baseline
CASES = ((0.0, 0.0, 0.0), (0.3, 0.0, 0.0), (1.0, 0.0, 0.0), (2.0, 0.0, 0.0), (0.0, 10.0, 0.0),
         (0.0, 0.0, 10.0), (1.0, 5.0, 5.0))
QUICK_CASES = ((0.0, 0.0, 0.0), (1.0, 0.0, 0.0))


def _network(name: str):
    """(topology, the impaired switch, time dilation) of a network name."""
    from testbed.topologies import LeafSpine, Star

    if name == "star4":
        return Star(4, bw_mbps=100, switch="programmable"), "tbs1", 4.0
    if name == "leafspine":
        return (LeafSpine(leaves=2, spines=1, hosts_per_leaf=2, bw_mbps=50,
                          switch="programmable"), "tbl1", 2.0)
    raise ValueError(f"network {name!r}: choose from {', '.join(NETWORKS)}")


def _spec(algo: str, mib: float, reps: int):
    from testbed.collectives import CollectiveSpec

    extra = {"placement": {"tree": "auto"}, "window": 16} if algo == "ina" else {}
    return CollectiveSpec(algo=algo, nbytes=int(mib * (1 << 20)) // 4 * 4, repetitions=reps,
                          timeout_s=120, seed=1, **extra)


def _rows_of(net, node: str, name: str, algos: list[str], cases, mib: float, reps: int,
             emit, cpu: str) -> list[dict]:
    from testbed.collectives import flowmodel, run_collective
    from testbed.collectives.testing import check_rows

    client = net.switch_client(node)
    workers = [h.name for h in net.hosts]
    out = []
    try:
        for loss, dup, reorder in cases:
            client.configure("impair", seed=5, loss=loss / 100, dup=dup / 100,
                             reorder=reorder / 100)
            for algo in algos:
                spec = _spec(algo, mib, reps)
                before = _impair_totals(net, node)
                rows = run_collective(net, spec)
                after = _impair_totals(net, node)
                try:
                    check_rows(rows, spec, len(workers))
                    correct = True
                except AssertionError:
                    correct = False
                unpriced = flowmodel.predict(net.routed_topo, spec, workers=workers,
                                             hop_latency_s=net.hop_latency_s(),
                                             time_dilation=net.time_dilation).time_s
                t = statistics.median(r["time_s"] for r in rows)
                model = rows[0]["model_s"]
                row = {"network": name, "algo": algo, "mib": mib, "loss_pct": loss,
                       "dup_pct": dup, "reorder_pct": reorder, "time_s": round(t, 4),
                       "model_s": round(model, 4), "unpriced_s": round(unpriced, 4),
                       "ratio": round(t / model, 3), "unpriced_ratio": round(t / unpriced, 3),
                       **{k: after[k] - before[k] for k in ("lost", "duplicated", "reordered")},
                       "correct": correct, "cpu_bound": any(r.get("cpu_bound") for r in rows),
                       "cpu_model": cpu}
                emit(row)
                out.append(row)
    finally:
        client.configure("impair", loss=0.0, dup=0.0, reorder=0.0)
    return out


def _impair_totals(net, node: str) -> dict:
    return net.counters()["datapath"][node]["stages"]["impair"]["totals"]


def _geomean_error(rows: list[dict], key: str) -> float:
    """exp(mean |log ratio|) - 1 over ``rows``: how far the model is, in either direction."""
    import math

    logs = [abs(math.log(r[key])) for r in rows]
    return math.exp(sum(logs) / len(logs)) - 1 if logs else float("nan")


def measure(emit, quick: bool, networks: str, algos: str, mib: float, reps: int) -> Outcome:
    """``testbed bench impairments`` (:mod:`testbed.bench.protocol`): one row per network,
    impairment and algorithm; ok when every sum was right."""
    from testbed.experiment.results import cpu_model
    from testbed.topologies import TestbedNet
    from testbed.topologies.pipeline import DatapathOptions, Impairment

    nets = [n.strip() for n in networks.split(",") if n.strip()]
    names = [a.strip() for a in algos.split(",") if a.strip()]
    bad = [a for a in names if a not in ("ring", "hd", "ina")]
    if not nets or not names or bad or mib <= 0 or reps < 1:
        raise ValueError("networks and algos (ring, hd, ina) must name something; mib > 0, "
                         f"reps >= 1 (got networks {nets}, algos {names}, mib {mib:g}, "
                         f"reps {reps})")
    for n in nets:
        _network(n)  # a bad name is refused before any network starts
    cases = QUICK_CASES if quick else CASES
    cpu = cpu_model()
    rows: list[dict] = []
    for name in nets:
        topo, node, f = _network(name)
        opts = DatapathOptions(impairments=(Impairment(node=node, direction="ingress"),))
        with TestbedNet(topo, datapath=opts, time_dilation=f) as net:
            rows += _rows_of(net, node, name, names, cases, mib, reps, emit, cpu)
    impaired = [r for r in rows if r["loss_pct"] or r["dup_pct"] or r["reorder_pct"]]
    priced, unpriced = (_geomean_error(impaired, k) for k in ("ratio", "unpriced_ratio"))
    targets = {
        "the priced model is nearer the measurements than the unpriced one (geometric mean "
        "of |log measured/model| over the impaired rows)": (
            bool(impaired) and priced <= unpriced,
            f"priced {priced:.1%}, unpriced {unpriced:.1%} off on average"),
        "every impaired row within 0.7-1.4x of the priced model": (
            all(0.7 <= r["ratio"] <= 1.4 for r in impaired),
            ", ".join(f"{r['network']} {r['algo']} {r['loss_pct']}/{r['dup_pct']}/"
                      f"{r['reorder_pct']}: {r['ratio']}" for r in impaired
                      if not 0.7 <= r["ratio"] <= 1.4) or "all"),
    }
    notes = {"repeats": reps, "cases (loss, dup, reorder %)": [list(c) for c in cases],
             "cpu_bound rows": sum(r["cpu_bound"] for r in rows)}
    return Outcome(rows, notes, targets, ok=all(r["correct"] for r in rows))
