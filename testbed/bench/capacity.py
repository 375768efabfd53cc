"""``testbed bench capacity [--json]``: how many workers one machine emulates faithfully.

On a machine with few cores the emulator, not the emulated network, is the limit: past some
number of workers every collective is CPU-bound (:mod:`testbed.collectives.cpumon` decides, from
the kernel's accounting of the ranks' and the data-path engines' threads and of the cores).
This benchmark finds that number for in-network aggregation and ring allreduce: for each ``n``
of a sweep it builds a star of ``n`` hosts with ``bw_mbps`` links around one programmable switch
(the engine forwards the ring's packets and aggregates INA's), runs each algorithm once and
records

* ``cpu_bound``: the run's verdict;
* ``cpu_s_per_kpkt_engine``: CPU-seconds the switch's engine spent per thousand packets it
  received (each one forwarded or answered), from the engine's own counters over the run;
* ``cpu_s_per_kpkt_worker``: CPU-seconds of the ranks' threads per thousand packets their
  interfaces sent or received (the hosts' kernel counters);
* ``cpu_s_per_kpkt_machine`` (an extra key): CPU-seconds the whole machine spent per thousand
  packets the engine received, from the busy time of the cores over the timed run. In a star
  every emulated packet crosses the switch once, so this is what one emulated packet costs end
  to end: the sender, both links' shaping, the engine, the receiver. It is the figure to
  compare changes by. The two per-process figures above move with the kernel's accounting:
  where the kernel counts CPU time by ticks (``CONFIG_IRQ_TIME_ACCOUNTING`` unset, as on the
  Firecracker VMs these benchmarks ran on), a softirq's work is charged to whichever process
  was running, so a shaper's timer that delivers another host's packets while the engine runs
  is counted as the engine's system time. None for a run shorter than
  :data:`MACHINE_MIN_WALL_S`, too short for the kernel's ticks;
* ``timer_irqs_per_pkt``, ``net_softirqs_per_pkt``, ``ctx_switches_per_pkt`` (extra keys): the
  machine's timer interrupts, NET_TX/NET_RX softirq runs and context switches per packet the
  engine received, over the whole collective call (:func:`testbed.collectives.cpumon.
  kernel_events`). Wherever a packet waits for a link's shaper, its departure is a timer:
  these say how much of the cost is wake-ups rather than the packet's own processing;
* ``max_workers_not_cpu_bound``: per algorithm, the largest ``n`` of the sweep that ran, like
  every smaller ``n``, without CPU saturation (0 when the smallest already saturated), the same
  on every row of the algorithm.

* ``min_time_dilation``: at the sweep's ``n`` in ``dilate_workers`` (default 8 and 16), the
  smallest time-dilation factor at which the algorithm runs below saturation, found by
  :func:`testbed.collectives.dilation.calibrate` on the same network (None elsewhere, and
  where even the largest factor saturated: ``dilation_note`` says so).

``speed_probe_s`` / ``speed_probe_end_s``: :func:`speed_probe_s` before and after the
sweep. The machine's speed, which the CPU-bound verdicts depend on, drifts on a shared VM;
compare runs only at similar probes.

One JSON object per line with ``--json`` (keys :data:`ROW_KEYS`), otherwise a table. ``io``
selects the engine's packet I/O (``ring``: PACKET_MMAP rings, the default; ``mmsg``:
``recvmmsg``/``sendmmsg``), so the two can be compared on one machine; ``shaping`` likewise
selects who shapes the switch's ports (``engine``: its ``shape`` stage, the default; ``qdisc``:
the kernel's HTB, as before the stage existed) and ``sched`` how the engine's packet loop is
scheduled (``fifo``: real-time, the default; ``other``: time-shared, as before);
``worker_send`` how the INA workers send (``gso``: runs of packets as one UDP GSO send where
the host allows it, :func:`testbed.collectives.ina.udp_gso_usable`, the default; ``mmsg``: one ``sendmmsg`` entry per packet, as
before; the ring's TCP is unaffected).
``time_dilation`` runs the whole sweep at that factor (links at ``bw_mbps / f``, times
reported undilated, the rows' CPU per packet then what the dilated run spent).

``fabric``: ``star`` (the sweep above) or ``fat_tree``: a programmable fat-tree of ``n``
hosts (16: k=4, 128: k=8), where a packet crosses up to five switches. Its engine figures
sum every switch's engine, and the figure to compare is then ``cpu_s_per_kpkt_delivered``
(an extra key, on stars too): the machine's CPU-seconds per thousand packets the hosts'
interfaces *received*, i.e. per emulated packet delivered end to end, however many hops it
crossed (on a star it equals the machine figure but for drops).

``engine_groups``: None (one engine process per switch) or n, the network's
``engine_groups`` (n processes serving the switches, the links between a process's switches
in memory; :mod:`testbed.datapath.group`), to compare the two on one machine.
"""

from __future__ import annotations

import os
import sys
import time

from testbed.bench.protocol import Outcome, parse_ints
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.cpumon import kernel_events
from testbed.collectives.dilation import MAX_AUTO_FACTOR, calibrate
from testbed.datapath.engine import SCHED_POLICIES
from testbed.experiment.results import cpu_model
from testbed.topologies import FatTree, Star, TestbedNet
from testbed.topologies.pipeline import DatapathOptions

MiB = 1 << 20
ALGOS = ("ina", "ring")
WORKERS = (2, 4, 8, 16)
#: the worker counts at which the smallest non-saturating dilation factor is searched
DILATE_WORKERS = (8, 16)
#: who shapes the switch's ports: its engine (``shape`` stage) or the kernel (HTB)
SHAPING = ("engine", "qdisc")
#: how INA workers send: UDP GSO runs or one datagram per sendmmsg entry (``TESTBED_INA_GSO``)
WORKER_SEND = ("gso", "mmsg")
#: what is emulated: a star of n hosts, or a fat-tree of n hosts (its k by FAT_TREE_K)
FABRICS = ("star", "fat_tree")
#: the fat-trees the benchmarks build, by their hosts (k^3/4): k=4 and k=8
FAT_TREE_K = {16: 4, 128: 8}
#: the shortest timed run whose machine-wide CPU is reported: ``/proc/stat`` counts in ticks
#: of 10 ms, so a 2-core machine's 0.5 s is 100 ticks (a 50 ms run read 0 busy ticks)
MACHINE_MIN_WALL_S = 0.5
ROW_KEYS = ("algo", "n", "bw_mbps", "cpu_bound", "cpu_s_per_kpkt_engine",
            "cpu_s_per_kpkt_worker", "max_workers_not_cpu_bound", "min_time_dilation")
EXTRA_KEYS = ("cpu_s_per_kpkt_machine", "timer_irqs_per_pkt", "net_softirqs_per_pkt",
              "ctx_switches_per_pkt", "cpu_s_per_kpkt_delivered", "delivered_kpkts",
              "fabric", "engine_groups", "time_s", "model_s", "correct", "cpu_util", "cpu_wait",
              "cpu_engine", "cpu_max", "engine_kpkts", "worker_kpkts", "io", "shaping", "sched",
              "worker_send", "bytes", "time_dilation", "dilation_note", "cpu_model",
              "speed_probe_s", "speed_probe_end_s")
HEADERS = ("algo", "n", "Mb/s", "cpu_bound", "engine s/kpkt", "worker s/kpkt", "max n",
           "min f", "time s", "model s", "correct", "cores", "wait", "engine", "machine s/kpkt")


def iface_packets(host, sent: bool = True) -> int:
    """Packets received (and, with ``sent``, sent) by ``host``'s data interfaces (kernel
    counters)."""
    total = 0
    for line in host.cmd("cat /proc/net/dev").splitlines():
        name, sep, rest = line.partition(":")
        if not sep or name.strip() == "lo" or not rest.split()[0].isdigit():
            continue
        f = rest.split()
        total += int(f[1]) + (int(f[9]) if sent else 0)
    return total


def engine_totals(counters: dict) -> tuple[int, float]:
    """(packets received on all ports, CPU-seconds) from an engine's counters."""
    return (sum(p["rx_packets"] for p in counters["ports"].values()),
            float(counters["cpu_seconds"]))


def _engines_totals(net) -> tuple[int, float]:
    """:func:`engine_totals` summed over every engine of ``net``."""
    pk, cpu = 0, 0.0
    for client in net.datapath_clients().values():
        p, c = engine_totals(client.counters())
        pk, cpu = pk + p, cpu + c
    return pk, cpu


def measure_once(net, algo: str, nbytes: int, window: int, timeout_s: float) -> dict:
    """Run ``algo`` once on ``net`` (a star, or any fabric of programmable switches); one
    row (no ``max_workers_not_cpu_bound`` yet)."""
    hosts = net.hosts
    n = len(hosts)
    pk0, cpu0 = _engines_totals(net)
    if0 = sum(iface_packets(h) for h in hosts)
    rx0 = sum(iface_packets(h, sent=False) for h in hosts)
    ev0 = kernel_events()
    spec = CollectiveSpec(algo=algo, nbytes=nbytes, window=window, timeout_s=timeout_s,
                          placement={"tree": "auto"} if algo == "ina" and
                          len(net.datapath_clients()) > 1 else {})
    r = run_collective(net, spec)[0]
    ev1 = kernel_events()
    pk1, cpu1 = _engines_totals(net)
    worker_pkts = sum(iface_packets(h) for h in hosts) - if0
    delivered = sum(iface_packets(h, sent=False) for h in hosts) - rx0
    engine_pkts = pk1 - pk0
    # the cores' busy time over the timed run: its busy fraction x cores x wall time, from
    # the kernel's ticks, so only for a run long enough for them (None below)
    wall_s = r["time_s"] * r["time_dilation"]
    machine_s = r["cpu_util"] * len(os.sched_getaffinity(0)) * wall_s \
        if wall_s >= MACHINE_MIN_WALL_S else None
    per_pkt = {f"{k}_per_pkt": round((ev1[k] - ev0[k]) / engine_pkts, 3)
               if engine_pkts and ev0[k] is not None and ev1[k] is not None else None
               for k in ev0}
    return per_pkt | {
        "algo": algo, "n": n, "bw_mbps": r["bw_mbps"], "cpu_bound": r["cpu_bound"],
        "cpu_s_per_kpkt_engine": round((cpu1 - cpu0) / (engine_pkts / 1e3), 5)
        if engine_pkts else None,
        "cpu_s_per_kpkt_worker": round(r["cpu_s"] / (worker_pkts / 1e3), 5)
        if worker_pkts else None,
        "max_workers_not_cpu_bound": None,
        "cpu_s_per_kpkt_machine": round(machine_s / (engine_pkts / 1e3), 5)
        if engine_pkts and machine_s is not None else None,
        "cpu_s_per_kpkt_delivered": round(machine_s / (delivered / 1e3), 5)
        if delivered and machine_s is not None else None,
        "delivered_kpkts": round(delivered / 1e3, 1),
        "time_s": round(r["time_s"], 4), "model_s": round(r["model_s"], 4),
        "correct": r["correct"], "cpu_util": r["cpu_util"], "cpu_wait": r["cpu_wait"],
        "cpu_engine": r["cpu_engine"], "cpu_max": r["cpu_max"],
        "engine_kpkts": round(engine_pkts / 1e3, 1), "worker_kpkts": round(worker_pkts / 1e3, 1),
        "bytes": nbytes,
    }


def smallest_dilation(net, algo: str, nbytes: int, window: int, timeout_s: float,
                      back_to: float, log) -> dict:
    """``min_time_dilation`` (and ``dilation_note``) of ``algo`` on ``net``: the calibration's
    factor, None when even the largest saturated; the net runs at ``back_to`` again after."""
    spec = CollectiveSpec(algo=algo, nbytes=nbytes, window=window, timeout_s=timeout_s)
    try:
        cal = calibrate(net, [spec], run_collective, log=log)
    finally:
        net.set_time_dilation(back_to)
        net.calibration = None
    return {"min_time_dilation": None if cal.saturated else cal.factor,
            "dilation_note": cal.note or None}


def max_not_bound(rows: list[dict]) -> int:
    """Largest ``n`` that ran without CPU saturation, like every smaller ``n`` (0: none)."""
    best = 0
    for r in sorted(rows, key=lambda r: r["n"]):
        if r["cpu_bound"] or r["cpu_bound"] is None:
            break
        best = r["n"]
    return best


def speed_probe_s(reps: int = 5) -> float:
    """Seconds a fixed pure-Python loop (3 million additions) takes here, best of ``reps``:
    the machine's speed at the time. A shared VM's speed drifts (1.7x within one session
    here) and the CPU-bound verdicts drift with it; the CPU model alone cannot tell."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        s = 0
        for i in range(3_000_000):
            s += i
        best = min(best, time.perf_counter() - t)
    return round(best, 4)


def run(workers=WORKERS, algos=ALGOS, bw_mbps: float = 100.0, nbytes: int = 8 * MiB,
        io: str = "ring", window: int = 64, timeout_s: float = 120.0,
        time_dilation: float = 1.0, dilate_workers=DILATE_WORKERS, shaping: str = "engine",
        sched: str = "fifo", worker_send: str = "gso", fabric: str = "star",
        engine_groups: int | None = None, log=sys.stderr) -> list[dict]:
    """The sweep (see the module docstring); rows in (algo, n) order."""
    if fabric not in FABRICS:
        raise ValueError(f"fabric must be one of {FABRICS}, got {fabric!r}")
    if fabric == "fat_tree" and any(int(n) not in FAT_TREE_K for n in workers):
        raise ValueError(f"workers: a fat-tree holds {sorted(FAT_TREE_K)} hosts (k="
                         f"{sorted(FAT_TREE_K.values())}), got {list(workers)}")
    if isinstance(time_dilation, bool) or not isinstance(time_dilation, int | float) \
            or not 1 <= time_dilation <= MAX_AUTO_FACTOR:
        raise ValueError(f"time_dilation must be a number in 1..{MAX_AUTO_FACTOR:g}, got "
                         f"{time_dilation!r}")
    time_dilation = float(time_dilation)
    bad = [a for a in algos if a not in ALGOS]
    if bad or not algos:
        raise ValueError(f"algos must be among {ALGOS}, got {list(algos)}")
    if not workers or any(int(n) < 2 for n in workers):
        raise ValueError(f"workers must list host counts >= 2, got {list(workers)}")
    if any(int(n) < 2 for n in dilate_workers):
        raise ValueError(f"dilate must list host counts >= 2 (those of the sweep whose "
                         f"dilation is searched), got {list(dilate_workers)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be a whole number of float32 (--mib > 0), got {nbytes!r}")
    if not bw_mbps > 0:
        raise ValueError(f"bw_mbps must be > 0, got {bw_mbps!r}")
    if io not in ("ring", "mmsg"):
        raise ValueError(f"io must be 'ring' or 'mmsg', got {io!r}")
    if shaping not in SHAPING:
        raise ValueError(f"shaping must be one of {SHAPING}, got {shaping!r}")
    if sched not in SCHED_POLICIES:
        raise ValueError(f"sched must be one of {SCHED_POLICIES}, got {sched!r}")
    if worker_send not in WORKER_SEND:
        raise ValueError(f"worker_send must be one of {WORKER_SEND}, got {worker_send!r}")
    # the workers inherit the environment (testbed.collectives.ina.udp_gso_usable reads it)
    saved = os.environ.get("TESTBED_INA_GSO")
    os.environ["TESTBED_INA_GSO"] = "1" if worker_send == "gso" else "0"
    try:
        return _sweep(workers, algos, bw_mbps, nbytes, io, window, timeout_s, time_dilation,
                      dilate_workers, shaping, sched, worker_send, fabric, engine_groups, log)
    finally:
        if saved is None:
            os.environ.pop("TESTBED_INA_GSO", None)
        else:
            os.environ["TESTBED_INA_GSO"] = saved


def _sweep(workers, algos, bw_mbps, nbytes, io, window, timeout_s, time_dilation,
           dilate_workers, shaping, sched, worker_send, fabric, engine_groups, log
           ) -> list[dict]:
    options = DatapathOptions(shape_in_engine=shaping == "engine")
    cpu = cpu_model()
    probe = speed_probe_s()
    rows: list[dict] = []
    for n in sorted({int(n) for n in workers}):
        topo = (Star(n, bw_mbps=bw_mbps, switch="programmable") if fabric == "star" else
                FatTree(k=FAT_TREE_K[n], bw_mbps=bw_mbps, switch="programmable"))
        with TestbedNet(topo, engine_opts={"io": io, "sched": sched},
                        time_dilation=time_dilation, datapath=options,
                        engine_groups=engine_groups) as net:
            for algo in algos:
                try:
                    row = measure_once(net, algo, nbytes, window, timeout_s)
                    if n in dilate_workers:
                        row.update(smallest_dilation(net, algo, nbytes, window, timeout_s,
                                                     time_dilation, log))
                except Exception as e:  # noqa: BLE001 - a failed run is a row, not the end
                    row = {"algo": algo, "n": n, "bw_mbps": bw_mbps, "cpu_bound": None,
                           "cpu_s_per_kpkt_engine": None, "cpu_s_per_kpkt_worker": None,
                           "max_workers_not_cpu_bound": None, "correct": False,
                           "bytes": nbytes, "error": f"{type(e).__name__}: {e}"}
                row.setdefault("min_time_dilation", None)
                row.update(io=io, shaping=shaping, sched=sched, worker_send=worker_send,
                           fabric=fabric, engine_groups=engine_groups,
                           time_dilation=time_dilation,
                           cpu_model=cpu, speed_probe_s=probe)
                rows.append(row)
                print(f"# {algo} n={n}: cpu_bound={row['cpu_bound']} engine "
                      f"{row['cpu_s_per_kpkt_engine']} s/kpkt, worker "
                      f"{row['cpu_s_per_kpkt_worker']} s/kpkt, machine "
                      f"{row.get('cpu_s_per_kpkt_machine')} s/kpkt (delivered: "
                      f"{row.get('cpu_s_per_kpkt_delivered')}), time {row.get('time_s')} s "
                      f"(model {row.get('model_s')} s), correct={row['correct']}"
                      + (f" ERROR {row['error']}" if "error" in row else ""), file=log)
    probe_end = speed_probe_s()
    for algo in algos:
        mine = [r for r in rows if r["algo"] == algo]
        best = max_not_bound(mine)
        for r in mine:
            r.update(max_workers_not_cpu_bound=best, speed_probe_end_s=probe_end)
    rows.sort(key=lambda r: (algos.index(r["algo"]), r["n"]))
    return rows


def measure(emit, quick: bool, workers: str, io: str, shaping: str, sched: str,
            worker_send: str, mib: int, bw: float, time_dilation: float, dilate: str,
            fabric: str, engine_groups: int = 0) -> Outcome:
    """``testbed bench capacity`` (:mod:`testbed.bench.protocol`); ok when every run
    completed correctly."""
    rows = run(workers=parse_ints("workers", workers), io=io, nbytes=mib * MiB, bw_mbps=bw,
               time_dilation=time_dilation, dilate_workers=parse_ints("dilate", dilate),
               shaping=shaping, sched=sched, worker_send=worker_send, fabric=fabric,
               engine_groups=engine_groups or None)
    notes = {"speed_probe_s": rows[0]["speed_probe_s"] if rows else None,
             "speed_probe_end_s": rows[0]["speed_probe_end_s"] if rows else None,
             "speed_probe": "a pure-Python loop of 3 M additions before and after: larger = "
                            "a slower machine"}
    return Outcome(rows, notes, ok=bool(rows) and all(r.get("correct") for r in rows))
