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
import shutil
import signal
import subprocess
import sys
import time

from testbed.collectives import cpumon, flowmodel
from testbed.collectives.report import make_row
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout

RUN_DIR = os.environ.get("TESTBED_RUN_DIR", "/run/testbed")
_seq = itertools.count()


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
        job["aggregator"] = _aggregator(net)
        agg_client = net.switch_client(job["aggregator"]["switch"])
        # a fresh partition of `window` slots for this job (removed again below)
        agg_client.configure("aggregate", jobs={spec.job_id: {"n_workers": n,
                                                              "slots": spec.window}})
    if spec.algo == "nic":
        _configure_nics(net)
    jobdir = os.path.join(RUN_DIR, f"coll-{os.getpid()}-{next(_seq)}")
    os.makedirs(jobdir, exist_ok=True)
    path = os.path.join(jobdir, "job.json")
    t0 = time.monotonic()
    job["t_popen"] = t0  # CLOCK_MONOTONIC is system-wide: the pool measures set-up from here
    with open(path, "w") as f:
        json.dump(job, f)
    cmd = [sys.executable, "-m", "testbed.collectives.worker", "--job", path] + [
        f"testbed-node={r['host']}" for r in ranks]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    limit = 60 + (spec.timeout_s + 10) * (spec.repetitions + 2)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _stop_pool(proc, jobdir, agg_client, spec.job_id)
        raise CollectiveTimeout(f"collective pool did not finish within {limit:.0f} s") from None
    except BaseException:  # KeyboardInterrupt included: clean up, then re-raise it unchanged
        _stop_pool(proc, jobdir, agg_client, spec.job_id)
        raise
    if agg_client is not None:
        try:
            agg_client.configure("aggregate", remove_jobs=[spec.job_id])
        except BaseException:
            shutil.rmtree(jobdir, ignore_errors=True)
            raise
    try:
        with open(os.path.join(jobdir, "result.json")) as f:
            result = json.load(f)
    except OSError:
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


def _stop_pool(proc: subprocess.Popen, jobdir: str, agg_client, job_id) -> None:
    """Teardown on a failure or Ctrl-C: kill the pool's process group, reap it, drop the job
    folder and the switch partition. Runs while an exception propagates, so nothing here may
    raise and mask it: the group may already be gone (the pool exited, or the terminal's
    Ctrl-C reached it first: ``ProcessLookupError``), and the switch's control channel may be
    down."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        proc.wait()
    shutil.rmtree(jobdir, ignore_errors=True)
    if agg_client is not None:
        try:
            agg_client.configure("aggregate", remove_jobs=[job_id])
        except Exception:  # noqa: BLE001, S110 - best effort; the original error matters
            pass


def _configure_nics(net) -> None:
    """Put every SmartNIC into fixed32 mode with the factor the error bound assumes."""
    from testbed.collectives.ina import NIC_FACTOR

    clients = getattr(net, "datapath_clients", dict)()
    nics = {k: c for k, c in clients.items() if k.startswith("tbn")}
    if not nics:
        raise ValueError("algo 'nic' needs SmartNICs running the nic_codec program: build the "
                         "topology with smartnic=True, programs={'smartnic': ['nic_codec']}")
    for name, c in nics.items():
        try:
            c.configure("nic_codec", codec="fixed32", factor=NIC_FACTOR)
        except Exception as e:  # noqa: BLE001 - the control error names the cause
            raise ValueError(f"algo 'nic': SmartNIC {name} has no usable nic_codec stage "
                             f"({e}); use programs={{'smartnic': ['nic_codec']}}") from None


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
