"""``testbed bench soak``: mixed collectives for M minutes on one network, with faults at
random times, watching the long-lived processes for leaks.

One leaf-spine (2 leaves x 2 hosts, 2 spines, programmable switches) stays up for the whole
soak; every switch port is a UET trimming queue (:data:`SOAK_DATAPATH`) and one spine drops,
duplicates and reorders 0.2 % of what it receives. Job after job, a seeded draw picks ring,
halving-doubling, a reduction server, the ring over the UET-like transport (trimmed, NACKed),
INA on a tree, INA with THC compression, INA with 1 % loss at the workers, or INA and a ring
at once (two tenants on disjoint hosts), and a size; with ``--faults`` a third of the jobs
also get a fault at a random moment (an uplink flapping, or the engine of one leaf or one
spine, :data:`KILLED`, SIGKILLed and restarted by the collective). Every result is checked
against the numpy sum.

Every ``--sample-s`` seconds each long-lived process is sampled: the switch engines (a
restarted engine is a new process: its series starts again) and this process, which runs
the control plane. Its RSS and open descriptors after the warm-up (the first fifth of the
soak, and at least until every mix and fault kind ran once: imports and first calls are done;
for a restarted engine also its own first minute) against the end give the growth; a process
is judged only over two minutes or more (engines killed every few dozen seconds are counted,
not judged). At the end the network is torn down and the machine checked for leftovers.

Rows: one per minute (``kind = "window"``: collectives, ok, wrong, failed, timed out, faults,
median time), one per collective that was not ok (``kind = "job"``), and one per process
(``kind = "process"``: RSS and descriptors at warm-up and at the end, the growth). Not a row
per collective: the rows stay in this process, whose memory the soak watches. Targets: 0
wrong, 0 hung or failed, RSS and descriptor growth <= 5 % after warm-up, engines' counters never
going backwards between samples (a counter reset is only allowed across a restart), and 0
leftovers. Not in the mix: NIC offload. A host behind a ``nic_codec`` SmartNIC gets every
INT32 result widened to float32 by its NIC, so it cannot also run the plain INA jobs; a NIC
soak needs a network of its own.
"""

from __future__ import annotations

import os
import random
import time

from testbed.bench.protocol import Outcome
from testbed.cleanup import leftovers
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.experiment.faults import FaultSchedule
from testbed.experiment.spec import Fault
from testbed.lifeline import start_ticks
from testbed.topologies import LeafSpine, TestbedNet
from testbed.topologies.pipeline import DatapathOptions, Impairment, Trimming

MiB = 1 << 20
MIX = ("ring", "hd", "rs", "uet", "ina", "ina_thc", "ina_loss", "tenants")
UPLINKS = [("tbl1", "tbsp1"), ("tbl1", "tbsp2"), ("tbl2", "tbsp1"), ("tbl2", "tbsp2")]
ENGINES = ("tbl1", "tbl2", "tbsp1", "tbsp2")
#: the engines faults kill: a leaf and a spine. The other two are never killed, so their memory
#: and descriptors are watched over the whole soak (a killed engine lives too short to judge)
KILLED = ("tbl2", "tbsp1")

#: every switch port a UET trimming queue (UET packets cut above a BDP, the rest drop-tail),
#: and one spine's ingress impaired: every job crosses queues that trim and drop, and some
#: cross loss, duplication and reordering
SOAK_DATAPATH = DatapathOptions(
    trimming=(Trimming(node="*", mode="uet", threshold_bdp=1.0, rtt_us=2000, trim_bytes=256),),
    impairments=(Impairment(node="tbsp2", direction="ingress", loss=0.002, dup=0.002,
                            reorder=0.002, seed=7),))


def _proc_sample(pid: int) -> dict | None:
    """RSS (kB) and open descriptors of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return {"rss_kb": rss, "fds": fds}


def _counter_total(counters: dict) -> int:
    """Packets an engine received and sent, over all its ports (monotone while it lives)."""
    return sum(p["rx_packets"] + p["tx_packets"] for p in counters.get("ports", {}).values())


PROC_WARM_S = 60.0  # a process's own warm-up: first jobs, first calls, arenas grown
MIN_SPAN_S = 120.0  # judged for a leak only over at least this long after its warm-up


class _Watch:
    """Samples of the long-lived processes, keyed by (name, pid, start time): engines killed
    every few dozen seconds for an hour wrap the pid space, and a restarted engine may get
    the pid of an earlier one."""

    def __init__(self, net):
        self.net = net
        self.series: dict[tuple[str, int, str | None], list[tuple[float, dict]]] = {}
        self.counters: dict[tuple[str, int, str | None], int] = {}
        self.backwards: list[str] = []

    def sample(self, t: float) -> None:
        procs = {"control": os.getpid()}
        for name in ENGINES:
            pid = self.net.mininet.get(name).engine_pid()
            if pid is not None:
                procs[name] = pid
        for name, pid in procs.items():
            s = _proc_sample(pid)
            if s is not None:
                self.series.setdefault((name, pid, start_ticks(pid)), []).append((t, s))
        for name in ENGINES:
            try:
                counters = self.net.switch_client(name).counters()
            except Exception:  # noqa: BLE001 - an engine between death and restart
                continue
            # keyed by the pid of the engine that answered: it may have been restarted
            # since engine_pid() was read, and a new engine counts from zero
            pid = counters["pid"]
            key = (name, pid, start_ticks(pid))
            total = _counter_total(counters)
            last = self.counters.get(key)
            if last is not None and total < last:
                self.backwards.append(f"{name} (pid {pid}): {last} -> {total}")
            self.counters[key] = total

    def rows(self, warm_s: float, min_span_s: float) -> tuple[list[dict], int]:
        """A row per process that lived at least ``min_span_s`` past both the soak's warm-up
        and its own (``PROC_WARM_S`` after it was first seen: a restarted engine grows while
        it serves its first jobs, which is not a leak); and how many lived too short."""
        out, young = [], 0
        for (name, pid, _), pts in sorted(self.series.items(), key=lambda kv: kv[0][:2]):
            born = pts[0][0] if name != "control" else 0.0
            after = [(t, s) for t, s in pts if t >= max(warm_s, born + PROC_WARM_S)]
            if len(after) < 2 or after[-1][0] - after[0][0] < min_span_s:
                young += 1
                continue
            (t1, first), (t2, last) = after[0], after[-1]
            out.append({"kind": "process", "process": name, "pid": pid,
                        "samples": len(after), "span_s": round(t2 - t1, 1),
                        "rss_kb_warm": first["rss_kb"], "rss_kb_end": last["rss_kb"],
                        "rss_growth": round(last["rss_kb"] / first["rss_kb"] - 1, 4),
                        "fds_warm": first["fds"], "fds_end": last["fds"],
                        "fd_growth": round(last["fds"] / max(first["fds"], 1) - 1, 4)})
        return out, young


def _draw(rng: random.Random, n_job: int, with_faults: bool) -> tuple[str, list, list[Fault]]:
    """(mix name, [(spec, None)], faults) of one job (its specs run at once)."""
    kind = rng.choice(MIX)
    nbytes = rng.choice((256 << 10, 1 * MiB, 2 * MiB))
    job_id = 1 + n_job % 200
    tree = {"tree": "auto"}
    if kind in ("ring", "hd", "rs"):
        runs = [(CollectiveSpec(algo=kind, nbytes=nbytes, timeout_s=30), None)]
    elif kind == "uet":  # the ring over the UET-like transport: sprayed UDP, NACKs, timeouts
        runs = [(CollectiveSpec(algo="ring", nbytes=nbytes, timeout_s=30, transport="uet"),
                 None)]
    elif kind == "ina_loss":  # 1 % of the packets a worker receives dropped: retransmissions
        runs = [(CollectiveSpec(algo="ina", nbytes=nbytes, timeout_s=30, job_id=job_id,
                                loss=0.01, seed=n_job, placement=tree), None)]
    elif kind == "ina":
        runs = [(CollectiveSpec(algo="ina", nbytes=nbytes, timeout_s=30, job_id=job_id,
                                placement=tree), None)]
    elif kind == "ina_thc":
        runs = [(CollectiveSpec(algo="ina", nbytes=nbytes, timeout_s=30, job_id=job_id,
                                compressor="thc", placement=tree), None)]
    else:  # two tenants: INA on one leaf's hosts, a ring on the other's
        runs = [(CollectiveSpec(algo="ina", nbytes=nbytes, timeout_s=30, job_id=job_id,
                                placement=tree, hosts=[0, 1]), None),
                (CollectiveSpec(algo="ring", nbytes=nbytes, timeout_s=30, hosts=[2, 3]), None)]
    faults: list[Fault] = []
    if with_faults and rng.random() < 1 / 3:
        at = round(rng.uniform(0.05, 0.3), 3)
        if rng.random() < 0.5:
            a, b = rng.choice(UPLINKS)
            faults = [Fault(link=[a, b], at_s=at, down_s=round(rng.uniform(0.1, 0.5), 3))]
        else:
            faults = [Fault(switch=rng.choice(KILLED), at_s=at)]
    return kind, runs, faults


def _run(net, runs: list) -> list[dict]:
    """Run one job's collectives (at once when there are two); their rows."""
    import threading

    rows: list = [None] * len(runs)

    def one(k: int) -> None:
        try:
            rows[k] = run_collective(net, runs[k][0])
        except BaseException as e:  # noqa: BLE001 - classified by the caller
            rows[k] = e

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


class _Window:
    """What the collectives of one minute did: one ``kind = "window"`` row each (a row per
    collective would grow the very process whose memory the soak watches)."""

    def __init__(self, t_s: float):
        self.t_s = t_s
        self.counts: dict[str, int] = {}
        self.times: list[float] = []
        self.faults = 0

    def add(self, row: dict) -> None:
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        if row.get("time_s") is not None:
            self.times.append(row["time_s"])

    def row(self, t_end: float) -> dict:
        times = sorted(self.times)
        return {"kind": "window", "t_s": round(self.t_s, 1), "until_s": round(t_end, 1),
                "collectives": sum(self.counts.values()), "ok": self.counts.get("ok", 0),
                "wrong": self.counts.get("wrong", 0), "errors": self.counts.get("error", 0),
                "hung": self.counts.get("hung", 0), "faults": self.faults,
                "median_time_s": round(times[len(times) // 2], 4) if times else None}


def _job_row(n_job: int, kind: str, spec, out, t_s: float, events: list) -> dict:
    """One collective's row: its status, time and the faults its job saw."""
    row = {"kind": "job", "job": n_job, "mix": kind, "algo": spec.algo,
           "compressor": spec.compressor, "bytes": spec.nbytes, "t_s": round(t_s, 2),
           "fault": "; ".join(f"{e['kind']} {e['target']}" for e in events) or None}
    if isinstance(out, BaseException):
        status = "hung" if isinstance(out, CollectiveTimeout) else "error"
        row.update(status=status, correct=False, error=f"{type(out).__name__}: {out}"[:300])
    else:
        ok = all(r["correct"] for r in out)
        row.update(status="ok" if ok else "wrong", correct=ok,
                   time_s=round(sum(r["time_s"] for r in out), 4),
                   engine_restarts=len(out[0].get("engine_restarts") or []))
    return row


def measure(emit, quick: bool, minutes: float = 60.0, seed: int = 0, faults: bool = True,
            sample_s: float = 10.0, time_dilation: float = 1.0) -> Outcome:
    """``testbed bench soak`` (:mod:`testbed.bench.protocol`). Rows: one per minute
    (``window``), one per collective that was not ok (``job``), one per process."""
    if minutes <= 0 or sample_s <= 0:
        raise ValueError("--minutes and --sample-s must be > 0")
    rng = random.Random(seed)
    rows: list[dict] = []
    total: dict[str, int] = {}
    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100, switch="programmable")
    with TestbedNet(topo, time_dilation=time_dilation, datapath=SOAK_DATAPATH) as net:
        watch = _Watch(net)
        t0 = time.monotonic()
        end = t0 + minutes * 60
        next_sample = t0
        window = _Window(0.0)
        n_job = 0
        seen: set[str] = set()  # mixes and fault kinds run so far
        warm_s = None  # when the last of them first ran: imports and first calls are done
        while time.monotonic() < end:
            now = time.monotonic() - t0
            if now + t0 >= next_sample:
                watch.sample(now)
                next_sample += sample_s
            if now - window.t_s >= 60:
                rows.append(window.row(now))
                emit(rows[-1])
                window = _Window(now)
            kind, runs, fs = _draw(rng, n_job, faults)
            t = time.monotonic()
            with FaultSchedule(net, fs) as sched:
                outcomes = _run(net, runs)
            window.faults += bool(sched.events)
            seen |= {kind} | {e["kind"] for e in sched.events}
            if warm_s is None and seen >= set(MIX) | ({"link_down", "engine_kill"} if faults
                                                       else set()):
                warm_s = time.monotonic() - t0
            for (spec, _), out in zip(runs, outcomes, strict=True):
                if isinstance(out, BaseException) and not isinstance(out, CollectiveError):
                    raise out  # not the collective's: a bug or Ctrl-C
                row = _job_row(n_job, kind, spec, out, t - t0, sched.events)
                window.add(row)
                total[row["status"]] = total.get(row["status"], 0) + 1
                if row["status"] != "ok":
                    rows.append(row)
                    emit(row)
            n_job += 1
        rows.append(window.row(time.monotonic() - t0))
        emit(rows[-1])
        watch.sample(time.monotonic() - t0)
    left = leftovers()
    n_left = sum(len(v) for v in left.values())
    # warm-up: a fifth of the soak, and at least until every mix and fault kind ran once
    warm = max(minutes * 60 * 0.2, warm_s if warm_s is not None else minutes * 60)
    proc_rows, young = watch.rows(warm, min(MIN_SPAN_S, (minutes * 60 - warm) / 2))
    for r in proc_rows:
        rows.append(r)
        emit(r)
    wrong, hung, errors = (total.get(k, 0) for k in ("wrong", "hung", "error"))
    n_coll = sum(total.values())
    worst_rss = max((r["rss_growth"] for r in proc_rows), default=None)
    worst_fd = max((r["fd_growth"] for r in proc_rows), default=None)
    targets = {
        "0 wrong": (wrong == 0, f"{wrong} of {n_coll} collectives wrong"),
        "0 hung, 0 failed": (hung == 0 and errors == 0,
                             f"{hung} timed out; {errors} failed otherwise"),
        "RSS growth <= 5 %": (worst_rss is not None and worst_rss <= 0.05,
                              f"worst {worst_rss} after warm-up over {len(proc_rows)} "
                              f"processes ({young} lived too short to judge)"
                              if proc_rows else "no process lived long enough past the "
                              "warm-up to judge: run longer (--minutes)"),
        "fd growth <= 5 %": (worst_fd is not None and worst_fd <= 0.05, f"worst {worst_fd}"),
        "counters consistent": (not watch.backwards,
                                "; ".join(watch.backwards) or "no engine counter went back"),
        "0 leftovers": (n_left == 0, f"{n_left}: {left}" if n_left else "none"),
    }
    if quick:  # a minute is all warm-up (imports, first jobs): growth means nothing yet
        del targets["RSS growth <= 5 %"], targets["fd growth <= 5 %"]
    notes = {"quick": quick, "minutes": minutes, "seed": seed, "faults": faults,
             "jobs": n_job, "collectives": n_coll, "errors": errors,
             "warm_up_s": round(warm, 1),
             **({"not judged": "RSS and descriptor growth: the quick soak is all warm-up; "
                 "run --minutes 10 or more"} if quick else {}),
             "faults_fired": sum(r["faults"] for r in rows if r["kind"] == "window"),
             "cpu": "see the rows' times: a 2-core machine runs engines, workers and the "
                    "control plane on the same cores"}
    return Outcome(rows, notes=notes, targets=targets,
                   ok=all(met for met, _ in targets.values()))
