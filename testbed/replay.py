"""``testbed replay``: MLCommons Chakra execution traces replayed on the emulated fabric.

A trace is one file per rank, ``<prefix>.<rank>.et``: a ``GlobalMetadata`` message and then
``Node`` messages (Chakra's ``et_def.proto``, each length-delimited), the format ASTRA-sim,
SimAI and ATLAHS take. Each rank walks its graph in its emulated host, in dependency order
(data and control dependencies; among ready nodes, the lowest id first, so every rank issues
its collectives in one order), a node once what it depends on ended. Communication does not
hold the walk up, as ASTRA-sim issues every ready node and a GPU computes beside its
communication stream: a backward pass whose next layer does not wait for the last bucket's
allreduce overlaps it.

* ``COMP_NODE``: waits ``duration_micros`` (times ``scale``, times the network's time
  dilation, so compute and communication keep their ratio);
* ``COMM_COLL_NODE``: the real collective of ``comm_size`` bytes (attribute ``comm_type``:
  ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, BARRIER) through
  ``torch.distributed``: plain gloo, or with ``algo`` the testbed's backend
  (:mod:`testbed.c10d`: float32 allreduces through ring, hd, INA...), one at a time on
  the rank's collective stream (a thread of its own, in the walk's order, as NCCL's stream).
  ``comm_size`` follows nccl-tests: the whole array (the gathered output of an all-gather,
  the input of a reduce-scatter);
* ``COMM_SEND_NODE`` / ``COMM_RECV_NODE``: ``comm_size`` bytes to ``comm_dst`` / from
  ``comm_src`` (attribute ``comm_tag`` optional), TCP between the hosts, posted
  (``isend``/``irecv``): a pipeline stage's send and receive run at once;
* memory and metadata nodes: recorded, nothing to run.

**Communicator groups**: a collective whose ``pg_name`` attribute names a group runs among
that group's ranks only (a ``torch.distributed`` subgroup over gloo; the world's collectives
go through ``algo``). The groups come as ASTRA-sim takes them (``--comm-group-configuration``):
a JSON object, group name -> its ranks, ``{"1": [0, 1], "2": [2, 3]}``; ``pg_name`` unset,
empty or ``"0"`` is the world. The members of a group issue its collectives in one order
(each group is checked on its own), and the ranks must not wait on each other forever across
groups (checked by running the graphs' order without times); the model prices a group's
collective on its members' hosts.

The ranks run as a launched job (:mod:`testbed.launch`). Everything is checked before any
network is built (:func:`testbed.workloads.chakra.load_trace`, where the format lives:
reading, checking, scheduling and writing traces); :class:`TraceError` names the file, the
node and the problem.

Several traces at once are tenants of one network (:func:`replay_tenants`), each on hosts of
its own from its arrival, admitted to one provider when it asks for a plan. An experiment
file runs them on its network with ``[[replay]]`` entries (:func:`replay_on`).

Output (:func:`replay`): a row per node per rank (start, end, undilated), a row per
collective (the last rank's arrival to the last rank's finish, the flow model's prediction
on the network), the trace's job completion time, and a validation table in the form
ASTRA-sim publishes: per collective, size and algorithm, measured against predicted, the error
in %, and the geometric mean of the errors. Needs the ``[torch]`` and ``[traces]`` extras.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

from testbed import at_once, describe_error
from testbed.workloads.chakra import (
    Node,
    TraceError,
    group_ranks,
    load_rank,
    load_trace,
    order,
    predict_jct,
    read_groups,
    trace_hints,
)

#: The ``CollectiveSpec.op`` the flow model predicts each with (None: no prediction).
MODEL_OPS = {"all_reduce": "allreduce", "all_gather": "allgather",
             "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}


@dataclasses.dataclass
class Replayed:
    """What a replay measured: ``nodes`` (a row per node per rank), ``collectives`` (a row per
    collective: measured and predicted), ``validation`` (per op, size and algorithm), the
    job completion time ``jct_s`` and the model's for the whole trace ``model_jct_s`` (None
    where a node has no prediction), the geometric mean of the errors ``geomean_error_pct``,
    the ``folder`` with everything, and the launch (``launched``: its ``returncode`` and
    ``failures`` say whether every rank finished)."""

    nodes: list[dict]
    collectives: list[dict]
    validation: list[dict]
    jct_s: float
    geomean_error_pct: float | None
    folder: Path
    launched: object
    model_jct_s: float | None = None


def replay(prefix: str | Path, *, algo: str | None = None,
           experiment: str | Path | None = None, topology: dict | None = None,
           time_dilation: float | str | None = None, scale: float = 1.0,
           out: str | Path | None = None, timeout_s: float = 600.0, echo=None,
           stop=None, groups: dict[str, list[int]] | str | Path | None = None,
           hints: dict | None = None, policy: str = "cooperative") -> Replayed:
    """Replay the trace ``prefix`` on an emulated network with a rank per host (the
    experiment file's first point's network, or a star of as many hosts as ranks at 100 Mb/s
    changed by ``topology``); ``algo``: the testbed algorithm of its float32 allreduces
    (None: gloo; ``"auto"``: the provider's ``policy`` plans them from ``hints`` over what
    :func:`trace_hints` finds); ``scale``: factor on compute durations; ``stop``: an event that
    stops the ranks (:func:`testbed.launch.launch`), the replay then reports what they ran;
    ``groups``: the communicator groups (name -> ranks, or ASTRA-sim's JSON file of them).
    TraceError before anything is built when the trace cannot be replayed."""
    return replay_tenants([Tenant(prefix, algo=algo, hints=hints, groups=groups, scale=scale)],
                          experiment=experiment, topology=topology,
                          time_dilation=time_dilation, out=out, timeout_s=timeout_s,
                          echo=echo, stop=stop, policy=policy).replayed[0]


@dataclasses.dataclass
class Tenant:
    """One trace of a multi-tenant replay (:func:`replay_tenants`): its ``prefix``, when it
    arrives (``arrival_s``, undilated seconds after the first tenant's start), the testbed
    ``algo`` of its float32 allreduces (None: gloo; ``"auto"``: the provider plans them from
    ``hints``, over what :func:`trace_hints` finds), its communicator ``groups``, the ``scale`` of
    its compute durations and a ``name`` (default: the prefix's file name)."""

    prefix: str | Path
    arrival_s: float = 0.0
    algo: str | None = None
    hints: dict | None = None
    groups: dict[str, list[int]] | str | Path | None = None
    scale: float = 1.0
    name: str | None = None


@dataclasses.dataclass
class ReplayedTenants:
    """What a multi-tenant replay measured: each tenant's :class:`Replayed` (in the order
    given), a row per tenant (``tenants``: hosts, arrival, start and end on one clock, JCT
    against the model's for the trace alone, the plan), the ``folder`` with everything."""

    replayed: list[Replayed]
    tenants: list[dict]
    folder: Path


def _checked_tenants(tenants: list[Tenant], policy: str) -> list[tuple]:
    """(tenant, name, groups, ranks) of each, everything checked before a network is built:
    ValueError / TraceError naming the tenant."""
    from testbed.launch import _check_plan_request

    if not tenants:
        raise ValueError("no traces to replay")
    out, names = [], set()
    for k, t in enumerate(tenants):
        name = t.name or Path(t.prefix).name
        if name in names:
            raise ValueError(f"tenants {name!r}: two tenants of one name (give each a name)")
        names.add(name)
        for what, v in (("arrival_s", t.arrival_s), ("scale", t.scale)):
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 \
                    or not math.isfinite(v):
                raise ValueError(f"tenant {k} ({name}): {what}={v!r} must be a number >= 0")
        if t.algo == "auto":
            _check_plan_request(t.hints, policy)
        elif t.hints:
            raise ValueError(f"tenant {k} ({name}): hints are for algo 'auto' (the provider "
                             "plans with them)")
        groups = read_groups(t.groups) if isinstance(t.groups, str | Path) else \
            dict(t.groups or {})
        out.append((t, name, groups, load_trace(t.prefix, groups)))
    return out


def replay_tenants(tenants: list[Tenant], *, experiment: str | Path | None = None,
                   topology: dict | None = None, time_dilation: float | str | None = None,
                   out: str | Path | None = None, timeout_s: float = 600.0, echo=None,
                   stop=None, policy: str = "cooperative") -> ReplayedTenants:
    """Replay several traces at once on one network built for them (:func:`replay_on`): the
    experiment file's first point's, or a star of as many hosts as all the tenants' ranks at
    100 Mb/s changed by ``topology``. Every trace is checked before anything is built
    (:class:`TraceError` naming it); the results go to a new folder under ``out`` (default:
    the results root)."""
    from testbed.collectives.algorithms import is_offloaded
    from testbed.experiment import results
    from testbed.launch import launch_network

    checked = _checked_tenants(tenants, policy)
    offloaded = any(t.algo == "auto" or (t.algo and is_offloaded(t.algo))
                    for t, *_ in checked)
    topo = {**({"switch": "programmable"} if offloaded else {}), **(topology or {})}
    network = launch_network(topo, experiment, sum(len(ranks) for *_, ranks in checked),
                             "ina" if offloaded else None, time_dilation)
    root = Path(results.results_root() if out is None else out)
    single = len(checked) == 1
    folder = results.unique_folder(root, f"replay-{checked[0][1]}" if single else
                                   "replay-tenants")
    with network as net:
        return _replay_checked(net, checked, folder, single, timeout_s, echo, stop, policy)


def replay_on(net, tenants: list[Tenant], folder: str | Path, *, timeout_s: float = 600.0,
              echo=None, stop=None, policy: str = "cooperative") -> ReplayedTenants:
    """Replay several traces at once on the running network ``net``, each tenant on hosts of
    its own (a rank per host, the tenants' hosts one after the other in the order given), each
    starting at its ``arrival_s``. Tenants with ``algo="auto"`` are admitted at their arrival
    to one provider (a fabric manager of this network running ``policy``), which plans each
    beside the jobs it already holds, and released when they end; a tenant that fails (a plan
    it cannot run, a rank that dies) fails alone. Each tenant's results go to
    ``folder/<name>/``, the table of tenants to ``folder/tenants.csv``. ``echo(line)``: the
    ranks' output, prefixed ``[tenant][rank]``. Every trace is checked before anything
    runs."""
    return _replay_checked(net, _checked_tenants(tenants, policy), Path(folder), False,
                           timeout_s, echo, stop, policy)


def _replay_checked(net, checked: list[tuple], folder: Path, single: bool, timeout_s: float,
                    echo, stop, policy: str) -> ReplayedTenants:
    """:func:`replay_on` of tenants already checked; ``single``: one tenant whose results
    fill ``folder`` itself (the single-trace replay's layout), and whose error is raised."""
    import threading

    from testbed.launch import backend_settings, fabric_manager, job_hosts, provider_replans

    sizes = [len(ranks) for *_, ranks in checked]
    total = sum(sizes)
    if len(net.hosts) < total:
        what = f"{checked[0][0].prefix}: {total} ranks" if len(checked) == 1 else \
            f"{len(checked)} traces: {total} ranks in all ({sizes})"
        raise TraceError(f"{what}, but the network has {len(net.hosts)} hosts")
    from testbed.collectives.runner import check_memory

    largest = [max((x.bytes for x in nodes), default=0)
               for *_, ranks in checked for nodes in ranks.values()]
    try:
        check_memory(net, largest, ", ".join(str(t.prefix) for t, *_ in checked))
    except ValueError as e:
        raise TraceError(str(e)) from None
    folder.mkdir(parents=True, exist_ok=True)
    done: list[Replayed | None] = [None] * len(checked)
    rows: list[dict] = [{} for _ in checked]
    errors: list[BaseException | None] = [None] * len(checked)
    f = float(net.time_dilation)
    manager = fabric_manager(net, policy) if any(t.algo == "auto" for t, *_ in checked) \
        else None
    lock = threading.Lock()  # the manager is not thread-safe
    halt = stop if stop is not None else threading.Event()  # stops every tenant
    t0 = time.time()

    def one(k: int) -> None:
        t, name, groups, ranks = checked[k]
        hosts = list(range(sum(sizes[:k]), sum(sizes[:k + 1])))
        row = rows[k]
        row.update(tenant=name, prefix=str(t.prefix), ranks=len(ranks),
                   hosts=[h.name for h in job_hosts(net, hosts)], arrival_s=t.arrival_s,
                   algo=t.algo, plan=None, planned=None)
        if halt.wait(t.arrival_s * f):
            return
        job_id = k + 1
        sub = folder if single else folder / name
        plans = None
        try:
            if t.algo == "auto":
                tj, plan = _admit(net, manager, lock, hosts,
                                  {**trace_hints(ranks), **(t.hints or {})}, policy,
                                  job_id, name)
                row["plan"] = {"algo": plan.algo, "compressor": plan.compressor,
                               "tree": plan.tree, "reason": plan.reason}
                row["planned"] = plan.algo + (f"+{plan.compressor}" if plan.compressor
                                              else "")
                plans = provider_replans(manager, name, lock)
            else:
                tj = backend_settings(t.algo, None, None, False, job_id)
            try:
                done[k] = _replay_on(net, t.prefix, ranks, groups, tj, hosts, sub, t.scale,
                                     timeout_s, _prefixed(echo, name, single), halt, t0,
                                     plans)
            finally:
                if t.algo == "auto":
                    with lock:
                        manager.release(name)
        except Exception as e:  # noqa: BLE001 - this tenant's; the others go on
            errors[k] = e

    # a Ctrl-C stops every tenant's ranks before the teardown
    at_once(one, len(checked), "tenant", on_interrupt=halt.set)
    if single and errors[0] is not None:
        raise errors[0]
    table = []
    for k, row in enumerate(rows):
        r = done[k]
        if r is not None:
            starts = [x["at_s"] for x in r.nodes]
            errs = [c["max_abs_err"] for c in r.collectives if c.get("max_abs_err") is not None]
            row.update(start_s=min(starts, default=None),
                       end_s=max((x["at_s"] + x["time_s"] for x in r.nodes), default=None),
                       jct_s=r.jct_s, model_jct_s=r.model_jct_s,
                       slowdown=r.jct_s / r.model_jct_s if r.model_jct_s else None,
                       geomean_error_pct=r.geomean_error_pct,
                       collectives=len(r.collectives), max_abs_err=max(errs, default=None),
                       replans=r.launched.replans,
                       failed=bool(r.launched.returncode),
                       error=" | ".join(r.launched.failures)[:2000] or None,
                       folder=str(r.folder))
        else:
            row.update(failed=True, error=describe_error(errors[k]) if errors[k] else
                       "stopped before it arrived")
        table.append(row)
    if not single:
        _save_tenants(folder, table)
    return ReplayedTenants([r for r in done if r is not None], table, folder)


def _admit(net, manager, lock, hosts: list[int], hints: dict, policy: str, job_id: int,
           name: str):
    """(backend settings, plan) of a tenant admitted to ``manager`` beside the others; a
    plan it cannot run releases it again."""
    from testbed.launch import planned_settings

    with lock:
        try:
            return planned_settings(net, hosts, hints, policy, job_id, name, manager=manager)
        except ValueError:
            if name in manager.jobs():
                manager.release(name)
            raise


def _prefixed(echo, name: str, single: bool):
    """``echo`` of one tenant's output lines (prefixed with its name when there are several)."""
    if echo is None or single:
        return echo
    return lambda line: echo(f"[{name}]{line}")


def _replay_on(net, prefix, ranks: dict[int, list[Node]], groups: dict[str, list[int]], tj,
               hosts: list[int], folder: Path, scale: float, timeout_s: float, echo, stop,
               t0: float, plans=None) -> Replayed:
    """Replay one checked trace on ``hosts`` (host ranks) of the running ``net`` into
    ``folder``; node times from ``t0`` (wall clock, undilated)."""
    from testbed.launch import job_hosts, run_script

    n = len(ranks)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "comm_groups.json").write_text(json.dumps(groups))
    f = float(net.time_dilation)
    names = [h.name for h in job_hosts(net, hosts)]
    done = run_script(net, __name__, [str(Path(prefix).resolve()), str(folder),
                                      str(scale * f)],
                      tj, folder, hosts=hosts, timeout_s=timeout_s, echo=echo, module=True,
                      stop=stop, plans=plans)
    rows = _node_rows(folder, n, f, t0)
    # which path each collective took, as the backend traced it (rank 0's calls in order)
    paths = [r["path"] for r in sorted((r for r in done.trace if r["rank"] == 0),
                                       key=lambda r: r["start_s"])
             if not r["op"].startswith(("send", "recv"))]
    transfer_s = _transfer_model(net, names, f)
    colls = _collective_rows(rows, net, names, tj, f, paths, transfer_s, groups)
    model_jct = predict_jct(ranks, {c["seq"] if c["group"] is None else
                                    (c["group"], c["seq"]): c["model_s"] for c in colls},
                            transfer_s, scale, groups)
    jct = (max((r["end_s"] for r in rows), default=0.0)
           - min((r["start_s"] for r in rows), default=0.0))
    validation, geo = _validation(colls)
    _save(folder, rows, colls, validation, jct, geo, done, model_jct)
    return Replayed(rows, colls, validation, jct, geo, folder, done, model_jct)


def _save_tenants(folder: Path, table: list[dict]) -> None:
    """``tenants.csv`` and ``tenants.json`` of a multi-tenant replay."""
    import pandas as pd

    pd.DataFrame(table).to_csv(folder / "tenants.csv", index=False)
    (folder / "tenants.json").write_text(json.dumps(table, indent=2, default=str))


def _node_rows(folder: Path, n: int, f: float, t0: float) -> list[dict]:
    """The ranks' node rows: undilated, from the trace's first node's start (``start_s``,
    ``end_s``) and from ``t0`` (``at_s``: where tenants share one clock)."""
    from testbed.launch import collect_rank_rows

    rows = collect_rank_rows(folder, "nodes", n)
    first = min((row["start_s"] for row in rows), default=0.0)
    for row in rows:
        row["at_s"] = (row["start_s"] - t0) / f
        row["start_s"], row["end_s"] = (row["start_s"] - first) / f, (row["end_s"] - first) / f
        row["time_s"] = row["end_s"] - row["start_s"]
    return rows


def _collective_rows(rows: list[dict], net, hosts: list[str], tj, f: float, paths: list[str],
                     transfer_s, groups: dict[str, list[int]] | None = None) -> list[dict]:
    """A row per collective (per communicator group, in its order): from the last member's
    arrival to the last member's finish, and the flow model's time for it on its members'
    hosts (``hosts``: rank -> host name); ``paths``: the path of each of the world's in order (``testbed:<algo>`` or
    ``gloo``, from the backend's trace; none traced over plain gloo; a group's run over
    gloo); ``transfer_s``: :func:`_transfer_model`'s prices of point-to-point transfers."""
    from testbed.collectives import flowmodel
    from testbed.collectives.spec import CollectiveSpec

    by_seq: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["kind"] == "coll":
            by_seq.setdefault((row.get("group") or "", row["seq"]), []).append(row)
    hop = net.hop_latency_s()
    impairments = net.link_impairments()
    n = len(hosts)
    out, cache = [], {}
    for (gname, seq), members in sorted(by_seq.items()):
        group = gname or None
        first = members[0]
        ranks = group_ranks(group, groups or {}, n)
        ours = group is None and tj is not None and seq < len(paths) and \
            paths[seq].startswith("testbed:")
        # the algorithm it ran (a re-planned job's changes); gloo's: predicted as the ring
        algo = paths[seq].removeprefix("testbed:") if ours else "ring"
        key = (first["op"], first["bytes"], algo, tuple(ranks))
        if key not in cache:
            cache[key] = None
            op = MODEL_OPS.get(first["op"])
            k = len(ranks)
            if first["op"] == "all_to_all" and k > 1 and ours:  # the testbed's all-to-all
                cache[key] = flowmodel.all_to_all_s(net.routed_topo, [hosts[r] for r in ranks],
                                                    first["bytes"], job_id=tj.job_id,
                                                    hop_latency_s=hop, time_dilation=f)
            elif first["op"] == "all_to_all" and k > 1:  # every pair's part at once, as gloo
                cache[key] = transfer_s([(a, b, first["bytes"] / k) for a in ranks
                                         for b in ranks if a != b])
            elif op and first["bytes"] >= 4 and first["bytes"] % 4 == 0 and k > 1:
                spec = CollectiveSpec(op=op, algo=algo, nbytes=first["bytes"])
                try:
                    cache[key] = flowmodel.predict(net.routed_topo, spec,
                                                   workers=[hosts[r] for r in ranks],
                                                   hop_latency_s=hop, time_dilation=f,
                                                   impairments=impairments).time_s
                except ValueError:  # a size or rank count the model does not take
                    cache[key] = None
        out.append({"seq": seq, "group": group, "node": first["node"], "name": first["name"],
                    "op": first["op"], "bytes": first["bytes"],
                    "path": f"testbed:{algo}" if ours else "gloo",
                    "time_s": max(r["end_s"] for r in members)
                    - max(r["start_s"] for r in members),
                    "model_s": cache[key], "ranks": len(members),
                    "max_abs_err": max((r["max_abs_err"] for r in members
                                        if r.get("max_abs_err") is not None), default=None)})
    return out


def _transfer_model(net, hosts: list[str], f: float):
    """``fn([(rank, rank, bytes), ...])`` -> the flow model's time of those TCP transfers at
    once between the ranks' ``hosts`` (rank -> host name) of ``net`` (undilated; None where
    it does not apply)."""
    from testbed.collectives import flowmodel

    hop = net.hop_latency_s()

    def fn(transfers: list[tuple[int, int, float]]) -> float | None:
        try:
            return flowmodel.transfers_s(net.routed_topo, [(hosts[a], hosts[b], x)
                                                    for a, b, x in transfers],
                                         hop_latency_s=hop, time_dilation=f)
        except ValueError:  # e.g. a path without a shaped link
            return None
    return fn


def _validation(colls: list[dict]) -> tuple[list[dict], float | None]:
    """Per (op, bytes, path): measured (median) against predicted, the error in %; and the
    geometric mean of |error| over the rows that have a prediction."""
    groups: dict[tuple, list[dict]] = {}
    for c in colls:
        groups.setdefault((c["op"], c["bytes"], c["path"]), []).append(c)
    rows, logs = [], []
    for (op, size, path), cs in sorted(groups.items()):
        times = sorted(c["time_s"] for c in cs)
        measured = times[len(times) // 2]
        model = cs[0]["model_s"]
        err = None if not model else (measured / model - 1) * 100
        rows.append({"op": op, "bytes": size, "path": path, "count": len(cs),
                     "measured_s": measured, "predicted_s": model,
                     "error_pct": err})
        if err is not None and measured > 0:
            logs.append(math.log(max(abs(err), 1e-3)))
    geo = math.exp(sum(logs) / len(logs)) if logs else None
    return rows, geo


def _save(folder: Path, rows, colls, validation, jct, geo, done, model_jct) -> None:
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    if rows:
        pd.DataFrame(rows).to_csv(folder / "nodes.csv", index=False)
    if colls:
        pd.DataFrame(colls).to_csv(folder / "collectives.csv", index=False)
    if validation:
        pd.DataFrame(validation).to_csv(folder / "validation.csv", index=False)
    events = [{"name": r["name"] or f"{r['kind']} {r['node']}", "cat": r["kind"], "ph": "X",
               "ts": r["start_s"] * 1e6, "dur": r["time_s"] * 1e6, "pid": 0,
               "tid": r["rank"], "args": {"node": r["node"], "op": r.get("op"),
                                          "bytes": r.get("bytes")}} for r in rows]
    (folder / "timeline.json").write_text(json.dumps({"traceEvents": events}))
    meta = json.loads((folder / "launch.json").read_text()) if \
        (folder / "launch.json").exists() else {}
    meta.update(jct_s=jct, model_jct_s=model_jct, geomean_error_pct=geo,
                collectives=len(colls), nodes=len(rows))
    (folder / "replay.json").write_text(json.dumps(meta, indent=2, default=str))


# ---------------------------------------------------------------------------- inside a rank

def _run_rank(prefix: str, folder: str, compute_factor: float) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    nodes = order(load_rank(f"{prefix}.{rank}.et"))
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    names = json.loads((Path(folder) / "comm_groups.json").read_text())
    # every rank creates every group, in one order (torch.distributed's rule), over gloo
    subgroups = {g: (dist.new_group(sorted(names[g]), backend="gloo"), sorted(names[g]))
                 for g in sorted(names)}
    seq: dict[str | None, int] = {}
    posted: dict[int, tuple] = {}  # communication under way: node id -> (handle, row)
    stream = _Stream()

    def settle(ids, log, wait: bool) -> None:
        """Log the communication among ``ids`` that ended (``wait``: wait for each first; a
        collective that failed raises here)."""
        for i in [i for i in ids if i in posted]:
            handle, row = posted[i]
            if wait:
                handle.wait()
            elif not handle.is_completed():
                continue
            row.setdefault("end_s", time.time())  # a collective's: set where it ran
            log.write(json.dumps(row) + "\n")
            del posted[i]

    def collective(x: Node, row: dict, members: list[int], pg) -> None:
        row["start_s"] = time.time()
        row["max_abs_err"] = _collective(dist, torch, x, members, pg)
        row["end_s"] = time.time()

    with open(Path(folder) / f"nodes{rank}.jsonl", "w") as log:
        for x in nodes:
            settle(x.deps, log, wait=True)  # a node starts after what it depends on
            row = {"rank": rank, "node": x.id, "name": x.name, "kind": x.kind, "op": x.op,
                   "bytes": x.bytes, "peer": x.peer, "start_s": time.time()}
            if x.kind in ("send", "recv"):  # posted, as ASTRA-sim issues every ready node
                post = dist.isend if x.kind == "send" else dist.irecv
                posted[x.id] = (post(_buffer(torch, x.bytes), x.peer, tag=x.tag), row)
                continue
            if x.kind == "coll":  # onto the rank's collective stream, in the walk's order
                pg, members = subgroups[x.group] if x.group is not None else \
                    (None, list(range(n)))
                row["group"], row["seq"] = x.group, seq.get(x.group, 0)
                seq[x.group] = row["seq"] + 1
                posted[x.id] = (stream.submit(lambda x=x, row=row, members=members, pg=pg:
                                              collective(x, row, members, pg)), row)
                continue
            if x.kind == "comp":
                time.sleep(x.duration_s * compute_factor)
            row["end_s"] = time.time()
            log.write(json.dumps(row) + "\n")
            settle(list(posted), log, wait=False)
        settle(list(posted), log, wait=True)
    dist.barrier()
    dist.destroy_process_group()


class _Stream:
    """A rank's collectives, one at a time in the order its walk reached them, on a thread of
    their own (a GPU's communication stream, NCCL's order): the walk goes on past a
    collective, and a node that depends on one waits for it. The thread is a daemon: a rank
    whose collective failed raises in its walk and exits, whatever still waits here."""

    class Handle:
        """One collective on the stream: ``wait`` (raises what it raised), ``is_completed``."""

        def __init__(self):
            self.done, self.error = threading.Event(), None

        def wait(self) -> None:
            self.done.wait()
            if self.error is not None:
                raise self.error

        def is_completed(self) -> bool:
            return self.done.is_set()

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="collectives", daemon=True).start()

    def _serve(self) -> None:
        while True:
            run, handle = self.jobs.get()
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - raised again by handle.wait()
                handle.error = e
            handle.done.set()

    def submit(self, run) -> _Stream.Handle:
        handle = self.Handle()
        self.jobs.put((run, handle))
        return handle


def _buffer(torch, nbytes: int):
    """float32 when the size allows (the testbed's algorithms take it), else bytes."""
    if nbytes % 4 == 0:
        return torch.ones(nbytes // 4, dtype=torch.float32)
    return torch.ones(nbytes, dtype=torch.uint8)


def _collective(dist, torch, x: Node, members: list[int], group=None) -> float | None:
    """``x`` among ``members`` (global ranks) on process group ``group`` (None: the world);
    an allreduce's largest error against the exact sum of its inputs (every rank sends ones:
    the sum is the member count), an all-to-all's against the parts it should have received
    (part j of member i holds i*n + j, modulo 251), None for the others."""
    n = len(members)
    if x.op == "barrier":
        dist.barrier(group=group)
    elif x.op == "all_reduce":
        buf = _buffer(torch, x.bytes)
        dist.all_reduce(buf, group=group)
        return float((buf.double() - n).abs().max()) if buf.numel() else 0.0
    elif x.op == "broadcast":
        dist.broadcast(_buffer(torch, x.bytes), src=members[0], group=group)
    else:  # the size is the whole array: n equal parts (rounded up to whole elements)
        dtype, item = (torch.float32, 4) if x.bytes % (4 * n) == 0 else (torch.uint8, 1)
        part = -(-x.bytes // (item * n))
        whole = torch.ones(part * n, dtype=dtype)
        mine = torch.ones(part, dtype=dtype)
        if x.op == "all_gather":
            dist.all_gather_into_tensor(whole, mine, group=group)
        elif x.op == "reduce_scatter":
            dist.reduce_scatter_tensor(mine, whole, group=group)
        else:  # all_to_all
            me = members.index(dist.get_rank())
            for j in range(n):
                whole[j * part:(j + 1) * part] = (me * n + j) % 251
            got = torch.empty_like(whole)
            dist.all_to_all_single(got, whole, group=group)
            want = torch.cat([torch.full((part,), (i * n + me) % 251, dtype=dtype)
                              for i in range(n)])
            return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    return None


if __name__ == "__main__":
    _run_rank(sys.argv[1], sys.argv[2], float(sys.argv[3]))
