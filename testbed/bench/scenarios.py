"""``testbed bench scenarios``: random networks, impairments and collectives, each run checked.

A seeded draw per scenario picks a topology (a star of 2-6 hosts, a leaf-spine of 2-3
leaves, 1-2 spines and 1-3 hosts per leaf, a fat-tree k=4, a dumbbell of 1-3 + 1-3 hosts,
an incast of 2-4 senders), its switches (programmable, or Linux bridges where nothing needs
the data path), a link rate (20-300 Mb/s), per-link delay (0, 0.5 or 2 ms), loss (0, 0.3 or
1 %), queue depth (the kernel's default, or 1-10 ms), sometimes SmartNICs and a time dilation
(2 or 4); then a collective on it: ring, halving-doubling, the reduction server, INA (on the
switch or a tree, with its delay-based window or THC compression) or the SmartNIC's, any op
the algorithm has, float32 or int32, 4 B to 3 MiB (odd sizes included), on all hosts or a
subset, with a compressor or the UET-like transport now and then. It runs on a fresh network
(:func:`testbed.collectives.run_collective`, every output against the numpy sum of the
inputs), and the machine is checked for leftovers after the network is gone.

Rows, one per scenario: what was drawn, ``status`` (``ok``: every repetition exact;
``refused``: the topology or the collective refused the combination with a reason, before
anything ran; ``wrong``: a result differs from numpy; ``error``: it failed while running, a
timeout included), the times against the flow model and ``cpu_bound`` (a saturated run
measured the emulator: its ratio says nothing about the network), and ``left``: what the
scenario left behind. Targets: 0 wrong, 0 errors, 0 leftovers. Refusals are counted, not
failures: a combination no layer can run must be refused by name (e.g. halving-doubling's
allgather on 6 workers).

What the first draws found (each fixed and kept by a test; ``c7a0bc1``, ``4b3132e``,
``4b92d4e``): INA's UDP GSO runs larger than a 5000 B host queue dropped whole on every resend
(a timeout); ``ina_cc="delay"``'s first window overflowing that queue (2-3 s where the next
collective took 0.1 s); the binomial broadcast's sends sharing an uplink (twice the model on a
star of 8).
"""

from __future__ import annotations

import random
import time

from testbed.bench.protocol import Outcome
from testbed.cleanup import leftovers
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.algorithms import OPS, algorithm, is_offloaded
from testbed.kernels.compressors import compressor_names
from testbed.topologies import TestbedNet, TopologyError, make_topology

SIZES = (4, 12, 1000, 4096, 65540, 300_004, 1 << 20, 3 * (1 << 20) + 8)
#: a scenario that runs past this (s, its repetitions together) is an error: the draw's
#: largest collective at its slowest link and worst loss takes a few seconds
TIMEOUT_S = 60.0


def draw(rng: random.Random) -> tuple[str, dict, float, dict]:
    """(topology kind, its parameters, time dilation, the collective's keyword arguments)."""
    kind = rng.choice(["star", "star", "leaf_spine", "leaf_spine", "fat_tree", "dumbbell",
                       "incast"])
    params: dict = {"bw_mbps": rng.choice([20, 50, 100, 100, 300]),
                    "delay_ms": rng.choice([0, 0, 0.5, 2]),
                    "loss_pct": rng.choice([0, 0, 0.3, 1.0]),
                    "queue_ms": rng.choice([None, None, 1, 2, 5, 10]),
                    "seed": rng.randrange(100),
                    "switch": rng.choice(["programmable", "programmable", "bridge"])}
    if params["delay_ms"] or params["loss_pct"]:
        params["switch"] = "programmable"  # without netem only the data path impairs links
    if kind == "star":
        params["n_hosts"] = rng.randint(2, 6)
    elif kind == "leaf_spine":
        params.update(leaves=rng.randint(2, 3), spines=rng.randint(1, 2),
                      hosts_per_leaf=rng.randint(1, 3))
    elif kind == "fat_tree":
        params["k"] = 4
    elif kind == "dumbbell":
        params.update(n_left=rng.randint(1, 3), n_right=rng.randint(1, 3),
                      bottleneck_mbps=rng.choice([None, 30]))
    else:
        params["n_senders"] = rng.randint(2, 4)
    nic = params["switch"] == "programmable" and rng.random() < 0.2
    if nic:
        params.update(smartnic=True, programs={"smartnic": ["nic_codec"]})
    dilation = rng.choice([1, 1, 1, 2, 4])
    programmable = params["switch"] == "programmable"
    algos = ["ring", "ring", "hd", "rs"] + (["ina", "ina"] if programmable else [])
    algo = rng.choice(["nic", "nic", "ring", "ina"] if nic else algos)
    ops = algorithm(algo).ops
    job = {"algo": algo, "op": rng.choice(ops) if rng.random() < 0.9 else rng.choice(OPS),
           "dtype": "float32" if is_offloaded(algo) and rng.random() < 0.9
           else rng.choice(["float32", "float32", "int32"]),
           "nbytes": rng.choice(SIZES), "seed": rng.randrange(1000),
           "repetitions": rng.choice([1, 1, 2]), "timeout_s": TIMEOUT_S}
    if rng.random() < 0.3:
        job["hosts"] = "subset"  # resolved against the network's hosts (run_one)
    if algo == "ring" and job["op"] == "allreduce" and rng.random() < 0.25:
        job["compressor"] = rng.choice(compressor_names())
    if algo in ("ring", "hd") and rng.random() < 0.15:
        job["transport"] = "uet"
    if is_offloaded(algo) and rng.random() < 0.4:
        job["placement"] = {"tree": rng.choice(["auto", "single"])}
    if algo == "ina" and rng.random() < 0.2:
        job["ina_cc"] = "delay"
    if algo == "ina" and rng.random() < 0.15:
        job["compressor"] = "thc"
    if algo == "rs":
        job["servers"] = rng.randint(1, 2)
    return kind, params, dilation, job


def run_one(index: int, seed: int) -> dict:
    """Draw scenario ``index`` of ``seed`` and run it: its row (see the module docstring)."""
    rng = random.Random(seed * 1_000_003 + index)
    kind, params, dilation, job = draw(rng)
    row = {"scenario": index, "kind": kind, "switch": params["switch"],
           "bw_mbps": params["bw_mbps"], "delay_ms": params["delay_ms"],
           "loss_pct": params["loss_pct"], "queue_ms": params["queue_ms"],
           "smartnic": bool(params.get("smartnic")), "time_dilation": dilation,
           "topology": {k: v for k, v in params.items()
                        if k not in ("bw_mbps", "delay_ms", "loss_pct", "queue_ms", "seed",
                                     "switch", "smartnic", "programs")},
           **{k: job.get(k) for k in ("algo", "op", "dtype", "nbytes", "repetitions",
                                      "compressor", "transport", "ina_cc")},
           "tree": (job.get("placement") or {}).get("tree"), "workers": None,
           "status": None, "correct": None, "time_s": None, "model_s": None,
           "fidelity": None, "cpu_bound": None, "error": None}
    t0 = time.monotonic()
    try:
        topo = make_topology(kind, **params)
    except TopologyError as e:
        row.update(status="refused", error=f"topology: {e}"[:300])
        return _done(row, t0)
    hosts = len(topo.hosts())
    if job.get("hosts") == "subset":
        job["hosts"] = sorted(rng.sample(range(hosts), rng.randint(min(2, hosts), hosts)))
    row["workers"] = len(job["hosts"]) if job.get("hosts") else hosts
    try:
        spec = CollectiveSpec(**job)
        spec.validate(hosts)
    except ValueError as e:  # refused by the collective's own checks: no network needed
        row.update(status="refused", error=f"{type(e).__name__}: {e}"[:300])
        return _done(row, t0)
    try:
        _run_on(topo, dilation, spec, row)
    except ValueError as e:  # the network refused the combination before it came up
        row.update(status="refused", error=f"{type(e).__name__}: {e}"[:300])
    return _done(row, t0)


def _run_on(topo, dilation: float, spec: CollectiveSpec, row: dict) -> None:
    """Bring the network up, run ``spec`` on it, fill ``row``'s outcome."""
    with TestbedNet(topo, time_dilation=dilation) as net:
        try:
            rows = run_collective(net, spec)
        except ValueError as e:  # refused before anything ran (a placement, a tree)
            row.update(status="refused", error=f"{type(e).__name__}: {e}"[:300])
        except Exception as e:  # noqa: BLE001 - a failed run is a row, the next one runs
            row.update(status="error", correct=False, error=f"{type(e).__name__}: {e}"[:300])
        else:
            ok = all(r["correct"] for r in rows)
            best = min(rows, key=lambda r: r["time_s"])
            row.update(status="ok" if ok else "wrong", correct=ok,
                       time_s=round(best["time_s"], 4), model_s=round(best["model_s"], 4),
                       fidelity=round(best["time_s"] / best["model_s"], 3)
                       if best["model_s"] else None,
                       cpu_bound=any(r["cpu_bound"] for r in rows))


def _done(row: dict, t0: float) -> dict:
    left = leftovers()
    row["left"] = sum(len(v) for v in left.values())
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


def measure(emit, quick: bool, count: int = 100, seed: int = 0) -> Outcome:
    """``testbed bench scenarios`` (:mod:`testbed.bench.protocol`)."""
    if count < 1:
        raise ValueError("--count must be >= 1")
    rows = []
    for i in range(count):
        rows.append(run_one(i, seed))
        emit(rows[-1])
    tally = {s: sum(r["status"] == s for r in rows) for s in ("ok", "refused", "wrong",
                                                               "error")}
    left = sum(r["left"] for r in rows)
    timed = sorted(r["fidelity"] for r in rows if r["status"] == "ok" and not r["cpu_bound"]
                   and r["fidelity"] is not None and r["nbytes"] >= 65536)
    notes = {"statuses": tally, "leftovers": left,
             "fidelity_median_64KiB_up": timed[len(timed) // 2] if timed else None,
             "caution": "fidelity of a saturated run (cpu_bound) or a small message (fixed "
                        "per-call costs) is not the network's"}
    targets = {"0 wrong": (tally["wrong"] == 0, f"{tally['wrong']} wrong"),
               "0 errors": (tally["error"] == 0, f"{tally['error']} failed while running"),
               "0 leftovers": (left == 0, f"{left} left behind")}
    return Outcome(rows, notes, targets, ok=all(met for met, _ in targets.values()))
