"""The benchmark protocol: a declaration per benchmark, one runner for all of them.

A benchmark's measuring function is ``measure(emit, quick, **options) -> Outcome``: it calls
``emit(row)`` as each row is measured (the JSON line is printed then, so a long benchmark shows
progress and an interrupted one keeps what it measured) and returns every row with its notes
and targets. It raises ``ValueError`` for a bad option (exit 2, nothing measured).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import describe_error

#: ``Option.quick`` when ``--quick`` leaves the option at its default
UNCHANGED = object()


@dataclass(frozen=True)
class Option:
    """One option of a benchmark: ``--name`` on the command line (underscores become dashes),
    ``name=`` of its measuring function. Its type is ``type`` or that of ``default``
    (``bool``: a ``--name/--no-name`` switch)."""

    name: str
    default: Any
    help: str
    quick: Any = UNCHANGED
    type: type | None = None
    metavar: str | None = None

    @property
    def kind(self) -> type:
        return self.type or type(self.default)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass
class Outcome:
    """What a benchmark measured: its rows, notes (anything the rows do not say: rates
    offered, samples, cautions), targets (name -> (met, detail)), and whether every row was
    right (``ok=False``: exit status 1)."""

    rows: list[dict]
    notes: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, tuple[bool, str]] = field(default_factory=dict)
    ok: bool = True


@dataclass(frozen=True)
class Benchmark:
    """One benchmark. ``measure`` is ``"module:function"`` (imported when it runs);
    ``case``: the columns that name a row in its plot; ``requires``: Python modules it needs
    (an optional extra); ``check``: ``"module:function"`` returning why it cannot run here
    (empty when it can)."""

    name: str
    summary: str
    measure: str
    options: tuple[Option, ...] = ()
    quick_help: str = "small sizes and short trials, to check that it runs"
    columns: tuple[str, ...] | None = None
    case: tuple[str, ...] = ()
    needs_root: bool = True
    requires: tuple[str, ...] = ()
    check: str | None = None

    def why_not(self) -> str:
        """Why this benchmark cannot run on this machine ('' when it can)."""
        if self.needs_root and os.geteuid() != 0:
            return "needs root (it builds Mininet networks)"
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return (f"needs {', '.join(missing)}: pip install -e '.[torch]' (or make setup, "
                    "which installs every extra)")
        return _load(self.check)() if self.check else ""

    def measure_fn(self) -> Callable[..., Outcome]:
        return _load(self.measure)


def _load(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


#: Every benchmark, in the order ``testbed bench all`` runs them.
CATALOG: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark(
        "kernels", "Numba kernels against numpy anchors (GB/s ratio).",
        "testbed.bench.kernels:measure", needs_root=False, case=("kernel", "anchor"),
        columns=("kernel", "elements", "gbps", "anchor", "anchor_gbps", "ratio", "note"),
        options=(Option("elements", 25_000_000, "gradient length (float32 elements)",
                        quick=1_000_000),
                 Option("only", "", "only these row groups: elementwise, trimming, packets, "
                                    "compressors ('' for all)", metavar="G,H")),
        quick_help="1,000,000 elements"),
    Benchmark(
        "datapath", "Data-path programs against Linux bridge, OVS userspace and a Python "
        "forwarder (kpps ratio).", "testbed.bench.datapath:measure",
        case=("program", "packet_bytes", "anchor"),
        columns=("program", "packet_bytes", "kpps", "gbps", "anchor", "anchor_kpps", "ratio"),
        options=(Option("duration", 1.0, "seconds per trial", quick=0.25),
                 Option("reps", 3, "trials per rate", quick=1),
                 Option("elems", "16,256", "int32 elements per frame (comma-separated)",
                        quick="16", metavar="E,F")),
        quick_help="one frame size, one short trial per rate"),
    Benchmark(
        "collectives", "Allreduce algorithms on a 100 Mb/s star against the alpha-beta model.",
        "testbed.bench.collectives:measure", case=("algo", "n", "bytes"),
        columns=("algo", "n", "bytes", "time_s", "model_s", "fidelity", "fidelity_cal",
                 "vs_ring", "model_vs_ring", "correct", "cpu_bound"),
        options=(Option("reps", 1, "repetitions per row (their median is reported)"),),
        quick_help="4 workers, 1 MiB"),
    Benchmark(
        "reliability", "In-network aggregation under loss, duplication, reordering, strangers "
        "and a dead switch (every row checked against numpy).",
        "testbed.bench.reliability:measure", case=("scenario", "topology", "algo"),
        columns=("scenario", "topology", "algo", "n", "loss_pct", "dup_pct", "reorder_pct",
                 "status", "time_s", "slowdown"),
        quick_help="each impairment alone at its worst and all combined, 1 MiB (minutes)"),
    Benchmark(
        "impairments", "Ring, halving-doubling and INA under seeded loss, duplication and "
        "reordering at a switch, against the flow model with the impairments priced and "
        "without (every row checked against numpy).",
        "testbed.bench.impairments:measure", case=("network", "algo", "loss_pct", "dup_pct",
                                                   "reorder_pct"),
        columns=("network", "algo", "loss_pct", "dup_pct", "reorder_pct", "time_s", "model_s",
                 "unpriced_s", "ratio", "unpriced_ratio", "correct", "cpu_bound"),
        options=(Option("networks", "star4,leafspine", "star4 and/or leafspine",
                        quick="star4", metavar="A,B"),
                 Option("algos", "ring,hd,ina", "ring, hd and/or ina", quick="ring,ina",
                        metavar="A,B"),
                 Option("mib", 4.0, "MiB per allreduce", quick=1.0),
                 Option("reps", 3, "allreduces per case (the median is reported)", quick=1)),
        quick_help="the star, ring and INA, no loss and 1 % loss, 1 MiB once"),
    Benchmark(
        "faults", "Ring, halving-doubling and INA on a leaf-spine while an uplink fails, a "
        "switch engine or a worker is killed: one row per fault and algorithm against the "
        "fault-free run (exact, the worker named, the switch back within 2 s).",
        "testbed.bench.faults:measure", case=("case", "algo"),
        columns=("case", "algo", "status", "correct", "time_s", "baseline_s", "slowdown",
                 "model_s", "switch_back_s", "in_network_fraction"),
        options=(Option("mib", 8.0, "MiB per allreduce", quick=2.0),
                 Option("at_s", 0.3, "when the mid-run faults fire (s into each run)",
                        quick=0.15),
                 Option("down_s", 1.0, "how long the flapping link stays down (s)", quick=0.3),
                 Option("time_dilation", 1.0, "run the network this many times slower")),
        quick_help="2 MiB, faults at 0.15 s, the link down for 0.3 s"),
    Benchmark(
        "soak", "Mixed collectives (ring, hd, INA, INA+THC, two tenants) for M minutes on one "
        "leaf-spine with links flapping and engines killed at random: 0 wrong, 0 hung, RSS and "
        "descriptors of the engines and the control plane flat after warm-up, 0 leftovers.",
        "testbed.bench.soak:measure", case=("kind", "mix", "process"),
        columns=("kind", "t_s", "collectives", "ok", "wrong", "errors", "hung", "faults",
                 "mix", "algo", "status", "process", "rss_growth", "fd_growth"),
        options=(Option("minutes", 60.0, "how long", quick=1.0),
                 Option("seed", 0, "the draw of jobs, sizes and faults"),
                 Option("faults", True, "inject faults into a third of the jobs"),
                 Option("sample_s", 10.0, "seconds between process samples", quick=5.0),
                 Option("time_dilation", 1.0, "run the network this many times slower")),
        quick_help="1 minute, samples every 5 s; memory and descriptor growth not judged (a minute is all warm-up)"),
    Benchmark(
        "scenarios", "Random networks (star, leaf-spine, fat-tree, dumbbell, incast), link "
        "impairments and collectives, each on a fresh network: every result exact or refused "
        "by name, nothing left behind.", "testbed.bench.scenarios:measure",
        case=("scenario", "kind", "algo"),
        columns=("scenario", "kind", "switch", "bw_mbps", "loss_pct", "queue_ms", "algo",
                 "op", "nbytes", "workers", "status", "fidelity", "cpu_bound", "left"),
        options=(Option("count", 100, "scenarios", quick=8),
                 Option("seed", 0, "the draw of networks and collectives")),
        quick_help="8 scenarios"),
    Benchmark(
        "tenancy", "Aggregation trees on a fat-tree and two tenants sharing switch memory "
        "(static vs shared pool), against their targets.", "testbed.bench.tenancy:measure",
        case=("experiment", "label"),
        options=(Option("time_dilation", None, "F or auto (default: the files', 8)", type=str,
                        metavar="F|auto"),
                 Option("only", "hierarchical,multitenant",
                        "which experiments: hierarchical, multitenant or both")),
        quick_help="4 MiB on the fat-tree, 1 MiB per tenant"),
    Benchmark(
        "fidelity", "Collectives on star, leaf-spine and fat-tree against the flow-level model.",
        "testbed.bench.fidelity:measure", case=("topology", "algo", "bytes"),
        columns=("topology", "algo", "n", "bytes", "time_s", "flow_model_s", "ratio",
                 "time_dilation", "correct", "cpu_bound"),
        options=(Option("programmable", True, "data path on every switch (off: Linux bridges "
                        "but for the aggregator's switch)"),
                 Option("time_dilation", "auto", "F or auto", metavar="F|auto"),
                 Option("tcp_cc", None, "TCP congestion control of ring, hd and rs (default: "
                        "the collectives' own, reno; 'host': each host's default); a list runs "
                        "each once per entry", type=str, metavar="NAME|host[,...]"),
                 Option("only", None, "comma-separated networks (star4, star8, leafspine-2:1, "
                        "leafspine-4:1, fattree-k4)", type=str),
                 Option("queue_ms", None, "every shaped link's queue in ms at its rate "
                        "(default and 0: the kernel's 1000 packets; 500: a lossless fabric, "
                        "like the model's)", type=float, metavar="MS"),
                 Option("engine_groups", None, "engine processes serving each network's "
                        "programmable switches, their links in memory (default: 1; 0: one "
                        "per switch)", type=int, metavar="N")),
        quick_help="one size (4 MiB)"),
    Benchmark(
        "capacity", "INA and ring on stars: most workers without CPU saturation, CPU per "
        "packet, and the smallest time dilation that keeps them below saturation.",
        "testbed.bench.capacity:measure", case=("algo", "n"),
        columns=("algo", "n", "time_s", "model_s", "correct", "cpu_util", "cpu_wait",
                 "cpu_engine", "cpu_s_per_kpkt_machine", "cpu_s_per_kpkt_delivered",
                 "cpu_bound"),
        options=(Option("workers", "2,4,8,16", "host counts of the sweep", quick="2,4"),
                 Option("io", "ring", "engine packet I/O: ring or mmsg"),
                 Option("shaping", "engine", "who shapes the switch's ports: engine (its shape "
                        "stage) or qdisc (the kernel's HTB)"),
                 Option("sched", "fifo", "the engine's packet loop: fifo (real-time) or other "
                        "(time-shared)"),
                 Option("worker_send", "gso", "how INA workers send: gso (UDP GSO runs) or mmsg "
                        "(a datagram per entry)"),
                 Option("mib", 8, "allreduce size (MiB)", quick=1),
                 Option("bw", 100.0, "link rate (Mb/s)"),
                 Option("time_dilation", 1.0, "run the sweep at this factor (>= 1)"),
                 Option("dilate", "8,16", "host counts at which the smallest non-saturating "
                        "dilation factor is searched ('' for none)", quick=""),
                 Option("fabric", "star", "star (the sweep of host counts) or fat_tree (16 "
                        "hosts: k=4, 128: k=8; compare cpu_s_per_kpkt_delivered)"),
                 Option("engine_groups", 0, "engine processes serving the switches, their "
                        "links in memory (0: one per switch)")),
        quick_help="2 and 4 workers, 1 MiB, no dilation search"),
    Benchmark(
        "scale", "64 and 128 workers on one machine (programmable leaf-spine, fat-tree k=8): "
        "set-up time, memory per emulated host, ring and INA exact and against the flow model.",
        "testbed.bench.scale:measure", case=("topology", "workers", "case"),
        columns=("topology", "workers", "case", "switches", "setup_s", "mb_per_host",
                 "correct", "time_s", "model_s", "ratio", "cpu_bound", "wall_s"),
        options=(Option("workers", "64,128", "worker counts (the leaf-spine: multiples of 4; "
                        "the fat-tree: 128 only)", quick="16", metavar="N,M"),
                 Option("topologies", "leaf_spine,fat_tree", "leaf_spine (4 leaves, 2 spines) "
                        "and/or fat_tree", quick="leaf_spine", metavar="A,B"),
                 Option("algos", "ring,ina", "ring and/or ina (on a tree, <= 32 members per "
                        "switch)", metavar="A,B"),
                 Option("mib", 1.0, "MiB per allreduce", quick=0.25),
                 Option("bw", 100.0, "link rate (Mb/s)"),
                 Option("time_dilation", 64.0, "emulation slow-down factor (128 workers on "
                        "2 cores: 64 keeps the leaf-spine's runs below saturation)", quick=8.0),
                 Option("engine_groups", 1, "engine processes serving each network's "
                        "switches, their links in memory (0: one per switch)")),
        quick_help="16 workers on the leaf-spine, 256 KiB, dilation 8"),
    Benchmark(
        "liveview", "The notebooks' live fabric view on a running INA experiment: updates per "
        "second, and the experiment's CPU with the view on against off (alternating).",
        "testbed.bench.liveview:measure", case=("pair", "view"),
        columns=("pair", "view", "time_s", "wall_s", "cpu_tree_s", "cpu_view_s",
                 "cpu_machine_s", "updates_per_s", "correct", "cpu_bound"),
        options=(Option("workers", 8, "INA workers (hosts of the star)", quick=4),
                 Option("mib", 8, "MiB per allreduce", quick=2),
                 Option("reps", 8, "allreduces per run", quick=2),
                 Option("pairs", 3, "off/on pairs of runs", quick=1),
                 Option("time_dilation", "3", "F or auto", metavar="F|auto")),
        quick_help="4 workers, 2 MiB, one off/on pair"),
    Benchmark(
        "ina-sharing", "An INA job and a TCP ring sharing a thin link, with and without the "
        "INA workers' congestion response (ina_cc): each job's slowdown, INA's share, and "
        "both against the flow model's fair share.",
        "testbed.bench.ina_sharing:measure", case=("ina_cc",),
        columns=("ina_cc", "ring_slowdown", "ina_slowdown", "ina_share", "ring_vs_fair",
                 "ina_vs_fair", "all_correct"),
        options=(Option("mbps", 10.0, "bottleneck rate (Mb/s)"),
                 Option("ring_kib", 64.0, "KiB per ring allreduce"),
                 Option("window", 64, "INA slots (its window without the response)"),
                 Option("repeats", 3, "repeats per setting", quick=1),
                 Option("ina_mib", 8.0, "MiB of the INA allreduce", quick=4.0)),
        quick_help="one repeat, a 4 MiB INA job"),
    Benchmark(
        "trimming", "Ultra Ethernet trimming against drop-tail: a 16:1 incast of TCP and of the "
        "UET-like transport (flow completion times, retransmission timeouts, the model) and a "
        "ring allreduce on a 4:1 leaf-spine.",
        "testbed.bench.trimming:measure", case=("case",),
        columns=("case", "flows", "fct_p50_s", "fct_p99_s", "fct_max_s", "p99_vs_tcp_drop_tail",
                 "timeouts", "nacks", "trimmed", "dropped", "measured_vs_model", "time_s",
                 "vs_tcp_drop_tail", "cpu_bound_runs", "cpu_bound"),
        options=(Option("senders", 16, "senders of the incast"),
                 Option("kib", 16, "KiB each sender sends"),
                 Option("mbps", 100.0, "link rate (Mb/s)"),
                 Option("buffer_kib", 32, "the receiver port's queue (KiB; UET's trim "
                        "threshold)"),
                 Option("trim_bytes", 128, "frame bytes a trimmed packet keeps"),
                 Option("reps", 5, "incasts per case", quick=2),
                 Option("time_dilation", 16.0, "time dilation factor (16 senders on 2 cores)"),
                 Option("ring_mib", 32.0, "MiB of the leaf-spine ring allreduce (0: none)",
                        quick=4.0)),
        quick_help="two incasts per case, a 4 MiB ring"),
    Benchmark(
        "ina-cost", "CPU time per packet of the INA worker and switch kernels, without a "
        "network.", "testbed.bench.ina_cost:measure", needs_root=False,
        case=("side", "burst"),
        options=(Option("reps", 5, "runs per row (median, min, max)", quick=1),),
        quick_help="one run per row"),
    Benchmark(
        "cluster", "A leaf-spine on one machine vs split over it and a netns server: set-up "
        "time, memory per server, INA and ring (docs/cluster.md).",
        "testbed.bench.cluster:measure", case=("servers",),
        check="testbed.nsserver:available",
        options=(Option("leaves", 2, "leaves of the leaf-spine (2 spines)"),
                 Option("hosts_per_leaf", 2, "hosts per leaf"),
                 Option("bw", 100.0, "link rate (Mb/s)")),
        quick_help="the default 2 x 2 leaf-spine (already small)"),
    Benchmark(
        "cooperation", "The offload policies on the shipped co-operation traces at several link "
        "rates, repeated: median and spread of the mean JCT, against the co-operation targets.",
        "testbed.bench.cooperation:measure", case=("trace", "bw_mbps", "policy"),
        columns=("trace", "bw_mbps", "policy", "repeats", "mean_jct_median_s", "spread",
                 "vs_tenant_only", "vs_provider_only", "vs_oracle",
                 "vs_cooperative_no_congestion", "vs_cooperative_alone",
                 "vs_cooperative_static", "lying_vs_honest",
                 "failed", "cpu_bound_runs", "replans"),
        options=(Option("traces", "cloud_cooperation,cloud_no_help,cloud_cheater,"
                        "cloud_congestion,cloud_spines,cloud_trimming",
                        "co-operation experiment "
                        "files (names in experiments/ or paths)", quick="cloud_cooperation",
                        metavar="A,B"),
                 Option("rates", "10,20,50", "link rates in Mb/s, each a variant of every trace "
                        "('' for the files')", quick="20", metavar="R,S"),
                 Option("repeats", 5, "runs of each trace per policy", quick=2),
                 Option("policies", "", "policies ('' for the files')",
                        quick="tenant_only,cooperative", metavar="P,Q"),
                 Option("iterations", 0, "iterations of every job (0: the files')",
                        quick=20)),
        quick_help="one trace at 20 Mb/s, two policies, two repeats, 20 iterations per job"),
    Benchmark(
        "torch", "The testbed process-group backend against gloo with an unmodified script: "
        "per-call overhead, DDP step time against the flow model, launch time and memory.",
        "testbed.bench.pytorch:measure", case=("test", "case"), requires=("torch",),
        columns=("test", "case", "n", "measured_s", "anchor_s", "ratio", "model_ratio",
                 "cpu_bound", "target", "met", "max_rss_mib"),
        options=(Option("time_dilation", None, "F or auto, for the DDP runs", type=str,
                        metavar="F|auto"),),
        quick_help="3 ranks, 1 MiB of gradient, a few steps (about a minute)"),
    Benchmark(
        "replay", "Chakra traces of a data-parallel and a mixture-of-experts job replayed on a "
        "leaf-spine: every collective and the trace's JCT against the flow model.",
        "testbed.bench.replay:measure", case=("trace", "op", "bytes"),
        requires=("torch", "chakra"),
        columns=("trace", "op", "bytes", "path", "count", "measured_s", "model_s", "ratio",
                 "error_pct", "cpu_bound"),
        options=(Option("ranks", 8, "ranks, one per host", quick=4),
                 Option("traces", "ddp,moe,export", "the traces: ddp, moe, export (a "
                        "training job's, exported and replayed)", metavar="A,B"),
                 Option("buckets", "1048576,4194304", "gradient buckets in bytes (the MoE "
                        "trace's dense gradient: the first)", quick="262144,1048576",
                        metavar="B,C"),
                 Option("a2a_bytes", 1 << 20, "bytes of each MoE all-to-all (per rank)",
                        quick=256 << 10),
                 Option("layers", 2, "MoE layers (two all-to-alls each)"),
                 Option("iterations", 3, "iterations of each trace", quick=2),
                 Option("compute_us", 5000, "compute before each communication (µs)"),
                 Option("algo", "ring", "the testbed algorithm of the allreduces (gloo: "
                        "plain gloo)"),
                 Option("topology", "leaf_spine", "leaf_spine (2 leaves, 2 spines) or star"),
                 Option("bw", 100.0, "link rate (Mb/s)"),
                 # 8: at 4 the MoE trace's all-to-all measured 1.15-1.20 of the model (eight
                 # ranks' Python between lockstep steps), at 8 1.13-1.15, at 16 1.13
                 Option("time_dilation", 8.0, "emulation slow-down factor", quick=2.0),
                 Option("export_hidden", 1024, "hidden units of the exported training job's "
                        "MLP", quick=256),
                 Option("export_iterations", 12, "steps of the exported training job",
                        quick=6)),
        quick_help="4 ranks, smaller sizes, 2 iterations"),
)}


def benchmark_names() -> tuple[str, ...]:
    return tuple(CATALOG)


def benchmark(name: str) -> Benchmark:
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; one of {', '.join(CATALOG)}") from None


def resolve_options(bench: Benchmark, given: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The options a run uses: each option's default, its ``--quick`` value under ``quick``,
    and what the user gave (``None`` = not given) over both."""
    unknown = set(given) - {o.name for o in bench.options}
    if unknown:
        raise ValueError(f"bench {bench.name} has no option {', '.join(sorted(unknown))}")
    out = {}
    for o in bench.options:
        value = o.default if not quick or o.quick is UNCHANGED else o.quick
        if given.get(o.name) is not None:
            value = given[o.name]
        out[o.name] = value
    return out


def run_benchmark(name: str, given: dict[str, Any] | None = None, *, quick: bool = False,
                  json_out: bool = False, out: str | Path | None = None,
                  stdout=None) -> int:
    """Run benchmark ``name`` as the command line does; return its exit status.

    ``json_out``: one JSON object per row on stdout as it is measured (``"bench": name`` added),
    then one summary object (``"summary": true`` with notes, targets, status and seconds);
    otherwise a table, its notes and targets. With ``out`` the rows are stored under
    ``out/bench-<name>-<time>/`` (:func:`testbed.bench.store.save_bench`), also those of a run
    that failed part-way."""
    stdout = stdout or sys.stdout
    err = sys.stderr
    bench = benchmark(name)
    t0 = time.monotonic()
    try:
        options = resolve_options(bench, given or {}, quick)
    except ValueError as e:
        print(f"testbed bench {name}: {e}", file=err)
        return 2
    why = bench.why_not()
    if why:
        print(f"testbed bench {name}: cannot run here: {why}", file=err)
        if json_out:
            _print_json({"bench": name, "summary": True, "status": 2, "skipped": why}, stdout)
        return 2
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if json_out:
            _print_json({"bench": name} | row, stdout)
        else:
            shown = bench.columns or tuple(row)[:8]
            print("  " + "  ".join(f"{k}={_short(row.get(k))}" for k in shown if k in row),
                  file=err, flush=True)

    from testbed.kernels.benchutil import cpu_description

    notes: dict[str, Any] = {"cpu": cpu_description(), "cores": os.cpu_count(),
                             "quick": quick, "options": options}
    outcome: Outcome | None = None
    status, error = 1, None
    try:
        outcome = bench.measure_fn()(emit, quick, **options)
        if json_out:  # rows returned without being emitted (the table shows them anyway)
            for row in outcome.rows[len(rows):]:
                _print_json({"bench": name} | row, stdout)
        status = 0 if outcome.ok else 1
    except ValueError as e:  # a bad option value, found by the benchmark before measuring
        error, status = f"{e}", 2
    except KeyboardInterrupt:
        error, status = "interrupted", 130
    except Exception as e:  # noqa: BLE001 - report it; the rows measured so far are kept
        error = describe_error(e)
    if outcome is not None:
        rows = outcome.rows
        notes |= outcome.notes
    targets = {k: {"met": bool(m), "detail": d}
               for k, (m, d) in (outcome.targets if outcome else {}).items()}
    seconds = round(time.monotonic() - t0, 1)
    if error:
        notes["error"] = error
        print(f"testbed bench {name}: {error}" + (f" ({len(rows)} rows measured before)"
                                                  if rows else ""), file=err)
    folder = None
    if out is not None and (rows or status != 2):
        from testbed.bench.store import save_bench

        folder = save_bench(bench, rows, out, notes | {"targets": targets, "status": status})
    if json_out:
        _print_json({"bench": name, "summary": True, "status": status, "seconds": seconds,
                     "rows": len(rows), "targets": targets, "notes": notes}, stdout)
    elif rows:
        from testbed.bench.store import print_rows

        print_rows(rows, f"testbed bench {name}", bench.columns, file=stdout)
        for k, v in notes.items():
            if k != "options":
                print(f"# {k}: {_short(v, 200)}", file=stdout)
        for k, t in targets.items():
            print(f"target {'MET    ' if t['met'] else 'NOT MET'} {k}: {t['detail']}",
                  file=stdout)
        print(f"# {seconds:.0f} s in all", file=stdout)
    if folder is not None:
        print(f"results: {folder}", file=err if json_out else stdout)
    return status


def parse_ints(option: str, text: str) -> list[int]:
    """A comma-separated list of integers ('' is none); ValueError naming ``option``."""
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--{option.replace('_', '-')} takes comma-separated integers, got "
                         f"{text!r}") from None


def parse_dilation(text: str | None) -> float | str | None:
    """``--time-dilation`` as the runs take it: a number, 'auto', or None (not given); a bad
    value is left for the run's own validation to explain with its allowed range."""
    if text is None or text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        return text


def _print_json(obj: dict, stream) -> None:
    from testbed.experiment.results import strict_json

    print(json.dumps(strict_json(obj), default=str), file=stream, flush=True)


def _short(v: Any, width: int = 40) -> str:
    s = f"{v:.4g}" if isinstance(v, float) else str(v)
    return s if len(s) <= width else s[:width - 1] + "…"
