"""``testbed bench fidelity [--quick] [--json]``: measured collective times against the
flow-level model, beyond one switch.

Networks (100 Mb/s access links): a star of 4 and of 8 hosts; a leaf-spine of 4 leaves x 2
spines with 2 hosts per leaf at 2:1 and at 4:1 oversubscription (uplinks 50 and 25 Mb/s); a
k=4 fat-tree (16 hosts). Every host is a worker. Algorithms: ring, halving-doubling, the
reduction server (one server co-located on every worker) and in-network aggregation. Sizes:
4 MiB (``--quick``), 4 and 32 MiB otherwise.

Switches: every switch runs the programmable data path (ECMP by the 5-tuple hash), its
engines grouped into :data:`ENGINE_GROUPS` process per network with the links between them
in memory (``engine_groups``, ``--engine-groups N``; 0: an engine process per switch, 20 on
the fat-tree; see :mod:`testbed.datapath.group`). ``programmable=False``
(``--no-programmable``) makes the switches Linux bridges instead but for the aggregator's,
which runs the data path (it must, for INA), as the benchmark did before engine groups: on
2 cores its fat-tree then calibrated to 12-13 where the grouped one calibrates to 4-6, and
the benchmark took 1377 s where it takes 662 s (``--quick``: 189 s, now 97 s). The model
follows whichever forwarding the fabric uses. Every shaped
link has the kernel's queue unless ``--queue-ms`` says otherwise (:data:`QUEUE_MS` says why).

Time dilation (``time_dilation``, default ``"auto"``): each network is calibrated once after
it is built (:func:`testbed.collectives.dilation.calibrate`) with the ring, then every run
uses that factor; a number runs every network at that factor, 1 in real time. Times are
reported undilated. The ring is the workload that needed the largest factor on every network
of the benchmark (each link busy both ways through the engines, a sender thread per peer):
calibrated with ring and INA on a shared 2-core machine, the ring needed 3.5-16, INA at most
as much, and calibrating with one workload halves the calibration's time. ``--quick`` caps
the factor at :data:`QUICK_MAX_FACTOR` (a run at 16 takes 16 times its undilated time),
except on the networks of :data:`QUICK_FACTORS`: the fat-tree's 16 ranks and 20 switches
needed 11-16 on a quiet 2-core machine, so ``--quick`` lets it go to 16 (its four runs then
take about 110 s of the budget) and starts its calibration at 4, skipping the factors that
never sufficed; the star of 8 likewise (it needed more than 8 on a quiet 2-core machine).
A run that the calibrated factor leaves ``cpu_bound`` (its algorithm needs more CPU than the
ring: INA and the reduction server on the star of 4 did) runs again at twice the factor, up to
the cap, and reports that run; the network returns to its calibrated factor for the next. The
rows say when the cap left a run ``cpu_bound``.

One row per run: ``topology, algo, n, bytes, time_s, model_s, fidelity (time_s / model_s),
cpu_bound, cpu_util, time_dilation`` plus ``cpu_wait, cpu_demand, cpu_max, cpu_engine, correct,
switches, cpu_model, tcp_cc`` (the TCP algorithms' congestion control, ``--tcp-cc``) and
``queue_ms`` (every shaped link's queue, ``--queue-ms``; None: the kernel's). Per
topology the summary compares the algorithms' order by the model with their order as
measured; algorithms the model puts within 3 % of each other are a tie (:data:`TIE_FRACTION`)
and not held to an order.
"""

from __future__ import annotations

import sys
import time

from testbed.bench.protocol import Outcome, parse_dilation
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.dilation import MAX_AUTO_FACTOR, calibrate, nice_factor
from testbed.collectives.report import tcp_cc_of
from testbed.collectives.spec import TCP_ALGOS
from testbed.experiment.results import cpu_model
from testbed.topologies import FatTree, LeafSpine, Star, TestbedNet
from testbed.topologies.pipeline import check_time_dilation

MiB = 1 << 20
ALGOS = ("ring", "hd", "rs", "ina")
#: programmable switches' engine processes per network (see the module docstring)
ENGINE_GROUPS = 1
#: the workloads a network is calibrated with (see the module docstring)
CALIBRATE_WITH = ("ring",)
#: the largest factor ``--quick`` calibrates to (see the module docstring)
QUICK_MAX_FACTOR = 8.0
#: per network, (first factor, largest factor) of the calibration where not (1, the cap)
QUICK_FACTORS = {"fattree-k4": (4.0, 16.0), "star8": (4.0, 16.0)}
ROW_KEYS = ("topology", "algo", "n", "bytes", "time_s", "model_s", "fidelity", "cpu_bound",
            "cpu_util", "time_dilation", "cpu_wait", "cpu_demand", "cpu_max", "cpu_engine",
            "correct", "switches", "cpu_model", "tcp_cc", "queue_ms")


#: Every shaped link's queue in the benchmark, ms at the link's rate (``queue_ms`` of the
#: topologies; None: the kernel's 1000 packets). A deep queue (``--queue-ms 500``) makes the
#: fabric lossless like the flow model, which charges no congestion loss: halving-doubling on
#: the 2:1 leaf-spine (ECMP puts two of its flows on one uplink) overflows the kernel's queue in
#: Reno's slow start (500-1200 drops per run at the leaves' uplinks) and measured 1.06-1.24 of
#: the model (ten runs, median 1.15; before hd clamped its TCP window, which now keeps it at
#: 1.01-1.02 with the kernel's queue: ``model.tcp_window_clamp``); with 500 ms: no drop,
#: 1.01-1.12 (five runs). But a deep
#: drop-tail FIFO is not fair: without losses, TCP flows sharing a link keep the unequal windows
#: they grew, where the model shares max-min fairly, and the ring, whose every step waits for
#: its slowest flow, measured 1.22 on the 4:1 leaf-spine (once in one run; 1.0-1.1 with the
#: kernel's queue). So the default stays the kernel's.
QUEUE_MS: float | None = None


def topologies(programmable: bool = True, queue_ms: float | None = QUEUE_MS
               ) -> list[tuple[str, object]]:
    """(name, topology) of every network of the benchmark; ``queue_ms``: every shaped link's
    queue (None: the kernel's default)."""
    def sw(agg: str):
        return "programmable" if programmable else {agg}

    q = {"queue_ms": queue_ms}
    return [
        ("star4", Star(4, bw_mbps=100, switch="programmable", **q)),
        ("star8", Star(8, bw_mbps=100, switch="programmable", **q)),
        ("leafspine-2:1", LeafSpine(leaves=4, spines=2, hosts_per_leaf=2, oversubscription=2,
                                    bw_mbps=100, switch=sw("tbsp1"), **q)),
        ("leafspine-4:1", LeafSpine(leaves=4, spines=2, hosts_per_leaf=2, oversubscription=4,
                                    bw_mbps=100, switch=sw("tbsp1"), **q)),
        ("fattree-k4", FatTree(4, bw_mbps=100, switch=sw("tbc1"), **q)),
    ]


def run(quick: bool = False, programmable: bool = True, reps: int = 1,
        time_dilation: float | str = "auto", only: list[str] | None = None, log=sys.stderr,
        on_row=None, tcp_cc: str | list[str] | None = None,
        queue_ms: float | None = QUEUE_MS, engine_groups: int | None = None) -> list[dict]:
    """Run the benchmark; return its rows (``ROW_KEYS``). ``only``: topology names to run;
    ``on_row(row)`` is called as each row is measured. ``time_dilation``: a factor for every
    network, or ``"auto"`` (calibrated per network). ``tcp_cc``: the TCP algorithms'
    congestion control (None: ``CollectiveSpec``'s default, ``"host"``: each host's), or a
    list of them: each TCP algorithm then runs once per entry on the same network and
    calibration (the first entry's), INA once. ``queue_ms``: :data:`QUEUE_MS`, or None for
    the kernel's queues. ``engine_groups`` (with ``programmable``): each network's
    ``engine_groups``, capped at its switches (None: :data:`ENGINE_GROUPS`; 0: an engine
    per switch)."""
    time_dilation = check_time_dilation(time_dilation)  # a bad value: ValueError, at once
    if engine_groups and not programmable:
        raise ValueError("engine_groups needs programmable switches (--programmable): "
                         "bridges have no engines to group")
    if engine_groups is None:
        engine_groups = ENGINE_GROUPS if programmable else 0
    nets = topologies(programmable, queue_ms)  # a bad queue_ms: TopologyError (a ValueError)
    names = [name for name, _ in nets]
    if only and set(only) - set(names):
        raise ValueError(f"unknown network(s) {sorted(set(only) - set(names))}; the benchmark "
                         f"has {names}")
    ccs = [{} if c is None else {"tcp_cc": None if c == "host" else c}
           for c in (tcp_cc if isinstance(tcp_cc, list | tuple) else [tcp_cc])]
    for cc in ccs:
        _spec("ring", MiB, 2, 1, cc).validate()  # a bad name: ValueError, at once
    sizes = [4 * MiB] if quick else [4 * MiB, 32 * MiB]
    cpu = cpu_model()
    rows: list[dict] = []
    for name, topo in nets:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        groups = min(engine_groups, len(topo.programmable)) or None
        with TestbedNet(topo, time_dilation=time_dilation, engine_groups=groups) as net:
            n = len(topo.host_names)
            lock = net.timings.get("lock_wait_s", 0.0)
            print(f"# {name}: {n} hosts, up in {time.monotonic() - t0 - lock:.1f} s "
                  f"(lock wait {lock:.1f} s), forwarding {net.forwarding_mode}", file=log)
            if time_dilation == "auto":
                start, cap = calibration_range(name, quick)
                cal = calibrate(net, [_spec(a, sizes[0], n, reps, ccs[0])
                                      for a in CALIBRATE_WITH], run_collective,
                                log=log, start=start, max_factor=cap)
                if cal.saturated and cap < MAX_AUTO_FACTOR and cal.factor >= cap:
                    print(f"# --quick stops at factor {cap:g}; without it the "
                          f"calibration may go up to {MAX_AUTO_FACTOR:g}", file=log)
            for size, algo, cc in _runs(sizes, ccs):
                spec = _spec(algo, size, n, reps, cc)
                try:
                    got = run_collective(net, spec)
                    if time_dilation == "auto":
                        got = _rerun_if_saturated(net, spec, got, cap, log)
                except Exception as e:  # noqa: BLE001 - a failed run is a row, not the end
                    print(f"# {name} {algo} {size // MiB} MiB failed: {e}", file=log)
                    got = [{"algo": algo, "n": n, "bytes": size, "time_s": float("nan"),
                            "model_s": float("nan"), "fidelity": float("nan"),
                            "cpu_bound": None, "cpu_util": None, "cpu_wait": None,
                            "cpu_max": None, "cpu_engine": None, "correct": False,
                            "time_dilation": net.time_dilation,
                            "tcp_cc": tcp_cc_of(spec), "error": f"{type(e).__name__}: {e}"}]
                for r in got:
                    row = {k: r.get(k) for k in ROW_KEYS}
                    row.update(topology=name, engine_groups=groups,
                               switches="programmable" if programmable else "aggregator",
                               cpu_model=cpu, queue_ms=net.topo.queue_ms)
                    if "error" in r:
                        row["error"] = r["error"]
                    rows.append(row)
                    print(_line(row), file=log)
                    if on_row is not None:
                        on_row(row)
    return rows


def _runs(sizes: list[int], ccs: list[dict]) -> list[tuple[int, str, dict]]:
    """(size, algorithm, extra spec fields) of every run on one network, in order: the TCP
    algorithms once per congestion-control entry, the others once."""
    return [(size, a, cc) for size in sizes for a in ALGOS
            for cc in (ccs if a in TCP_ALGOS else ccs[:1])]


def _rerun_if_saturated(net, spec, got: list[dict], cap: float, log) -> list[dict]:
    """A run the calibrated factor left ``cpu_bound`` (the calibration's workload needed less
    CPU than this one) runs again at twice the factor, up to ``cap``, until it is not; the
    network goes back to its calibrated factor after. Returns the last run's rows."""
    base = net.time_dilation
    f = base
    try:
        while any(r.get("cpu_bound") for r in got) and f < cap:
            f = min(cap, nice_factor(2 * f))
            print(f"# {spec.algo} {spec.nbytes // MiB} MiB was cpu_bound at factor "
                  f"{net.time_dilation:g}: again at {f:g}", file=log)
            net.set_time_dilation(f)
            got = run_collective(net, spec)
    finally:
        if net.time_dilation != base:
            net.set_time_dilation(base)
    return got


def calibration_range(name: str, quick: bool) -> tuple[float, float]:
    """(first factor, largest factor) the calibration of network ``name`` tries."""
    if not quick:
        return 1.0, MAX_AUTO_FACTOR
    return QUICK_FACTORS.get(name, (1.0, QUICK_MAX_FACTOR))


def _spec(algo: str, size: int, n: int, reps: int, extra: dict | None = None):
    """The benchmark's collective: every host a worker (and a reduction server); ``extra``:
    further ``CollectiveSpec`` fields."""
    return CollectiveSpec(algo=algo, nbytes=size, servers=n, window=64, repetitions=reps,
                          timeout_s=120, **(extra or {}))


def _line(r: dict) -> str:
    def f(v, fmt):
        return "-" if v is None or v != v else format(v, fmt)

    return (f"{r['topology']:>14} {r['algo']:>4} n={r['n']:<2} {r['bytes'] // MiB:>3} MiB  "
            f"time {f(r['time_s'], '.3f')} s  model {f(r['model_s'], '.3f')} s  "
            f"fidelity {f(r['fidelity'], '.2f')}  f={f(r['time_dilation'], 'g')}  "
            f"cpu_bound={r['cpu_bound']} "
            f"(util {f(r['cpu_util'], '.2f')}, wait {f(r['cpu_wait'], '.2f')}, "
            f"engine {f(r['cpu_engine'], '.2f')})  correct={r['correct']}")


#: Model times closer than this fraction (of the larger) are a tie: the model does not order
#: them, so neither does the comparison (the measurement's own run-to-run spread is 2-5 % here).
TIE_FRACTION = 0.03


def model_ties(mod: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs of algorithms whose model times are within :data:`TIE_FRACTION` of each other."""
    algos = sorted(mod, key=mod.get)
    return [(a, b) for i, a in enumerate(algos) for b in algos[i + 1:]
            if abs(mod[b] - mod[a]) <= TIE_FRACTION * max(mod[a], mod[b])]


def orderings(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (topology, bytes): the algorithms ordered by model and by measurement (mean over
    repetitions), the model's ties (:func:`model_ties`), and whether the orders agree: every
    pair the model does not call a tie is ordered the same way by the measurement."""
    out: dict[tuple[str, int], dict] = {}
    groups: dict[tuple[str, int], dict[str, list]] = {}
    for r in rows:
        if r["time_s"] == r["time_s"] and r["time_s"] is not None:
            g = groups.setdefault((r["topology"], r["bytes"]), {})
            g.setdefault(r["algo"], []).append((r["time_s"], r["model_s"]))
    for key, g in groups.items():
        meas = {a: sum(t for t, _ in v) / len(v) for a, v in g.items()}
        mod = {a: v[0][1] for a, v in g.items()}
        by_model = sorted(mod, key=mod.get)
        by_meas = sorted(meas, key=meas.get)
        ties = model_ties(mod)
        same = all((mod[a] < mod[b]) == (meas[a] < meas[b])
                   for i, a in enumerate(by_model) for b in by_model[i + 1:]
                   if (a, b) not in ties)
        out[key] = {"model": by_model, "measured": by_meas, "ties": ties, "same": same}
    return out


def summary(rows: list[dict]) -> list[str]:
    """Lines: the fidelity range and the orderings per topology and size (per TCP congestion
    control when the rows have several: each with the rows without TCP)."""
    lines = []
    ok = [r for r in rows if r["fidelity"] == r["fidelity"] and r["fidelity"] is not None]
    bound = [r for r in ok if r["cpu_bound"]]
    within = [r for r in ok if 0.90 <= r["fidelity"] <= 1.15]
    lines.append(f"{len(ok)} runs: {len(bound)} cpu_bound, {len(within)} within 0.90-1.15 of "
                 "the model")
    ccs = list(dict.fromkeys(r.get("tcp_cc") for r in rows if r.get("tcp_cc")))
    for cc in ccs or [None]:
        some = [r for r in rows if r.get("tcp_cc") in (None, cc)]
        for line in _order_lines(some):
            lines.append(line + (f" [tcp {cc}]" if len(ccs) > 1 else ""))
    return lines


def _order_lines(rows: list[dict]) -> list[str]:
    lines = []
    for (topo, size), o in orderings(rows).items():
        lines.append(f"{topo:>14} {size // MiB:>3} MiB  model: {' < '.join(o['model'])}   "
                     f"measured: {' < '.join(o['measured'])}   "
                     f"{'same order' if o['same'] else 'ORDER DIFFERS'}"
                     + (f" (model ties: {', '.join(f'{a}~{b}' for a, b in o['ties'])})"
                        if o["ties"] else ""))
    return lines


def measure(emit, quick: bool, programmable: bool, time_dilation: str, tcp_cc: str | None,
            only: str | None, queue_ms: float | None, engine_groups: int | None = None
            ) -> Outcome:
    """``testbed bench fidelity`` (:mod:`testbed.bench.protocol`); ok when every run
    completed correctly."""
    rows = run(quick=quick, programmable=programmable,
               time_dilation=parse_dilation(time_dilation), on_row=emit,
               tcp_cc=tcp_cc.split(",") if tcp_cc else None,
               only=only.split(",") if only else None,
               queue_ms=QUEUE_MS if queue_ms is None else queue_ms or None,
               engine_groups=engine_groups)
    return Outcome(rows, {"summary": summary(rows)},
                   ok=bool(rows) and all(r["correct"] for r in rows))
