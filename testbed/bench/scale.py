"""``testbed bench scale``: how far one machine goes — 64 and 128 workers on a programmable
leaf-spine (4 leaves, 2 spines) and 128 on a fat-tree k=8, with time dilation.

Per network: the set-up time (build, engines, configuration; lock wait excluded), and the
memory the emulation holds per emulated host — the proportional set size (shared pages split
among their sharers, so the sum is what the machine really holds) of every node's shell and
data-path engine, plus the collective's worker processes at their peak (the pool's own
``mem_mb``). Per algorithm (ring, INA on a tree of at most 32 members per switch): exactness
against numpy, measured against the flow model, and whether the CPU was saturated
(``cpu_bound``: then the emulator was measured, not the fabric).

The switches' engines run as ``engine_groups`` processes per network (default 1, their
links in memory: :mod:`testbed.datapath.group`; 0: one per switch). On 2 cores the fat-tree
k=8's 80 engines were ``cpu_bound`` at dilation 64 (ring 1.81 of the model); one group runs
them in the band at 14 MB per emulated host.
"""

from __future__ import annotations

import time

from testbed.bench.capacity import FAT_TREE_K
from testbed.bench.protocol import Outcome, parse_ints
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.worker import pss_mb
from testbed.topologies import FatTree, LeafSpine, TestbedNet

#: Issue 36's targets at 128 workers
BAND = (0.90, 1.15)
SETUP_S = 60.0
MB_PER_HOST = 40.0
SETUP_KEYS = ("build_s", "start_s", "configure_s")


def _network_pss_mb(net) -> float:
    """PSS (MB) of the network's node shells and data-path engines (and the fork server
    they share their loaded code with)."""
    mn = net.mininet
    pids = {node.pid for node in mn.hosts + mn.switches if node.pid}
    pids.update(net.engine_pids())
    if net.engine_server is not None:
        pids.add(net.engine_server.pid)
    return sum(pss_mb(p) for p in pids)


def _topology(kind: str, workers: int, bw: float):
    if kind == "leaf_spine":
        if workers % 4:
            raise ValueError(f"workers={workers}: the leaf-spine has 4 leaves; give a multiple "
                             "of 4")
        return LeafSpine(leaves=4, spines=2, hosts_per_leaf=workers // 4, bw_mbps=bw,
                         switch="programmable")
    if kind == "fat_tree":
        k = FAT_TREE_K.get(workers)
        if k is None:
            raise ValueError(f"workers={workers}: a fat-tree holds k^3/4 hosts (16 at k=4, "
                             "128 at k=8)")
        return FatTree(k=k, bw_mbps=bw, switch="programmable")
    raise ValueError(f"topology {kind!r}: leaf_spine or fat_tree")


def _spec(algo: str, mib: float) -> CollectiveSpec:
    """The allreduce of ``mib`` MiB a row runs (INA on a tree: more than 32 workers)."""
    return CollectiveSpec(algo=algo, nbytes=int(mib * (1 << 20)) // 4 * 4,
                          placement={"tree": "auto"} if algo == "ina" else {}, timeout_s=300)


def measure(emit, quick: bool, workers: str, topologies: str, algos: str, mib: float,
            bw: float, time_dilation: float, engine_groups: int = 1) -> Outcome:
    """``testbed bench scale`` (:mod:`testbed.bench.protocol`): a network row and a row per
    algorithm for every (topology, workers) that exists; ok when every collective was
    exact."""
    counts = parse_ints("workers", workers)
    kinds = [k for k in topologies.split(",") if k]
    names = [a for a in algos.split(",") if a]
    bad = sorted(set(names) - {"ring", "ina"})
    if bad or not names:
        raise ValueError(f"algos: {bad or names} not among ring, ina")
    cases = []
    for kind in kinds:
        for n in counts:
            try:
                cases.append((kind, n, _topology(kind, n, bw)))
            except ValueError as e:
                if kind == "fat_tree" and len(counts) > 1:
                    continue  # a fat-tree has only some sizes: those of the sweep it has
                raise ValueError(str(e)) from None
    for _, n, _ in cases:  # a size or algorithm no run can take: said before any network
        for algo in names:
            try:
                _spec(algo, mib).validate(n)
            except ValueError as e:
                raise ValueError(f"--mib {mib:g}, {algo} on {n} workers: {e}") from None
    rows, notes, targets, ok = [], {}, {}, True
    for kind, n, topo in cases:
        t0 = time.monotonic()
        with TestbedNet(topo, time_dilation=time_dilation,
                        engine_groups=engine_groups or None) as net:
            setup_s = sum(net.timings.get(k, 0.0) for k in SETUP_KEYS)
            fabric_mb = _network_pss_mb(net)
            net_row = {"topology": kind, "workers": n, "case": "network",
                       "switches": len(net.mininet.switches), "setup_s": round(setup_s, 2),
                       "up_wall_s": round(time.monotonic() - t0, 2),
                       "fabric_pss_mb": round(fabric_mb, 1),
                       "engine_start": "fork" if net.engine_server else "exec",
                       "engine_groups": engine_groups or None,
                       "time_dilation": time_dilation}
            peak_workers_mb = 0.0
            algo_rows = []
            for algo in names:
                spec = _spec(algo, mib)
                t1 = time.monotonic()
                try:
                    (r,) = run_collective(net, spec)
                except Exception as e:  # noqa: BLE001 - a failed run is a row, not a crash
                    ok = False
                    row = {"topology": kind, "workers": n, "case": algo, "correct": False,
                           "error": f"{type(e).__name__}: {e}"[:500]}
                    algo_rows.append(row)
                    emit(row)
                    continue
                ratio = r["time_s"] / r["model_s"] if r.get("model_s") else None
                row = {"topology": kind, "workers": n, "case": algo, "correct": r["correct"],
                       "time_s": r["time_s"], "model_s": r["model_s"], "ratio": ratio,
                       "cpu_bound": r["cpu_bound"], "workers_pss_mb": r.get("mem_mb"),
                       "wall_s": round(time.monotonic() - t1, 2),
                       "time_dilation": time_dilation}
                ok = ok and bool(r["correct"])
                peak_workers_mb = max(peak_workers_mb, float(r.get("mem_mb") or 0.0))
                algo_rows.append(row)
                emit(row)
            net_row["workers_peak_pss_mb"] = round(peak_workers_mb, 1)
            net_row["mb_per_host"] = round((fabric_mb + peak_workers_mb) / n, 1)
        net_row["teardown_s"] = round(net.timings.get("teardown_s", 0.0), 2)
        rows.append(net_row)
        rows.extend(algo_rows)
        emit(net_row)
        if n == 128:
            label = f"{kind}, 128 workers"
            targets[f"{label}: set-up <= {SETUP_S:.0f} s"] = (
                setup_s <= SETUP_S, f"{setup_s:.1f} s")
            targets[f"{label}: <= {MB_PER_HOST:.0f} MB per emulated host"] = (
                net_row["mb_per_host"] <= MB_PER_HOST, f"{net_row['mb_per_host']} MB")
            for r in algo_rows:
                inside = r.get("ratio") is not None and BAND[0] <= r["ratio"] <= BAND[1]
                targets[f"{label}, {r['case']}: exact, measured/model in "
                        f"{BAND[0]}-{BAND[1]}, not cpu_bound"] = (
                    bool(r.get("correct")) and inside and not r.get("cpu_bound"),
                    r.get("error") or f"correct={r['correct']}, ratio {r['ratio']:.2f}"
                    + (", cpu_bound: the emulator was measured" if r["cpu_bound"] else ""))
    notes["memory"] = ("proportional set size: node shells and engines, plus the "
                       "collective's worker processes at their peak, divided by the hosts")
    return Outcome(rows, notes, targets, ok)
