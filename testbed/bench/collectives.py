"""``testbed bench collectives``: allreduce algorithms on a 100 Mb/s star against the model.

Grid (default): algo in ring, hd, rs, ina x n in 4, 8 x size in 8 MB, 32 MB. ``quick=True``
(``--quick``): n = 4, size 1 MB. Networks: ring / hd / rs run on a Linux
bridge star (the kernel switch stands for a normal datacenter switch); rs uses m = n dedicated
server hosts (Vertex AI style: each server link carries n*S/m = S). INA runs on a star whose
switch is the programmable data path (aggregate + forward programs). Each n gets its own
networks (2n-host bridge star, n-host programmable star).

Anchor: ring allreduce of the same n and size, measured in the same run; every row carries
``vs_ring`` (time / ring time) and ``model_vs_ring`` (the model's ratio). Fidelity targets
(checked and printed): no n=4 run cpu_bound; ring, rs and INA within 10 % of model_s when
not cpu_bound; INA/ring ratio within 10 % of the model's ratio.

``python -m testbed.bench.collectives rs [MB,...]``: the reduction server's fidelity for
dedicated (m = 4, 2, 1) and co-located servers, ring as the anchor (:func:`rs_fidelity`).
"""

from __future__ import annotations

import json
import sys
import time

from testbed.bench.protocol import Outcome
from testbed.collectives import model
from testbed.collectives.algorithms import is_offloaded
from testbed.collectives.runner import run_collective
from testbed.collectives.spec import CollectiveSpec
from testbed.topologies import Star, TestbedNet

MB = 1 << 20
SHOW = ("algo", "n", "bytes", "time_s", "model_s", "fidelity", "fidelity_cal", "vs_ring",
        "model_vs_ring", "busbw", "cpu_bound", "cpu_max", "cpu_engine", "cpu_wait", "correct")


def grid(quick: bool) -> tuple[list[int], list[int], list[str]]:
    """(worker counts, sizes in bytes, algorithms) of the benchmark."""
    if quick:
        return [4], [1 * MB], ["ring", "hd", "rs", "ina"]
    return [4, 8], [8 * MB, 32 * MB], ["ring", "hd", "rs", "ina"]


def run(quick: bool = False, reps: int = 1, window: int = 64, log=sys.stderr) -> list[dict]:
    """Run the grid; return rows (REPORT_COLUMNS + vs_ring, model_vs_ring, network)."""
    ns, sizes, algos = grid(quick)
    rows: list[dict] = []
    host_algos = [a for a in algos if a != "ina"]
    eff = 1.0
    for n in ns:
        # 2n hosts: the first n are workers, the rest the reduction servers (m = n)
        t0 = time.monotonic()
        with TestbedNet(Star(2 * n, bw_mbps=100)) as net:
            print(f"# bridge star ({2 * n} hosts) up in {time.monotonic() - t0:.1f} s",
                  file=log)
            if n == ns[0]:
                try:
                    gp = calibrate(net)
                    eff = gp / (100e6 * model.GOODPUT["tcp"])
                    print(f"# iperf3 --bidir tbh1<->tbh2: {gp / 1e6:.1f} Mb/s TCP goodput per "
                          f"direction = {eff:.3f} x the model's goodput", file=log)
                except Exception as e:  # noqa: BLE001 - a diagnostic, not required
                    print(f"# iperf3 calibration failed: {e}", file=log)
            for size in sizes:
                for algo in host_algos:
                    spec = CollectiveSpec(algo=algo, nbytes=size, workers=n, servers=n,
                                          repetitions=reps, timeout_s=60)
                    for r in run_collective(net, spec):
                        r["network"] = "linux-bridge"
                        rows.append(r)
                        print(_line(r), file=log)
        if "ina" not in algos:
            continue
        t0 = time.monotonic()
        topo = Star(n, bw_mbps=100, switch="programmable")
        with TestbedNet(topo) as net:
            print(f"# programmable star ({n} hosts) up in {time.monotonic() - t0:.1f} s",
                  file=log)
            for size in sizes:
                spec = CollectiveSpec(algo="ina", nbytes=size, window=window,
                                      repetitions=reps, timeout_s=60)
                for r in run_collective(net, spec):
                    r["network"] = "programmable"
                    rows.append(r)
                    print(_line(r), file=log)
    _add_ratios(rows)
    for r in rows:  # the model with the link goodput measured by iperf3 in this run
        r["link_eff"] = round(eff, 4)
        r["fidelity_cal"] = r["time_s"] / (r["model_s"] / eff)
    return rows


def calibrate(net, seconds: float = 3.0) -> float:
    """TCP goodput (bit/s per direction) of the tbh1<->tbh2 path, both directions at once
    (iperf3 --bidir), measured on the same emulated links as the collectives."""
    h1, h2 = net.hosts[0], net.hosts[1]
    ip2 = h2.IP()
    srv = h2.popen(["iperf3", "-s", "-1", "-B", ip2])
    try:
        time.sleep(0.3)
        out = h1.cmd(f"iperf3 -c {ip2} -t {seconds} --bidir -J")
        res = json.loads(out[out.index("{"):])
        end = res["end"]
        a = end["sum_received"]["bits_per_second"]
        b = end.get("sum_received_bidir_reverse", end["sum_received"])["bits_per_second"]
        return (a + b) / 2
    finally:
        if srv.poll() is None:
            srv.terminate()
        srv.wait(timeout=5)


def _line(r: dict) -> str:
    return (f"{r['algo']:>5} n={r['n']} {r['bytes'] / MB:5.0f} MB  t={r['time_s']:.3f} s  "
            f"model={r['model_s']:.3f} s  fid={r['fidelity']:.2f}  cpu_bound={r['cpu_bound']} "
            f"(max {r['cpu_max']:.2f}, engine {r['cpu_engine']:.2f}, wait {r['cpu_wait']:.2f})"
            f"  correct={r['correct']}")


def _add_ratios(rows: list[dict]) -> None:
    ring = {(r["n"], r["bytes"], r["rep"]): r for r in rows if r["algo"] == "ring"}
    for r in rows:
        a = ring.get((r["n"], r["bytes"], r["rep"]))
        r["vs_ring"] = r["time_s"] / a["time_s"] if a else float("nan")
        r["model_vs_ring"] = r["model_s"] / a["model_s"] if a else float("nan")


def targets(rows: list[dict]) -> dict:
    """The fidelity targets: name -> (met, detail)."""
    out = {}
    n4 = [r for r in rows if r["n"] == 4]
    bad = [f"{r['algo']}/{r['bytes'] // MB}MB" for r in n4 if r["cpu_bound"]]
    out["no n=4 run cpu_bound"] = (not bad, f"cpu_bound: {bad}" if bad else "none")
    fid = [r for r in rows if r["algo"] in ("ring", "rs", "ina") and not r["cpu_bound"]]
    off = [f"{r['algo']}/n{r['n']}/{r['bytes'] // MB}MB:{r['fidelity']:.2f}" for r in fid
           if abs(r["fidelity"] - 1) > 0.10]
    out["ring/rs/ina within 10% of model (not cpu_bound)"] = (
        bool(fid) and not off, f"{len(fid)} eligible; off: {off}" if fid else "no eligible run")
    ina = [r for r in rows if r["algo"] == "ina" and r["vs_ring"] == r["vs_ring"]]
    off = [f"n{r['n']}/{r['bytes'] // MB}MB: {r['vs_ring']:.2f} vs {r['model_vs_ring']:.2f}"
           for r in ina if abs(r["vs_ring"] / r["model_vs_ring"] - 1) > 0.10]
    out["INA/ring ratio within 10% of model ratio"] = (bool(ina) and not off,
                                                       f"off: {off}" if off else "all within")
    return out


def measure(emit, quick: bool, reps: int) -> Outcome:
    """``testbed bench collectives`` (:mod:`testbed.bench.protocol`); ok when every run was
    correct."""
    rows = run(quick=quick, reps=reps)
    return Outcome(rows, targets=targets(rows), ok=bool(rows) and all(r["correct"] for r in rows))

def scale(ns: tuple[int, ...] = (2, 4, 8, 16, 32), nbytes: int = 1 * MB, algo: str = "ring",
          log=sys.stderr) -> list[dict]:
    """Set-up time, memory and completion of an allreduce as the worker count grows.

    One star of ``max(ns)`` hosts (bridge; programmable for ina; its build time is reported
    once, as ``net_s``);
    per n one ``algo`` allreduce of ``nbytes``. Returns rows with n, net_s, setup_s (pool
    process start + fork + connections), mem_mb (PSS of pool + children), time_s, correct.
    """
    out = []
    t0 = time.monotonic()
    sw = "programmable" if is_offloaded(algo) else "bridge"
    with TestbedNet(Star(max(ns), bw_mbps=100, switch=sw)) as net:
        net_s = time.monotonic() - t0 - net.timings.get("lock_wait_s", 0.0)
        for n in ns:
            spec = CollectiveSpec(algo=algo, nbytes=nbytes, workers=n, servers=n,
                                  timeout_s=60)
            try:
                r = run_collective(net, spec)[0]
                row = {"n": n, "net_s": round(net_s, 2), "setup_s": round(r["setup_s"], 3),
                       "mem_mb": r["mem_mb"], "time_s": round(r["time_s"], 3),
                       "model_s": round(r["model_s"], 3), "correct": r["correct"],
                       "cpu_bound": r["cpu_bound"]}
            except Exception as e:  # noqa: BLE001 - the largest n that completes is the result
                row = {"n": n, "net_s": round(net_s, 2), "error": f"{type(e).__name__}: {e}"}
            print(row, file=log)
            out.append(row)
    return out


def rs_fidelity(sizes_mb: tuple[int, ...] = (8,), reps: int = 2, bw_mbps: int = 100,
                log=sys.stdout) -> list[dict]:
    """Reduction-server fidelity (time / model) on one 8-host star: ring n=4 (anchor), rs
    n=4 with m = 4, 2, 1 dedicated servers, rs n=8 with m=4 co-located. Prints one line per
    repetition (with ``vs_ring`` and the model's ratio) and returns the rows."""
    cases = [("ring", 4, 1), ("rs", 4, 4), ("rs", 4, 2), ("rs", 4, 1), ("rs", 8, 4)]
    rows: list[dict] = []
    with TestbedNet(Star(8, bw_mbps=bw_mbps)) as net:
        for mb in sizes_mb:
            for algo, n, m in cases:
                spec = CollectiveSpec(algo=algo, nbytes=mb * MB, workers=n, servers=m,
                                      repetitions=reps, timeout_s=60)
                for r in run_collective(net, spec):
                    r["servers"] = m if algo == "rs" else 0
                    r["placement"] = "co-located" if n + m > 8 else "dedicated"
                    rows.append(r)
    _add_ratios(rows)
    for r in rows:
        print(f"{_line(r)}  m={r['servers']} {r['placement']}  vs_ring={r['vs_ring']:.2f} "
              f"(model {r['model_vs_ring']:.2f})", file=log)
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rs":
        mbs = tuple(int(v) for v in sys.argv[2].split(",")) if len(sys.argv) > 2 else (8,)
        sys.exit(0 if all(r["correct"] for r in rs_fidelity(mbs)) else 1)
    sys.exit("usage: python -m testbed.bench.collectives rs [MB,...]  (the benchmark itself: "
             "testbed bench collectives)")
