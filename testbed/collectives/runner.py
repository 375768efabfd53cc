"""``run_collective(net, spec)``: run a collective on an emulated network, return report rows.

``net`` is a ``testbed.topologies.TestbedNet`` (or anything with the same handles: ``hosts``
in rank order, ``topo`` (the topology the model reads), ``bottleneck_bps(hosts)``,
``hop_latency_s()``, optionally ``aggregator``, ``describe()``). The run happens in a pool
process (``python -m testbed.collectives.worker``) whose children enter the hosts' network
namespaces; see worker.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from testbed.collectives import cpumon, flowmodel, ports
from testbed.collectives.report import make_row
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout

RUN_DIR = os.environ.get("TESTBED_RUN_DIR", "/run/testbed")
_seq = itertools.count()
#: how often the runner checks the pool and the data-path engines (s)
POLL_S = 0.2


def _hosts(net) -> list:
    hosts = list(getattr(net, "hosts", []))
    if not hosts:
        raise ValueError("net has no hosts: pass a started TestbedNet")
    return hosts


def placement(net, spec: CollectiveSpec) -> tuple[list, list, bool]:
    """(worker hosts, server hosts, servers co-located with workers?) for ``spec``."""
    hosts = _hosts(net)
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


def net_bandwidth(net, hosts: list, algo: str) -> float:
    """The model's B (bit/s) among ``hosts``: the net's bottleneck for one flow per host in a
    ring (host algorithms; the reduction server's extra link load is in the model) or every
    host to the aggregator and back (INA)."""
    fn = getattr(net, "bottleneck_bps", None)
    if fn is None:
        raise ValueError("net has no bottleneck_bps(hosts): cannot compute the model")
    uniq = list({h.name: h for h in hosts}.values())
    pattern = "ina" if algo in ("ina", "nic") else "ring"
    try:
        bw = fn(uniq, pattern=pattern)
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


def run_collective(net, spec: CollectiveSpec, extra_pids: list[int] | None = None) -> list[dict]:
    """Run ``spec`` on ``net``; one row (keys ``REPORT_COLUMNS``) per repetition.

    Raises ``ValueError`` for a bad spec, :class:`CollectiveTimeout` when a rank stayed silent
    longer than ``spec.timeout_s``, :class:`CollectiveError` when a rank failed or died.
    ``extra_pids``: more processes (e.g. data-path engines) whose CPU marks ``cpu_bound``.
    """
    if not isinstance(spec, CollectiveSpec):
        raise ValueError(f"spec must be a CollectiveSpec, got {type(spec).__name__}")
    hosts = _hosts(net)
    spec.validate(len(hosts))
    workers, servers, colocated = placement(net, spec)
    n, m = len(workers), len(servers)
    ranks = [{"host": h.name, "pid": int(h.pid), "ip": h.IP()} for h in workers + servers]
    bw = net_bandwidth(net, workers + servers, spec.algo)
    # the flow-level model on the net's own topology: the real ECMP path of every flow,
    # max-min sharing, the measured hop latency (the closed form is its star special case)
    model_s = flowmodel.predict(net.topo, spec, workers=[h.name for h in workers],
                                servers=[h.name for h in servers],
                                hop_latency_s=net.hop_latency_s()).time_s
    job = {"spec": spec.to_json(), "n": n, "m": m, "ranks": ranks, "bw_bps": bw,
           "extra_pids": list(extra_pids or []) + _engine_pids(net)}
    agg_client = None
    if spec.algo in ("ina", "nic"):
        agg_client = register_ina_job(net, spec, job, workers)
    if spec.algo in ("ina", "nic"):
        try:
            _configure_nics(net, spec, offload=True)
        except BaseException:
            with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
                _release(net, spec, agg_client)
            raise
    jobdir = os.path.join(RUN_DIR, f"coll-{os.getpid()}-{next(_seq)}")
    os.makedirs(jobdir, exist_ok=True)
    path = os.path.join(jobdir, "job.json")
    t0 = time.monotonic()
    job["t_popen"] = t0  # CLOCK_MONOTONIC is system-wide: the pool measures set-up from here
    with open(path, "w") as f:
        json.dump(job, f)
    cmd = [sys.executable, "-m", "testbed.collectives.worker", "--job", path] + [
        f"testbed-node={r['host']}" for r in ranks]
    log_path = os.path.join(jobdir, "pool.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    limit = 60 + (spec.timeout_s + 10) * (spec.repetitions + 2)
    try:
        _wait_pool(proc, net, spec, limit)
    except BaseException:  # KeyboardInterrupt included: clean up, then re-raise it unchanged
        _stop_pool(proc, jobdir, net, spec, agg_client)
        raise
    try:
        _release(net, spec, agg_client)
        with open(os.path.join(jobdir, "result.json")) as f:
            result = json.load(f)
    except OSError:
        with open(log_path, "rb") as f:
            out = f.read()
        raise CollectiveError(f"collective pool exited {proc.returncode} without a result:\n"
                              f"{out.decode(errors='replace')[-2000:]}") from None
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if result.get("error"):
        cls = CollectiveTimeout if result.get("timeout") else CollectiveError
        raise cls(f"{spec.op}/{spec.algo} on {n} workers failed: {result['error']}")
    setup_s = result.get("setup_s", time.monotonic() - t0)
    bw_mbps = bw / 1e6
    topo = _topology_name(net)
    rows = []
    for rep, r in enumerate(result["reps"]):
        # cpumon: cores saturated, a rank/engine thread waiting for a CPU, or one never idle
        bound = bool(cpumon.cpu_bound_reasons(r["cpu_util"], r["cpu_wait"], r["cpu_demand"]))
        rows.append(make_row(spec, n=n, time_s=r["time_s"], model_s=model_s, cpu_bound=bound,
                             max_abs_err=r["max_abs_err"], correct=r["correct"], rep=rep,
                             topology=topo, bw_mbps=bw_mbps, cpu_max=round(r["cpu_max"], 3),
                             cpu_engine=round(r["cpu_engine"], 3),
                             cpu_wait=round(r["cpu_wait"], 3), cpu_s=round(r["cpu_s"], 3),
                             engine_cpu_s=round(r["engine_cpu_s"], 3),
                             cpu_util=round(r["cpu_util"], 3), setup_s=setup_s,
                             mem_mb=round(result.get("mem_mb", 0.0), 1)))
    return rows


def register_ina_job(net, spec: CollectiveSpec, job: dict, workers: list):
    """Control plane of an INA job: give every worker its UDP port, register the members (and
    a fresh first round) with the aggregating switch; return its control client."""
    agg = _aggregator(net)
    port = ports.ina_worker_port(spec.job_id)
    members = net.ina_members(workers, port)
    agg["seq0"] = random.SystemRandom().getrandbits(32)  # late packets of earlier runs: STALE
    job["aggregator"] = agg
    for r, m in enumerate(members):
        job["ranks"][r]["port"] = port
        job["ranks"][r]["mac"] = m["mac"]
    client = net.switch_client(agg["switch"])
    try:
        client.configure("aggregate", jobs={spec.job_id: {
            "slots": spec.window, "seq0": agg["seq0"], "members": members}})
    except RuntimeError as e:  # the control channel's error names the node and the cause
        raise CollectiveError(f"{spec.op}/{spec.algo}: cannot register job {spec.job_id} on "
                              f"{agg['switch']}: {e}") from None
    return client


def unregister_ina_job(client, spec: CollectiveSpec) -> None:
    try:
        client.configure("aggregate", remove_jobs=[spec.job_id])
    except RuntimeError as e:  # the control channel's error names the node and the cause
        raise CollectiveError(f"{spec.op}/{spec.algo}: removing job {spec.job_id} failed: "
                              f"{e}") from None


def _wait_pool(proc: subprocess.Popen, net, spec: CollectiveSpec, limit: float) -> None:
    """Wait for the pool, failing fast when a data-path engine of the network dies (the
    collective could only time out then)."""
    deadline = time.monotonic() + limit
    dead_fn = getattr(net, "dead_engines", None)
    while True:
        try:
            proc.wait(timeout=POLL_S)
            _wait_group_gone(proc.pid)
            return
        except subprocess.TimeoutExpired:
            pass
        dead = dead_fn() if dead_fn is not None else {}
        if dead:
            what = ", ".join(f"{node} (exit status {code})" for node, code in sorted(dead.items()))
            raise CollectiveError(f"{spec.op}/{spec.algo}: the data-path engine of {what} "
                                  "died during the collective; its log is in "
                                  f"{RUN_DIR}/<node>.log")
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"collective pool did not finish within {limit:.0f} s")


def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
    """Wait until no process of the pool's group is left (its children die with it, a moment
    later); SIGKILL stragglers after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _release(net, spec: CollectiveSpec, agg_client) -> None:
    """Give back what the job held: its switch partition, and its SmartNIC offload."""
    if agg_client is not None:
        unregister_ina_job(agg_client, spec)
    if spec.algo == "nic":
        _configure_nics(net, spec, offload=False)


def _stop_pool(proc: subprocess.Popen, jobdir: str, net, spec: CollectiveSpec,
               agg_client) -> None:
    """Teardown on a failure or Ctrl-C: kill the pool's process group, reap it, drop the job
    folder, the switch partition and the NICs' offload. Runs while an exception propagates,
    so nothing here may raise and mask it: the group may already be gone (the pool exited, or
    the terminal's Ctrl-C reached it first: ``ProcessLookupError``), and a data-path engine's
    control channel may be down."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        proc.wait()
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
    return pids


def _aggregator(net) -> dict:
    agg = getattr(net, "aggregator", None)
    if agg is None:
        raise ValueError("algo 'ina'/'nic' needs a net with a programmable switch "
                         "(net.aggregator is None): use switch='programmable'")
    return {"ip": agg["ip"], "port": int(agg.get("port", 41000)), "switch": agg["switch"]}


@contextlib.contextmanager
def offload_job(net, spec: CollectiveSpec, job: dict, workers: list):
    """The control plane around a job whose ranks run outside :func:`run_collective` (a
    training job's pool): for ``algo`` ina/nic, register the job's members with the
    aggregating switch (filling ``job["aggregator"]`` and the ranks' ports and MACs) and set
    the SmartNICs' offload, and give both back on exit, failures included. Yields the
    switch's control client (None for host algorithms)."""
    client = None
    if spec.algo in ("ina", "nic"):
        client = register_ina_job(net, spec, job, workers)
        try:
            _configure_nics(net, spec, offload=True)
        except BaseException:
            with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
                _release(net, spec, client)
            raise
    try:
        yield client
    except BaseException:
        with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
            _release(net, spec, client)
        raise
    _release(net, spec, client)
