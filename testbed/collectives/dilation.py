"""Time dilation: the smallest factor that keeps the emulator below CPU saturation.

On a machine with few cores the emulator saturates before the emulated network does: a ring of
16 workers at 100 Mb/s keeps every data-path engine and TCP stack busy, and the collective
then runs at the CPU's pace, several times the model's. A network dilated by a factor f
(``TestbedNet(..., time_dilation=f)``, :mod:`testbed.topologies.net`) carries the same packets
f times slower: links at ``bw / f``, delays, jitter, timeouts and retransmission timers times
f. Every packet costs the same CPU, but f times fewer of them arrive per second, so the CPU
load drops by about f; :func:`testbed.collectives.run_collective` divides the measured times
by f and reports what the undilated network would give (``time_dilation`` column).

Where dilation is exact and where not:

* **exact**: everything the network's rates and configured times decide: serialisation,
  queueing at shaped links and trimming queues (bytes stay bytes), configured delays and
  jitter, INA's retransmission timer (its 10 ms floor and 320 ms cap are times f), the pool's
  silent-peer timeouts, and the flow model's prediction (:mod:`testbed.collectives.flowmodel`
  computes the dilated run and divides by f);
* **stretched with the network**: the engines' interrupt-coalescing wait (times f, so an
  engine wakes up once per as many packets as undilated; without it a dilated engine would
  pay its per-wake-up cost per packet: on the fat-tree k=4 at f=16 that alone kept ring and
  the reduction server CPU-bound);
* **not stretched**: the emulator's fixed cost per packet (a system call, an engine's batch,
  a context switch) takes the same wall time, so divided by f it shrinks: a dilated run
  reports the per-packet software latency of a faster machine. The CPU cost per packet is
  the same, but packets per second drop by f, which is the point. The kernel's delayed-ACK
  timer is not dilated either (ACKs come relatively sooner: harmless). Its minimum RTO is
  (``testbed.topologies.net.TCP_RTO_MIN_US``): undilated, the 200 ms floor fired on a
  dilated queue's delay alone (spurious timeouts, then a slow start);
* **not a cure for a busy machine**: other processes' load does not shrink with f. When the
  cores are saturated whatever the factor, :func:`calibrate` says so instead of climbing.

:func:`calibrate` picks the factor for "auto": it runs each given collective, at a size that
takes about :data:`CAL_WALL_S` of wall time, at growing factors on the running network until
no run is close to saturation by the measurement of :mod:`testbed.collectives.cpumon` (in
the median of :data:`CAL_REPS` repetitions each signal below :data:`HEADROOM` times its
threshold: the calibration runs are short, the real ones longer), then tries factors
between the last saturated and the first good one (:func:`search`). It costs a few pools per
workload (2-4 s each here); pass the workloads that load the emulator most, not every one
that will run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from testbed.collectives import cpumon, flowmodel
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveTimeout

#: Largest factor the calibration tries (a 4 MiB ring on 8 hosts then takes ~10 s of wall time).
MAX_AUTO_FACTOR = 16.0
#: A factor passes when every calibration run stays below this fraction of each cpumon
#: threshold (cores busy, a thread waiting, a thread never idle).
HEADROOM = 0.9
#: Wall time one calibration repetition aims at (its size shrinks as the factor grows).
CAL_WALL_S = 0.6
#: Smallest and largest undilated model time of a calibration repetition.
CAL_MIN_MODEL_S = 0.04
CAL_MAX_MODEL_S = 0.3
#: Repetitions per calibration run (one pool); the median decides, so one repetition that a
#: burst of other work delayed does not double the factor.
CAL_REPS = 3
#: When the background (the load other processes put on the cores) alone is this close to
#: the saturation threshold, no factor can help.
BACKGROUND_LIMIT = cpumon.UTIL_SATURATED * HEADROOM


@dataclass
class Calibration:
    """What :func:`calibrate` found: the chosen ``factor``, every run it made (``trials``:
    factor, algo, bytes, the CPU signals, whether it passed) and ``saturated`` (True with a
    ``note`` when no factor kept the runs below saturation)."""

    factor: float
    trials: list[dict] = field(default_factory=list)
    saturated: bool = False
    note: str = ""

    def summary(self) -> str:
        """One line: the factor and how it was found."""
        tried = sorted({t["factor"] for t in self.trials})
        line = (f"time dilation {self.factor:g} (tried {', '.join(f'{f:g}' for f in tried)} "
                f"with {len(self.trials)} calibration runs)")
        return line + (f"; {self.note}" if self.note else "")

    def to_json(self) -> dict:
        """JSON-serialisable form (for results metadata)."""
        return dataclasses.asdict(self)


def pressure(row: dict) -> float:
    """How close a run came to saturation: the largest of its CPU signals, each as a fraction
    of its cpumon threshold (1.0 = the run is ``cpu_bound``)."""
    return max(row["cpu_util"] / cpumon.UTIL_SATURATED, row["cpu_wait"] / cpumon.WAIT_LIMIT,
               row["cpu_demand"] / cpumon.DEMAND_SATURATED)


def background_util(row: dict) -> float:
    """Busy fraction of the cores that the run's own threads (ranks and engines) do not
    explain: other processes' load."""
    cores = len(os.sched_getaffinity(0)) or 1
    wall = row["time_s"] * row["time_dilation"]
    own = (row["cpu_s"] + row["engine_cpu_s"]) / max(wall, 1e-9) / cores
    return max(0.0, row["cpu_util"] - own)


def calibration_bytes(net, spec: CollectiveSpec, factor: float) -> int:
    """Message size of a calibration run of ``spec`` at ``factor``: about :data:`CAL_WALL_S`
    of wall time by the model (within the model-time bounds), a multiple of 4 KiB. It does
    not depend on ``spec.nbytes``: the calibration measures the CPU a workload needs per
    second of moving data, which small messages (dominated by per-message costs) hide."""
    hosts = list(net.topo.host_names)
    probe = [flowmodel.predict_s(net.routed_topo, dataclasses.replace(spec, nbytes=s << 20),
                                 workers=hosts[:spec.workers or len(hosts)]) for s in (1, 2)]
    per_mib = max(probe[1] - probe[0], 1e-9)
    want = min(max(CAL_WALL_S / factor, CAL_MIN_MODEL_S), CAL_MAX_MODEL_S)
    nbytes = int(max(want - (probe[0] - per_mib), per_mib / 8) / per_mib * (1 << 20))
    return max(4096, nbytes - nbytes % 4096)


def _trial(net, spec: CollectiveSpec, factor: float, run) -> tuple[bool, float, list[dict]]:
    """Run ``spec`` shrunk for calibration at the net's current factor: (passed, median
    pressure of its repetitions, one record per repetition)."""
    small = dataclasses.replace(spec, nbytes=calibration_bytes(net, spec, factor),
                                repetitions=CAL_REPS)
    try:
        rows = run(net, small)
    except CollectiveTimeout as e:  # a starved emulator can stall: count it as saturated
        return False, math.inf, [{"factor": factor, "algo": spec.algo, "bytes": small.nbytes,
                                  "error": str(e)[:300], "passed": False}]
    records, pressures = [], []
    for r in rows:
        p = pressure(r)
        p = math.inf if math.isnan(p) else p  # a missing CPU signal counts as saturated
        pressures.append(p)
        records.append({"factor": factor, "algo": spec.algo, "bytes": small.nbytes,
                        "time_s": r["time_s"], "model_s": r["model_s"],
                        "cpu_util": r["cpu_util"], "cpu_wait": r["cpu_wait"],
                        "cpu_demand": r["cpu_demand"], "pressure": round(p, 3),
                        "background": round(background_util(r), 3),
                        "passed": p < HEADROOM})
    # decide from the same unrounded values as each record's "passed": rounded, a 0.8996
    # reads 0.9, and a trial could fail while most of its records passed
    median = sorted(pressures)[len(pressures) // 2]
    return median < HEADROOM, median, records


def _distinct(specs: list[CollectiveSpec]) -> list[CollectiveSpec]:
    """One spec per workload (sizes and repetitions aside)."""
    seen, out = set(), []
    for s in specs:
        key = repr(dataclasses.replace(s, nbytes=4, repetitions=1, seed=0))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def calibrate(net, specs: list[CollectiveSpec], run, *, start: float = 1.0,
              max_factor: float = MAX_AUTO_FACTOR, log=None) -> Calibration:
    """Choose and set the smallest dilation factor at which every collective of ``specs``
    stays below CPU saturation on the running ``net`` (see the module docstring).

    ``run``: what runs a collective, :func:`testbed.collectives.run_collective` (passed in: the
    runner calls this module for a network built with ``time_dilation = "auto"``, so this
    module cannot import it). ``start``: the first factor tried (e.g. what a similar network needed); ``max_factor``:
    the largest. ``log``: a file to print one line per calibration run to. The net runs at
    the chosen factor afterwards and keeps the result in ``net.calibration``. When even
    ``max_factor`` saturates, or other processes keep the cores busy whatever the factor,
    the result says so (``saturated``, ``note``) and the net runs at the factor that came
    closest.
    """
    if not specs:
        raise ValueError("calibrate: give at least one CollectiveSpec to calibrate with")
    if not hasattr(net, "set_time_dilation"):
        raise ValueError("calibrate: net must be a running TestbedNet (set_time_dilation)")
    f = float(min(max(start, 1.0), max_factor))
    cal = Calibration(factor=f)

    def run_at(factor: float, workloads: list) -> tuple[list, float, float]:
        net.set_time_dilation(factor)
        failed, worst, busy = [], 0.0, 1.0
        for spec in workloads:
            ok, p, records = _trial(net, spec, factor, run)
            cal.trials.extend(records)
            worst = max(worst, p)
            for r in records:
                _log(log, r)
                if not r["passed"] and "background" in r:
                    busy = min(busy, r["background"])
            if not ok:
                failed.append(spec)
        return failed, worst, busy if failed else 0.0

    previous, net.calibration = net.calibration, cal  # run_collective must not recalibrate
    try:
        search(cal, f, _distinct(list(specs)), max_factor, run_at)
        net.set_time_dilation(cal.factor)
    except BaseException:
        net.calibration = previous
        raise
    _log(log, cal.summary())
    return cal


def nice_factor(f: float) -> float:
    """``f`` rounded to a factor that reads well: to 0.5 below 4, to a whole number above."""
    return round(f * 2) / 2 if f < 4 else float(round(f))


def search(cal: Calibration, f: float, pending: list, max_factor: float, run_at) -> None:
    """The factor search of :func:`calibrate`; sets ``cal.factor`` (and ``saturated``).

    ``run_at(factor, workloads) -> (failed workloads, largest pressure, background)`` runs
    the workloads at ``factor``. Up: from ``f``, multiply the factor by the largest pressure
    (how far the runs were from passing; between 2 and 4) until every workload passes. Then
    down: at most two steps halfway (on a log scale, :func:`nice_factor`) between the largest
    factor that failed and the smallest that passed, with only the workloads that failed
    there.
    Workloads are assumed to need no more CPU at a larger factor.
    """
    lo = None  # the largest factor at which some workload failed
    best = (math.inf, f)  # (pressure, factor) of the factor that came closest
    while True:
        failed, worst, busy = run_at(f, pending)
        best = min(best, (worst, f))
        if not failed:
            break
        lo, pending = f, failed
        if busy >= BACKGROUND_LIMIT:
            cal.saturated = True
            cal.note = (f"other processes keep the cores {busy:.0%} busy: no dilation brings "
                        "the runs below saturation")
        elif f >= max_factor:
            cal.saturated = True
            cal.note = f"still close to saturation at the largest factor {max_factor:g}"
        if cal.saturated:
            cal.factor = best[1]
            return
        f = min(nice_factor(f * min(max(worst, 2.0), 4.0)), max_factor)
    hi = f
    for _ in range(2):
        if lo is None or hi / lo <= 1.5:
            break
        mid = nice_factor(math.sqrt(lo * hi))
        if not lo < mid < hi:
            break
        failed, _, _ = run_at(mid, pending)
        if failed:
            lo, pending = mid, failed
        else:
            hi = mid
    cal.factor = hi


def _log(log, what) -> None:
    if log is None:
        return
    if isinstance(what, dict):
        if "error" in what:
            what = (f"calibration f={what['factor']:g} {what['algo']} {what['bytes']} B: "
                    f"failed ({what['error'][:80]})")
        else:
            what = (f"calibration f={what['factor']:g} {what['algo']} {what['bytes']} B: "
                    f"util {what['cpu_util']:.2f} wait {what['cpu_wait']:.2f} demand "
                    f"{what['cpu_demand']:.2f} (background {what['background']:.2f}) -> "
                    f"{'ok' if what['passed'] else 'too close to saturation'}")
    print(f"# {what}", file=log, flush=True)
