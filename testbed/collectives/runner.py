"""``run_collective(net, spec)``: run a collective on an emulated network, return report rows.

``net`` is a ``testbed.topologies.TestbedNet`` (or anything with the same handles: ``hosts``
in rank order, ``topo`` (the topology the model reads), ``bottleneck_bps(hosts)``,
``hop_latency_s()``, optionally ``aggregator``, ``describe()``, ``time_dilation``). The run
happens in a pool process (``python -m testbed.collectives.worker``) whose children enter the
hosts' network namespaces; see worker.py. On a cluster network the ranks whose hosts sit on
another server run in a pool started on that server over the network's ssh connection
(:func:`remote_pools`), which the local pool coordinates.

On a network dilated by a factor f (``net.time_dilation``, see :mod:`testbed.topologies.net`)
the pool's timeouts (``spec.timeout_s``, INA's retransmission timer) are multiplied by f and
every row reports undilated time: ``time_s`` is the measured time divided by f, so ``algbw``,
``busbw`` and ``fidelity`` speak of the network the topology describes, and the row says
``time_dilation = f``. A network built with ``time_dilation="auto"`` is calibrated with the
first collective run on it (:func:`testbed.collectives.dilation.calibrate`).

Why one module this long: it is the one place where a spec meets a network (placement,
NIC and switch configuration, INA registration with its fallbacks, the pool's launch, wait
and stop, the report row); each part is short, and every exit path releases what the earlier
parts configured, which reads best in one file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from testbed.cleanup import job_dir
from testbed.collectives import cpumon, flowmodel, ports
from testbed.collectives.algorithms import is_offloaded
from testbed.collectives.dilation import calibrate
from testbed.collectives.report import make_row
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.datapath import forks
from testbed.kernels.wire import TESTBED_UDP_PORT

RUN_DIR = os.environ.get("TESTBED_RUN_DIR", "/run/testbed")
_seq = itertools.count()
#: how often the runner checks the pool and the data-path engines (s)
POLL_S = 0.2


def _hosts(net) -> list:
    hosts = list(getattr(net, "hosts", []))
    if not hosts:
        raise ValueError("net has no hosts: pass a started TestbedNet")
    return hosts


def require_local_namespaces(net) -> None:
    """Refuse a net whose hosts live on another machine's kernel, for a training job: its
    pool is one process here that enters each host's namespace through /proc (collectives
    run one pool per server, :func:`remote_pools`; docs/cluster.md)."""
    foreign = getattr(net, "hosts_on_other_kernels", list)()
    if foreign:
        raise ValueError(f"hosts {foreign} run on another server's kernel: a training job's "
                         "pool enters host namespaces on this machine only (collectives run "
                         "one pool per server, training jobs do not yet: docs/cluster.md); "
                         "place the job's hosts on this machine or on a server sharing its "
                         "kernel")


def remote_pools(net, ranks: list[dict]) -> list[dict]:
    """One pool per other server holding ranks of the job: ``{"server", "ranks", "argv"}``,
    ``argv`` the local command that starts ``python -m testbed.collectives.remotepool``
    there over the network's ssh connection to it (the same checkout and venv path on every
    server, docs/cluster.md). Ranks whose hosts are on this machine (every rank, on a net
    without servers) run in the local pool, which coordinates the others."""
    where = getattr(net, "placement", None) or {}
    conns = getattr(net, "connections", None) or {}
    by_server: dict[str, list[int]] = {}
    for r, info in enumerate(ranks):
        srv = where.get(info["host"])
        if srv in conns:
            by_server.setdefault(srv, []).append(r)
    out = []
    for srv, rs in by_server.items():
        cmd = [sys.executable, "-m", "testbed.collectives.remotepool"] + [
            f"testbed-node={ranks[r]['host']}" for r in rs]
        out.append({"server": srv, "ranks": rs, "argv": conns[srv].argv(shlex.join(cmd))})
    return out


def _refuse_remote_fallbacks(job: dict) -> None:
    """Host fallback aggregators (shared-mode INA) run in the local pool only."""
    elsewhere = {job["ranks"][r]["host"]: p["server"] for p in job.get("remote", [])
                 for r in p["ranks"]}
    bad = [f"{fb['host']} (on {elsewhere[fb['host']]})" for fb in job.get("fallbacks") or []
           if fb["host"] in elsewhere]
    if bad:
        raise ValueError(f"placement mode 'shared' needs host fallback aggregators on {bad}, "
                         "but they run on this machine's pool only: use mode 'static' on a "
                         "cluster network, or place those hosts on this machine")


def placement(net, spec: CollectiveSpec) -> tuple[list, list, bool]:
    """(worker hosts, server hosts, servers co-located with workers?) for ``spec``: the hosts
    of ``spec.hosts`` (default every host of the net) in order, workers first."""
    hosts = _hosts(net)
    if spec.hosts is not None:
        hosts = [hosts[r] for r in spec.hosts]
    n = spec.workers or len(hosts)
    workers = hosts[:n]
    if spec.algo != "rs":
        return workers, [], False
    m = spec.servers
    if n + m <= len(hosts):
        return workers, hosts[n:n + m], False
    if m > n:
        raise ValueError(f"CollectiveSpec.servers={m}: co-located servers need servers <= "
                         f"workers ({n}); add hosts to the topology or lower servers")
    # spread co-located servers evenly over the workers
    return workers, [workers[(j * n) // m] for j in range(m)], True


def net_bandwidth(net, hosts: list, algo: str, aggregator: str | None = None) -> float:
    """The model's B (bit/s) among ``hosts``: the net's bottleneck for one flow per host in a
    ring (host algorithms; the reduction server's extra link load is in the model) or every
    host to the aggregator (``aggregator``: a tree's root; default the net's) and back (INA)."""
    fn = getattr(net, "bottleneck_bps", None)
    if fn is None:
        raise ValueError("net has no bottleneck_bps(hosts): cannot compute the model")
    uniq = list({h.name: h for h in hosts}.values())
    pattern = "ina" if is_offloaded(algo) else "ring"
    try:
        bw = fn(uniq, pattern=pattern, aggregator=aggregator) if aggregator else \
            fn(uniq, pattern=pattern)
    except TypeError:  # a net without patterns
        bw = fn(uniq)
    if bw is None:
        raise ValueError("the links between the workers are not shaped (bw_mbps=None): the "
                         "alpha-beta model needs a bandwidth")
    return float(bw)


def net_alpha(net) -> float:
    """One-way latency of a message between two hosts (s): two hops (host-switch-host, as
    on the star) of the net's measured per-link latency (RTT/2 per hop)."""
    fn = getattr(net, "hop_latency_s", None)
    return 2.0 * float(fn()) if fn is not None else 0.0


def _topology_name(net) -> str:
    d = getattr(net, "describe", None)
    if d is None:
        return type(net).__name__
    v = d()
    if isinstance(v, dict):
        return str(v.get("topology") or v.get("name") or v.get("kind") or "")
    return str(v).split("\n")[0][:80]


#: Bytes a worker holds per byte of the message, at least: its input and its result
#: (measured on a star of 3 at 32-128 MiB: ring 2.0, INA 3.0, plus ~100 MB per pool).
MIN_MEMORY_PER_BYTE = 2


def check_memory(net, message_bytes: list[int], what: str) -> None:
    """Refuse messages the ranks of ``net`` cannot hold on this machine: ``message_bytes``,
    the largest message of each rank, each held as input and result (a typo such as '8GiB'
    would otherwise end in the OOM killer, which may take the user's notebook with it).
    ``what`` names them in the ``ValueError``. A network spread over servers is not checked:
    its ranks are on other machines."""
    from testbed.topologies.scale import mem_available_kb

    if getattr(net, "servers", None) is not None:
        return

    need, avail = sum(message_bytes) * MIN_MEMORY_PER_BYTE, mem_available_kb() * 1024
    if avail and need > avail:
        raise ValueError(f"{what}: {len(message_bytes)} ranks each holding their message and "
                         f"its result need at least {need / 2**30:.1f} GiB, and this machine "
                         f"has {avail / 2**30:.1f} GiB available: use smaller messages (or "
                         "fewer ranks)")


def run_collective(net, spec: CollectiveSpec, extra_pids: list[int] | None = None,
                   registration: dict | None = None) -> list[dict]:
    """Run ``spec`` on ``net``; one row (keys ``REPORT_COLUMNS``) per repetition.

    ``registration``: for ina/nic, the job's switch registration made by the provider
    (``SwitchConfigurator.registrations[job]``, served as ``GET /v1/jobs/{job}``): the
    collective runs on it instead of registering (and afterwards removing) its own; see
    :func:`adopt_registration`.

    A data-path engine that dies during the collective (``placement["engine_death"]``,
    default ``"restart"``; TCP algorithms always restart): is started again
    (``net.restart_engine``, at most :data:`MAX_ENGINE_RESTARTS` times). A TCP collective
    goes on (its connections retransmit what the dead switch lost); an INA one, whose
    registration and rounds died with the switch, is registered again and run again from its
    start, exact. Rows say so: ``engine_restarts`` (node, exit status, seconds to restart),
    ``fallback_s`` (from the death to the rerun's start) and ``rerun``. With
    ``"engine_death": "fail"``, or a provider's registration (the provider registers again),
    it fails fast naming the node (:class:`EngineDied`). A job that fails otherwise while an
    engine of the network is dead, or was restarted by a tenant beside it since the job began,
    is run again the same way, whatever its algorithm: an engine killed while the job was being
    set up fails the model's, the tree's or the registration's request to it.

    Raises ``ValueError`` for a bad spec, :class:`CollectiveTimeout` when a rank stayed silent
    longer than ``spec.timeout_s``, :class:`CollectiveError` when a rank failed or died.
    ``extra_pids``: more processes (e.g. data-path engines) whose CPU marks ``cpu_bound``.
    """
    starts = dict(getattr(net, "engine_starts", {}))  # a tenant beside may restart one first
    try:
        return _run_collective(net, spec, extra_pids, registration)
    except (EngineDied, TreeBroken):
        raise  # the policy said fail (the rerun paths handled the rest)
    except Exception:  # noqa: BLE001 - re-raised unless an engine died under the job
        died = _died_in_set_up(net, spec, registration, starts)
        if died is None:
            raise
        return _rerun(net, spec, extra_pids, died)


def _died_in_set_up(net, spec: CollectiveSpec, registration, starts: dict[str, int]
                    ) -> EngineDied | None:
    """After the job failed: :class:`EngineDied` naming the engines that died (the kernel may
    take a moment to reap one killed as a request went out) where ``spec`` may restart them
    and run again, else None. A fault injected at a run's start (``testbed run``'s ``faults``
    at 0 s) killed a switch between the runner's check for dead engines and the first thing
    that asked it something: the model's query of every switch's stages on a fat-tree (the
    engine's ``ControlError``), the hop latency's ping on a star (``RuntimeError``). ``starts``:
    ``net.engine_starts`` when the job began; an engine that another job (a concurrent
    tenant) restarted since counts as died too."""
    if registration is not None or not hasattr(net, "restart_engine") or \
            (spec.placement or {}).get("engine_death", "restart") != "restart":
        return None
    deadline = time.monotonic() + 1.0
    while (died := _engines_died(net, spec, starts)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return died


def _run_collective(net, spec: CollectiveSpec, extra_pids: list[int] | None,
                    registration: dict | None) -> list[dict]:
    """:func:`run_collective`'s run, once."""
    if not isinstance(spec, CollectiveSpec):
        raise ValueError(f"spec must be a CollectiveSpec, got {type(spec).__name__}")
    hosts = _hosts(net)
    spec.validate(len(hosts))
    if getattr(net, "time_dilation_requested", None) == "auto" and net.calibration is None:
        calibrate(net, [spec], run_collective)
    dilation = float(getattr(net, "time_dilation", 1.0))
    workers, servers, colocated = placement(net, spec)
    # a switch that died between collectives (nobody's job was running on it) is started
    # again before this one registers or sends a packet through it
    before = getattr(net, "dead_engines", dict)()
    if before and hasattr(net, "restart_engine") and registration is None and \
            (spec.placement or {}).get("engine_death", "restart") == "restart":
        _restart(net, before)
    n, m = len(workers), len(servers)
    check_memory(net, [spec.nbytes] * (n + m), f"CollectiveSpec.nbytes={spec.nbytes}")
    ranks = [{"host": h.name, "pid": int(h.pid), "ip": h.IP()} for h in workers + servers]
    root = None
    if is_offloaded(spec.algo) and registration is None and hasattr(net, "ina_plan"):
        # the tree, planned before anything starts: a placement this fabric cannot host is
        # refused here, naming why (and its root is the alpha-beta model's aggregator)
        try:
            root = net.ina_plan(workers, ports.ina_worker_port(spec.job_id),
                                (spec.placement or {}).get("tree")).root
        except ValueError as e:
            raise ValueError(f"CollectiveSpec.placement: {e}") from None
    bw = net_bandwidth(net, workers + servers, spec.algo, root)
    # the flow-level model on the net's own topology: the real ECMP path of every flow,
    # max-min sharing, the measured hop latency (the closed form is its star special case)
    model_s = flowmodel.predict(net.routed_topo, spec, workers=[h.name for h in workers],
                                servers=[h.name for h in servers],
                                hop_latency_s=net.hop_latency_s(),
                                time_dilation=dilation,
                                impairments=getattr(net, "link_impairments", list)()).time_s
    # the pool runs in dilated time: its timeouts stretch with the network
    job = {"spec": {**spec.to_json(), "timeout_s": spec.timeout_s * dilation}, "n": n, "m": m,
           "ranks": ranks, "bw_bps": bw, "time_dilation": dilation,
           "extra_pids": list(extra_pids or []) + _engine_pids(net),
           "remote": remote_pools(net, ranks)}
    agg_client = None
    if registration is not None:
        adopt_registration(spec, job, workers, registration)
    elif is_offloaded(spec.algo):
        try:
            agg_client = register_ina_job(net, spec, job, workers)
        except AdmissionRefused as e:
            if (spec.placement or {}).get("refused", "fail") != "ring":
                raise
            # the tenant's fallback: the same collective on the hosts
            ring = dataclasses.replace(spec, algo="ring", placement={}, compressor=None,
                                       compressor_params={})
            rows = run_collective(net, ring, extra_pids)
            for r in rows:
                r.update(placement_mode="refused", refused_by=e.switch)
            return rows
    ina_cols = None
    if is_offloaded(spec.algo):
        try:
            _refuse_remote_fallbacks(job)
            _configure_nics(net, spec, offload=True)
        except BaseException:
            with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
                _release(net, spec, agg_client)
            raise
    jobdir = job_dir(RUN_DIR, "coll", next(_seq))
    path = os.path.join(jobdir, "job.json")
    log_path = os.path.join(jobdir, "pool.log")
    cmd = [sys.executable, "-m", "testbed.collectives.worker", "--job", path] + [
        f"testbed-node={r['host']}" for r in ranks]
    limit = 60 + (spec.timeout_s * dilation + 10) * (spec.repetitions + 2)
    # TCP collectives ride out a switch restart; an INA one is rerun (see the docstring)
    restarts: list | None = [] if not is_offloaded(spec.algo) and \
        hasattr(net, "restart_engine") else None
    proc = None
    starts = dict(getattr(net, "engine_starts", {}))  # whose restart takes this job's state
    try:
        os.makedirs(jobdir, exist_ok=True)
        t0 = time.monotonic()
        job["t_popen"] = t0  # CLOCK_MONOTONIC is system-wide: the pool measures set-up from here
        server = _pool_server(net)
        if server is not None:
            job["pool_server"] = server.pid
        with open(path, "w") as f:
            json.dump(job, f)
        with open(log_path, "wb") as log:
            proc = _start_pool(server, cmd, log)
        pinned = tree_interfaces(agg_client.plan) if agg_client is not None else None
        _wait_pool(proc, net, spec, limit, restarts, pinned, starts)
        # the pool may have ended first (its workers saw it)
        died = _engines_died(net, spec, starts if restarts is None else None,
                             {i.rsplit("-eth", 1)[0] for i in pinned} if pinned else None)
        if died is not None and restarts is not None and len(restarts) < MAX_ENGINE_RESTARTS:
            restarts += _restart(net, died.nodes)  # TCP: its result stands, the switch is back
        elif died is not None:
            raise died
    except TreeBroken as e:
        _stop_pool(proc, jobdir, net, spec, agg_client)
        if registration is not None or \
                (spec.placement or {}).get("link_failure", "replan") != "replan":
            raise
        e.aborted_s = (time.monotonic() - t0) / dilation
        return _rerun_around(net, spec, extra_pids, e)
    except EngineDied as e:
        _stop_pool(proc, jobdir, net, spec, agg_client)
        if not _rerun_on_engine_death(net, spec, registration):
            raise
        e.aborted_s = (time.monotonic() - t0) / dilation
        return _rerun(net, spec, extra_pids, e)
    except BaseException:  # KeyboardInterrupt included: clean up, then re-raise it unchanged
        _stop_pool(proc, jobdir, net, spec, agg_client)
        raise
    try:
        with open(os.path.join(jobdir, "result.json")) as f:
            result = json.load(f)
    except OSError:
        with open(log_path, "rb") as f:
            out = f.read()
        _release(net, spec, agg_client)
        raise CollectiveError(f"collective pool exited {proc.returncode} without a result:\n"
                              f"{out.decode(errors='replace')[-2000:]}") from None
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    try:
        if agg_client is not None:
            ina_cols = _ina_columns(agg_client, result.get("fallback"))
        _release(net, spec, agg_client)
    except CollectiveError:
        # a switch that died once the collective was done: the result stands; the switch
        # is started again for whatever runs next (what its death took is gone with it).
        # Its control channel closes before its process is reaped: give that a moment
        died = _engines_died(net, spec, starts)
        deadline = time.monotonic() + ENGINE_EXIT_WAIT_S
        while died is None and time.monotonic() < deadline:
            time.sleep(0.05)
            died = _engines_died(net, spec, starts)
        if died is None or not hasattr(net, "restart_engine"):
            raise
        restarts = (restarts or []) + _restart(net, died.nodes)
    if result.get("error"):
        cls = CollectiveTimeout if result.get("timeout") else CollectiveError
        raise cls(f"{spec.op}/{spec.algo} on {n} workers failed: {result['error']}")
    setup_s = result.get("setup_s", time.monotonic() - t0)
    bw_mbps = bw / 1e6
    topo = _topology_name(net)
    rows = []
    for rep, r in enumerate(result["reps"]):
        # cpumon: cores saturated, a rank/engine thread waiting for a CPU, or one never idle
        why = cpumon.cpu_bound_reasons(r["cpu_util"], r["cpu_wait"], r["cpu_demand"])
        if why and r.get("cpu_why"):
            why = r["cpu_why"]  # the pool's own reasons name the threads
        row = make_row(spec, n=n, time_s=r["time_s"] / dilation, model_s=model_s,
                       cpu_bound=bool(why), max_abs_err=r["max_abs_err"],
                       correct=r["correct"], rep=rep, topology=topo, bw_mbps=bw_mbps,
                       cpu_max=round(r["cpu_max"], 3), cpu_engine=round(r["cpu_engine"], 3),
                       cpu_wait=round(r["cpu_wait"], 3), cpu_s=round(r["cpu_s"], 3),
                       engine_cpu_s=round(r["engine_cpu_s"], 3),
                       cpu_util=round(r["cpu_util"], 3), setup_s=setup_s,
                       mem_mb=round(result.get("mem_mb", 0.0), 1),
                       cpu_demand=round(r["cpu_demand"], 3), cpu_why="; ".join(why),
                       time_dilation=dilation, ina=ina_cols)
        # a cluster network: was a tunnel between servers slower than the links it carries?
        row.update(net.tunnel_flags() if hasattr(net, "tunnel_flags") else {})
        if restarts:
            row.update(engine_restarts=list(restarts), rerun=False)
        if spec.transport == "uet":
            row.update(uet_row(result["reps"], rep))
        rows.append(row)
    return rows


def uet_row(reps: list[dict], rep: int) -> dict:
    """Row keys of the UET transport's counters in repetition ``rep`` (the ranks report their
    totals so far): packets, retransmissions after a NACK and after a timeout, timeouts."""
    now = reps[rep].get("uet_total") or {}
    before = (reps[rep - 1].get("uet_total") or {}) if rep else {}
    d = {k: v - before.get(k, 0) for k, v in now.items()}
    return {"uet_packets": d.get("packets_sent", 0),
            "uet_trimmed": d.get("trimmed_received", 0),
            "uet_nack_retransmits": d.get("nack_retransmits", 0),
            "uet_timeouts": d.get("timeouts", 0), "uet_lasthop_nacks": d.get("lasthop_nacks", 0)}


#: Seconds a switch whose control channel failed after its collective is given to be seen
#: dead (its process is reaped after its sockets close) before the failure is the run's.
ENGINE_EXIT_WAIT_S = 2.0
#: Seconds a pool's process group SIGKILLed after its grace is given to vanish (be reaped).
KILLED_GONE_S = 2.0
#: Engine restarts one collective may go through before it fails (a switch that keeps dying).
MAX_ENGINE_RESTARTS = 2


def _restart(net, dead: dict[str, int]) -> list[list]:
    """Start the dead engines (node -> exit status) again: ``[node, status, seconds]`` each.
    Jobs sharing the network may see one death at once: the first restarts the engine, the
    others find it running again (0 s each) rather than restart the new one under it."""
    with getattr(net, "engine_lock", contextlib.nullcontext()):
        still = net.dead_engines() if hasattr(net, "dead_engines") else dead
        return [[node, code, round(net.restart_engine(node), 3) if node in still else 0.0]
                for node, code in sorted(dead.items())]


def _rerun_on_engine_death(net, spec: CollectiveSpec, registration) -> bool:
    """Whether an INA collective whose switch died is run again after a restart."""
    return (is_offloaded(spec.algo) and hasattr(net, "restart_engine") and registration is None
            and (spec.placement or {}).get("engine_death", "restart") == "restart")


def _rerun(net, spec: CollectiveSpec, extra_pids, died: EngineDied, depth: int = 0
           ) -> list[dict]:
    """Restart the dead engines and run ``spec`` again (registered afresh), at most
    :data:`MAX_ENGINE_RESTARTS` times; rows carry the restarts and the fallback time."""
    t_dead = time.monotonic()
    restarts = _restart(net, died.nodes)
    fallback_s = time.monotonic() - t_dead
    rows = _again(net, spec, extra_pids, "engine_death", depth,
                  lambda e, d: _rerun(net, spec, extra_pids, e, d))
    for r in rows:
        r["engine_restarts"] = restarts + list(r.get("engine_restarts") or [])
    return _rerun_rows(rows, fallback_s, died)


def _rerun_around(net, spec: CollectiveSpec, extra_pids, broken: TreeBroken,
                  depth: int = 0) -> list[dict]:
    """Run an INA collective whose tree lost a link again from its start, on a tree planned
    over the links left (at most :data:`MAX_ENGINE_RESTARTS` times); rows carry ``rerun``
    and ``fallback_s`` (from the link's failure to the rerun's start)."""
    fallback_s = time.monotonic() - broken.since
    rows = _again(net, spec, extra_pids, "link_failure", depth,
                  lambda e, d: _rerun_around(net, spec, extra_pids, e, d))
    return _rerun_rows(rows, fallback_s, broken)


def _again(net, spec: CollectiveSpec, extra_pids, knob: str, depth: int, on_again
           ) -> list[dict]:
    """Run ``spec`` again; the last time allowed with ``placement[knob] = "fail"``. The same
    failure once more (an engine that died, a tree that broke) goes to
    ``on_again(error, depth + 1)``."""
    last = depth + 1 >= MAX_ENGINE_RESTARTS
    failure = EngineDied if knob == "engine_death" else TreeBroken
    try:
        return run_collective(net, dataclasses.replace(
            spec, placement={**spec.placement, knob: "fail"}) if last else spec, extra_pids)
    except failure as again:
        if last:
            raise
        return on_again(again, depth + 1)


def _rerun_rows(rows: list[dict], fallback_s: float, why: CollectiveError) -> list[dict]:
    """Mark the rows of a rerun: ``rerun``, the time it fell back and ``aborted_s``, the
    undilated seconds of the attempts given up (each added up over reruns; ``time_s`` is the
    last attempt's alone)."""
    for r in rows:
        r["fallback_s"] = round(fallback_s + float(r.get("fallback_s") or 0.0), 3)
        r["aborted_s"] = round(getattr(why, "aborted_s", 0.0)
                               + float(r.get("aborted_s") or 0.0), 4)
        r["rerun"] = True
    return rows


def _ina_columns(handle: InaJob, fallback: dict | None) -> dict:
    """The INA columns of a job's rows (over the whole run): its tree, how much of it the
    network aggregated, what the host fallback did (``fallback``: its counters), the switch
    memory it held."""
    per_switch = handle.switch_counters()
    host_rounds = int((fallback or {}).get("completed", 0))
    spec = handle.spec
    # a round is aggregated once at every tree switch (or that switch's host fallback)
    rounds = _ina().rounds(spec, len(handle.plan.workers)) * spec.repetitions * len(handle.tree)
    return {"tree": handle.tree, "host_fallback_chunks": host_rounds,
            "placement_mode": (spec.placement or {}).get("mode", "static"),
            "in_network_fraction": round(1.0 - host_rounds / rounds, 4) if rounds else None,
            "switch_mem_bytes": int(sum(c.get("memory_bytes", 0)
                                        for c in per_switch.values()))}


class AdmissionRefused(CollectiveError):
    """A switch of the job's tree refused it at admission (memory, slots or jobs full);
    ``switch`` names it."""

    switch: str = ""


class InaJob:
    """An INA job registered on the switches of its aggregation tree (the control plane's
    handle): the plan, the switches' control clients, the host fallback aggregators (shared
    mode; empty otherwise)."""

    def __init__(self, spec: CollectiveSpec, plan, clients: dict, fallbacks: list[dict]):
        self.spec, self.plan, self.clients, self.fallbacks = spec, plan, clients, fallbacks

    @property
    def tree(self) -> list[str]:
        """Aggregating switches, root first."""
        return self.plan.tree

    def switch_counters(self) -> dict[str, dict]:
        """Per tree switch, its aggregate stage's counters for this job (memory, slots)."""
        out = {}
        for sw, c in self.clients.items():
            try:
                agg = c.counters()["stages"]["aggregate"]
            except RuntimeError as e:  # the control channel's error: the switch is gone
                raise CollectiveError(f"{self.spec.op}/{self.spec.algo}: reading job "
                                      f"{self.spec.job_id}'s counters on {sw} failed: {e}"
                                      ) from None
            out[sw] = dict(agg["jobs"].get(str(self.spec.job_id), {}),
                           fallback_forwarded=agg["fallback_forwarded"],
                           contributions=agg["contributions"], completed=agg["completed"])
        return out

    def release(self) -> None:
        """Remove the job from every switch (all are tried; the first failure is raised)."""
        errors = []
        for sw, c in self.clients.items():
            try:
                c.configure("aggregate", remove_jobs=[self.spec.job_id])
            except RuntimeError as e:  # the control channel's error names the node
                errors.append(f"{sw}: {e}")
        if errors:
            raise CollectiveError(f"{self.spec.op}/{self.spec.algo}: removing job "
                                  f"{self.spec.job_id} failed: {'; '.join(errors)}")


def _shared_fallbacks(net, plan, job_id: int, regs: dict, workers: list,
                      rounds: dict) -> list[dict]:
    """Put every switch of the job's tree in shared mode (``regs``: their registrations,
    changed here) with host fallback aggregators of its own: one per worker host below it,
    slot ``s`` overflowing to the ``(s % n)``-th, so the overflow is spread like a sharded
    reduction server rather than onto one host's link. A host serves every tree switch on its
    path to the root, each on the UDP port of its depth (``ports.fallback_port``). Below the
    root a fallback's partial sums go to its switch, which relays them up; a fallback whose
    switch has switches as members sends its RESULTs through its switch too
    (``docs/protocol.md``, F3). Returns the fallbacks the workers' pool starts
    (``HostAggregator``'s settings, with ``rounds``: slots, seq0, lanes)."""
    aggs = net.aggregators()
    below: dict[str, list] = {sw: [] for sw in plan.tree}
    for host, w in zip(workers, plan.workers, strict=True):
        sw = w["switch"]
        while sw is not None:
            below[sw].append(host)
            parent = plan.nodes[sw]["parent"]
            sw = parent["switch"] if parent else None
    switch_members = {n["parent"]["switch"] for n in plan.nodes.values() if n["parent"]}

    def depth(sw: str) -> int:
        parent = plan.nodes[sw]["parent"]
        return 0 if parent is None else 1 + depth(parent["switch"])

    fallbacks = []
    for sw in plan.tree:
        node, port = plan.nodes[sw], ports.fallback_port(job_id, depth(sw))
        members = [{k: m[k] for k in ("worker", "mac", "ip", "port")} for m in node["members"]]
        regs[sw]["mode"] = "shared"
        regs[sw]["fallback"] = []
        for host in dict.fromkeys(below[sw]):
            regs[sw]["fallback"].append({"mac": host.MAC(), "ip": host.IP(), "port": port,
                                         "egress": net.first_hop(sw, host.name,
                                                                 TESTBED_UDP_PORT, port)})
            fb = {"host": host.name, "pid": int(host.pid), "ip": host.IP(), "mac": host.MAC(),
                  "port": port, "switch": sw, "switch_ip": aggs[sw]["ip"],
                  "switch_mac": aggs[sw]["mac"], "members": members, **rounds}
            if node["parent"]:
                fb["parent_index"] = node["parent"]["index"]
            if sw in switch_members:
                fb["results_via_switch"] = True
            fallbacks.append(fb)
    return fallbacks


def register_ina_job(net, spec: CollectiveSpec, job: dict, workers: list) -> InaJob:
    """Control plane of an INA job: plan its aggregation tree (``spec.placement``), give every
    worker its UDP port, its switch and member id, and register the job (members, parent,
    memory, a fresh first round) on every tree switch; in shared mode cap the job's window at
    its fair share of the root's pool (unless the switch's ``pool_fair_share`` is off; the
    returned handle's ``spec`` and the pool's ``job["spec"]`` carry the window the switch holds)
    and plan the host fallback aggregators (one per worker host). Returns the
    :class:`InaJob`."""
    port = ports.ina_worker_port(spec.job_id)
    place = spec.placement or {}
    try:
        plan = net.ina_plan(workers, port, place.get("tree"))
    except ValueError as e:  # a TopologyError names what is wrong with the tree
        raise ValueError(f"CollectiveSpec.placement: {e}") from None
    if place.get("mode") == "shared":
        # the provider's pool policy: a window no larger than the job's fair share of the pool
        # of every tree switch
        slots = spec.slots
        for sw in plan.tree:
            agg = net.switch_client(sw).counters()["stages"]["aggregate"]
            if agg["memory"].get("pool_fair_share", True):
                others = sum(1 for jid, j in agg["jobs"].items()
                             if j["mode"] == "shared" and jid != str(spec.job_id))
                slots = min(slots, _ina().fair_share_slots(
                    spec.slots, agg["memory"]["pool_entries"], others))
        if slots != spec.slots:  # the handle's spec says what the switches hold
            spec = dataclasses.replace(spec, placement={**place, "slots": slots})
            # and so does the job file the ranks read (a collective's, a training job's, a
            # launched job's; a provider's entry has none)
            for key in ("spec", "train", "torch"):
                if isinstance(job.get(key), dict):
                    job[key] = {**job[key], "placement": spec.placement}
    seq0 = random.SystemRandom().getrandbits(32)  # late packets of earlier runs: STALE
    lanes = _ina().ina_lanes(spec, len(workers))
    regs = plan.registrations(spec.slots, seq0, lanes)
    fallbacks: list[dict] = []
    if place.get("mode") == "shared":
        fallbacks = _shared_fallbacks(net, plan, spec.job_id, regs, workers,
                                      {"slots": spec.slots, "seq0": seq0, "lanes": lanes})
    job["seq0"] = seq0
    job["tree"] = plan.tree
    job["fallbacks"] = fallbacks
    for r, w in enumerate(plan.workers):
        job["ranks"][r].update(port=port, member=w["member"], aggregator={
            "ip": w["ip"], "mac": w["mac"], "switch": w["switch"],
            "port": TESTBED_UDP_PORT,
            "fallback_ips": list(dict.fromkeys(f["ip"] for f in fallbacks))})
    clients: dict = {}
    handle = InaJob(spec, plan, clients, fallbacks)
    for sw in plan.tree:
        try:
            c = net.switch_client(sw)
            c.configure("aggregate", jobs={spec.job_id: regs[sw]})
        except (RuntimeError, KeyError) as e:  # the control error names the cause
            with contextlib.suppress(CollectiveError):
                handle.release()
            cls = AdmissionRefused if str(e).startswith("AdmissionError:") else CollectiveError
            err = cls(f"{spec.op}/{spec.algo}: cannot register job {spec.job_id} on {sw}: {e}")
            err.switch = sw
            raise err from None
        clients[sw] = c
    return handle


def unregister_ina_job(handle: InaJob, spec: CollectiveSpec) -> None:
    """Remove the job from its switches (see :meth:`InaJob.release`)."""
    handle.release()


class TreeBroken(CollectiveError):
    """A link an INA job's aggregation tree rides failed during the collective (its switches
    send to and expect from pinned ports); ``since``: when it failed (monotonic)."""

    since: float = 0.0


def tree_interfaces(plan) -> set[str]:
    """The switch ports an aggregation tree pins: every member's ingress and every parent's
    egress and ingress (a plan's ``nodes``, see ``testbed.topologies.aggtree``)."""
    used = set()
    for node in plan.nodes.values():
        used.update(m["ingress"] for m in node["members"])
        if node["parent"] is not None:
            used.update((node["parent"]["egress"], node["parent"]["ingress"]))
    return used


def _tree_broken(net, spec: CollectiveSpec, pinned: set[str] | None) -> TreeBroken | None:
    """:class:`TreeBroken` when a port the job's tree pins is down now, else None."""
    down = getattr(net, "down_interfaces", None)
    hit = sorted(pinned & set(down)) if pinned and down else []
    if not hit:
        return None
    err = TreeBroken(f"{spec.op}/{spec.algo} job {spec.job_id}: its aggregation tree rides "
                     f"{', '.join(hit)}, whose link failed during the collective")
    err.since = min(down[i] for i in hit)
    return err


class EngineDied(CollectiveError):
    """A data-path engine of the network died during a collective; ``nodes``: node -> exit
    status."""

    nodes: dict[str, int] = {}


def _engines_died(net, spec: CollectiveSpec, starts: dict[str, int] | None = None,
                  nodes: set[str] | None = None) -> EngineDied | None:
    """:class:`EngineDied` naming the network's dead engines, or None when all run. With
    ``starts`` (``net.engine_starts`` when the job registered), also the engines of
    ``nodes`` (default all) another job restarted since: they run, but without this job's
    registration (exit status None)."""
    dead = net.dead_engines() if hasattr(net, "dead_engines") else {}
    if starts is not None:
        now = getattr(net, "engine_starts", {})
        dead.update({node: None for node, k in now.items() if k != starts.get(node, 0)
                     and (nodes is None or node in nodes) and node not in dead})
    if not dead:
        return None
    what = ", ".join(f"{node} (exit status {code})" if code is not None else
                     f"{node} (restarted by another job)" for node, code in sorted(dead.items()))
    err = EngineDied(f"{spec.op}/{spec.algo}: the data-path engine of {what} died during "
                     f"the collective; its log is in {RUN_DIR}/<node>.log")
    err.nodes = dict(dead)
    return err


def _pool_server(net) -> forks.PoolServer | None:
    """The network's pool server (started on its first collective, kept until it stops), or
    None: a network that keeps no helper processes, or ``TESTBED_POOL_START=exec``."""
    keep = getattr(net, "keep", None)
    if keep is None or forks.start_mode(forks.POOL_START_ENV) != "fork":
        return None
    return keep("pools", lambda: forks.PoolServer(
        os.path.join(RUN_DIR, f"pools.{os.getpid()}.{id(net):x}.log")))


def _start_pool(server: forks.PoolServer | None, cmd: list[str], log
                ) -> subprocess.Popen | forks.ForkedProcess:
    """The pool process running ``cmd`` (``python -m testbed.collectives.worker ...``):
    forked from ``server`` (Numba and the INA kernels already loaded: an INA pool's set-up
    0.65 -> 0.1 s), else, or when that server has died, started afresh."""
    if server is not None:
        with contextlib.suppress(RuntimeError, OSError):
            return server.fork(cmd[3:], log)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_pool(proc: subprocess.Popen | forks.ForkedProcess, net, spec: CollectiveSpec,
               limit: float, restarts: list | None = None, pinned: set[str] | None = None,
               starts: dict[str, int] | None = None) -> None:
    """Wait for the pool. When a data-path engine of the network dies: with ``restarts`` (a
    list, TCP algorithms: their connections outlive a switch that restarts), start it again
    and go on waiting (``(node, exit status, seconds)`` appended to ``restarts``); else fail
    fast with :class:`EngineDied` (the collective could only time out), also when another
    job restarted an engine of ``pinned``'s switches since ``starts``. When a port of
    ``pinned`` (an INA job's tree) goes down: :class:`TreeBroken`."""
    tree = {i.rsplit("-eth", 1)[0] for i in pinned} if pinned else None
    deadline = time.monotonic() + limit
    dead_fn = getattr(net, "dead_engines", None)
    while True:
        try:
            proc.wait(timeout=POLL_S)
            _wait_group_gone(proc.pid)
            return
        except subprocess.TimeoutExpired:
            pass
        broken = _tree_broken(net, spec, pinned)
        if broken is not None:
            raise broken
        dead = dead_fn() if dead_fn is not None else {}
        if dead and restarts is not None and len(restarts) < MAX_ENGINE_RESTARTS:
            restarts += _restart(net, dead)
            continue
        if dead:
            died = _engines_died(net, spec)
            if died is not None:  # (None: another job restarted it since dead_fn looked)
                raise died
            continue
        if restarts is None and starts is not None:
            moved = _engines_died(net, spec, starts, tree)
            if moved is not None:
                raise moved
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"collective pool did not finish within {limit:.0f} s")


def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
    """Wait until no process of the pool's group is left (its children die with it, a moment
    later); SIGKILL stragglers after ``timeout``, and give them :data:`KILLED_GONE_S` to be
    reaped, so what the caller tears down next is not still in use."""
    if _group_gone(pgid, timeout):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    _group_gone(pgid, KILLED_GONE_S)


def kill_pool(proc: subprocess.Popen | forks.ForkedProcess) -> None:
    """SIGKILL a pool's process group, reap its leader and give the rest
    :data:`KILLED_GONE_S` to be reaped (never raises: the group may be gone already)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        proc.wait()
    _group_gone(proc.pid, KILLED_GONE_S)


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether process group ``pgid`` is empty within ``timeout`` (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _release(net, spec: CollectiveSpec, agg_client) -> None:
    """Give back what the job held: its switch partition, and its SmartNIC offload."""
    if agg_client is not None:
        unregister_ina_job(agg_client, spec)
    if spec.algo == "nic":
        _configure_nics(net, spec, offload=False)


def _stop_pool(proc: subprocess.Popen | forks.ForkedProcess | None, jobdir: str, net,
               spec: CollectiveSpec, agg_client) -> None:
    """Teardown on a failure or Ctrl-C: kill the pool's process group, reap it, drop the job
    folder, the switch partition and the NICs' offload. Runs while an exception propagates,
    so nothing here may raise and mask it: the group may already be gone (the pool exited, or
    the terminal's Ctrl-C reached it first: ``ProcessLookupError``), and a data-path engine's
    control channel may be down; ``proc`` is None when the pool was not started yet."""
    if proc is not None:
        kill_pool(proc)
    shutil.rmtree(jobdir, ignore_errors=True)
    with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
        _release(net, spec, agg_client)


def _ina():
    """The INA client module, imported on first use: it loads the compressor kernels, which
    start Numba's thread pool, and the pool process (``worker.py``, which imports this module)
    must choose a fork-safe threading layer before that happens."""
    from testbed.collectives import ina

    return ina


def _configure_nics(net, spec: CollectiveSpec, offload: bool) -> None:
    """SmartNIC offload of one INA job. ``algo="nic"``: every SmartNIC quantises (fixed32, the
    factor the error bound assumes) for this job only while ``offload``, for no job after;
    ``algo="ina"``: the NICs must leave the job's packets alone (the workers quantise)."""
    ina = _ina()
    clients = getattr(net, "datapath_clients", dict)()
    nics = {k: c for k, c in clients.items() if k.startswith("tbn")}
    if not nics:
        if spec.algo == "nic":
            raise ValueError("algo 'nic' needs SmartNICs running the nic_codec program: build "
                             "the topology with smartnic=True, programs={'smartnic': "
                             "['nic_codec']}")
        return
    for name, c in nics.items():
        if spec.algo == "nic":
            settings = {"codec": "fixed32", "factor": ina.NIC_FACTOR,
                        "jobs": [spec.job_id] if offload else []}
        else:
            settings = {"jobs": []}
        try:
            c.configure("nic_codec", **settings)
        except RuntimeError as e:  # the control error names the cause
            if spec.algo == "nic" or "no stage" not in str(e):
                raise ValueError(f"algo {spec.algo!r}: SmartNIC {name} has no usable nic_codec "
                                 f"stage ({e}); use programs={{'smartnic': ['nic_codec']}}"
                                 ) from None


def _engine_pids(net) -> list[int]:
    """PIDs of the data-path engines serving ``net``'s programmable nodes."""
    mn = getattr(net, "mininet", None)
    pids = []
    for node in list(getattr(mn, "switches", [])) + list(getattr(mn, "hosts", [])):
        eng = getattr(node, "engine", None)
        if eng is not None and getattr(eng, "pid", None) and eng.poll() is None:
            pids.append(int(eng.pid))
    return list(dict.fromkeys(pids))  # an engine group's nodes share one


def adopt_registration(spec: CollectiveSpec, job: dict, workers: list,
                       registration: dict) -> None:
    """Fill ``job`` (the pool's job dict) from an INA registration the provider made
    (``SwitchConfigurator.registrations[job]``: job id, tree, first round, per rank its UDP
    port, member id and aggregator, the host fallbacks, the slots and lanes it registered),
    instead of registering the job here. The provider keeps owning it: nothing here removes
    it. Raises ``ValueError`` when the registration does not fit ``spec`` or ``workers``."""
    if not is_offloaded(spec.algo):
        raise ValueError(f"registration: only an ina/nic collective runs on a switch "
                         f"registration; algo {spec.algo!r} needs none (pass registration=None)")
    if registration.get("job_id") != spec.job_id:
        raise ValueError(f"registration: the provider registered job id "
                         f"{registration.get('job_id')}, the spec has job_id={spec.job_id}; set "
                         "CollectiveSpec.job_id to the registration's job_id")
    hosts = [r["host"] for r in registration.get("ranks", [])]
    if hosts != [w.name for w in workers]:
        raise ValueError(f"registration: the provider registered hosts {hosts} (in rank order), "
                         f"the collective runs on {[w.name for w in workers]}; run it on the "
                         "registered hosts")
    slots, lanes = registration.get("slots"), registration.get("lanes")
    if slots is not None and spec.slots > slots:
        raise ValueError(f"registration: {slots} slots per switch were registered, the spec "
                         f"uses {spec.slots}; set placement.slots (or window) to at most {slots}")
    if lanes is not None and _ina().ina_lanes(spec, len(workers)) != lanes:
        raise ValueError(f"registration: the switches hold {lanes} lanes per slot, the spec's "
                         f"packets carry {_ina().ina_lanes(spec, len(workers))}; use the plan's "
                         "compressor and parameters")
    job["seq0"] = registration["seq0"]
    job["tree"] = list(registration["tree"])
    job["fallbacks"] = list(registration.get("fallbacks", []))
    for r, reg in enumerate(registration["ranks"]):
        job["ranks"][r].update(port=reg["port"], member=reg["member"],
                               aggregator=dict(reg["aggregator"]))


#: Seconds the host fallbacks of a job outside the pool get to start (kernels load, sockets).
FALLBACKS_START_S = 60


@contextlib.contextmanager
def host_fallbacks(job: dict, spec: CollectiveSpec,
                   server: Callable[[], subprocess.Popen] | None = None):
    """Serve ``job["fallbacks"]`` (a shared-mode INA registration's host fallback
    aggregators) while the ``with`` block runs, for ranks that run outside the collectives'
    pool (which serves them itself): one process (``python -m testbed.collectives.fallback``)
    forks them into their hosts' namespaces (``server``: gives that process, e.g. a
    :class:`SpareFallbackServer`'s ``take``; default: start one); on exit their summed
    counters go to ``job["fallback"]``. Nothing to do without fallbacks."""
    if not job.get("fallbacks"):
        yield
        return
    _refuse_remote_fallbacks(job)
    proc = server() if server is not None else _start_fallback_server()
    try:
        proc.stdin.write(json.dumps({"job_id": spec.job_id, "timeout_s": spec.timeout_s,
                                     "fallbacks": job["fallbacks"]}) + "\n")
        proc.stdin.flush()
        ready = _line_within(proc, FALLBACKS_START_S)
        if ready.get("type") != "ready":
            raise CollectiveError(f"{spec.op}/{spec.algo}: job {spec.job_id}'s host fallback "
                                  f"aggregators did not start: {ready.get('error', ready)}")
        yield
    finally:
        try:  # closing its standard input stops them; it then reaps them and reports
            out, _ = proc.communicate(timeout=30)
            last = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            if last and last[-1].get("type") == "counters":
                job["fallback"] = last[-1]["counters"]
        except (subprocess.TimeoutExpired, OSError, ValueError):
            proc.kill()  # its fallbacks die with it (PR_SET_PDEATHSIG)
            proc.wait()


def _start_fallback_server() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "testbed.collectives.fallback"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


class SpareFallbackServer:
    """A fallback server (``python -m testbed.collectives.fallback``) kept started ahead of
    need: Python started and the aggregation kernel loaded, about a second on a loaded 2-core
    machine, which a running job moved to shared-pool INA would otherwise wait for before it
    can switch. :meth:`take` hands the ready one over (for :func:`offload_job`'s
    ``fallback_server``) and starts the next. A context manager: its end stops the spare; the
    spare is a child of this process and dies with it."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SpareFallbackServer:
        self.proc = _start_fallback_server()
        return self

    def take(self) -> subprocess.Popen:
        proc = self.proc
        if proc is None:  # outside its block: nothing is kept ahead
            return _start_fallback_server()
        self.proc = _start_fallback_server()
        if proc.poll() is not None:  # it died: start one now
            return _start_fallback_server()
        return proc

    def __exit__(self, *exc) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # an unused spare exits on the end of its input
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:  # still loading its kernel: it holds nothing yet
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            proc.stdout.close()


def _line_within(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The next JSON line ``proc`` writes within ``timeout_s`` ({} if it exits or stays
    silent, then it is killed)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if sel.select(timeout_s):
            line = proc.stdout.readline()
            with contextlib.suppress(ValueError):
                return json.loads(line)
    proc.kill()
    return {}


@contextlib.contextmanager
def offload_job(net, spec: CollectiveSpec, job: dict, workers: list,
                registration: dict | None = None,
                fallback_server: Callable[[], subprocess.Popen] | None = None):
    """The control plane around a job whose ranks run outside :func:`run_collective` (a
    training job's pool): for ``algo`` ina/nic, register the job's members with the
    aggregating switch (filling ``job["aggregator"]`` and the ranks' ports and MACs) and set
    the SmartNICs' offload, and give both back on exit, failures included. Yields the
    switch's control client (None for host algorithms). ``registration``: a registration the
    provider made (:func:`adopt_registration`): used as it is and left on the switches.
    ``fallback_server``: what :func:`host_fallbacks` starts its process with."""
    client = None
    if registration is not None:
        adopt_registration(spec, job, workers, registration)
    elif is_offloaded(spec.algo):
        client = register_ina_job(net, spec, job, workers)
    if is_offloaded(spec.algo):
        try:
            _configure_nics(net, spec, offload=True)
        except BaseException:
            with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
                _release(net, spec, client)
            raise
    try:
        with host_fallbacks(job, spec, fallback_server):
            yield client
    except BaseException:
        with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
            _release(net, spec, client)
        raise
    _release(net, spec, client)
