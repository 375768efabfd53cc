"""``testbed bench liveview``: what the notebooks' live fabric view costs a running experiment.

One network (``workers`` hosts on a programmable star of 100 Mb/s links, at time dilation
``time_dilation``) runs the same INA allreduce (``mib`` MiB, ``reps`` repetitions: one
collective run) ``pairs`` times with the view off and on, alternating (off first), after one
unmeasured run with the view attached (the first run loads what the later ones find ready:
the data path's kernels, the view's modules and figure; the quick form's one pair measured
0.3 s of experiment CPU per run, and that first load alone doubled it). Alternating on one network
puts both sides under the same conditions: a machine shared with others drifts between runs
more than the view costs. The view is the notebooks' one (:class:`testbed.experiment.live.
FabricView`), attached for the run and detached after it, with its widget made where
ipywidgets is installed, so every update encodes the picture a notebook would get. Per run:

* ``cpu_tree_s``: CPU time of this process and every process it started (the data-path
  engine, the worker pool and its ranks; exited ones through their parents' accounts) plus
  the kernel's softirq threads: the experiment's CPU, whatever else runs on the machine;
* ``cpu_view_s``: what the view's updates took (their thread's CPU; part of ``cpu_tree_s``);
* ``cpu_machine_s``: every core's busy time, others' processes included (a cross-check);
* ``updates_per_s``: the view's readings per second during the run.

Targets: at least 2 updates per second in every run, and the experiment's CPU with the view
on within 5 % of it off: ``cpu_tree_s`` summed over the runs with the view on over those
without (the view's own share included). The ratio of each pair is listed too; on 2 cores
they scatter by a few per cent around the whole run's, more than the view costs.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from testbed.bench.protocol import Outcome, parse_dilation

COLUMNS = ("pair", "view", "time_s", "wall_s", "cpu_tree_s", "cpu_view_s", "cpu_machine_s",
           "updates", "updates_per_s", "correct", "cpu_bound")
_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its waited-for children)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), sum(int(v) for v in fields[11:15]) / _TICK


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds of ``root`` (this process), its descendants and the softirq threads."""
    root = os.getpid() if root is None else root
    stats, softirq = {}, 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        s = _stat(pid)
        if s is None:
            continue
        stats[int(pid)] = s
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("ksoftirqd"):
                softirq += s[1]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += children.get(pid, [])
    return total + softirq


def machine_busy_s() -> float:
    """Busy seconds of every core since boot (``/proc/stat``: all but idle and iowait)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / _TICK


def one_run(net, spec, view=None) -> dict:
    """Run ``spec`` on ``net`` with ``view`` following it (None: no view); its figures."""
    from testbed.collectives import run_collective

    u0, v0 = (view.updates, view.cpu_s) if view else (0, 0.0)
    t0, c0, m0 = time.monotonic(), tree_cpu_s(), machine_busy_s()
    with view.watching() if view else contextlib.nullcontext():
        rows = run_collective(net, spec)
    wall = time.monotonic() - t0
    fig = {"wall_s": wall, "cpu_tree_s": tree_cpu_s() - c0,
           "cpu_machine_s": machine_busy_s() - m0,
           "cpu_view_s": view.cpu_s - v0 if view else 0.0,
           "updates": view.updates - u0 if view else 0}
    fig["updates_per_s"] = fig["updates"] / wall if view else None
    return {**fig, "time_s": sum(r["time_s"] for r in rows) / len(rows),
            "correct": all(r["correct"] for r in rows),
            "cpu_bound": any(r["cpu_bound"] for r in rows)}


def targets(rows: list[dict]) -> dict[str, tuple[bool, str]]:
    on = [r for r in rows if r["view"] == "on"]
    off = [r for r in rows if r["view"] == "off"]
    ratios = [a["cpu_tree_s"] / b["cpu_tree_s"] for a, b in zip(on, off, strict=False)
              if b["cpu_tree_s"] > 0]
    total = sum(r["cpu_tree_s"] for r in on) / max(sum(r["cpu_tree_s"] for r in off), 1e-9)
    slowest = min((r["updates_per_s"] for r in on), default=0.0)
    return {"updates per second >= 2": (slowest >= 2.0, f"{slowest:.2f} (slowest run)"),
            "experiment CPU on/off <= 1.05": (
                bool(ratios) and total <= 1.05,
                f"{total:.3f} over all; per pair " + ", ".join(f"{x:.3f}" for x in ratios))}


def measure(emit, quick: bool, workers: int, mib: int, reps: int, pairs: int,
            time_dilation: str) -> Outcome:
    """``testbed bench liveview`` (:mod:`testbed.bench.protocol`); ok when every run is
    correct."""
    from testbed.collectives import CollectiveSpec
    from testbed.experiment.live import FabricView
    from testbed.topologies import Star, TestbedNet

    if workers < 2 or mib < 1 or reps < 1 or pairs < 1:
        raise ValueError("workers >= 2, mib >= 1, reps >= 1 and pairs >= 1")
    spec = CollectiveSpec(op="allreduce", algo="ina", nbytes=mib << 20, repetitions=reps)
    view = FabricView()
    with contextlib.suppress(ImportError):  # the notebook's picture per update
        view.widget()
    rows = []
    with TestbedNet(Star(n_hosts=workers, bw_mbps=100, switch="programmable"),
                    time_dilation=parse_dilation(time_dilation)) as net:
        # unmeasured, the view attached: what a first run loads (the data path's kernels, the
        # view's modules and figure) is ready for every measured one, either side
        one_run(net, CollectiveSpec(op="allreduce", algo="ina", nbytes=mib << 20), view)
        for k in range(pairs):
            for mode in ("off", "on"):
                r = {"pair": k, "view": mode, **one_run(net, spec, view if mode == "on"
                                                         else None)}
                rows.append(r)
                emit(r)
        dilation = net.time_dilation
    notes = {"time_dilation": dilation, "load_avg": os.getloadavg()[0],
             "widget": bool(view._ui),
             "cpu_machine_on/off": [round(rows[i + 1]["cpu_machine_s"] /
                                          rows[i]["cpu_machine_s"], 3)
                                    for i in range(0, len(rows) - 1, 2)]}
    if any(r["cpu_bound"] for r in rows):
        notes["caution"] = "some runs were CPU-bound: raise --time-dilation"
    return Outcome(rows, notes, targets(rows), ok=all(r["correct"] for r in rows))
