"""``testbed bench replay``: Chakra traces of a data-parallel job and of a mixture-of-experts
job replayed on an emulated leaf-spine, each collective against the flow model as ASTRA-sim
publishes its validation (measured, predicted, error in %, geometric mean of |error|), and
the whole trace's completion time against the model's (:func:`testbed.workloads.chakra.predict_jct`);
and the export round trip (trace ``export``): a training job run on the same fabric, written
as a Chakra trace (``chakra_out``) and replayed, its communication time per iteration against
the original run's.

Every iteration of a trace repeats its collectives, so each (op, size) is measured several
times and its median compared (a single collective is measured on cold connections). The
machine's CPU over each replay is recorded: a replay that kept every core busy measured the
emulator, and is flagged ``cpu_bound``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from testbed.bench.protocol import Outcome, parse_ints
from testbed.collectives.cpumon import UTIL_SATURATED, CpuMonitor

#: measured / model of every collective, and the trace's JCT, within these (issue 33's band)
BAND = (0.90, 1.15)
JCT_TOLERANCE = 0.15
#: an exported job's replay: communication per iteration within this of the original run's
EXPORT_TOLERANCE = 0.05
TRACES = ("ddp", "moe", "export")


def measure(emit, quick: bool, ranks: int, traces: str, buckets: str, a2a_bytes: int,
            layers: int, iterations: int, compute_us: int, algo: str, topology: str,
            bw: float, time_dilation: float, export_hidden: int = 1024,
            export_iterations: int = 12) -> Outcome:
    """Replay each trace of ``traces`` (ddp, moe; export: a training job's, see the module
    docstring, an MLP of ``export_hidden`` units trained ``export_iterations`` steps) on
    ``ranks`` hosts of ``topology`` (leaf_spine: two leaves, two spines; star) at ``bw``
    Mb/s, its allreduces through the testbed's ``algo`` ('' or gloo: plain gloo)."""
    from testbed.collectives.algorithms import algorithm_names
    from testbed.replay import replay
    from testbed.workloads.chakra import ddp_graphs, moe_graphs, write_trace

    sizes = parse_ints("buckets", buckets)
    names = [t.strip() for t in traces.split(",") if t.strip()]
    bad = sorted(set(names) - set(TRACES))
    if bad or not names:
        raise ValueError(f"traces: {bad or names} not among {', '.join(TRACES)}")
    if "export" in names and algo in ("", "gloo"):
        raise ValueError("traces: export runs a training job, whose allreduce is a testbed "
                         "algorithm's: give algo")
    allreducing = algorithm_names("allreduce", trains=True)
    if algo not in ("", "gloo", *allreducing):
        raise ValueError(f"algo={algo!r}: one of {allreducing}, or gloo")
    if ranks < 2 or (topology == "leaf_spine" and ranks % 2):
        raise ValueError(f"ranks={ranks}: at least 2 (an even number on the leaf-spine's two "
                         "leaves)")
    if topology not in ("leaf_spine", "star"):
        raise ValueError(f"topology={topology!r}: leaf_spine or star")
    topo = ({"kind": "leaf_spine", "leaves": 2, "spines": 2, "hosts_per_leaf": ranks // 2}
            if topology == "leaf_spine" else {"kind": "star", "n_hosts": ranks})
    topo["bw_mbps"] = bw
    graphs = {"ddp": lambda: ddp_graphs(ranks, sizes, compute_us, iterations),
              "moe": lambda: moe_graphs(ranks, layers, a2a_bytes, sizes[0], compute_us,
                                        iterations)}
    rows, notes, targets, ok = [], {"band": BAND}, {}, True
    with tempfile.TemporaryDirectory(prefix="tb-bench-replay-") as tmp:
        for name in names:
            if name == "export":
                ok &= _round_trip(emit, rows, targets, notes, Path(tmp), topo, ranks, algo,
                                  time_dilation, export_hidden, export_iterations,
                                  compute_us)
                continue
            prefix = write_trace(Path(tmp) / name, graphs[name]())
            cores = CpuMonitor({})  # the machine's cores over the replay
            res = replay(prefix, algo=algo if algo not in ("", "gloo") else None,
                         topology=topo, time_dilation=time_dilation, out=Path(tmp) / "out",
                         echo=lambda line: None)
            util = cores.stop().cpu_util
            if res.launched.returncode != 0:
                ok = False
                notes[f"{name} failed"] = res.launched.failures
                continue
            cpu_bound = util >= UTIL_SATURATED
            ratios = []
            for v in res.validation:
                ratio = v["measured_s"] / v["predicted_s"] if v["predicted_s"] else None
                if ratio is not None:
                    ratios.append(ratio)
                row = {"trace": name, "op": v["op"], "bytes": v["bytes"], "path": v["path"],
                       "count": v["count"], "measured_s": v["measured_s"],
                       "model_s": v["predicted_s"], "ratio": ratio, "error_pct": v["error_pct"],
                       "cpu_util": util, "cpu_bound": cpu_bound}
                rows.append(row)
                emit(row)
            jct_ratio = res.jct_s / res.model_jct_s if res.model_jct_s else None
            row = {"trace": name, "op": "jct", "bytes": None, "path": res.validation[0]["path"]
                   if res.validation else None, "count": 1, "measured_s": res.jct_s,
                   "model_s": res.model_jct_s, "ratio": jct_ratio,
                   "error_pct": None if jct_ratio is None else (jct_ratio - 1) * 100,
                   "geomean_error_pct": res.geomean_error_pct, "cpu_util": util,
                   "cpu_bound": cpu_bound}
            rows.append(row)
            emit(row)
            inside = [r for r in ratios if BAND[0] <= r <= BAND[1]]
            targets[f"{name}: every collective's measured/model in {BAND[0]}-{BAND[1]}"] = (
                bool(ratios) and len(inside) == len(ratios) and not cpu_bound,
                f"{len(inside)} of {len(ratios)} in the band "
                f"({', '.join(f'{r:.2f}' for r in ratios)})"
                + ("; cpu_bound: the emulator was measured" if cpu_bound else ""))
            targets[f"{name}: JCT within {JCT_TOLERANCE:.0%} of the model's"] = (
                jct_ratio is not None and abs(jct_ratio - 1) <= JCT_TOLERANCE
                and not cpu_bound,
                "no model" if jct_ratio is None else f"measured/model {jct_ratio:.2f}")
    notes["topology"] = topo
    notes["time_dilation"] = time_dilation
    return Outcome(rows, notes, targets, ok)


def _round_trip(emit, rows: list, targets: dict, notes: dict, tmp: Path, topo: dict,
                ranks: int, algo: str, time_dilation: float, hidden: int, iterations: int,
                compute_us: int) -> bool:
    """A training job (``algo``, an MLP of ``hidden`` units, ``iterations`` steps of
    ``compute_us`` each) on ``topo``, exported as a Chakra trace and replayed on a network of
    the same kind: its per-iteration communication (the median allreduce: the job
    allreduces its gradient once per step) measured both ways. False when a run failed."""
    import statistics

    from testbed.launch import launch_network
    from testbed.replay import replay
    from testbed.workloads.chakra import export
    from testbed.workloads.runner import run_training
    from testbed.workloads.spec import TrainingSpec

    spec = TrainingSpec(name="export", algo=algo, hidden=hidden, iterations=iterations,
                        eval_every=iterations, compute_ms=compute_us / 1000.0,
                        time_dilation=time_dilation, workers=ranks)
    cores = CpuMonitor({})
    with launch_network(topo, None, None, algo, time_dilation) as net:
        res = run_training(net, spec)
    trained_util = cores.stop().cpu_util
    prefix = tmp / "export" / "job"
    export(res.trace, prefix, ranks)
    cores = CpuMonitor({})
    replayed = replay(prefix, algo=algo, topology=topo,
                      time_dilation=time_dilation, out=tmp / "out", echo=lambda line: None)
    util = max(trained_util, cores.stop().cpu_util)
    if replayed.launched.returncode != 0:
        notes["export failed"] = replayed.launched.failures
        return False
    # the first step runs on cold connections in both: left out
    original = statistics.median(r["comm_s"] for r in res.iterations[1:])
    again = statistics.median(c["time_s"] for c in replayed.collectives[1:])
    ratio = again / original
    cpu_bound = util >= UTIL_SATURATED
    row = {"trace": "export", "op": "all_reduce", "bytes": 4 * spec.n_params(),
           "path": f"testbed:{algo}", "count": len(replayed.collectives) - 1,
           "measured_s": again, "model_s": res.summary.get("model_comm_s"),
           "original_s": original, "ratio": ratio, "error_pct": (ratio - 1) * 100,
           "cpu_util": util, "cpu_bound": cpu_bound}
    rows.append(row)
    emit(row)
    targets[f"export: replayed communication per iteration within {EXPORT_TOLERANCE:.0%} of "
            "the original run's"] = (
        abs(ratio - 1) <= EXPORT_TOLERANCE and not cpu_bound,
        f"replayed/original {ratio:.3f} ({again * 1e3:.1f} ms vs {original * 1e3:.1f} ms)"
        + ("; cpu_bound: the emulator was measured" if cpu_bound else ""))
    return True
