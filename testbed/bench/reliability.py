"""``testbed bench reliability``: in-network aggregation under loss, duplication, reordering,
strangers and a dying switch. One JSON object per line (``--json``) or a table.

Impairments act at the aggregating switch, on every port and in both directions (an ingress
``impair_ingress`` stage before ``aggregate`` and an egress ``impair`` stage after ``forward``,
configured at run time through the control channel): contributions and results are lost,
duplicated and held back. Networks: a star of 8 workers (plus one host that is not in the job)
and a fat-tree k=4 whose aggregator is the core switch ``tbc1`` with 12 workers; algorithms
``ina``, ``ina`` + THC and ``nic`` (SmartNIC-offloaded, on the same fabrics with a SmartNIC in
front of every host). Every row is checked against the numpy sum of the inputs.

Rows (keys): ``scenario`` (``matrix``, ``slowdown``, ``non_member_flood``, ``engine_killed``,
``engine_restarted``),
``topology``, ``algo``, ``n``, ``bytes``, ``loss_pct``, ``dup_pct``, ``reorder_pct``,
``status`` (``ok`` | ``wrong`` | ``hang`` | ``error``), ``correct``, ``time_s``,
``clean_time_s``, ``slowdown``, and per scenario: ``drops_not_member``, ``stray_sent``
(flood: every stray is dropped ``NOT_MEMBER`` while the job is registered, ``UNKNOWN_JOB``
before and after; ``all_strays_counted`` checks both against what the stranger sent and the
switch port received), ``seconds_to_error``, ``error``, ``leftovers`` (engine killed: a job
that asked to fail, ``placement["engine_death"] = "fail"``); ``seconds_to_end``,
``engine_restarts``, ``fallback_s``, ``rerun`` (engine restarted: INA and a TCP ring, the
default, which must complete exact).

``--quick``: each impairment alone at its largest value and all three combined, 1 MiB, plus
the star's slowdown rows at 1 % and 5 % loss (8 MiB), the flood and the killed engine; the full
matrix is every combination of ``loss_pct`` {0, 1, 5, 10}, ``dup_pct`` {0, 1, 5},
``reorder_pct`` {0, 2, 10}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import select
import signal
import socket
import threading
import time

import numpy as np

from testbed.bench.protocol import Outcome
from testbed.cleanup import leftovers
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.ports import ina_worker_port
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.collectives.worker import enter_netns
from testbed.kernels.reference.packets import udp_frame
from testbed.kernels.wire import TESTBED_UDP_PORT, MsgType, pack_header
from testbed.topologies import FatTree, Star, TestbedNet

MiB = 1 << 20
FULL = {"loss_pct": (0, 1, 5, 10), "dup_pct": (0, 1, 5), "reorder_pct": (0, 2, 10)}
QUICK = [(0, 0, 0), (10, 0, 0), (0, 5, 0), (0, 0, 10), (10, 5, 10)]
ALGOS = {"ina": {"algo": "ina"}, "ina+thc": {"algo": "ina", "compressor": "thc"},
         "nic": {"algo": "nic"}}
#: packets a reordered packet waits for (the impair stage's reorder_k)
REORDER_K = 3
TIMEOUT_S = 20.0


#: packets the stranger sends per wake-up
BURST = 20


def _topology(kind: str, nic: bool):
    """(topology, aggregator switch, workers) of a fabric with a zero impairment pair on the
    aggregator, ready to be configured per scenario."""
    agg = "tbc1" if kind == "fattree_k4" else "tbs1"
    zero = {"filter": "testbed", "reorder_k": REORDER_K}
    programs = {agg: [("impair_ingress", dict(zero)), ("aggregate", {}), ("forward", {}),
                      ("impair", dict(zero, direction="egress"))]}
    if nic:
        programs["smartnic"] = [("nic_codec", {})]
    opts = {"bw_mbps": 100, "switch": "programmable", "programs": programs, "smartnic": nic}
    if kind.startswith("star"):  # starN: N workers and one host that is not in the job
        n = int(kind[4:])
        return Star(n + 1, **opts), agg, n
    return FatTree(4, aggregator=agg, **opts), agg, 12


def set_impairments(net, agg: str, loss_pct: float, dup_pct: float, reorder_pct: float,
                    seed: int = 0) -> None:
    """Configure both impair stages of the aggregator (probabilities in per cent)."""
    c = net.switch_client(agg)
    for stage in ("impair_ingress", "impair"):
        c.configure(stage, loss=loss_pct / 100, dup=dup_pct / 100, reorder=reorder_pct / 100,
                    seed=seed)


def _cell(net, spec: CollectiveSpec) -> dict:
    """Run one collective; classify the outcome."""
    t0 = time.monotonic()
    try:
        rows = run_collective(net, spec)
    except CollectiveTimeout as e:
        return {"status": "hang", "correct": False, "time_s": None, "error": str(e)[:300]}
    except (CollectiveError, ValueError, RuntimeError) as e:
        return {"status": "error", "correct": False, "time_s": None, "error": str(e)[:300]}
    ok = all(r["correct"] for r in rows)
    return {"status": "ok" if ok else "wrong", "correct": ok,
            "time_s": float(np.median([r["time_s"] for r in rows])),
            "wall_s": round(time.monotonic() - t0, 2), "cpu_bound": any(r["cpu_bound"]
                                                                    for r in rows)}


def _spec(algo: str, nbytes: int, n: int, job_id: int, reps: int = 1) -> CollectiveSpec:
    return CollectiveSpec(nbytes=nbytes, workers=n, window=64, timeout_s=TIMEOUT_S, seed=job_id,
                          job_id=job_id, repetitions=reps, **ALGOS.get(algo, {"algo": algo}))


def matrix(kind: str, algos, scenarios, nbytes: int, emit) -> None:
    """Rows of the impairment matrix on one fabric (one network per SmartNIC need)."""
    jobs = itertools.count(100)
    for nic in (False, True):
        todo = [a for a in algos if (a == "nic") == nic]
        if not todo:
            continue
        topo, agg, n = _topology(kind, nic)
        with TestbedNet(topo) as net:
            clean = {}
            for (loss, dup, reorder), algo in itertools.product(scenarios, todo):
                set_impairments(net, agg, loss, dup, reorder, seed=next(jobs))
                row = {"scenario": "matrix", "topology": kind, "algo": algo, "n": n,
                       "bytes": nbytes, "loss_pct": loss, "dup_pct": dup,
                       "reorder_pct": reorder}
                row.update(_cell(net, _spec(algo, nbytes, n, next(jobs))))
                if (loss, dup, reorder) == (0, 0, 0):
                    clean[algo] = row["time_s"]
                _slowdown(row, clean.get(algo))
                emit(row)


def _slowdown(row: dict, clean) -> None:
    row["clean_time_s"] = clean
    row["slowdown"] = (round(row["time_s"] / clean, 3)
                       if row.get("time_s") and clean else None)


def slowdown_rows(nbytes: int, losses, emit) -> None:
    """Star of 8, INA, ``nbytes``: time under each loss rate against the clean run."""
    topo, agg, n = _topology("star8", False)
    with TestbedNet(topo) as net:
        clean = None
        for k, loss in enumerate((0, *losses)):
            set_impairments(net, agg, loss, 0, 0, seed=k)
            row = {"scenario": "slowdown", "topology": "star8", "algo": "ina", "n": n,
                   "bytes": nbytes, "loss_pct": loss, "dup_pct": 0, "reorder_pct": 0}
            row.update(_cell(net, _spec("ina", nbytes, n, 200 + k, reps=3)))
            if loss == 0:
                clean = row["time_s"]
            _slowdown(row, clean)
            emit(row)


# ------------------------------------------------------------------------ strangers


def _flood(host_pid: int, dst_ip: str, job_id: int, n: int, slots: int, seq0: int, spoof: dict,
           rate_pps: float, seconds: float, stop_fd: int, out_fd: int) -> None:
    """In a forked child: spray DATA packets with the job's id, every worker id and slot and
    rounds around the job's, half from this host's own socket, half as raw frames spoofing a
    member's MAC, IP and port (they arrive on the wrong ingress port). Stops when ``stop_fd``
    becomes readable (only between bursts: a signal could land between a send and its count)
    and writes the count.

    The packets are built before the flood starts and sent in bursts of ``BURST``: the stranger
    stands for another machine, so its own CPU must not be taken from the emulated job (a
    per-packet Python loop at 2000 pps cost this 2-core machine a third of a core)."""
    sent = 0
    try:
        enter_netns(host_pid)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        raw.bind((spoof["iface"], 0))
        rng = np.random.default_rng(job_id)
        packets = []
        for k in range(2 * n * slots):
            w, slot = k % n, (k // n) % slots
            seq = (seq0 + int(rng.integers(-2, 4))) & 0xFFFFFFFF
            ne = int(rng.integers(1, 257))
            data = pack_header(msg_type=int(MsgType.DATA), job_id=job_id, worker_id=w, slot=slot,
                               slot_set=seq & 1, n_workers=n, elem_count=ne, chunk_offset=0,
                               seq=seq) + rng.integers(-1000, 1000, ne).astype("<i4").tobytes()
            packets.append(udp_frame(spoof["mac"], spoof["agg_mac"], spoof["ip"],
                                     spoof["agg_ip"], spoof["port"], TESTBED_UDP_PORT, data)
                           if k % 2 else data)
        dst = (dst_ip, TESTBED_UDP_PORT)
        t_end = time.monotonic() + seconds
        gap = BURST / rate_pps
        nxt = time.monotonic()
        while time.monotonic() < t_end:
            if select.select([stop_fd], [], [], 0)[0]:
                break
            for _ in range(BURST):
                pkt = packets[sent % len(packets)]
                if sent % 2:
                    raw.send(pkt)
                else:
                    udp.sendto(pkt, dst)
                sent += 1
            nxt += gap
            pause = nxt - time.monotonic()
            if pause > 0 and select.select([stop_fd], [], [], pause)[0]:
                break
    finally:
        os.write(out_fd, str(sent).encode())
        os._exit(0)


def non_member_flood(nbytes: int, rate_pps: float, kind: str, emit) -> None:
    """A star + a stranger that floods the running job; clean run as the anchor."""
    topo, agg, n = _topology(kind, False)
    with TestbedNet(topo) as net:
        clean = _cell(net, _spec("ina", nbytes, n, 300, reps=3))
        spec = _spec("ina", nbytes, n, 301, reps=3)
        stranger = net.hosts[n]
        member = net.hosts[0]
        c = net.switch_client(agg)
        before = c.counters()
        spoof = {"iface": stranger.defaultIntf().name, "mac": _mac(member.MAC()),
                 "ip": _ip(member.IP()), "port": ina_worker_port(spec.job_id),
                 "agg_mac": _mac(net.aggregator["mac"]), "agg_ip": _ip(net.aggregator["ip"])}
        r, w = os.pipe()
        stop_r, stop_w = os.pipe()
        # the stranger does not know seq0 (random per registration); it guesses around 0
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(stop_w)
            _flood(int(stranger.pid), net.aggregator["ip"], spec.job_id, n, spec.window, 0,
                   spoof, rate_pps, 3600, stop_r, w)
        os.close(w)
        os.close(stop_r)
        try:
            time.sleep(0.5)  # the flood is under way before the job starts
            row = {"scenario": "non_member_flood", "topology": kind, "algo": "ina", "n": n,
                   "bytes": nbytes, "loss_pct": 0, "dup_pct": 0, "reorder_pct": 0,
                   "stray_pps": rate_pps}
            row.update(_cell(net, spec))
        finally:
            os.write(stop_w, b"x")
            os.close(stop_w)
            os.waitpid(pid, 0)
        stray = int(os.read(r, 64) or b"0")
        os.close(r)
        port = f"{agg}-eth{n + 1}"  # the stranger's switch port
        # the last strays drain through the switch: a loaded machine may take a while
        deadline = time.monotonic() + 5.0
        while True:
            after = c.counters()
            received = after["ports"][port]["rx_packets"] - before["ports"][port]["rx_packets"]
            # while the job is registered a stray is NOT_MEMBER; before and after, UNKNOWN_JOB
            not_member = _drops(after, "NOT_MEMBER") - _drops(before, "NOT_MEMBER")
            unknown = _drops(after, "UNKNOWN_JOB") - _drops(before, "UNKNOWN_JOB")
            if not_member + unknown == received == stray or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        row.update(stray_sent=stray, stray_received=received, drops_not_member=not_member,
                   drops_unknown_job=unknown,
                   all_strays_counted=not_member + unknown == received == stray)
        _slowdown(row, clean["time_s"])
        emit(row)


def _drops(counters: dict, reason: str) -> int:
    return sum(int(p["drops"].get(reason, 0)) for p in counters["ports"].values())


def _mac(s: str) -> bytes:
    return bytes(int(p, 16) for p in s.split(":"))


def _ip(s: str) -> bytes:
    return bytes(int(p) for p in s.split("."))


# ------------------------------------------------------------------------ a dying switch


def engine_killed(nbytes: int, kind: str, emit, algo: str = "ina",
                  on_death: str = "fail") -> None:
    """SIGKILL the aggregator's engine mid-allreduce. ``on_death="fail"`` (an INA job's
    ``placement["engine_death"]``): the collective must fail fast with an error naming the
    node. ``"restart"`` (the default of every job): the engine is started again and the
    collective completes exact (INA rerun from its start, a TCP ring riding it out); the row
    says how long the switch was away. Nothing may be left behind after the network is
    torn down."""
    topo, agg, n = _topology(kind, False)
    spec = _spec(algo, nbytes, n, 400, reps=50 if on_death == "fail" else 20)
    if on_death == "fail":
        spec = dataclasses.replace(spec, placement={"engine_death": "fail"})
    row = {"scenario": "engine_killed" if on_death == "fail" else "engine_restarted",
           "topology": kind, "algo": algo, "n": n,
           "bytes": nbytes, "loss_pct": 0, "dup_pct": 0, "reorder_pct": 0,
           "timeout_s": spec.timeout_s}
    with TestbedNet(topo) as net:
        box: dict = {}

        def run() -> None:
            try:
                box["rows"] = run_collective(net, spec)
            except Exception as e:  # noqa: BLE001 - classified below
                box["error"] = e
            box["t_end"] = time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        _wait_for_process(f"tbw-{net.hosts[0].name}", 60.0)  # the workers are up ...
        time.sleep(0.5)  # ... and the allreduces under way
        engine = net.mininet.get(agg).engine
        t_kill = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        t.join(spec.timeout_s * spec.repetitions + 120)
        err = box.get("error")
        row["seconds_to_error" if on_death == "fail" else "seconds_to_end"] = \
            round(box["t_end"] - t_kill, 3) if "t_end" in box else None
        row["error"] = f"{type(err).__name__}: {err}"[:300] if err else None
        if on_death == "fail":
            named = isinstance(err, CollectiveError) and agg in str(err)
            row["status"] = "error" if named else ("ok" if err is None else "wrong")
            row["correct"] = False
        else:
            rows = box.get("rows") or []
            restarts = (rows[0].get("engine_restarts") or []) if rows else []
            row["correct"] = bool(rows) and all(r["correct"] for r in rows)
            row["status"] = "ok" if row["correct"] and restarts else \
                ("error" if err is not None else "wrong")
            row.update(engine_restarts=restarts, rerun=rows[0].get("rerun") if rows else None,
                       fallback_s=rows[0].get("fallback_s") if rows else None,
                       time_s=round(sum(r["time_s"] for r in rows), 4) if rows else None)
    # what the dead engine's network left running (its log is kept on purpose: the error
    # names it)
    left = leftovers()
    row["leftovers"] = sum(len(v) for k, v in left.items() if k != "files")
    emit(row)


def _wait_for_process(comm: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in os.listdir("/proc"):
            if path.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{path}/comm") as f:
                    if f.read().strip() == comm:
                        return
        time.sleep(0.05)
    raise RuntimeError(f"no process {comm!r} appeared within {timeout} s")


# ------------------------------------------------------------------------ entry point


def run(quick: bool = False, emit=None) -> list[dict]:
    """All scenarios; returns the rows (and calls ``emit(row)`` as each one finishes)."""
    rows: list[dict] = []

    def out(row: dict) -> None:
        rows.append(row)
        if emit is not None:
            emit(row)

    if quick:
        scenarios, nbytes = QUICK, 1 * MiB
    else:
        scenarios = list(itertools.product(*FULL.values()))
        nbytes = 2 * MiB
    for kind in ("star8", "fattree_k4"):
        matrix(kind, list(ALGOS), scenarios, nbytes, out)
    slowdown_rows(8 * MiB, (1, 5), out)
    non_member_flood(8 * MiB, 2000.0, "star8", out)
    engine_killed(4 * MiB, "star8", out)
    for algo in ("ina", "ring"):
        engine_killed(4 * MiB, "star8", out, algo=algo, on_death="restart")
    return rows


def measure(emit, quick: bool) -> Outcome:
    """``testbed bench reliability`` (:mod:`testbed.bench.protocol`); not ok when a matrix,
    slowdown or flood row is wrong or hung, or a killed engine went unnoticed."""
    rows = run(quick, emit)
    bad = [r for r in rows if r["scenario"] in ("matrix", "slowdown", "non_member_flood",
                                                "engine_restarted") and r["status"] != "ok"]
    checked = [r for r in rows if r["scenario"] != "engine_killed"]
    killed = [r for r in rows if r["scenario"] == "engine_killed"]
    missed = [r for r in killed if r["status"] != "error" or r["leftovers"]
              or (r["seconds_to_error"] or 1e9) > r["timeout_s"] + 2]
    tg = {"exact": (not bad, f"{len(checked) - len(bad)} of {len(checked)} rows ok "
                             "(exact, no hang) under impairments and strangers"),
          "killed engine named": (bool(killed) and not missed,
                                  f"{len(killed) - len(missed)} of {len(killed)} killed engines "
                                  "named within the timeout, nothing left behind")}
    return Outcome(rows, targets=tg, ok=not bad and not missed)
