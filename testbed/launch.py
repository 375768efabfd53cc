"""``testbed launch``: run an unmodified PyTorch script on the emulated hosts, torchrun-style.

One rank per emulated host (the first ``hosts`` of the network), or ``nproc_per_host`` on
each (consecutive ranks on one host; plain gloo or a TCP algorithm), each a fresh interpreter
inside its host's network namespace with torchrun's environment: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (within the host), ``GROUP_RANK`` (the host's index),
``ROLE_RANK`` (the rank),
``MASTER_ADDR`` (rank 0's emulated address), ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, plus
``GLOO_SOCKET_IFNAME`` (the host's interface), so ``init_process_group("gloo")`` with the
default ``env://`` rendezvous works as under torchrun and every byte crosses the emulated
links. Output lines are prefixed ``[rank]:`` (torchrun's ``--tee`` style); the exit status is
the worst rank's. A rank that fails is named (host, exit status, its last lines of output)
and the others are stopped; nothing is left running.

How an unmodified script reaches the testbed's algorithms: with ``algo`` set, each rank runs
the script through a shim (``python -m testbed.launch rank ...``) that registers the
``testbed`` backend (:mod:`testbed.c10d`) and makes ``init_process_group`` build it where the
script asks for gloo (or no backend); the script's file runs as ``__main__`` with its own
``sys.argv``. Without ``algo`` the script runs over plain gloo: the baseline.

:func:`launch` (Python, notebooks) returns a :class:`Launched` (exit statuses, the
per-collective trace as rows, the results folder); the command line prints it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from testbed.atomic import write_json

#: MASTER_PORT of launched jobs (torchrun's default), plus the job id.
MASTER_PORT = 29500
#: What a failed rank's report shows of its output.
TAIL_LINES = 20


@dataclasses.dataclass
class Launched:
    """What a launch left: each rank's exit status (``returncodes``), the collectives it ran
    (``trace``: rows of :data:`testbed.c10d.TRACE_COLUMNS`, empty over plain gloo), the
    ``failures`` (one line per failed rank) and the results ``folder`` (``launch.json``,
    ``trace.csv``, ``rank<R>.log``)."""

    returncodes: list[int]
    trace: list[dict]
    failures: list[str]
    folder: Path
    #: the ranks that failed on their own (the others were stopped because of them)
    failed_ranks: list[int] = dataclasses.field(default_factory=list)
    #: from the first rank's start to the last one's end, undilated
    time_s: float = 0.0
    #: the provider's plan of an ``algo="auto"`` launch (a Plan as a dict), else None
    plan: dict | None = None
    #: the Chakra trace files written (``chakra_out``), one per rank
    chakra: list[Path] = dataclasses.field(default_factory=list)
    #: the plans the job ran under when it was re-planned while it ran (``plans``): each
    #: with its settings and the full collective it applied from (:class:`JobPlans`)
    plan_history: list[dict] = dataclasses.field(default_factory=list)
    #: the hints the provider planned an ``algo="auto"`` job with at its end (those derived
    #: from its first iterations included)
    hints: dict | None = None

    @property
    def replans(self) -> str | None:
        """The plans the running job moved to, in one line (``ring from collective 6``), None
        when it kept its first."""
        return " -> ".join(
            f"{p['algo']}{'+' + p['compressor'] if p['compressor'] else ''} "
            + (f"from collective {p['from_call']}" if p["from_call"] else
               "(offered; the job ended before it applied)")
            for p in self.plan_history[1:]) or None

    @property
    def returncode(self) -> int:
        """The exit status of the job: the first failed rank's (a signal N as 128 + N, as a
        shell reports it), 0 when every rank succeeded."""
        codes = [self.returncodes[r] for r in self.failed_ranks] or \
            [c for c in self.returncodes if c != 0]
        if not codes:
            return 0
        return 128 - codes[0] if codes[0] < 0 else codes[0]


def launch_network(topology: dict | None, experiment: str | Path | None, hosts: int | None,
                   algo: str | None, time_dilation):
    """The (not yet started) network the job runs on: the experiment file's first point's,
    or a star of ``hosts`` hosts at 100 Mb/s changed by ``topology`` (which may name another
    kind, with that kind's fields)."""
    from pydantic import ValidationError

    from testbed.collectives.algorithms import is_offloaded
    from testbed.experiment.networks import network_for
    from testbed.experiment.spec import TopologySpec, format_errors, load_point
    from testbed.topologies import make_topology
    from testbed.topologies.net import TestbedNet
    from testbed.topologies.pipeline import DatapathOptions

    if experiment is not None:
        point = load_point(experiment, 0)[1]
        if time_dilation is not None:
            point = point.model_copy(update={"time_dilation": time_dilation})
        return network_for(point)
    topo = {"kind": "star", "bw_mbps": 100.0,
            "switch": "programmable" if algo and is_offloaded(algo) else "bridge",
            **(topology or {})}
    if topo["kind"] == "star":  # another kind is sized by its own fields
        topo.setdefault("n_hosts", hosts or 2)
    try:
        spec = TopologySpec(**topo)
    except ValidationError as e:
        raise ValueError("; ".join(f"topology.{p}" for p in format_errors(e))) from None
    return TestbedNet(make_topology(spec.kind, **spec.kwargs()),
                      datapath=DatapathOptions(aggregate=spec.aggregate_settings()),
                      time_dilation=1.0 if time_dilation is None else time_dilation)


def launch(script: str | Path, args: Sequence[str] = (), *, hosts: int | None = None,
           topology: dict | None = None, experiment: str | Path | None = None,
           algo: str | None = None, compressor: str | None = None,
           compressor_params: dict | None = None, error_feedback: bool = False,
           time_dilation: float | str | None = None, out: str | Path | None = None,
           timeout_s: float = 600.0, job_id: int = 1, echo=None,
           module: bool = False, hints: dict | None = None,
           policy: str = "cooperative", chakra_out: str | Path | None = None,
           nproc_per_host: int = 1, stop=None, transport: str = "tcp",
           plans=None, provider: str | bool | None = None,
           tree: str | list[str] | None = None) -> Launched:
    """Run ``script`` with ``args`` on ``hosts`` emulated hosts (default: every host of the
    network), ``nproc_per_host`` ranks on each (torchrun's ``--nproc-per-node``: rank ``r``
    on host ``r // nproc_per_host``), and return what it did (see the module docstring).
    ``module``: ``script`` is a module name (``python -m``). ``stop``: an event (e.g. the
    live view's Stop button); once set, the ranks still running are stopped, as when one
    fails, and the job returns what it did. ``plans``: a callable polled while the job runs
    that returns new backend settings (a :class:`testbed.torch.TorchJob`: your own policy)
    or None; see :func:`run_script`.

    The network: ``experiment`` (a file; its first sweep point's topology, impairments...), or
    a star of ``hosts`` hosts at 100 Mb/s changed by ``topology`` (experiment-file topology
    fields). ``algo`` (ring, hd, ina, nic or a plug-in; None: plain gloo) with ``compressor``,
    ``compressor_params``, ``error_feedback``, ``transport`` ("uet": the UET-like transport
    instead of TCP, one rank per host): what the ``testbed`` backend allreduces float32 with
    (with ``algo="auto"`` or ``provider``, ``transport="uet"`` says the workers *may* run it:
    the provider may plan their ring over UET, with trimming on its ports); ``algo="auto"``: the provider plans them (:func:`provider_plan` with ``policy`` and
    the tenant's ``hints``, :class:`testbed.provider.schema.Hints` fields such as
    ``tolerance``, ``error_budget``, ``collective_bytes``, ``priority``; the plan is in the
    result and ``launch.json``; without ``collective_bytes`` the launcher derives the job's
    hints from its first iterations (:func:`derive_hints`) and the provider may re-plan it,
    each new plan applied while the script runs: :class:`JobPlans`). ``provider``: the
    address of a provider serving the network ``testbed up`` runs (``testbed provider serve
    --attach``; True: its default socket): the job runs on that network as one of its
    tenants, planned by that provider from ``hints`` (:class:`testbed.served.ServedJob`;
    ``experiment``, if given, must be the file ``up`` runs). ``chakra_out``: a folder where the job's collectives are
    written as a Chakra trace, ``<script>.<rank>.et`` (:func:`testbed.workloads.chakra.export`; needs
    ``algo``, whose backend traces them, and the ``[traces]`` extra). ``echo(line)``: called
    with every ``[rank]: ...`` output line (default: print). ``out``: the results root
    (default ``TESTBED_RESULTS``). ``tree`` (with an offloaded ``algo``: ina, nic): the
    job's aggregation tree, ``"auto"``, ``"single"`` or a list of switches
    (``CollectiveSpec.placement["tree"]``); default: one switch, or ``"auto"`` for more ranks
    than one switch takes. Raises ``ValueError`` for bad options before anything is built.
    """
    from testbed.collectives.algorithms import check_nproc_per_host
    from testbed.experiment import results

    if not module:
        script = _checked_script(script)
    if provider:
        _check_served(algo, topology, time_dilation, compressor, error_feedback, plans,
                      nproc_per_host, transport)
        algo = "auto"
    planned = algo == "auto"
    check_nproc_per_host(nproc_per_host, algo)  # before the network is built
    if transport == "uet" and nproc_per_host > 1:
        raise ValueError(f"nproc_per_host={nproc_per_host} with transport 'uet': the UET-like "
                         "transport takes one rank per host (its receive port is the host's "
                         "testbed port); use one rank per host or transport 'tcp'")
    if planned and transport == "uet":
        # the workers may run UET: the provider may plan their ring over it, with trimming
        hints = {**(hints or {}), "transports": ["tcp", "uet"]}
    if chakra_out is not None:
        import importlib.util

        if algo is None:
            raise ValueError("a Chakra trace needs --algo: the testbed backend traces the "
                             "collectives (plain gloo is not traced)")
        if importlib.util.find_spec("chakra") is None:
            raise ValueError("writing a Chakra trace needs the [traces] extra "
                             "(.venv/bin/pip install -e '.[traces]')")
    if planned:
        if tree is not None:
            raise ValueError("algo 'auto' lets the provider place the job; --tree is for "
                             "--algo ina or nic")
        if compressor is not None or error_feedback:
            raise ValueError("algo 'auto' lets the provider choose the compressor; give the "
                             "job's tolerance (hints) instead of --compressor/--error-feedback")
        if plans is not None:
            raise ValueError("algo 'auto' takes its plans from the provider, not from plans")
        _check_plan_request(hints, policy)
        tj = None
    else:
        if hints:
            raise ValueError("hints are for algo 'auto' (the provider plans with them)")
        if plans is not None and algo is None:
            raise ValueError("plans (re-plans of the running job) need --algo: plain gloo "
                             "runs no testbed algorithm to change")
        tj = backend_settings(algo, compressor, compressor_params, error_feedback, job_id,
                              placement=_tree_placement(tree, algo), transport=transport)
    stem = str(script).rsplit(".", 1)[-1] if module else Path(script).stem
    if provider:
        done = _launch_served(provider, script, args, hosts, experiment, hints, out, stem,
                              timeout_s=timeout_s, echo=echo, module=module, stop=stop,
                              job_id=job_id)
        return _chakra(done, chakra_out, stem)
    _check_no_up()
    # a provider-planned job gets a fabric where every algorithm can run (programmable)
    network = launch_network(topology, experiment, hosts, "ina" if planned else algo,
                             time_dilation)
    folder = results.unique_folder(results.results_root() if out is None else out,
                                   f"launch-{stem}")
    with network as net:
        plan = None
        if planned:
            tj, plan, manager, plans = planned_job(net, hosts, hints, policy, job_id,
                                                   f"launch-{stem}", folder)
        done = run_script(net, script, args, tj, folder, hosts=hosts, timeout_s=timeout_s,
                          echo=echo, module=module, nproc_per_host=nproc_per_host, stop=stop,
                          plans=plans, extra={"plan": plan.model_dump(), "policy": policy,
                                 "hints": dict(hints or {})} if plan else None)
        done.plan = plan.model_dump() if plan else None
        if planned:
            done.hints = manager.jobs()[plan.job]["hints"]
            meta = json.loads((done.folder / "launch.json").read_text())
            meta.update(hints_planned=done.hints, provider_log=[
                c.to_json() for c in manager.log if c.job == plan.job])
            (done.folder / "launch.json").write_text(json.dumps(meta, indent=2, default=str))
    return _chakra(done, chakra_out, stem)


def _chakra(done: Launched, chakra_out: str | Path | None, stem: str) -> Launched:
    if chakra_out is not None:
        from testbed.workloads.chakra import export

        done.chakra = export(done.trace, Path(chakra_out) / stem, len(done.returncodes))
    return done


def _check_no_up() -> None:
    """``ValueError`` when ``testbed up`` runs a network: the machine has one at a time, and
    building another would wait for it to go down."""
    from testbed.experiment.networks import up_state

    state = up_state()
    if state is not None and state["alive"]:
        raise ValueError(f"a network is up ('testbed up {state.get('file')}', pid "
                         f"{state.get('pid')}) and a machine runs one at a time: run the job "
                         "on it with --provider beside 'testbed provider serve --attach', or "
                         "'testbed down' first")


def _check_served(algo, topology, time_dilation, compressor, error_feedback, plans,
                  nproc_per_host: int, transport: str) -> None:
    """``ValueError`` for options a job on a served provider's network cannot take."""
    given = [name for name, v in (("algo", algo not in (None, "auto")),
                                  ("topology", topology), ("time_dilation", time_dilation),
                                  ("compressor", compressor),
                                  ("error_feedback", error_feedback), ("plans", plans))
             if v]
    if given:
        raise ValueError(f"provider: {', '.join(given)} cannot be given: the job runs on the "
                         "network 'testbed up' runs, as its provider plans it (state the "
                         "job's hints: tolerance, error budget, bytes, priority)")
    if nproc_per_host != 1:
        raise ValueError("provider: a served job runs one rank per host (the provider plans "
                         "per host)")


def _launch_served(provider: str | bool, script, args, hosts, experiment, hints, out,
                   stem: str, **kw) -> Launched:
    """:func:`launch` of a job admitted to the provider at ``provider`` that serves the
    network ``testbed up`` runs."""
    from testbed.experiment import results
    from testbed.experiment.networks import attach_up
    from testbed.served import ServedJob

    net = attach_up(None if experiment is None else str(experiment), what="provider")
    with contextlib.closing(net):
        workers = job_hosts(net, hosts)
        folder = results.unique_folder(results.results_root() if out is None else out,
                                       f"launch-{stem}")
        with ServedJob(None if provider is True else provider, folder.name, workers, hints,
                       folder / "trace0.jsonl", net.time_dilation, kw["job_id"]) as served:
            done = run_script(net, script, args, served.first, folder, hosts=hosts,
                              timeout_s=kw["timeout_s"], echo=kw["echo"], module=kw["module"],
                              stop=kw["stop"], plans=served,
                              extra={"plan": served.plan.model_dump(),
                                     "provider": served.address, "provider_job": served.name,
                                     "hints": dict(hints or {})})
            done.plan = served.plan.model_dump()
            done.hints = served.hints()
            meta = json.loads((done.folder / "launch.json").read_text())
            meta.update(hints_planned=done.hints, provider_log=served.log(),
                        plan_errors=meta.get("plan_errors", []) + served.errors)
            (done.folder / "launch.json").write_text(json.dumps(meta, indent=2, default=str))
    return done


def _check_plan_request(hints: dict | None, policy: str) -> None:
    """``ValueError`` for hints the provider's schema refuses or an unknown policy, before a
    network is built."""
    from testbed.provider.policies import POLICIES
    from testbed.provider.schema import check_hints

    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {sorted(POLICIES)}")
    try:
        check_hints(hints)
    except ValueError as e:
        raise ValueError(f"hints: {e}") from None


def fabric_manager(net, policy: str = "cooperative"):
    """A provider's fabric manager of the running ``net``: its inventory, the static
    aggregator memory and shared pools its engines report, the flow model with the measured
    hop latency."""
    from testbed.provider.manager import FabricManager, inventory_of
    from testbed.provider.policies import PlanModel
    from testbed.provider.service import engine_memory

    desc = net.describe()
    model = PlanModel(desc, hop_latency_s=net.hop_latency_s())
    return FabricManager(inventory_of(desc, *engine_memory(net)), policy, model)


def provider_plan(net, hosts: list[str], hints: dict | None, policy: str = "cooperative",
                  job: str = "launch", manager=None):
    """The plan the provider's ``policy`` gives a job on ``hosts`` of the running ``net`` with
    the tenant's ``hints``: a :class:`testbed.provider.schema.Plan` admitted by ``manager``
    (None: a fresh :func:`fabric_manager`, the job its only tenant)."""
    from testbed.provider.schema import Hints, JobRequest

    manager = manager if manager is not None else fabric_manager(net, policy)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", job)[:64] or "launch"  # the schema's job names
    plan = manager.admit(JobRequest(job=name, hosts=hosts, hints=Hints(**(hints or {}))))
    if plan.trim_head_bits is not None:
        raise ValueError(f"the provider planned trimming ({plan.reason}); a launched script's "
                         "allreduce does not trim")
    return plan


def planned_settings(net, hosts: int | Sequence[int] | None, hints: dict | None, policy: str,
                     job_id: int, name: str, manager=None):
    """(the testbed backend's settings, the provider's plan) of a job on ``hosts`` of ``net``
    (see :func:`job_hosts`) planned by ``policy`` from ``hints``; ``manager``: a
    :func:`fabric_manager` of ``net`` the job is admitted to beside the jobs it holds (None: the
    job is a fresh manager's only tenant)."""
    from testbed.collectives.spec import communication_of

    workers = job_hosts(net, hosts)
    plan = provider_plan(net, [h.name for h in workers], hints, policy, job=name,
                         manager=manager)
    tj = backend_settings(**communication_of(plan), job_id=job_id,
                          placement=plan_placement(plan))
    return tj, plan


def planned_job(net, hosts: int | Sequence[int] | None, hints: dict | None, policy: str,
                job_id: int, name: str, folder: Path):
    """A provider-planned launched job, the only tenant of a fresh :func:`fabric_manager` of
    ``net``: (backend settings, plan, the manager, the ``plans`` source that brings its
    re-plans to the running job, for :func:`run_script` into ``folder``). With no
    ``collective_bytes`` among the ``hints`` the source derives them from the job's first
    iterations (:func:`derived_hints_replans`)."""
    manager = fabric_manager(net, policy)
    tj, plan = planned_settings(net, hosts, hints, policy, job_id, name, manager=manager)
    if (hints or {}).get("collective_bytes"):
        plans = provider_replans(manager, plan.job)
    else:
        plans = derived_hints_replans(manager, plan.job, folder / "trace0.jsonl",
                                      float(net.time_dilation))
    return tj, plan, manager, plans


def provider_replans(manager, job: str, lock=None):
    """A ``plans`` source for :func:`run_script`: the backend settings of ``job``'s newest plan
    at ``manager`` (a :func:`fabric_manager`) whenever its plan version rose since the last
    call (or since admission), else None. ``lock``: held around each look at ``manager``,
    which is not thread-safe. A plan that trims raises ``ValueError`` (the follower records
    it as not applied: a launched script's allreduce does not trim)."""
    from testbed.collectives.spec import communication_of

    guard = lock if lock is not None else contextlib.nullcontext()
    with guard:
        seen = manager.plan_version(job)

    def poll():
        nonlocal seen
        with guard:
            version = manager.plan_version(job)
            if version <= seen:
                return None
            seen = version
            plan = manager.plans()[job]
        if plan.trim_head_bits is not None:
            raise ValueError(f"the provider planned trimming ({plan.reason}); a launched "
                             "script's allreduce does not trim")
        return backend_settings(**communication_of(plan), job_id=1,
                                placement=plan_placement(plan))
    return poll


#: A launched job's iteration is taken as known once its pattern of collectives repeated
#: this many times in a row (:func:`derive_hints`).
DERIVE_REPEATS = 3


def derive_hints(rows: list[dict], time_dilation: float = 1.0,
                 repeats: int = DERIVE_REPEATS) -> dict | None:
    """A job's hints from what rank 0 ran so far (``rows``: its trace rows in order,
    :data:`testbed.c10d.TRACE_COLUMNS`), or None while they show no iteration yet.

    An iteration is the shortest run of collectives (op and bytes; sends and receives left
    out) that the last ``repeats`` x its length calls repeat ``repeats`` times: a DDP step's
    buckets, a hand-written loop's calls. Its hints: ``collective_bytes`` (what it
    allreduces), ``iteration_s`` (start to start, undilated by ``time_dilation``) and
    ``compute_s`` (the iteration's time outside its collectives). A job that allreduces
    nothing in its iteration gives None: the provider plans allreduces."""
    calls = [r for r in rows if not r["op"].startswith(("send", "recv"))]
    keys = [(r["op"], r["bytes"]) for r in calls]
    for period in range(1, len(keys) // repeats + 1):
        tail = keys[len(keys) - repeats * period:]
        if any(tail[i] != tail[i % period] for i in range(len(tail))):
            continue
        first = len(calls) - repeats * period
        last = calls[first + (repeats - 1) * period:]
        nbytes = sum(r["bytes"] for r in last if r["op"] == "allreduce")
        if not nbytes:
            return None
        f = float(time_dilation)
        iteration = (last[0]["start_s"] - calls[first]["start_s"]) / (repeats - 1) / f
        busy = sum(r["end_s"] - r["start_s"] for r in last) / f
        return {"collective_bytes": int(nbytes), "iteration_s": max(iteration, 1e-6),
                "compute_s": max(iteration - busy, 0.0)}
    return None


class HintsDeriver:
    """Reads rank 0's trace (``trace``) as it grows; :meth:`poll` gives the job's hints once
    :func:`derive_hints` finds its iteration (once; None before and after)."""

    def __init__(self, trace: Path, time_dilation: float):
        self.trace, self.time_dilation = trace, float(time_dilation)
        self.rows: list[dict] = []
        self.offset = 0
        self.derived: dict | None = None

    def poll(self) -> dict | None:
        if self.derived is not None or not self.trace.exists():
            return None
        with open(self.trace, "rb") as f:  # bytes: the offset is a byte count
            f.seek(self.offset)
            data = f.read()
        done = data[:data.rfind(b"\n") + 1]  # whole lines only
        self.offset += len(done)
        self.rows.extend(json.loads(line) for line in done.splitlines() if line)
        self.derived = derive_hints(self.rows, self.time_dilation)
        return self.derived

    @staticmethod
    def reason(hints: dict) -> str:
        """What the provider's log says of derived hints."""
        return (f"hints derived from the job's first iterations ({hints['collective_bytes']:,} B"
                f" allreduced every {hints['iteration_s']:.3g} s)")


def derived_hints_replans(manager, job: str, trace: Path, time_dilation: float, lock=None):
    """A ``plans`` source for an ``algo="auto"`` launch whose tenant stated no
    ``collective_bytes``: it reads rank 0's trace as it grows (``trace``), and once
    :func:`derive_hints` finds the job's iteration it gives the provider (``manager``) those
    hints (:meth:`~testbed.provider.manager.FabricManager.update_hints`), once; the re-plan
    that may follow, and any later one, comes from :func:`provider_replans`."""
    replans = provider_replans(manager, job, lock)
    deriver = HintsDeriver(trace, time_dilation)
    guard = lock if lock is not None else contextlib.nullcontext()

    def poll():
        hints = deriver.poll()
        if hints is not None:
            with guard:
                manager.update_hints(job, hints, deriver.reason(hints))
        return replans()
    return poll


def job_hosts(net, hosts: int | Sequence[int] | None) -> list:
    """The hosts of ``net`` a job runs on: the first ``hosts`` (an int; None: all), or those
    of the given host ranks (0-based, each once). ``ValueError`` naming what the network
    lacks."""
    every = list(net.hosts)
    if hosts is None or isinstance(hosts, int):
        if hosts is not None and not 1 <= hosts <= len(every):
            raise ValueError(f"hosts={hosts}, but the network has {len(every)} hosts")
        return every[:hosts or len(every)]
    ranks = list(hosts)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)
           or not 0 <= r < len(every)]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"hosts={ranks}: host ranks must be distinct, in 0..{len(every) - 1}"
                         f" (the network has {len(every)} hosts)")
    return [every[r] for r in ranks]


def plan_placement(plan) -> dict:
    """``CollectiveSpec.placement`` of a provider's plan (empty when it does not aggregate in
    the network)."""
    from testbed.collectives.algorithms import is_offloaded

    if not is_offloaded(plan.algo):
        return {}
    return {"tree": plan.tree if plan.tree is not None else "single",
            "slots": max(plan.slots, 1), "mode": plan.mode}


def _checked_script(script: str | Path) -> Path:
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # fail here, not in every rank
        raise ValueError("testbed launch runs PyTorch scripts: install the [torch] extra "
                         "(.venv/bin/pip install -e '.[torch]')")
    path = Path(script).resolve()
    if not path.is_file():
        raise ValueError(f"script {path} does not exist")
    try:  # what every rank's interpreter would stop at, said before a network is built
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError) as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        why = e.msg if isinstance(e, SyntaxError) else e
        raise ValueError(f"script {path} does not compile{where}: {why}") from None
    return path


def backend_settings(algo: str | None, compressor: str | None,
                     compressor_params: dict | None, error_feedback: bool, job_id: int,
                     placement: dict | None = None, transport: str = "tcp"):
    """The testbed backend's settings (None: plain gloo); ``ValueError`` on bad ones."""
    from testbed.torch import TorchJob
    from testbed.workloads.spec import check_communication

    if algo is None:
        if compressor is not None:
            raise ValueError("a compressor needs --algo (plain gloo does not compress)")
        if transport != "tcp":
            raise ValueError(f"transport={transport!r} needs --algo (plain gloo runs its own "
                             "TCP)")
        return None
    tj = TorchJob(comm="testbed", algo=algo, compressor=compressor,
                  compressor_params=dict(compressor_params or {}),
                  error_feedback=error_feedback, job_id=job_id, timeout_s=60.0,
                  placement=dict(placement or {}), transport=transport)
    check_communication(tj)
    return tj


def run_script(net, script: str | Path, args: Sequence[str], tj, folder: Path, *,
               hosts: int | Sequence[int] | None = None, timeout_s: float = 600.0, echo=None,
               module: bool = False, extra: dict | None = None,
               nproc_per_host: int = 1, stop=None, plans=None) -> Launched:
    """Run ``script`` on ``hosts`` of the running network ``net`` (the first ``hosts``, or
    those host ranks: :func:`job_hosts`; ``nproc_per_host`` ranks on each, consecutive ranks
    on one host), with the
    testbed backend's settings ``tj`` (a :class:`testbed.torch.TorchJob`, None: plain gloo);
    what it leaves goes to ``folder``. ``module``: ``script`` is a module name, run as
    ``python -m`` runs it (torchrun's ``--module``), not a file. ``extra``: more entries for
    ``launch.json`` (e.g. the provider's plan). ``stop``: see :func:`launch`. ``plans``: a
    callable polled while the ranks run that returns the job's new backend settings (a
    :class:`testbed.torch.TorchJob`, e.g. a provider's re-plan: :func:`provider_replans`) or
    None when nothing changed; each new plan is applied at a collective boundary every rank
    agrees on (:class:`JobPlans`), and the trace's ``plan`` column says which plan each
    call ran under."""
    import importlib.util

    from testbed.collectives.algorithms import check_nproc_per_host
    from testbed.torch import TorchJob

    if module:
        if importlib.util.find_spec(str(script)) is None:
            raise ValueError(f"no module {script}")
        target = ["-m", str(script)]
    else:
        script = _checked_script(script)
        target = [str(script)]
    echo = echo or (lambda line: print(line, flush=True))
    check_nproc_per_host(nproc_per_host, tj.algo if tj is not None else None)
    workers = [h for h in job_hosts(net, hosts) for _ in range(nproc_per_host)]  # per rank
    n = len(workers)
    if tj is not None:
        tj = _tree_for_many(tj, n)
        tj.validate(n)
    ranks = [{"host": h.name, "pid": int(h.pid), "ip": h.IP(), "intf": h.defaultIntf().name}
             for h in workers]
    settings = tj if tj is not None else TorchJob(comm="gloo")
    job = {"torch": dataclasses.asdict(settings), "n": n, "m": 0, "ranks": ranks,
           "nproc_per_host": nproc_per_host,
           "time_dilation": float(net.time_dilation)}
    meta = {"script": str(script), "args": list(args), "hosts": [r["host"] for r in ranks],
            "nproc_per_host": nproc_per_host,
            "algo": tj.algo if tj else None, "compressor": tj.compressor if tj else None,
            "describe": net.describe(), "time_dilation": net.time_dilation, **(extra or {})}
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if tj is None:
        codes, failed, failures = _run_ranks(workers, job, target, args, folder, False,
                                             timeout_s, echo, stop)
        followed = None
    else:
        with JobPlans(net, job, workers, tj, folder, plans) as followed:
            codes, failed, failures = _run_ranks(workers, job, target, args, folder, True,
                                                 timeout_s, echo, stop, followed.tick)
    wall = time.monotonic() - t0
    trace = collect_rank_rows(folder, "trace", n)
    if tj is not None:
        _add_model(trace, net, workers, followed.settings)
    _save_trace(trace, folder)
    meta.update(returncodes=codes, failed_ranks=failed, failures=failures,
                collectives=len(trace), wall_s=wall)
    if followed is not None and plans is not None:
        meta.update(plans=followed.history, plan_errors=followed.errors)
    (folder / "launch.json").write_text(json.dumps(meta, indent=2, default=str))
    return Launched(codes, trace, failures, folder, failed, wall / float(net.time_dilation),
                    plan_history=followed.history if followed and plans is not None else [])


def _tree_placement(tree, algo: str | None) -> dict | None:
    """The backend's placement for ``--tree``: None without one; ``ValueError`` where the
    algorithm aggregates in no switch or the value names no tree."""
    from testbed.collectives.algorithms import is_offloaded

    if tree is None:
        return None
    if algo is None or not is_offloaded(algo):
        raise ValueError(f"--tree is for an algorithm that aggregates in the switches (ina, "
                         f"nic), not {algo or 'plain gloo'}")
    if isinstance(tree, str) and tree not in ("auto", "single"):
        tree = [t for t in tree.split(",") if t]
    if not tree:
        raise ValueError("--tree takes auto, single or switch names (tbl1,tbsp1)")
    return {"tree": tree}


def _tree_for_many(tj, n: int):
    """``tj`` of ``n`` ranks with placement tree 'auto' when it offloads more ranks than one
    switch takes (32) and names no tree (``--tree``): a tree is then the only placement they
    can have."""
    from testbed.collectives.algorithms import is_offloaded
    from testbed.collectives.spec import MAX_SWITCH_MEMBERS

    if is_offloaded(tj.algo) and n > MAX_SWITCH_MEMBERS and "tree" not in tj.placement:
        return dataclasses.replace(tj, placement={**tj.placement, "tree": "auto"})
    return tj


def _rank_env(job: dict, r: int, folder: Path, offload: bool) -> dict:
    """A rank's environment: torchrun's variables, and one thread for OpenMP as torchrun
    gives each of several ranks on a machine. Numba's too: its OpenMP pool (started when the
    testbed's kernels load) sets the thread count of the one OpenMP runtime torch shares, so
    torch's own operations would run on two threads that spin between them, a rank's
    tensor copies taking 10-40 ms instead of 1 on a loaded 2-core machine. A rank follows
    the launcher (``TESTBED_OWNER``): it ends when the launcher does, however it ends, also
    on a network another process owns (``testbed up``)."""
    from testbed.lifeline import OWNER_ENV, identity

    me, n, k = job["ranks"][r], len(job["ranks"]), job.get("nproc_per_host", 1)
    env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r % k),
           "LOCAL_WORLD_SIZE": str(k), "GROUP_RANK": str(r // k), "ROLE_RANK": str(r),
           "ROLE_WORLD_SIZE": str(n), "GROUP_WORLD_SIZE": str(n // k), "ROLE_NAME": "default",
           "MASTER_ADDR": job["ranks"][0]["ip"],
           "MASTER_PORT": str(MASTER_PORT + job["torch"]["job_id"]),
           "TORCHELASTIC_RUN_ID": f"testbed-{os.getpid()}", "GLOO_SOCKET_IFNAME": me["intf"],
           "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "TESTBED_JOB": str(folder / "job.json"),
           "TESTBED_TRACE": str(folder / f"trace{r}.jsonl"), "PYTHONUNBUFFERED": "1",
           "TESTBED_LAUNCH_T0": str(job["t0"]), OWNER_ENV: identity()}
    env.pop("TESTBED_BACKEND", None)
    if offload:
        env["TESTBED_BACKEND"] = "testbed"
    return env


class JobPlans:
    """The launcher's side of a running job's plan changes (the ranks' side:
    :class:`testbed.c10d.Replans`), as a context manager around the ranks' run.

    On entry it registers the first plan's offload
    (:func:`~testbed.collectives.runner.offload_job`). :meth:`tick`, polled while the ranks run, asks ``source()`` for a new plan; a new one
    gets a job id of its own (:func:`~testbed.workloads.replan.epoch_job_id`), its INA
    registration beside the old one (a switch that refuses it for memory the old plans still
    hold is asked again until :data:`~testbed.workloads.runner.ADMISSION_WAIT_S` times the
    dilation has passed; so is the first plan of a job with a ``source``, whose memory may be
    held by a job just re-planned away from it) and is written to ``plan.json`` for rank 0 to
    schedule. Once every rank acknowledged a plan, the registrations of the plans before it
    are removed. On exit every registration still held is. :attr:`settings` maps each plan's number to its
    settings; :attr:`history` lists the plans (0: the first) with the full collective each
    applied from (``from_call``, counted alike on every rank; None: the job ended before
    every rank ran it) and when their registrations were released; :attr:`errors` names the
    plans that could not be offered.

    A ``source`` may also have ``registration(tj)``, the switch registration a provider made
    for a plan it gave (``tj`` as it gave it; None: none), which that plan then runs on under
    the registration's job id instead of one registered here, and ``running(tj)``, told once
    every rank runs that plan (:class:`testbed.served.ServedJob`)."""

    def __init__(self, net, job: dict, workers: list, tj, folder: Path, source=None):
        self.net, self.job, self.workers, self.folder = net, job, workers, folder
        self.source = source
        self.base = copy.deepcopy(job)  # a new plan's job starts from it
        self.settings = {0: tj}
        self._given = {0: tj}  # each plan as the source gave it
        self._told = 0  # the newest plan the source was told every rank runs
        self.history: list[dict] = [self._entry(0, tj)]
        self.errors: list[str] = []
        self.epoch = 0  # the newest plan offered to the ranks
        self._planes: dict[int, contextlib.ExitStack] = {}
        self._wanted = None
        self._refused_since: float | None = None

    def __enter__(self) -> JobPlans:
        from testbed.collectives.runner import AdmissionRefused
        from testbed.workloads.runner import ADMISSION_WAIT_S

        if self.source is not None:
            self.job["replan"] = str(self.folder)
        # a provider's job may find its switch memory still held by a job the provider has
        # just re-planned away from it: asked again until that job's ranks have left it
        deadline = time.monotonic() + ADMISSION_WAIT_S * float(self.net.time_dilation)
        while True:
            try:
                self._planes[0] = self._plane(self.settings[0], self.job,
                                              self._registration(self.settings[0]))
                return self
            except AdmissionRefused:
                if self.source is None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        planes, self._planes = self._planes, {}
        for epoch in sorted(planes, reverse=True):
            self._release(epoch, planes[epoch])
        # the exchange's files: what they said goes to the history (a plan counts as applied
        # once every rank ran it: a job may end before the call it was due from)
        acked = min((self._acked(r) for r in range(len(self.workers))), default=0)
        for k in range(1, len(self.history)):
            path = self.folder / f"switch{k}.json"
            if path.exists():
                switch = json.loads(path.read_text())
                if switch["epoch"] <= acked:
                    self.history[switch["epoch"]]["from_call"] = switch["at"]
        for path in [self.folder / "plan.json", *self.folder.glob("switch*.json"),
                     *self.folder.glob("ack*"), *self.folder.glob(".*.tmp*")]:
            path.unlink(missing_ok=True)

    @staticmethod
    def _entry(epoch: int, tj) -> dict:
        return {"plan": epoch, "algo": tj.algo, "compressor": tj.compressor,
                "placement": tj.placement, "job_id": tj.job_id, "offered_s": time.time(),
                "from_call": 1 if epoch == 0 else None, "released_s": None}

    def _release(self, epoch: int, plane: contextlib.ExitStack) -> None:
        try:
            plane.close()
        except Exception as e:  # noqa: BLE001 - the others are released all the same
            self.errors.append(f"plan {epoch}: its release failed: {e}")
        self.history[epoch]["released_s"] = time.time()

    def _registration(self, given) -> dict | None:
        ask = getattr(self.source, "registration", None)
        return ask(given) if ask is not None else None

    def _plane(self, tj, job: dict, registration: dict | None = None) -> contextlib.ExitStack:
        from testbed.collectives.runner import offload_job

        stack = contextlib.ExitStack()
        stack.enter_context(offload_job(self.net, tj.collective(), job, self.workers,
                                        registration=registration))
        return stack

    def tick(self) -> None:
        if self.source is None:
            return
        try:
            wanted = self.source()
        except ValueError as e:  # a plan this job cannot take
            self.errors.append(f"plan {self.epoch + 1} not applied: {e}")
            wanted = None
        if wanted is not None:
            self._wanted = wanted
        if self._wanted is not None:
            self._offer()
        self._retire()
        self._report()

    def _report(self) -> None:
        """Tell the source which plan every rank runs now, once per plan."""
        tell = getattr(self.source, "running", None)
        if tell is None or self.epoch == self._told:
            return
        acked = min(self._acked(r) for r in range(len(self.workers)))
        if acked > self._told:
            self._told = acked
            tell(self._given[acked])

    def _offer(self) -> None:
        from testbed.collectives.runner import AdmissionRefused, CollectiveError
        from testbed.workloads.replan import epoch_job_id
        from testbed.workloads.runner import ADMISSION_WAIT_S

        given = tj = self._wanted
        now = self.settings[self.epoch]
        if dataclasses.replace(tj, job_id=now.job_id) == now:
            self._wanted = None
            return  # the plan in force already
        epoch = self.epoch + 1
        label = f"plan {epoch} ({tj.algo}{'+' + tj.compressor if tj.compressor else ''})"
        try:
            reg = self._registration(given)
            tj = dataclasses.replace(tj, job_id=reg["job_id"] if reg else
                                     epoch_job_id(self.settings[0].job_id, epoch))
            tj.validate(len(self.workers))
            job = copy.deepcopy(self.base)
            job["torch"] = dataclasses.asdict(tj)
            plane = self._plane(tj, job, reg)
        except AdmissionRefused as e:  # memory the old plans hold: ask again while it may come
            wall = time.monotonic()
            self._refused_since = self._refused_since or wall
            waited = wall - self._refused_since
            if waited > ADMISSION_WAIT_S * float(self.net.time_dilation):
                self._refused_since, self._wanted = None, None
                self.errors.append(f"{label} not applied: refused for {waited:.0f} s: {e}")
            return
        except (CollectiveError, ValueError, RuntimeError) as e:
            self._wanted, self._refused_since = None, None
            self.errors.append(f"{label} not applied: {e}")
            return
        self._wanted, self._refused_since = None, None
        self.epoch = epoch
        self.settings[epoch] = tj
        self._given[epoch] = given
        self._planes[epoch] = plane
        self.history.append(self._entry(epoch, tj))
        write_json(self.folder / "plan.json", {"epoch": epoch, "job": job})

    def _retire(self) -> None:
        """Remove the registrations of the plans every rank has left."""
        held = [e for e in self._planes if e < self.epoch]
        if not held:
            return
        acked = min(self._acked(r) for r in range(len(self.workers)))
        for e in held:
            if e < acked:
                self._release(e, self._planes.pop(e))

    def _acked(self, rank: int) -> int:
        """The newest plan ``rank`` runs (0 until it switched once)."""
        try:
            return json.loads((self.folder / f"ack{rank}").read_text())["epoch"]
        except FileNotFoundError:
            return 0


def _run_ranks(workers: list, job: dict, target: list[str], args, folder: Path, offload: bool,
               timeout_s: float, echo, stop=None, tick=None
               ) -> tuple[list[int], list[int], list[str]]:
    """Start every rank, relay its output, stop the others when one fails; (exit statuses,
    the ranks that failed on their own, one line per failure). ``tick()``: called every
    50 ms while they run."""
    job["t0"] = time.time()  # wall clock: a rank may time its start from it
    (folder / "job.json").write_text(json.dumps(job))
    procs, pumps, tails = [], [], []
    try:
        for r, h in enumerate(workers):
            log = open(folder / f"rank{r}.log", "w")  # noqa: SIM115 - closed by its pump
            p = h.popen([sys.executable, "-m", "testbed.launch", "rank",
                         f"testbed-node={h.name}", *target, *args],
                        env=_rank_env(job, r, folder, offload), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd())
            procs.append(p)
            tails.append([])
            t = threading.Thread(target=_pump, args=(p, r, log, tails[-1], echo), daemon=True)
            t.start()
            pumps.append(t)
        failed, failures = _wait(procs, workers, tails, timeout_s, stop, tick)
    finally:
        for p in procs:
            _stop(p)
        for t in pumps:
            t.join(10)
    return [p.returncode for p in procs], failed, failures


def _pump(p, r: int, log, tail: list, echo) -> None:
    with log:
        for raw in iter(p.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            log.write(line + "\n")
            tail.append(line)
            del tail[:-TAIL_LINES]
            echo(f"[{r}]:{line}")


def _wait(procs: list, workers: list, tails: list, timeout_s: float, stop=None, tick=None
          ) -> tuple[list[int], list[str]]:
    """(the ranks that failed, a line each) once every rank ended, one failed or ``stop``
    was set."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if tick is not None:
            tick()
        if stop is not None and stop.is_set():
            left = [r for r, p in enumerate(procs) if p.poll() is None]
            return left, [f"stopped on request; ranks {left} were stopped"]
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            time.sleep(0.5)  # its last lines reach the pump
            return failed, [_failure(r, workers[r].name, procs[r].returncode, tails[r])
                            for r in failed]
        if time.monotonic() > deadline:
            late = [r for r, p in enumerate(procs) if p.poll() is None]
            return late, [f"the job did not finish within {timeout_s:.0f} s; ranks {late} "
                          "were stopped"]
        time.sleep(0.05)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    return failed, [_failure(r, workers[r].name, procs[r].returncode, tails[r])
                    for r in failed]


def _failure(r: int, host: str, code: int, tail: list) -> str:
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    last = "\n".join(f"    {line}" for line in tail[-TAIL_LINES:])
    return f"rank {r} ({host}) failed with {how}; its last output:\n{last}"


def _stop(p) -> None:
    if p.poll() is None:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)  # mnexec -d: the rank leads its own session
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    p.wait()


def collect_rank_rows(folder: Path, stem: str, n: int) -> list[dict]:
    """The JSON lines every rank wrote to ``folder/<stem><rank>.jsonl`` (files removed once
    read), ordered by start time then rank."""
    rows = []
    for r in range(n):
        path = folder / f"{stem}{r}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line]
            path.unlink()
    return sorted(rows, key=lambda row: (row["start_s"], row["rank"]))


def _add_model(trace: list[dict], net, workers: list, plans: dict) -> None:
    """Give every row its undilated measured time (``time_s``) and, for the testbed's
    allreduces, sharded collectives and all-to-alls, the flow model's prediction on this
    network (``model_s``, as ``run_collective``'s rows have it; none for trim's incast, nor
    with several ranks on a host: the model places one rank per host) under the plan the row
    ran with (``plans``: the backend's settings per plan number)."""
    from testbed.collectives import flowmodel

    f = float(net.time_dilation)
    ours = any(r["path"].startswith("testbed:") for r in trace)
    hop = net.hop_latency_s() if ours else 0.0
    impairments = net.link_impairments() if ours else []
    names = [h.name for h in workers]
    cache: dict[tuple[str, int], float] = {}
    for row in trace:
        tj = plans[row.get("plan") or 0]
        row["time_s"] = (row["end_s"] - row["start_s"]) / f
        row["model_s"] = None
        algo = row["path"].removeprefix("testbed:")
        if not row["path"].startswith("testbed:") or not row["bytes"] \
                or len(set(names)) != len(names):
            continue
        if row["op"] == "all_to_all":  # the testbed's all-to-all, in any algorithm's job
            key = ("all_to_all", row["bytes"], "", 0)
            if key not in cache:
                # on the first plan's connections, which every later plan takes over
                cache[key] = flowmodel.all_to_all_s(net.routed_topo, names, row["bytes"],
                                                    job_id=plans[0].job_id, hop_latency_s=hop,
                                                    time_dilation=f)
            row["model_s"] = cache[key]
            continue
        if algo == "trim" or row["op"] not in ("allreduce", "reduce_scatter", "allgather"):
            continue
        # the whole array, as the model counts it (an allgather's row has one rank's part);
        # a 16-bit float that an in-network job summed as float32 crossed the links as one
        nbytes = row["bytes"] * (len(names) if row["op"] == "allgather" else 1)
        if algo != "ring" and row.get("dtype") in ("float16", "bfloat16"):
            nbytes *= 2
        if nbytes % 4:
            continue  # the model counts float32 elements
        key = (row["op"], nbytes, algo, row.get("plan") or 0)
        if key not in cache:
            spec = dataclasses.replace(tj.collective(nbytes), op=row["op"])
            if algo != tj.algo or row.get("note"):  # the ring of the job's hosts, as it is
                spec = dataclasses.replace(spec, algo=algo, compressor=None,
                                           compressor_params={}, error_feedback=False)
            cache[key] = flowmodel.predict(net.routed_topo, spec, workers=names,
                                           hop_latency_s=hop, time_dilation=f,
                                           impairments=impairments).time_s
        row["model_s"] = cache[key]


def _save_trace(trace: list[dict], folder: Path) -> None:
    """``trace.csv`` and ``trace.json``, a timeline for Perfetto / chrome://tracing (one
    track per rank)."""
    if not trace:
        return
    import pandas as pd

    pd.DataFrame(trace).to_csv(folder / "trace.csv", index=False)
    t0 = min(r["start_s"] for r in trace)
    events = [{"name": f"{r['op']} {r['bytes']} B", "cat": r["path"], "ph": "X",
               "ts": (r["start_s"] - t0) * 1e6, "dur": (r["end_s"] - r["start_s"]) * 1e6,
               "pid": 0, "tid": r["rank"],
               "args": {k: r[k] for k in ("dtype", "bytes", "path", "model_s") if k in r}}
              for r in trace]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                "args": {"name": f"rank {rank}"}} for rank in sorted({r["rank"] for r in trace})]
    (folder / "trace.json").write_text(json.dumps({"traceEvents": events}))


# ---------------------------------------------------------------------------- inside a rank

def _rank(marker: str, target: list[str], args: list[str]) -> None:
    """Run the script (or ``-m`` module) ``target`` as ``__main__`` with ``args``; with
    ``TESTBED_BACKEND=testbed`` its gloo (or default) process group is the testbed's."""
    from testbed.lifeline import follow_owner

    follow_owner()
    if os.environ.get("TESTBED_BACKEND") == "testbed":
        import torch.distributed as dist

        from testbed import c10d

        c10d.register()
        original = dist.init_process_group

        def init_process_group(backend=None, *a, **kw):
            if backend in (None, "gloo", "cpu:gloo"):
                backend = c10d.BACKEND
            return original(backend, *a, **kw)

        dist.init_process_group = init_process_group
        dist.distributed_c10d.init_process_group = init_process_group
    if target[0] == "-m":
        sys.argv = [target[1], *args]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target[0], *args]
        sys.path.insert(0, str(Path(target[0]).parent))  # as `python script.py` does
        runpy.run_path(target[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 3 and argv[0] == "rank":
        n = 2 if argv[2] == "-m" else 1
        if len(argv) >= 2 + n:
            _rank(argv[1], argv[2:2 + n], argv[2 + n:])
            return 0
    print("usage: python -m testbed.launch rank testbed-node=HOST (SCRIPT | -m MODULE) "
          "[ARGS...] (started by 'testbed launch')", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
