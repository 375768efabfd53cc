"""The process tree that runs one collective: ``python -m testbed.collectives.worker --job J``.

Design (measured): one *pool* process starts in the root namespace, imports numpy once,
generates every rank's input into shared memory, then ``fork``s one child per rank (workers,
then reduction servers). Each child ``setns``-es into its host's network namespace
(``/proc/<host shell pid>/ns/net``), names itself ``tbw-<host>`` (servers ``tbr-<host>``, a
shared-mode job's host fallback aggregator ``tbf-<host>``) and dies with the pool
(``PR_SET_PDEATHSIG``). A fork costs a few ms and shares the parent's pages, where a fresh
interpreter per host costs 0.34 s / 31 MB (numpy) to 1.3 s / 164 MB (numba + kernels) each,
measured here. Measured set-up (pool start + fork + TCP connections) and memory (PSS of pool +
children) for a ring of n workers: n=2 0.28 s / 35 MB, n=8 0.39 s / 55 MB, n=32 0.61 s / 131 MB;
INA (numba kernels loaded once) n=32 2.3 s / 271 MB.

Control: one socketpair per child carrying JSON lines. Children report their listening port,
get everyone's address, connect, report ready; for each repetition the pool takes the time,
releases all children at once (``go``), and collects ``done`` (with the child's finish time).
Time of a repetition = last rank's finish - release. Outputs land directly in shared memory,
where the pool checks them against the numpy sum of the inputs. The pool writes
``result.json`` into the job folder; a failed or silent rank fails the run with a message
naming it, and every child is killed and reaped before the pool exits.

On a cluster network the ranks whose hosts sit on another server run in a pool started
there over ssh (:mod:`testbed.collectives.remotepool`): it forks them, enters their namespaces
through its own /proc, relays the control lines over the ssh session (tagged by rank), checks
its ranks' outputs itself and reports per-rank durations from ``go``; this pool coordinates
(docs/cluster.md).

Why one module this long: the pool's whole process life cycle (fork, namespaces, control lines,
fallback aggregators, CPU sampling, teardown) is here so that every exit path can be read
together; the per-algorithm code lives in ``ring.py``, ``hd.py``, ``ina.py`` and ``server.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import signal
import socket
import sys
import time
import traceback

import numpy as np

from testbed.collectives import compress, server
from testbed.collectives.algorithms import is_offloaded, peer_algorithm
from testbed.collectives.cpumon import CpuMonitor
from testbed.collectives.model import rs_chunk_bytes, rs_window_pieces, tcp_window_clamp
from testbed.collectives.rankgroup import ControlLine, RankGroup, fork_with_line
from testbed.collectives.report import check, input_count, output_count, rank_input
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveTimeout, Comm
from testbed.collectives.uet import UetComm
from testbed.lifeline import follow_owner

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
#: what a host fallback aggregator reports (summed over a job's fallbacks)
FALLBACK_COUNTERS = ("completed", "contributions", "duplicates", "not_member", "stale",
                     "results_sent", "results_sent_host", "foreign")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14

def enter_netns(pid: int) -> None:
    """Move the calling (single-threaded) process into the network namespace of ``pid``."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the netns of pid {pid}: {os.strerror(err)}")
    finally:
        os.close(fd)


def set_process_name(name: str) -> None:
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def peers_of(spec: CollectiveSpec, rank: int, n: int, m: int) -> list[int]:
    """Ranks that ``rank`` exchanges data with (servers are ranks n..n+m-1)."""
    if spec.algo == "rs":
        return list(range(n, n + m)) if rank < n else list(range(n))
    alg = peer_algorithm(spec.algo)
    return [] if alg is None else alg.peers(rank, n, spec.op)


#: Threading layers whose thread pool survives ``fork`` (Numba's "forksafe" picks tbb when
#: installed, else workqueue on Linux).
FORK_SAFE_LAYERS = ("forksafe", "safe", "tbb", "workqueue")


def fork_safe_numba() -> bool:
    """Make Numba's parallel kernels usable in the forked ranks; return whether they are.

    Why: Numba's default layer here is GNU OpenMP ("omp"), which is not fork-safe. A child
    forked from a process whose libgomp pool was started (``testbed.kernels.compressors``
    starts it at import) ``raise(SIGTERM)``s itself at its first parallel region ("Terminating:
    fork() called from a process already using GNU OpenMP"). The compressors switch to their
    prange variants from ``PAR_MIN`` = 2**20 elements, so every rank of a compressed
    allreduce of >= 4 MiB float32 died with SIGTERM. The pool therefore selects a fork-safe
    layer before Numba starts; this works only while Numba has not started its threads in
    this process (the ``python -m testbed.collectives.worker`` pool that ``run_collective``
    starts: always). Returns False when an unsafe layer already runs here (an in-process
    :func:`run_pool` after other Numba work, e.g. in a test session). Imports numba.
    """
    import numba
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:  # imported but no thread pool yet: still choosable
        if numba.config.THREADING_LAYER not in FORK_SAFE_LAYERS:
            numba.config.THREADING_LAYER = "forksafe"
        return True
    if parallel._threading_layer != "omp":
        return True
    from numba.np.ufunc import omppool

    return omppool.openmp_vendor != "GNU"  # Intel / LLVM OpenMP are fork-safe


def _child_threads(n_procs: int) -> None:
    """Give each forked rank its share of the cores for Numba's parallel kernels: the ranks
    run their compression at the same moment, so more threads would only oversubscribe the
    (shared) CPUs and slow every rank down."""
    if "numba" not in sys.modules:
        return
    import numba
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:  # no parallel kernels loaded: do not start threads
        return
    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS,
                                     (os.cpu_count() or 1) // max(n_procs, 1))))


def _shared(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)


def connect_rank(job: dict, spec: CollectiveSpec, rank: int, ctl: ControlLine, x, out,
                 contribution=None):
    """Set up rank ``rank`` of ``job`` for ``spec``, in the network namespace it is already in:
    report its listening port to the pool, get every rank's address, connect to its peers.
    Returns ``(run, close)``: ``run(step)`` runs one collective from ``x`` into ``out``
    (``step``: the repetition, or a training iteration: compressors draw their shared random
    streams from it), ``close()`` releases the sockets. ``contribution``: with a compressor on
    the ring, receives this rank's decompressed contribution to each sum (for checks).

    The collective pool calls it once per child and then ``run`` per repetition; a training
    job's children (``testbed.workloads.pool``) call it once and then ``run`` per iteration.
    """
    n, m = job["n"], job["m"]
    info = job["ranks"][rank]
    names = [r["host"] for r in job["ranks"]]
    chunk = max(1, spec.chunk_bytes // spec.itemsize)
    if spec.algo == "rs":
        chunk_b = rs_chunk_bytes(spec.nbytes, m, spec.chunk_bytes)
        chunk = chunk_b // spec.itemsize
        window = rs_window_pieces(chunk_b, job.get("bw_bps"), m)
    if is_offloaded(spec.algo):
        from testbed.collectives import ina

        client = ina.InaClient(job, spec, rank)
        ctl.send({"type": "port", "port": 0})
        ctl.recv()
        return (lambda step: client.allreduce(x, out)), client.close
    if spec.transport == "uet":
        comm = UetComm(rank, names, spec.timeout_s, job_id=spec.job_id,
                       time_dilation=float(job.get("time_dilation", 1.0)))
    else:
        comm = Comm(rank, names, spec.timeout_s, job_id=spec.job_id, tcp_cc=spec.tcp_cc,
                    window_clamp=tcp_window_clamp(spec.algo, job.get("bw_bps")))
    try:
        port = comm.listen(info["ip"])
        ctl.send({"type": "port", "port": port})
        addrs = {int(k): v for k, v in ctl.recv()["addrs"].items()}
        comm.connect(peers_of(spec, rank, n, m), addrs)
    except BaseException:
        comm.close()
        raise
    if rank >= n:
        bufs = server.shard_buffers(spec.count, np.dtype(spec.dtype), n, m, rank - n)

        def run(step):
            server.serve(comm, spec.count, np.dtype(spec.dtype), n, m, rank - n, chunk, bufs)
    elif spec.compressor is not None:
        comp, mem = compress.make(spec)

        def run(step):
            compress.allreduce(comm, x, out, n, comp, mem, step, spec.chunk_bytes,
                               contribution)
    elif spec.algo == "rs":
        def run(step):
            server.worker_allreduce(comm, x, out, n, m, chunk, window)
    else:
        fn = peer_algorithm(spec.algo).rank_function(spec.op)

        def run(step):
            fn(comm, x, out, n, chunk)
    if isinstance(comm, UetComm):
        run.stats = comm.stats  # the transport's counters go back with each 'done'
    return run, comm.close


def enter_rank(job: dict, rank: int) -> None:
    """First steps of a forked rank: die with the pool, name the process ``tbw-<host>``
    (servers ``tbr-<host>``: ``testbed cleanup`` and the tests find them by it), move into
    its host's network namespace and take its share of the cores."""
    n, m = job["n"], job["m"]
    info = job["ranks"][rank]
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != job["_pool_pid"]:
        raise RuntimeError("the pool exited before this rank started")
    set_process_name(("tbw-" if rank < n else "tbr-") + info["host"])
    enter_netns(info["pid"])
    _child_threads(n + m)


def report_error(ctl: ControlLine, e: BaseException) -> None:
    """Tell the pool why this rank failed (it fails the run with the message)."""
    msg = str(e) if str(e) else repr(e)
    if not isinstance(e, OSError | EOFError) and "Collective" not in type(e).__name__:
        msg += "\n" + traceback.format_exc(limit=4)
    try:
        ctl.send({"type": "error", "error": f"{type(e).__name__}: {msg}",
                  "timeout": isinstance(e, CollectiveTimeout)})
    except OSError:
        pass


def prefault(a: np.ndarray | None, write: bool) -> None:
    """Map every page of ``a`` into this process now (for writing when ``write``). A forked
    rank shares its input and output with the pool but has no page-table entries for them
    yet: left alone, it would take one fault per 4 KiB page inside the timed collective
    (8 MiB in and out: 4096 faults, a tenth of an INA worker's CPU at 8 workers). ``None``
    (a reduction server has no input or output) is left alone."""
    if a is None or a.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = a.ctypes.data & ~(page - 1)
    length = a.ctypes.data + a.nbytes - start
    if _libc.madvise(start, length, MADV_POPULATE_WRITE if write else MADV_POPULATE_READ):
        flat = a.reshape(-1)  # an older kernel: touch one element per page
        step = max(1, page // a.itemsize)
        if write:
            flat[::step] = flat[::step]
        else:
            flat[::step].sum()


def _child(job: dict, spec: CollectiveSpec, rank: int, ctl: ControlLine, x, out) -> int:
    close = None
    try:
        enter_rank(job, rank)
        prefault(x, write=False)
        prefault(out, write=True)
        run, close = connect_rank(job, spec, rank, ctl, x, out)
        ctl.send({"type": "ready"})
        while True:
            msg = ctl.recv()
            if msg["type"] != "go":
                return 0
            t0 = time.monotonic()
            run(msg["rep"])
            done = {"type": "done", "t_start": t0, "t_end": time.monotonic()}
            if hasattr(run, "stats"):
                done["transport"] = run.stats()
            ctl.send(done)
    except Exception as e:  # noqa: BLE001 - reported to the pool, which fails the run
        report_error(ctl, e)
        return 1
    finally:
        if close is not None:
            close()


def _fallback_child(job: dict, fb: dict, spec: CollectiveSpec, sock: socket.socket) -> int:
    """One of a job's host fallback aggregators (shared mode, ``fb``): serve until the pool
    says stop, then report the counters."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != job["_pool_pid"]:
        return 1
    set_process_name("tbf-" + fb["host"])
    ctl = ControlLine(sock)
    try:
        enter_netns(fb["pid"])
        from testbed.collectives.fallback import HostAggregator  # numba: shared mode only

        agg = HostAggregator(spec.job_id, fb)
        ctl.send({"type": "ready"})
        counters = agg.serve(sock.fileno())
        agg.close()
        ctl.send({"type": "counters", "counters": {k: counters[k] for k in FALLBACK_COUNTERS}})
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the pool, which fails the run
        with contextlib.suppress(OSError):
            ctl.send({"type": "error", "error": f"fallback aggregator on {fb['host']}: "
                      f"{type(e).__name__}: {e}", "timeout": False})
        return 1


def _start_fallbacks(job: dict, spec: CollectiveSpec) -> list[tuple[int, ControlLine]]:
    """Fork the job's host fallback aggregators and wait until each listens."""
    started: list[tuple[int, ControlLine]] = []
    if job.get("fallbacks"):
        from testbed.collectives.fallback import warm_up  # numba: shared mode only

        warm_up()  # once here: the forked fallbacks inherit the loaded kernel
    try:
        for fb in job.get("fallbacks") or []:
            pid, line = fork_with_line(lambda ctl, fb=fb: _fallback_child(job, fb, spec,
                                                                          ctl.sock))
            line.sock.settimeout(spec.timeout_s + 30)
            started.append((pid, line))
            try:
                msg = line.recv()
            except (OSError, EOFError) as e:
                raise RuntimeError(f"fallback aggregator on {fb['host']}: {e}") from None
            if msg["type"] != "ready":
                raise RuntimeError(msg.get("error", str(msg)))
    except BaseException:
        _stop_fallbacks(started, {})
        raise
    return started


def _stop_fallbacks(fallbacks: list[tuple[int, ControlLine]], result: dict) -> None:
    """Stop the fallback aggregators; their summed counters go to ``result["fallback"]``."""
    total: dict[str, int] = {}
    for _pid, line in fallbacks:  # all told first: they drain and report side by side
        with contextlib.suppress(OSError):
            line.send({"type": "stop"})
    for pid, line in fallbacks:
        with contextlib.suppress(OSError, EOFError, ValueError):
            msg = line.recv()
            if msg.get("type") == "counters":
                for k, v in msg["counters"].items():
                    total[k] = total.get(k, 0) + int(v)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    if fallbacks:
        result["fallback"] = total


def pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` in MB (shared pages split among the sharers, so the
    sum over the pool and its forked children is their real memory cost)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0




def _par_min() -> int:
    from testbed.kernels.parallel import PAR_MIN

    return PAR_MIN


def rank_buffers(spec: CollectiveSpec, n: int) -> tuple[list, list]:
    """(inputs, outputs) of every worker rank, in shared memory: the forked ranks read their
    input and write their output in place, where the pool checks them. Inputs come from the
    spec's seed (:func:`~testbed.collectives.report.rank_input`); for a broadcast only the
    root's matters, and it is every rank's input here (the reference of every output)."""
    count, dt = spec.count, np.dtype(spec.dtype)
    in_counts = [input_count(spec.op, count, n, r) for r in range(n)]
    out_counts = [output_count(spec.op, count, n, r) for r in range(n)]
    shm_in = _shared(sum(in_counts) * dt.itemsize)
    shm_out = _shared(sum(out_counts) * dt.itemsize)
    ins, outs = [], []
    off = 0
    for r in range(n):
        a = np.frombuffer(shm_in, dtype=dt, count=in_counts[r], offset=off * dt.itemsize)
        if spec.op == "broadcast" and r > 0:
            a = np.zeros(0, dtype=dt)  # only the root's input matters
        else:
            a[:] = rank_input(spec, r, in_counts[r])
        ins.append(a)
        off += in_counts[r]
    off = 0
    for r in range(n):
        outs.append(np.frombuffer(shm_out, dtype=dt, count=out_counts[r],
                                  offset=off * dt.itemsize))
        off += out_counts[r]
    if spec.op == "broadcast":
        ins = [ins[0]] * n
    return ins, outs


def numba_fork_safety(spec: CollectiveSpec) -> bool:
    """Whether this process may fork ranks that use Numba's parallel kernels; call it before
    anything loads the kernels (only jobs that use them pay the numba import)."""
    uses_numba = spec.compressor is not None or is_offloaded(spec.algo)
    return fork_safe_numba() if uses_numba else True


def load_kernels(spec: CollectiveSpec, fork_safe: bool, n: int) -> list | None:
    """Load the kernels the ranks use once, before the fork (the children inherit them);
    returns every worker's compressor + memory (replayed for the reference), or None."""
    replicas = None
    # PAR_MIN // 2: some compressors pad to the next power of two (THC) before their kernels
    if not fork_safe and spec.compressor is not None and spec.count >= _par_min() // 2:
        raise ValueError(
            f"compressor={spec.compressor!r} with {spec.count} elements runs Numba's parallel "
            "kernels, but this process already runs GNU OpenMP, which cannot be used after "
            "fork: call run_collective (it starts a fresh pool process) or set "
            "NUMBA_THREADING_LAYER=workqueue before importing numba")
    if spec.compressor is not None:
        # every worker's compressor + memory replayed here for the reference; building them
        # before the fork also loads the kernels once for all children
        replicas = [compress.make(spec) for _ in range(n)]
        compress.warm(spec)
    if is_offloaded(spec.algo):
        from testbed.collectives import ina  # numba: only INA jobs pay for it

        ina.warm_up()  # load the cached kernels once here; forked children inherit them
    return replicas


def fork_ranks(group: RankGroup, job: dict, spec: CollectiveSpec, ranks: list[int],
                ins: list, outs: list) -> None:
    """Fork one child per rank of ``ranks`` (workers first, then reduction servers)."""
    n = job["n"]
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in ranks:
        x = ins[rank] if rank < n else None
        o = outs[rank] if rank < n else None
        group.fork(rank, lambda ctl, rank=rank, x=x, o=o: _child(job, spec, rank, ctl, x, o))


def connect_ranks(group: RankGroup, job: dict, spec) -> None:
    """Every rank reports its listening port, gets every rank's address, connects to its
    peers and reports ready (``spec``: a collective's or a training job's; its timeout)."""
    ports = group.gather("port", spec.timeout_s + 30)
    group.broadcast({"type": "addrs", "addrs": {
        r: [job["ranks"][r]["ip"], ports[r]["port"]] for r in sorted(ports)}})
    group.gather("ready", spec.timeout_s + 30)


def check_outputs(spec: CollectiveSpec, replicas: list | None, ins: list, outs: list,
               rep: int, ranks: list[int] | None = None) -> tuple[float, bool]:
    """(max_abs_err, correct) of repetition ``rep``'s outputs against the numpy reference
    (computed from every rank's input): of the worker ranks ``ranks`` (default all)."""
    n = len(ins)
    if ranks is not None:
        outs = [outs[r] for r in ranks]
    if replicas is not None and spec.algo == "ina":
        # INA + THC: the switch summed quantized rotations; THC's own error bound
        from testbed.collectives.ina import thc_check

        return thc_check(spec, ins, outs, n, step=rep)
    if replicas is not None:
        return compress.check(replicas, ins, outs, rep)
    return check(spec, ins, outs, n, ranks)


def clear_outputs(outs: list, spec: CollectiveSpec) -> None:
    """Poison the outputs before a repetition (NaN, or int32's minimum): a rank that writes
    nothing fails the check."""
    dt = np.dtype(spec.dtype)
    for o in outs:
        o.fill(np.nan if dt.kind == "f" else np.iinfo(dt).min)


def _repetition(group: RankGroup, spec: CollectiveSpec, rep: int, ins: list, outs: list,
                replicas: list | None) -> dict:
    """Release every rank at once, gather their ``done``, check the outputs: one rep row
    (time = last rank's finish - release, and the CPU it took).

    A rank on another server reports ``elapsed``, its time from receiving ``go`` on its own
    clock: its finish here is taken as release + elapsed (which leaves out the one-way trip
    of ``go`` over ssh). Its outputs are checked by its own pool; the verdicts combine."""
    local = [r for r in group.lines if r < len(ins)]
    clear_outputs([outs[r] for r in local], spec)
    sampler = group.monitor
    sampler.start()
    t_go = time.monotonic()
    group.broadcast({"type": "go", "rep": rep})
    done = group.gather("done", spec.timeout_s + 5)
    t_end = max(t_go + d["elapsed"] if "elapsed" in d else d["t_end"] for d in done.values())
    cpu = sampler.stop()
    err, ok = check_outputs(spec, replicas, ins, outs, rep, local if group.remotes else None)
    stats = [d["transport"] for d in done.values() if "transport" in d]
    # the UET counters are cumulative per rank: a repetition's are the difference
    uet = {k: sum(s[k] for s in stats) for k in stats[0]} if stats else None
    for pool in group.remotes:
        e, good = pool.checks.pop(rep)
        err, ok = max(err, e), ok and good
    return {"time_s": t_end - t_go, "max_abs_err": err, "correct": ok,
            "cpu_util": cpu.cpu_util, "cpu_wait": cpu.cpu_wait, "cpu_demand": cpu.cpu_demand,
            "cpu_max": cpu.group_max["ranks"], "cpu_engine": cpu.group_max["engines"],
            "cpu_s": cpu.group_cpu_s["ranks"], "engine_cpu_s": cpu.group_cpu_s["engines"],
            "cpu_why": cpu.why, "uet_total": uet}


def run_pool(job: dict) -> dict:
    """Run the collective described by ``job`` (see runner.py); return the result dict.

    ``job["remote"]``: ranks on other servers, one entry per server (``server``, ``ranks``,
    ``argv``: the ssh command of its pool, :mod:`testbed.collectives.remotepool`); this pool
    forks the other ranks and coordinates them all."""
    spec = CollectiveSpec(**job["spec"])
    fork_safe = numba_fork_safety(spec)  # before anything below loads the kernels
    n, m = job["n"], job["m"]
    t_launch = time.monotonic()
    group = RankGroup({r: job["ranks"][r]["host"] for r in range(n + m)}, spec.timeout_s)
    remote = job.pop("remote", None) or []
    for pool in remote:  # first: their start (ssh, imports) overlaps the work here
        group.start_remote(pool["server"], pool["ranks"], pool["argv"], job)
    elsewhere = {r for pool in remote for r in pool["ranks"]}
    fallbacks: list = []
    try:
        ins, outs = rank_buffers(spec, n)
        replicas = load_kernels(spec, fork_safe, n)
        job["_pool_pid"] = os.getpid()
        fallbacks = _start_fallbacks(job, spec)
        fork_ranks(group, job, spec, [r for r in range(n + m) if r not in elsewhere],
                   ins, outs)
        return _coordinate(group, job, spec, t_launch, ins, outs, replicas, fallbacks)
    finally:
        _stop_fallbacks(fallbacks, {})  # stopped (with their counters) already when it ran
        group.stop()


def _coordinate(group: RankGroup, job: dict, spec: CollectiveSpec, t_launch: float,
                ins: list, outs: list, replicas: list | None, fallbacks: list) -> dict:
    """Connect the ranks, run the repetitions, stop the fallback aggregators: the result."""
    n = job["n"]
    result: dict = {"reps": [], "error": None, "timeout": False,
                    "pids": {job["ranks"][r]["host"] + ("" if r < n else "/server"): p
                             for r, p in group.pids.items()}}
    # CPU saturation per thread and core (cpumon): the ranks and the data-path engines here
    group.monitor = CpuMonitor({"ranks": group.live_pids() + [pid for pid, _ in fallbacks],
                                "engines": list(job.get("extra_pids", []))})
    try:
        connect_ranks(group, job, spec)
        # from the runner's Popen (interpreter start + imports) when known
        result["setup_s"] = time.monotonic() - job.get("t_popen", t_launch)
        # a pool forked from the network's pool server shares its pages: that server counts
        # (not when the runner had to start this pool afresh beside it)
        server = [os.getppid()] if job.get("pool_server") == os.getppid() else []
        result["mem_mb"] = sum(pss_mb(p) for p in [*server, os.getpid(), *group.live_pids()]) \
            + sum(pool.mem_mb for pool in group.remotes)
        for rep in range(spec.repetitions):
            result["reps"].append(_repetition(group, spec, rep, ins, outs, replicas))
    except RuntimeError as e:
        result["error"] = str(e)
        result["timeout"] |= bool(getattr(e, "timeout", False))
    finally:
        if group.remotes:
            result["pools"] = {p.server: {"pid": p.pid, "ranks": p.ranks} for p in group.remotes}
            for pool in group.remotes:
                result["pids"].update({job["ranks"][r]["host"] + ("" if r < n else "/server"):
                                       pid for r, pid in pool.pids.items()})
        _stop_fallbacks(fallbacks, result)
        fallbacks.clear()
    return result


def job_file_main(argv: list[str] | None, prog: str, run, failed: dict) -> int:
    """Entry point of a pool process: read ``--job FILE``, ``run(job)``, write the result
    dict as ``result.json`` next to the file (atomically). A crash of ``run`` becomes
    ``failed`` with its ``error`` set, so the runner always finds a result."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--job", required=True, help="job.json written by the runner")
    ap.add_argument("marker", nargs="*", help="testbed-node=<host> tags for cleanup")
    args = ap.parse_args(argv)
    follow_owner()  # the ranks go with the pool: they hold PR_SET_PDEATHSIG
    with open(args.job) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as e:  # noqa: BLE001 - reported to the runner through result.json
        result = {**failed, "error": f"pool: {type(e).__name__}: {e}\n"
                  + traceback.format_exc(limit=6), "timeout": False}
    tmp = os.path.join(os.path.dirname(args.job), "result.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(os.path.dirname(args.job), "result.json"))
    return 0 if result.get("error") is None else 2


def preload_pool() -> str:
    """What every pool forked from a network's pool server shares
    (:class:`testbed.datapath.forks.PoolServer`): Numba, its threading layer chosen fork-safe
    before anything loads a kernel, and the INA client's kernels. Returns what, for its log."""
    fork_safe_numba()
    from testbed.collectives import ina

    ina.warm_up()
    return "Numba and the INA client's kernels"


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the job file and write ``result.json`` next to it; with
    ``--fork-server FD``, serve forked pools on socket FD instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--fork-server"] and len(argv) == 2:
        # the module by its name, as every other module imports it (not this __main__ copy)
        from testbed.collectives import worker
        from testbed.datapath.forks import serve

        return serve(int(argv[1]), worker.preload_pool, lambda args, _fds: worker.main(args))
    return job_file_main(argv, "python -m testbed.collectives.worker", run_pool, {"reps": []})


if __name__ == "__main__":
    sys.exit(main())
