"""Was a run limited by the CPU instead of the emulated network? Per thread and per core.

An emulated network is only measured when the emulator keeps up with it. Three things say it
did not, each measured over the run from the kernel's own accounting:

* **the machine's cores were saturated**: ``cpu_util``, the busy fraction of the cores this
  process may run on (``/proc/stat``, per core, averaged), reached :data:`UTIL_SATURATED`.
  On a saturated machine every runnable thread queues for a CPU, whoever caused the load
  (other users of a shared machine included);
* **a thread on the critical path waited for a CPU**: ``cpu_wait``, the largest fraction of
  the run one thread of the watched processes spent runnable but not running
  (``/proc/<pid>/task/<tid>/schedstat``, second field), exceeded :data:`WAIT_LIMIT`. Every
  thread of a collective's ranks and of the data-path engines is on the critical path: each
  moves bytes of the collective, and a late one holds its peers back;
* **a thread on the critical path was hardly ever idle**: ``cpu_demand``, the largest share
  of the run one such thread spent running or waiting to run, reached
  :data:`DEMAND_SATURATED`; that thread set the pace (a data-path engine forwarding every
  packet of a switch is the usual one).

Each is per thread, never summed over a process's threads: a worker with one sender thread
per peer may use 0.9 of a core in total while no core is saturated and no thread waits.

Thresholds. ``WAIT_LIMIT = 0.10``: a thread that spent a tenth of the run waiting for a CPU
delayed its share of the collective by about that much; with busy processes pinned to every
core a rank's thread waits 0.5 of the run and more (``tests/collectives/test_collectives_cpumon.py``).
``UTIL_SATURATED = 0.90`` leaves room for the idle moments of the kernel's 10 ms accounting.
``DEMAND_SATURATED = 0.90``: a polling thread that sleeps on purpose never reaches 1.0 even
when it is the bottleneck; the data-path engine sleeps 50 us after each mostly empty burst
(interrupt coalescing). Measured here: the engine of an 8-host programmable star forwarding
a ring allreduce ran 0.85-0.94 of the run while the cores were only 0.71-0.78 busy, and the
run took 2.5-3.4x the model: the engine set the pace. On the oversubscribed leaf-spines of
``testbed bench fidelity``, where runs came within 1.03-1.37x of the model, the engines ran
0.49-0.67.

Use::

    mon = CpuMonitor({"ranks": [pid, ...], "engines": [pid, ...]})
    ... the run, calling mon.sample() now and then (catches threads that exit early) ...
    rep = mon.stop()      # CpuReport: cpu_util, cpu_wait, cpu_demand, cpu_bound, why, ...
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

#: Mean busy fraction of the usable cores at which the machine counts as saturated.
UTIL_SATURATED = 0.90
#: Fraction of the run a critical thread may wait for a CPU before the run is CPU-bound.
WAIT_LIMIT = 0.10
#: Share of the run a critical thread spent running or waiting to run (not idle) at which it
#: counts as the bottleneck.
DEMAND_SATURATED = 0.90


def thread_times(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (ns on a CPU, ns runnable but waiting for one) for every thread of ``pid``;
    empty when the process is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
        except (OSError, ValueError):
            continue  # the thread exited meanwhile
        out[int(tid)] = (int(run), int(wait))
    return out


def thread_name(pid: int, tid: int) -> str:
    """``comm`` of a thread ('' when gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def core_times(cpus: set[int] | None = None) -> dict[int, tuple[int, int]]:
    """cpu -> (busy, total) jiffies from ``/proc/stat`` for the cores in ``cpus`` (default:
    the cores this process may run on). Busy is everything but idle and iowait."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *vals = line.split()
            cpu = int(name[3:])
            if cpu not in cpus:
                continue
            v = [int(x) for x in vals[:8]]
            total = sum(v)
            out[cpu] = (total - v[3] - v[4], total)
    return out


#: the timer interrupt's line in ``/proc/interrupts``: x86's local APIC timer, arm64's timer
TIMER_IRQ_LINES = ("LOC:", "arch_timer")


def kernel_events() -> dict[str, int | None]:
    """Machine-wide counts of the kernel events a packet's emulation costs besides its own
    processing: ``timer_irqs`` (timer interrupts: the shapers' per-packet departures and the
    sleepers' wake-ups), ``net_softirqs`` (NET_TX + NET_RX runs) and ``ctx_switches``. A
    count this kernel does not expose is None."""
    out: dict[str, int | None] = dict.fromkeys(("timer_irqs", "net_softirqs", "ctx_switches"))

    def per_cpu_total(path: str, wanted) -> int | None:
        """Sum of the per-CPU columns (as many as the header names) of the rows ``wanted``
        accepts, None when none does."""
        found = None
        with open(path) as f:
            ncpu = len(f.readline().split())
            for line in f:
                fields = line.split()
                if fields and wanted(fields):
                    found = (found or 0) + sum(int(x) for x in fields[1:1 + ncpu])
        return found

    try:
        out["timer_irqs"] = per_cpu_total(
            "/proc/interrupts",
            lambda f: f[0] == TIMER_IRQ_LINES[0] or f[-1] == TIMER_IRQ_LINES[1])
        out["net_softirqs"] = per_cpu_total("/proc/softirqs",
                                            lambda f: f[0] in ("NET_TX:", "NET_RX:"))
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("ctxt "):
                    out["ctx_switches"] = int(line.split()[1])
    except OSError:
        pass
    return out


@dataclass
class CpuReport:
    """What :meth:`CpuMonitor.stop` measured (fractions of the run's wall time)."""

    wall_s: float
    cpu_util: float
    core_util: dict[int, float]
    cpu_wait: float
    wait_thread: str
    cpu_max: float
    busy_thread: str
    cpu_demand: float = 0.0
    demand_thread: str = ""
    group_max: dict[str, float] = field(default_factory=dict)
    group_wait: dict[str, float] = field(default_factory=dict)
    group_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def why(self) -> list[str]:
        """The reasons the run was CPU-bound (empty when it was not)."""
        return cpu_bound_reasons(self.cpu_util, self.cpu_wait, self.cpu_demand,
                                 self.wait_thread, self.demand_thread)

    @property
    def cpu_bound(self) -> bool:
        """Whether any of the three signals fired (see the module docstring)."""
        return bool(self.why)


def cpu_bound_reasons(cpu_util: float, cpu_wait: float, cpu_demand: float,
                      wait_thread: str = "", demand_thread: str = "") -> list[str]:
    """The decision: which of the three saturation signals fired, as readable reasons."""
    why = []
    if cpu_util >= UTIL_SATURATED:
        why.append(f"cores saturated ({cpu_util:.0%} busy)")
    if cpu_wait > WAIT_LIMIT:
        why.append(f"thread {wait_thread or '?'} waited for a CPU {cpu_wait:.0%} of the run")
    if cpu_demand >= DEMAND_SATURATED:
        why.append(f"thread {demand_thread or '?'} was busy or waiting for a CPU "
                   f"{cpu_demand:.0%} of the run")
    return why


class CpuMonitor:
    """Watch the threads of some processes (grouped by name) and the cores over a run."""

    def __init__(self, groups: dict[str, list[int]], cpus: set[int] | None = None,
                 min_interval: float = 0.25):
        self.groups = {g: [int(p) for p in pids] for g, pids in groups.items()}
        self.cpus = cpus
        self.min_interval = min_interval
        self.start()

    def start(self) -> None:
        """Begin a measurement (e.g. one repetition)."""
        self.t0 = time.monotonic()
        self.c0 = core_times(self.cpus)
        self.first = {(g, p): thread_times(p) for g, pids in self.groups.items() for p in pids}
        self.last = {k: dict(v) for k, v in self.first.items()}
        self.t_sample = self.t0

    def sample(self, force: bool = False) -> None:
        """Remember the threads' counters now (at most every ``min_interval`` s unless
        ``force``), so a thread that exits before :meth:`stop` still counts with what it had
        used. Cheap enough to call from a polling loop."""
        now = time.monotonic()
        if not force and now - self.t_sample < self.min_interval:
            return
        self.t_sample = now
        for (_g, p), seen in self.last.items():
            seen.update(thread_times(p))

    def stop(self) -> CpuReport:
        """The measurement since :meth:`start`."""
        self.sample(force=True)
        wall = max(time.monotonic() - self.t0, 1e-6)
        c1 = core_times(self.cpus)
        core_util = {}
        for cpu, (b1, t1) in c1.items():
            b0, t0 = self.c0.get(cpu, (b1, t1))
            core_util[cpu] = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        util = sum(core_util.values()) / len(core_util) if core_util else 0.0
        rep = CpuReport(wall, util, core_util, 0.0, "", 0.0, "",
                        group_max=dict.fromkeys(self.groups, 0.0),
                        group_wait=dict.fromkeys(self.groups, 0.0),
                        group_cpu_s=dict.fromkeys(self.groups, 0.0))
        for (g, p), seen in self.last.items():
            base = self.first[(g, p)]
            gmax = gwait = gcpu = 0.0
            for tid, (run, wait) in seen.items():
                r0, w0 = base.get(tid, (0, 0))  # a thread born during the run starts at 0
                busy, waited = (run - r0) / 1e9 / wall, (wait - w0) / 1e9 / wall
                gcpu += (run - r0) / 1e9
                if busy > gmax:
                    gmax = busy
                if waited > gwait:
                    gwait = waited
                if busy > rep.cpu_max:
                    rep.cpu_max, rep.busy_thread = busy, f"{thread_name(p, tid)}[{tid}]"
                if waited > rep.cpu_wait:
                    rep.cpu_wait, rep.wait_thread = waited, f"{thread_name(p, tid)}[{tid}]"
                if busy + waited > rep.cpu_demand:
                    rep.cpu_demand = busy + waited
                    rep.demand_thread = f"{thread_name(p, tid)}[{tid}]"
            rep.group_max[g] = max(rep.group_max.get(g, 0.0), gmax)
            rep.group_wait[g] = max(rep.group_wait.get(g, 0.0), gwait)
            rep.group_cpu_s[g] = rep.group_cpu_s.get(g, 0.0) + gcpu
        return rep
