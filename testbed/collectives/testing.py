"""Helpers for tests of code that runs collectives."""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import signal
import threading
import time

import numpy as np

from testbed.collectives.algorithms import algorithm
from testbed.collectives.ina import InaClient
from testbed.collectives.report import REPORT_COLUMNS, rank_input
from testbed.collectives.runner import RUN_DIR, register_ina_job
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import DEFAULT_TCP_CC, CollectiveError, Comm, host_tcp_cc
from testbed.collectives.worker import enter_netns


def loopback_ip() -> str:
    """An address of 127.0.0.0/8 of this process's own (derived from its pid): ranks of a
    test run on the loopback bind deterministic TCP ports (``collectives.ports``), so test
    sessions running at once on one machine must not share an address."""
    pid = os.getpid()
    return f"127.{1 + (pid >> 16) % 254}.{(pid >> 8) & 255}.{1 + (pid & 255) % 254}"


def connected_mesh(job: int, ips: list[str], timeout_s: float = 5.0,
                   tcp_cc: str | None = DEFAULT_TCP_CC,
                   window_clamp: int | None = None) -> list[Comm]:
    """``len(ips)`` ranks of job ``job`` in this process, rank r listening on ``ips[r]``, every
    pair connected (each rank connects from its own thread, as the pool's children do at
    once), with congestion control ``tcp_cc`` and ``window_clamp``. On a failure every Comm is
    closed and the first error raised."""
    n = len(ips)
    comms = [Comm(r, [f"h{i}" for i in range(n)], timeout_s, job_id=job, tcp_cc=tcp_cc,
                  window_clamp=window_clamp) for r in range(n)]
    try:
        addrs = {r: (ips[r], comms[r].listen(ips[r])) for r in range(n)}
    except BaseException:
        for c in comms:
            c.close()
        raise
    errors: list[BaseException] = []

    def go(r):
        try:
            comms[r].connect([p for p in range(n) if p != r], addrs)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    ts = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        for c in comms:
            c.close()
        raise errors[0]
    return comms


def run_ranks(comms: list, fn, join_s: float = 60.0) -> None:
    """``fn(rank, comm)`` for every rank of ``comms`` at once, a thread each (as a pool's
    ranks run), waiting up to ``join_s`` for each; the first error is raised again, and ranks
    still running after that are a ``TimeoutError`` naming them. The caller closes the comms
    (which also ends a hung rank's blocking call)."""
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            fn(r, comms[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,), daemon=True)
               for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    if errors:
        raise errors[0]
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {join_s} s")


def leftovers(owner_pid: int | None = None) -> list[str]:
    """Collective processes (``tbw-*`` workers, ``tbr-*`` servers, ``tbf-*`` host fallback
    aggregators) still alive, and job folders of ``owner_pid`` (default: this process) still
    under ``/run/testbed``."""
    left = []
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(("tbw-", "tbr-", "tbf-")):
            left.append(f"{comm}: {name}")
    pid = os.getpid() if owner_pid is None else owner_pid
    left += glob.glob(os.path.join(RUN_DIR, f"coll-{pid}-*"))
    return left


def check_rows(rows: list[dict], spec, n: int, bw_mbps: float | None = None) -> None:
    """Assert the rows of ``run_collective`` are complete and correct (AssertionError)."""
    assert len(rows) == spec.repetitions, rows
    for r in rows:
        assert tuple(r) == REPORT_COLUMNS, sorted(set(r) ^ set(REPORT_COLUMNS))
        if algorithm(spec.algo).traffic == "tcp":
            assert r["tcp_cc"] == (spec.tcp_cc or host_tcp_cc() or None), r["tcp_cc"]
        assert r["correct"], r
        assert r["n"] == n and r["bytes"] == spec.nbytes, r
        assert r["time_s"] > 0 and r["model_s"] > 0, r
        if bw_mbps is not None:
            assert abs(r["bw_mbps"] - bw_mbps) < 1e-6 * bw_mbps, r


def when_process_appears(comm: str, delay_s: float, action, within_s: float = 30.0):
    """Start a thread that calls ``action(pid)`` ``delay_s`` after the first process named
    ``comm`` (e.g. ``tbw-tbh3``, a collective's rank) appears; a fault in the middle of a
    run. Returns ``(thread, results)``: join the thread, then ``results`` holds what
    ``action`` returned (empty if no such process appeared within ``within_s``)."""
    results: list = []

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for path in glob.glob("/proc/[0-9]*/comm"):
                try:
                    with open(path) as f:
                        if f.read().strip() != comm:
                            continue
                except OSError:
                    continue
                time.sleep(delay_s)  # let the collective get going
                results.append(action(int(path.split("/")[2])))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread, results


def kill_process_later(comm: str, delay_s: float, within_s: float = 30.0):
    """:func:`when_process_appears` that SIGKILLs the process; ``results`` holds its pid."""
    def kill(pid: int) -> int:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return pid

    return when_process_appears(comm, delay_s, kill, within_s)


def run_direct(net, spec: CollectiveSpec, n: int, hosts=None) -> tuple[list, list, float]:
    """Run ``n`` INA clients once, each forked into its host's namespace (``hosts``, default
    the first ``n``), without the collective pool: ``(inputs, outputs, seconds)``; inputs are
    ``report.rank_input``.

    For checks the pool does not make (e.g. THC's bound on one run). Registers the job on the
    aggregator for the run only; children are killed on failure."""
    hosts = list(hosts if hosts is not None else net.hosts)[:n]
    job = {"n": n, "ranks": [{"host": h.name, "pid": int(h.pid), "ip": h.IP()} for h in hosts]}
    handle = register_ina_job(net, spec, job, hosts)
    count = spec.count
    xs = [rank_input(spec, r, count) for r in range(n)]
    shm = mmap.mmap(-1, 4 * count * n)
    outs = [np.frombuffer(shm, np.float32, count, 4 * count * r) for r in range(n)]
    for o in outs:
        o.fill(np.nan)
    pids: list[int] = []
    t0 = time.monotonic()
    try:
        for r in range(n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    enter_netns(int(hosts[r].pid))
                    c = InaClient(job, spec, r)
                    c.allreduce(xs[r], outs[r])
                    c.close()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        pids = []
        if codes != [0] * n:
            raise CollectiveError(f"run_direct: worker exit codes {codes}")
        return xs, [o.copy() for o in outs], time.monotonic() - t0
    finally:
        for p in pids:  # only our own children, on failure
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
        handle.release()
