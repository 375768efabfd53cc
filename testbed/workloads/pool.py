"""The process tree of one training job: ``python -m testbed.workloads.pool --job J``.

The same design as the collective pool (``testbed.collectives.worker``), whose pieces it
uses: one pool process loads the data set and the kernels once, then ``fork``s one child per
worker; each child dies with the pool, names itself ``tbw-<host>``, enters its host's network
namespace (:func:`~testbed.collectives.worker.enter_rank`) and sets up its side of the
gradient allreduce once (:func:`~testbed.collectives.worker.connect_rank`: TCP connections for
ring/hd, the INA client and its UDP socket for ina/nic). Then the child runs the whole
training loop (:func:`testbed.workloads.loop.train_worker`) and calls that allreduce in-process
between iterations: no process or connection is created per iteration, as in a framework
whose communicator lives as long as the job.

Control (JSON lines over one socketpair per child, as the collective pool): ``port`` ->
``addrs`` -> ``ready``; the pool releases every worker at once (``go``) and collects ``done``
with each worker's log; ``exit`` lets them close their sockets only once every worker is done
(a peer may still be receiving the last sum).

Checks. Gradients and sums live in shared memory; at :func:`check_iterations` each child
copies its gradient, the sum it received (and, for a compressed ring, its decompressed
contribution) into shared check slots, and the pool checks them against numpy afterwards,
with the collectives' own bounds (``report.check``; ``ina.thc_check`` for INA + THC;
``compress.check_contributions`` for compressors on the ring). Every worker's final
parameters must be bit-identical (``replicas_agree``). The pool writes ``result.json``.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import time

import numpy as np

from testbed.collectives import compress, trimmed
from testbed.collectives.algorithms import is_offloaded
from testbed.collectives.cpumon import CpuMonitor, cpu_bound_reasons
from testbed.collectives.rankgroup import ControlLine, RankGroup
from testbed.collectives.report import check
from testbed.collectives.trimmed import TrimmedGather
from testbed.collectives.worker import (
    connect_rank,
    connect_ranks,
    enter_rank,
    fork_safe_numba,
    job_file_main,
    pss_mb,
    report_error,
)
from testbed.workloads.data import load_dataset
from testbed.workloads.loop import build, train_worker
from testbed.workloads.replan import MAX_SWITCHES, Coordinator, Switcher
from testbed.workloads.spec import TrainingSpec


def check_iterations(spec: TrainingSpec) -> list[int]:
    """Iterations whose allreduce the pool checks against numpy: the first one and one in
    the middle (after updates and, with error feedback, a non-zero residual)."""
    return sorted({0, spec.iterations // 2})


def replannable(job: dict, spec: TrainingSpec) -> bool:
    """Whether the job takes plan changes: the runner gave it a plan channel, and its
    collective is an allreduce a plan can replace (not the trimmed exchange)."""
    return job.get("plan_fd") is not None and spec.algo != "trim"


def tx_counter(intf: str | None):
    """A function returning the bytes interface ``intf`` of the caller's network namespace
    has sent (``/proc/net/dev`` shows the namespace of the reading thread); 0 without one."""
    if not intf:
        return lambda: 0
    key = intf + ":"

    def read() -> int:
        with open("/proc/net/dev") as f:
            for line in f:
                line = line.strip()
                if line.startswith(key):
                    return int(line[len(key):].split()[8])
        return 0

    return read


class _Shared:
    """Gradient and sum buffers of every rank, and the check slots, in shared memory."""

    def __init__(self, n: int, p: int, checks: int):
        self.n, self.p = n, p
        self.mem = mmap.mmap(-1, max(4 * p * n * (2 + 3 * checks), 1),
                             flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.flags = mmap.mmap(-1, max(n * checks, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self._off = 0

        def arr():
            a = np.frombuffer(self.mem, np.float32, p, self._off)
            self._off += 4 * p
            return a

        self.grad = [arr() for _ in range(n)]
        self.out = [arr() for _ in range(n)]
        self.chk = [{"x": [arr() for _ in range(n)], "out": [arr() for _ in range(n)],
                     "dec": [arr() for _ in range(n)]} for _ in range(checks)]

    def mark(self, c: int, rank: int) -> None:
        self.flags[c * self.n + rank] = 1

    def complete(self, c: int) -> bool:
        return all(self.flags[c * self.n + r] for r in range(self.n))


def _child(job: dict, spec: TrainingSpec, data, rank: int, ctl: ControlLine,
           sh: _Shared) -> int:
    close = None
    n = job["n"]
    cspec = spec.collective()
    its = check_iterations(spec)
    replan = replannable(job, spec)
    contribution = np.zeros(sh.p, np.float32) if replan or (
        cspec.compressor and cspec.algo == "ring") else None
    switcher = None
    gather = None
    if spec.algo == "trim":  # rank 0 writes the trimmed chunks' error bound into the slot
        contribution = np.zeros(sh.p, np.float32) if rank == 0 else None
    try:
        enter_rank(job, rank)
        grad, out = sh.grad[rank], sh.out[rank]
        if spec.algo == "trim":
            # incast of trimmable packets to rank 0, then the ring's broadcast of the sum
            # the silence before a NACK is wall time: stretched with the network
            gather = TrimmedGather(job["ranks"], rank, spec.bits, spec.job_id, spec.seed,
                                   spec.timeout_s, spec.idle_ms / 1000.0
                                   * float(job.get("time_dilation", 1.0)),
                                   resend_trimmed=spec.transport == "uet")
            broadcast, close = connect_rank(job, cspec, rank, ctl, out, out)

            def run(step: int) -> None:
                gather.reduce(grad, out, step, contribution)
                broadcast(step)
        elif replan:
            switcher = Switcher(rank, ctl, lambda j, c: connect_rank(j, c, rank, ctl, grad, out,
                                                                     contribution),
                                job, cspec, spec.iterations)
            run = switcher

            def close() -> None:
                switcher.close()
        else:
            run, close = connect_rank(job, cspec, rank, ctl, grad, out, contribution)
        probe = tx_counter(job["ranks"][rank].get("intf"))
        ctl.send({"type": "ready"})
        if ctl.recv()["type"] != "go":
            return 0

        def fill(c: int) -> None:
            slot = sh.chk[c]
            slot["x"][rank][:] = grad
            slot["out"][rank][:] = out
            if contribution is not None:
                slot["dec"][rank][:] = contribution
            sh.mark(c, rank)

        def keep(it: int) -> None:
            if it in its:
                fill(its.index(it))
            if switcher is not None and switcher.applied and switcher.applied[-1][0] == it:
                fill(len(its) + switcher.applied[-1][1] - 1)  # the new plan's first sum

        log = train_worker(spec, data, rank, n, grad, out, run, tx_bytes=probe,
                           after_allreduce=keep)
        if gather is not None:
            log.comm_stats = dict(gather.stats)
        ctl.send({"type": "done", "log": log.to_json()})
        while ctl.recv()["type"] != "exit":  # a plan offered too late to apply: ignored
            pass  # exit: every worker has its last sum, sockets may close
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the pool, which fails the job
        report_error(ctl, e)
        return 1
    finally:
        if close is not None:
            close()
        if gather is not None:
            gather.close()


def _checks(spec: TrainingSpec, sh: _Shared, n: int,
            coordinator: Coordinator | None = None) -> list[dict]:
    """Each complete check slot against numpy with the bound of the collective in force at
    its iteration: the check iterations, then the first sum under every applied plan."""
    slots = [(c, it, spec) for c, it in enumerate(check_iterations(spec))]
    if coordinator is not None:
        slots = [(c, it, TrainingSpec(**coordinator.spec_at(it))) for c, it, _ in slots]
        base = len(slots)
        slots += [(base + epoch - 1, at, TrainingSpec(**t))
                  for at, epoch, t in coordinator.epochs[1:]]
    return [r for c, it, s in slots if sh.complete(c)  # else the job stopped before it
            for r in [_check_slot(s, sh.chk[c], n, it, c)]]


def _check_slot(spec: TrainingSpec, slot: dict, n: int, it: int, c: int) -> dict:
    """One check slot (iteration ``it``) against numpy with ``spec``'s collective's bound."""
    cspec = spec.collective()
    if spec.algo == "trim":
        err, ok = _trim_check(slot["x"], slot["out"], slot["dec"][0])
    elif cspec.compressor is not None and cspec.algo == "ina":
        from testbed.collectives.ina import thc_check  # numba: INA jobs only

        err, ok = thc_check(cspec, slot["x"], slot["out"], n, step=it)
    elif cspec.compressor is not None:
        comp, _ = compress.make(cspec)
        err, ok = compress.check_contributions(comp, slot["dec"], slot["x"], slot["out"])
    else:
        err, ok = check(cspec, slot["x"], slot["out"], n)
    return {"iteration": it, "max_abs_err": float(err), "correct": bool(ok), "slot": c,
            "algo": spec.algo, "compressor": spec.compressor}


def _trim_check(inputs: list, outputs: list, trim_bound: np.ndarray) -> tuple[float, bool]:
    """(max |output - sum|, every output within the trimmed chunks' bound plus float32
    rounding: the decode and the n-way sum)."""
    total = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    mag = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    eps = float(np.finfo(np.float32).eps)
    bound = trim_bound.astype(np.float64) * (1 + 4 * eps) + (len(inputs) + 1) * eps * mag
    worst, ok = 0.0, True
    for o in outputs:
        err = np.abs(o.astype(np.float64) - total)
        if not np.all(np.isfinite(err)):
            return float("inf"), False
        worst = max(worst, float(err.max(initial=0.0)))
        ok = ok and bool(np.all(err <= bound + 1e-30))
    return worst, ok


def run_pool(job: dict) -> dict:
    """Run the training job described by ``job`` (see runner.py); return the result dict."""
    spec = TrainingSpec(**job["train"])
    cspec = spec.collective()
    replan = replannable(job, spec)  # a later plan may be INA or compressed
    if cspec.compressor is not None or is_offloaded(cspec.algo) or replan:
        fork_safe_numba()  # before anything loads the kernels
    n = job["n"]
    t_launch = time.monotonic()
    data = load_dataset(spec.dataset, seed=spec.seed, test_fraction=spec.test_fraction,
                        samples=spec.samples, features=spec.features, classes=spec.classes)
    model, _ = build(spec, data)
    sh = _Shared(n, model.n_params,
                 len(check_iterations(spec)) + (MAX_SWITCHES if replan else 0))
    if cspec.compressor is not None and cspec.algo == "ring":
        compress.warm(cspec)
    if is_offloaded(cspec.algo) or replan:
        from testbed.collectives import ina  # numba: only INA jobs (and re-plannable) pay

        ina.warm_up()
    if spec.algo == "trim":
        trimmed.warm()
    job["_pool_pid"] = os.getpid()
    channel = ControlLine(socket.socket(fileno=int(job["plan_fd"]))) if replan else None
    group = RankGroup({r: job["ranks"][r]["host"] for r in range(n)}, spec.timeout_s)
    if channel is not None:
        group.close_in_child.append(channel.sock)
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(n):
        group.fork(rank, lambda ctl, rank=rank: _child(job, spec, data, rank, ctl, sh))
    result: dict = {"error": None, "timeout": False, "logs": [], "checks": [],
                    "pids": {job["ranks"][r]["host"]: p for r, p in group.pids.items()}}
    try:
        connect_ranks(group, job, spec)
        result["setup_s"] = time.monotonic() - job.get("t_popen", t_launch)
        result["mem_mb"] = sum(pss_mb(p) for p in [os.getpid(), *group.live_pids()])
        group.monitor = monitor = CpuMonitor({"ranks": group.live_pids(),
                                              "engines": list(job.get("extra_pids", []))})
        result["t_go"] = time.monotonic()
        group.broadcast({"type": "go"})
        coordinator = Coordinator(job, group.lines, channel) if replan else None
        done = _train(group, coordinator)
        cpu = monitor.stop()
        result["logs"] = [done[r]["log"] for r in range(n)]
        result["cpu"] = {"cpu_util": cpu.cpu_util, "cpu_wait": cpu.cpu_wait,
                         "cpu_max": cpu.group_max["ranks"], "cpu_engine": cpu.group_max["engines"],
                         "cpu_s": cpu.group_cpu_s["ranks"],
                         "engine_cpu_s": cpu.group_cpu_s["engines"],
                         "cpu_bound": bool(cpu_bound_reasons(cpu.cpu_util, cpu.cpu_wait,
                                                             cpu.cpu_demand)),
                         "cpu_why": cpu.why}
        result["checks"] = _checks(spec, sh, n, coordinator)
        if coordinator is not None:
            ran = min(len(log["t0"]) for log in result["logs"])
            result["plan_switches"] = coordinator.summary(ran)
        result["replicas_agree"] = len({log["digest"] for log in result["logs"]}) == 1
    except RuntimeError as e:
        result["error"] = str(e)
        result["timeout"] = bool(getattr(e, "timeout", False))
    finally:
        group.stop()
    return result


def _train(group: RankGroup, coordinator: Coordinator | None) -> dict[int, dict]:
    """Every worker's ``done`` (with its log), as long as they live; meanwhile plan changes
    go through ``coordinator`` (the runner's plan channel, the ranks' ``switch`` and ``port``
    messages; a failing one fails the rank that sent it)."""
    if coordinator is None:
        return group.gather("done", None)
    watch = {}
    if coordinator.channel is not None:
        watch[coordinator.channel.sock] = coordinator.on_channel

    def on_message(rank: int, msg: dict) -> None:
        try:
            coordinator.on_message(rank, msg)
        except (RuntimeError, KeyError, OSError) as e:
            raise RuntimeError(f"plan change: {type(e).__name__}: {e}") from None

    return group.gather("done", None, on_message, watch)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the job file and write ``result.json`` next to it."""
    return job_file_main(argv, "python -m testbed.workloads.pool", run_pool,
                         {"logs": [], "checks": []})


if __name__ == "__main__":
    sys.exit(main())
