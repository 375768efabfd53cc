"""``testbed replay``: MLCommons Chakra execution traces replayed on the emulated fabric.

A trace is one file per rank, ``<prefix>.<rank>.et``: a ``GlobalMetadata`` message and then
``Node`` messages (Chakra's ``et_def.proto``, each length-delimited), the format ASTRA-sim,
SimAI and ATLAHS take. Each rank replays its graph in its emulated host, in dependency order
(data and control dependencies; among ready nodes, the lowest id first, so every rank issues
its collectives in one order):

* ``COMP_NODE``: waits ``duration_micros`` (times ``scale``, times the network's time
  dilation, so compute and communication keep their ratio);
* ``COMM_COLL_NODE``: the real collective of ``comm_size`` bytes (attribute ``comm_type``:
  ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, BARRIER) through
  ``torch.distributed``: plain gloo, or with ``algo`` the testbed's backend
  (:mod:`testbed.c10d`: float32 allreduces through ring, hd, INA...). ``comm_size`` follows
  nccl-tests: the whole array (the gathered output of an all-gather, the input of a
  reduce-scatter);
* ``COMM_SEND_NODE`` / ``COMM_RECV_NODE``: ``comm_size`` bytes to ``comm_dst`` / from
  ``comm_src`` (attribute ``comm_tag`` optional), TCP between the hosts;
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
network is built (:func:`load_trace`): missing or extra rank files, a truncated or undecodable
protobuf, duplicate ids, dependencies on nodes that do not exist, cycles, unknown node or
collective types, communicator groups the configuration lacks or a rank outside its group,
collectives that a group's ranks would not issue in the same order, ranks that would wait on
each other forever, sends without their receive.
:class:`TraceError` names the file, the node and the problem.

Output (:func:`replay`): a row per node per rank (start, end, undilated), a row per
collective (the last rank's arrival to the last rank's finish, the flow model's prediction
on the network), the trace's job completion time, and a validation table in the form
ASTRA-sim publishes: per collective, size and algorithm, measured against predicted, the error
in %, and the geometric mean of the errors. Needs the ``[torch]`` and ``[traces]`` extras.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from testbed import describe_error

#: Chakra's collective types that are replayed, by the name ``torch.distributed`` gives them.
COLLECTIVES = {"ALL_REDUCE": "all_reduce", "ALL_GATHER": "all_gather",
               "REDUCE_SCATTER": "reduce_scatter", "ALL_TO_ALL": "all_to_all",
               "BROADCAST": "broadcast", "BARRIER": "barrier"}
#: The ``CollectiveSpec.op`` the flow model predicts each with (None: no prediction).
MODEL_OPS = {"all_reduce": "allreduce", "all_gather": "allgather",
             "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}


#: testbed.c10d's traced op names -> Chakra's collective types (the export's)
TRACED_COLLECTIVES = {"allreduce": "ALL_REDUCE", "allgather": "ALL_GATHER",
                      "reduce_scatter": "REDUCE_SCATTER", "all_to_all": "ALL_TO_ALL",
                      "broadcast": "BROADCAST", "barrier": "BARRIER"}


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, the node and why."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a rank's graph, as the replay needs it."""

    id: int
    name: str
    kind: str  # comp, coll, send, recv, mem, meta
    deps: tuple[int, ...] = ()
    duration_s: float = 0.0
    op: str | None = None  # a collective's torch.distributed name
    bytes: int = 0
    peer: int | None = None  # send: destination, recv: source
    tag: int = 0
    group: str | None = None  # a collective's communicator group (None: the world)

#: ``pg_name`` values that mean the world group
WORLD_NAMES = (None, "", "0")


def _schema():
    try:
        from chakra.schema.protobuf import et_def_pb2
    except ImportError as e:
        raise TraceError("replaying Chakra traces needs the [traces] extra (.venv/bin/pip "
                         f"install -e '.[traces]': mlc-chakra): {e}") from None
    return et_def_pb2


def _messages(path: Path):
    """The length-delimited messages of ``path`` as bytes (TraceError when one is cut)."""
    from google.protobuf.internal.decoder import _DecodeVarint32

    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        try:
            size, start = _DecodeVarint32(data, pos)
        except Exception:  # noqa: BLE001 - the varint decoder raises its own types
            raise TraceError(f"{path}: a message length at byte {pos} is cut off "
                             "(truncated file?)") from None
        if start + size > len(data):
            raise TraceError(f"{path}: the message at byte {pos} says {size} bytes but only "
                             f"{len(data) - start} follow (truncated file?)")
        yield pos, data[start:start + size]
        pos = start + size


def _attrs(node) -> dict:
    out = {}
    for a in node.attr:
        which = a.WhichOneof("value")
        out[a.name] = getattr(a, which) if which else None
    return out


def load_rank(path: str | Path, n_ranks: int | None = None) -> list[Node]:
    """The nodes of one rank's file, checked on their own (see the module docstring)."""
    pb = _schema()
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    messages = list(_messages(path))
    if not messages:
        raise TraceError(f"{path}: empty file (expected GlobalMetadata and nodes)")
    meta = pb.GlobalMetadata()
    try:
        meta.ParseFromString(messages[0][1])
    except DecodeError as e:
        raise TraceError(f"{path}: the first message is not Chakra's GlobalMetadata: {e}") \
            from None
    nodes: list[Node] = []
    kinds = {pb.COMP_NODE: "comp", pb.COMM_COLL_NODE: "coll", pb.COMM_SEND_NODE: "send",
             pb.COMM_RECV_NODE: "recv", pb.MEM_LOAD_NODE: "mem", pb.MEM_STORE_NODE: "mem",
             pb.METADATA_NODE: "meta"}
    for pos, raw in messages[1:]:
        msg = pb.Node()
        try:
            msg.ParseFromString(raw)
        except DecodeError as e:
            raise TraceError(f"{path}: the node message at byte {pos} does not decode: {e}") \
                from None
        where = f"{path}: node {msg.id} ({msg.name!r})"
        if msg.type not in kinds:
            known = msg.type in pb.NodeType.values()
            raise TraceError(f"{where}: node type "
                             f"{pb.NodeType.Name(msg.type) if known else msg.type} is not "
                             "replayed (compute, collective, send, recv, memory and metadata "
                             "nodes are)")
        kind, attrs = kinds[msg.type], _attrs(msg)
        fields = {"id": int(msg.id), "name": msg.name, "kind": kind,
                  "deps": tuple(dict.fromkeys([*msg.data_deps, *msg.ctrl_deps])),
                  "duration_s": msg.duration_micros * 1e-6}
        if kind in ("coll", "send", "recv"):
            size = attrs.get("comm_size", 0)
            if not isinstance(size, int) or size < 0:
                raise TraceError(f"{where}: comm_size {size!r} must be a byte count >= 0")
            fields["bytes"] = size
            pg = attrs.get("pg_name")
            if pg not in WORLD_NAMES:
                fields["group"] = str(pg)
        if kind == "coll":
            ctype = attrs.get("comm_type")
            name = pb.CollectiveCommType.Name(ctype) if ctype in \
                pb.CollectiveCommType.values() else None
            if name not in COLLECTIVES:
                raise TraceError(f"{where}: collective type {name or ctype!r} is not replayed "
                                 f"(one of {', '.join(COLLECTIVES)})")
            fields["op"] = COLLECTIVES[name]
        elif kind in ("send", "recv"):
            key = "comm_dst" if kind == "send" else "comm_src"
            peer = attrs.get(key)
            if not isinstance(peer, int) or peer < 0 or (n_ranks is not None
                                                         and peer >= n_ranks):
                raise TraceError(f"{where}: {key} {peer!r} is not a rank of this trace "
                                 f"(0..{(n_ranks or 1) - 1})")
            fields["peer"], fields["tag"] = peer, int(attrs.get("comm_tag") or 0)
        nodes.append(Node(**fields))
    ids = [n.id for n in nodes]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise TraceError(f"{path}: node ids {dup} appear more than once")
    known = set(ids)
    for n in nodes:
        missing = [d for d in n.deps if d not in known]
        if missing:
            raise TraceError(f"{path}: node {n.id} ({n.name!r}) depends on nodes {missing}, "
                             "which are not in the file")
    order(nodes, path)  # raises on a cycle
    return nodes


def order(nodes: list[Node], path: str | Path = "trace") -> list[Node]:
    """The nodes in dependency order, the lowest id first among those ready (every rank of a
    trace orders its collectives by this one rule); TraceError on a cycle."""
    by_id = {n.id: n for n in nodes}
    waiting = {n.id: len(n.deps) for n in nodes}
    children: dict[int, list[int]] = {}
    for n in nodes:
        for d in n.deps:
            children.setdefault(d, []).append(n.id)
    ready = [i for i, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(by_id[i])
        for c in children.get(i, []):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, c)
    if len(out) != len(nodes):
        stuck = sorted(i for i, k in waiting.items() if k > 0)
        raise TraceError(f"{path}: the dependencies of nodes {stuck[:10]} form a cycle")
    return out


def rank_files(prefix: str | Path) -> dict[int, Path]:
    """Rank -> file of the trace ``prefix`` (``<prefix>.<rank>.et``)."""
    prefix = Path(prefix)
    found = {}
    for p in prefix.parent.glob(f"{prefix.name}.*.et"):
        m = re.fullmatch(re.escape(prefix.name) + r"\.(\d+)\.et", p.name)
        if m:
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def read_groups(path: str | Path) -> dict[str, list[int]]:
    """Communicator groups from a JSON file as ASTRA-sim takes them: group name -> ranks."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TraceError(f"communicator groups {path}: {e}") from None
    if not isinstance(data, dict):
        raise TraceError(f"communicator groups {path}: expected a JSON object, group name -> "
                         "list of ranks")
    return {str(k): v for k, v in data.items()}


def _check_groups(groups: dict, n: int, where: str) -> dict[str, list[int]]:
    out = {}
    for name, ranks in groups.items():
        if not isinstance(ranks, list) or not ranks or any(
                isinstance(r, bool) or not isinstance(r, int) for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise TraceError(f"{where}: communicator group {name!r}: {ranks!r} must be a list "
                             "of distinct rank numbers")
        outside = [r for r in ranks if not 0 <= r < n]
        if outside:
            raise TraceError(f"{where}: communicator group {name!r} names ranks {outside}, "
                             f"but the trace has ranks 0..{n - 1}")
        out[str(name)] = list(ranks)
    return out


def group_ranks(group: str | None, groups: dict[str, list[int]], n: int) -> list[int]:
    """The ranks of communicator ``group`` (None: the world), in rank order."""
    return list(range(n)) if group is None else sorted(groups[group])


def load_trace(prefix: str | Path, groups: dict[str, list[int]] | None = None
               ) -> dict[int, list[Node]]:
    """Every rank's nodes of the trace ``prefix``, checked alone and against each other (see
    the module docstring); ``groups``: the communicator groups (name -> ranks) its
    collectives' ``pg_name`` refer to. TraceError on the first problem."""
    files = rank_files(prefix)
    if not files:
        raise TraceError(f"no trace files {prefix}.<rank>.et")
    n = len(files)
    if sorted(files) != list(range(n)):
        missing = sorted(set(range(max(files) + 1)) - set(files))
        raise TraceError(f"{prefix}: rank files {missing} are missing (ranks must be "
                         f"0..N-1; found {sorted(files)})")
    groups = _check_groups(groups or {}, n, str(prefix))
    ranks = {r: load_rank(p, n) for r, p in files.items()}
    seqs: dict[str | None, dict[int, list]] = {}
    for r, nodes in ranks.items():
        for x in order(nodes):
            if x.kind != "coll":
                continue
            if x.group is not None and x.group not in groups:
                raise TraceError(
                    f"{files[r]}: node {x.id} ({x.name!r}) runs on communicator group "
                    f"{x.group!r}, which the group configuration lacks (it has "
                    f"{sorted(groups) or 'none'}: give the groups as ASTRA-sim's "
                    "--comm-group-configuration JSON, --comm-groups FILE)")
            if r not in group_ranks(x.group, groups, n):
                raise TraceError(f"{files[r]}: node {x.id} ({x.name!r}): rank {r} is not a "
                                 f"member of communicator group {x.group!r} "
                                 f"{groups[x.group]}")
            seqs.setdefault(x.group, {}).setdefault(r, []).append((x.op, x.bytes))
    for group, by_rank in seqs.items():
        members = group_ranks(group, groups, n)
        first = members[0]
        label = "the world" if group is None else f"communicator group {group!r}"
        for r in members:
            mine, theirs = by_rank.get(r, []), by_rank.get(first, [])
            if mine != theirs:
                k = next((i for i, (a, b) in enumerate(zip(theirs, mine, strict=False))
                          if a != b), min(len(theirs), len(mine)))
                raise TraceError(f"{files[r]}: its collective #{k} of {label} "
                                 f"{mine[k] if k < len(mine) else 'is missing'} differs "
                                 f"from rank {first}'s "
                                 f"{theirs[k] if k < len(theirs) else 'none'}: every rank "
                                 f"of {label} must issue its collectives in one order")
    sends: dict[tuple, int] = {}
    for r, nodes in ranks.items():
        for x in nodes:
            if x.kind == "send":
                sends[(r, x.peer, x.tag, x.bytes)] = sends.get((r, x.peer, x.tag, x.bytes), 0) + 1
            elif x.kind == "recv":
                sends[(x.peer, r, x.tag, x.bytes)] = sends.get((x.peer, r, x.tag, x.bytes), 0) - 1
    bad = [k for k, v in sends.items() if v]
    if bad:
        src, dst, tag, size = bad[0]
        raise TraceError(f"{prefix}: sends from rank {src} to rank {dst} (tag {tag}, {size} "
                         "B) do not match that rank's receives in number")
    stuck = _schedule(ranks, groups)[1]
    if stuck:
        raise TraceError(f"{prefix}: the ranks would wait on each other forever: "
                         + "; ".join(f"rank {r} at node {x.id} ({x.name!r}, {x.kind}"
                                     + (f" on group {x.group!r}" if x.group else "") + ")"
                                     for r, x in sorted(stuck.items())[:6]))
    return ranks


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


def trace_hints(ranks: dict[int, list[Node]]) -> dict:
    """A tenant's hints as its trace shows them (rank 0's graph), the trace taken as one
    iteration: the bytes its world allreduces (``collective_bytes``) and its compute time
    (``compute_s``); what a provider plans a replayed job with when the tenant says
    nothing."""
    nodes = ranks[min(ranks)]
    coll = sum(x.bytes for x in nodes if x.kind == "coll" and x.op == "all_reduce"
               and x.group is None)
    comp = sum(x.duration_s for x in nodes if x.kind == "comp")
    return {"iterations": 1, **({"collective_bytes": int(coll)} if coll else {}),
            **({"compute_s": comp} if comp else {})}


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
    """Replay several traces at once on one network, each tenant on hosts of its own (a rank
    per host, the tenants' hosts one after the other in the order given), each starting at
    its ``arrival_s``. Tenants with ``algo="auto"`` are admitted at their arrival to one
    provider (a fabric manager of this network running ``policy``), which plans each beside
    the jobs it already holds, and released when they end; a plan a tenant cannot run fails
    that tenant only. The network: the experiment file's first point's, or a star of as many
    hosts as all the tenants' ranks at 100 Mb/s changed by ``topology``. ``echo(line)``: the
    ranks' output, prefixed ``[tenant][rank]``. Every trace is checked before anything is
    built (:class:`TraceError` naming it)."""
    import threading

    from testbed.collectives.algorithms import is_offloaded
    from testbed.experiment import results
    from testbed.launch import backend_settings, fabric_manager, job_hosts, launch_network

    checked = _checked_tenants(tenants, policy)
    sizes = [len(ranks) for *_, ranks in checked]
    total = sum(sizes)
    offloaded = any(t.algo == "auto" or (t.algo and is_offloaded(t.algo))
                    for t, *_ in checked)
    topo = {**({"switch": "programmable"} if offloaded else {}), **(topology or {})}
    network = launch_network(topo, experiment, total, "ina" if offloaded else None,
                             time_dilation)
    root = Path(results.results_root() if out is None else out)
    single = len(checked) == 1
    folder = results.unique_folder(root, f"replay-{checked[0][1]}" if single else
                                   "replay-tenants")
    folder.mkdir(parents=True, exist_ok=True)
    done: list[Replayed | None] = [None] * len(checked)
    rows: list[dict] = [{} for _ in checked]
    errors: list[BaseException | None] = [None] * len(checked)
    with network as net:
        if len(net.hosts) < total:
            what = f"{checked[0][0].prefix}: {total} ranks" if single else \
                f"{len(checked)} traces: {total} ranks in all ({sizes})"
            raise TraceError(f"{what}, but the network has {len(net.hosts)} hosts")
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
            try:
                if t.algo == "auto":
                    tj, plan = _admit(net, manager, lock, hosts,
                                      {**trace_hints(ranks), **(t.hints or {})}, policy,
                                      job_id, name)
                    row["plan"] = {"algo": plan.algo, "compressor": plan.compressor,
                                   "tree": plan.tree, "reason": plan.reason}
                    row["planned"] = plan.algo + (f"+{plan.compressor}" if plan.compressor
                                                  else "")
                else:
                    tj = backend_settings(t.algo, None, None, False, job_id)
                try:
                    done[k] = _replay_on(net, t.prefix, ranks, groups, tj, hosts, sub, t.scale,
                                         timeout_s, _prefixed(echo, name, single), halt, t0)
                finally:
                    if t.algo == "auto":
                        with lock:
                            manager.release(name)
            except Exception as e:  # noqa: BLE001 - this tenant's; the others go on
                errors[k] = e

        if single:  # in this thread: a Ctrl-C reaches its ranks as before
            one(0)
        else:
            threads = [threading.Thread(target=one, args=(k,), name=f"tenant-{k}")
                       for k in range(len(checked))]
            for th in threads:
                th.start()
            try:
                for th in threads:
                    th.join()
            except KeyboardInterrupt:  # every tenant's ranks stopped before the teardown
                halt.set()
                for th in threads:
                    th.join()
                raise
    if single and errors[0] is not None:
        raise errors[0]
    table = []
    for k, row in enumerate(rows):
        r = done[k]
        if r is not None:
            starts = [x["at_s"] for x in r.nodes]
            row.update(start_s=min(starts, default=None),
                       end_s=max((x["at_s"] + x["time_s"] for x in r.nodes), default=None),
                       jct_s=r.jct_s, model_jct_s=r.model_jct_s,
                       slowdown=r.jct_s / r.model_jct_s if r.model_jct_s else None,
                       geomean_error_pct=r.geomean_error_pct,
                       failed=bool(r.launched.returncode), folder=str(r.folder))
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
               t0: float) -> Replayed:
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
                      stop=stop)
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


def export(trace: list[dict], prefix: str | Path, n_ranks: int) -> list[Path]:
    """Write what a launched job ran (``trace``: :mod:`testbed.c10d`'s rows, e.g.
    ``Launched.trace``) as a Chakra trace, ``<prefix>.<rank>.et`` per rank, that
    :func:`replay` (or ASTRA-sim) runs: per rank, in the order it ran them, each collective
    (``comm_size`` as nccl-tests counts it: an all-gather's gathered whole) and each send and
    recv, with a compute node before each for the time the rank spent between the previous
    one's end and its start (measured, not divided by a time dilation: compute ran at full
    speed), every node depending on the one before. Returns the files."""
    pb = _schema()
    from chakra.src.third_party.utils.protolib import encodeMessage

    files = []
    for rank in range(n_ranks):
        rows = sorted((r for r in trace if r["rank"] == rank), key=lambda r: r["start_s"])
        path = Path(f"{prefix}.{rank}.et")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
            prev: list[int] = []
            end = None
            for k, r in enumerate(rows):
                if end is not None and r["start_s"] > end:
                    comp = pb.Node(id=2 * k, name=f"compute{k}", type=pb.COMP_NODE,
                                   data_deps=prev,
                                   duration_micros=round((r["start_s"] - end) * 1e6))
                    encodeMessage(f, comp)
                    prev = [comp.id]
                node = pb.Node(id=2 * k + 1, name=f"{r['op']}{k}", data_deps=prev)
                node.attr.append(pb.AttributeProto(name="comm_size",
                                                   int64_val=_chakra_bytes(r, n_ranks)))
                peer = re.fullmatch(r"(send to|recv from) (\d+)", r["op"])
                if peer:
                    node.type = pb.COMM_SEND_NODE if peer.group(1) == "send to" \
                        else pb.COMM_RECV_NODE
                    node.attr.append(pb.AttributeProto(
                        name="comm_dst" if peer.group(1) == "send to" else "comm_src",
                        int64_val=int(peer.group(2))))
                elif r["op"] in TRACED_COLLECTIVES:
                    node.type = pb.COMM_COLL_NODE
                    node.attr.append(pb.AttributeProto(
                        name="comm_type",
                        int64_val=pb.CollectiveCommType.Value(TRACED_COLLECTIVES[r["op"]])))
                else:
                    raise TraceError(f"rank {rank}: traced op {r['op']!r} has no Chakra node "
                                     "type")
                encodeMessage(f, node)
                prev, end = [node.id], r["end_s"]
        files.append(path)
    return files


def write_trace(prefix: str | Path, graphs: dict[int, list[dict]]) -> Path:
    """Write ``graphs`` (rank -> its nodes, each ``{"id", "name", "kind": comp|coll,
    "deps": [...], "us"`` for compute or ``"op"`` (a Chakra collective type such as
    ``"ALL_REDUCE"``) and ``"bytes"`` for a collective) as ``<prefix>.<rank>.et`` with Chakra's
    schema and writer; returns ``prefix``."""
    pb = _schema()
    from chakra.src.third_party.utils.protolib import encodeMessage

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for rank, nodes in graphs.items():
        with open(f"{prefix}.{rank}.et", "wb") as f:
            encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
            for x in nodes:
                node = pb.Node(id=x["id"], name=x["name"], data_deps=list(x["deps"]))
                if x["kind"] == "comp":
                    node.type, node.duration_micros = pb.COMP_NODE, int(x["us"])
                else:
                    node.type = pb.COMM_COLL_NODE
                    node.attr.append(pb.AttributeProto(
                        name="comm_type", int64_val=pb.CollectiveCommType.Value(x["op"])))
                    node.attr.append(pb.AttributeProto(name="comm_size",
                                                       int64_val=int(x["bytes"])))
                encodeMessage(f, node)
    return prefix


def ddp_graphs(n: int, buckets: list[int], compute_us: int, iterations: int = 1
               ) -> dict[int, list[dict]]:
    """A data-parallel job's graphs: per iteration, the backward pass's compute before each
    gradient bucket's allreduce (issued as soon as it is ready), then the optimizer step."""
    it = [x for b in buckets for x in (("comp", "backward", compute_us),
                                       ("ALL_REDUCE", "allreduce", b))]
    it.append(("comp", "optimizer", compute_us))
    return {r: _chain(it * iterations) for r in range(n)}


def moe_graphs(n: int, layers: int, a2a_bytes: int, grad_bytes: int, compute_us: int,
               iterations: int = 1) -> dict[int, list[dict]]:
    """A mixture-of-experts job's graphs (expert parallelism): per iteration and layer, the
    attention's compute, the all-to-all that dispatches tokens to their experts, the experts'
    compute and the all-to-all that combines them; then the dense gradient's allreduce."""
    layer = [("comp", "attention", compute_us), ("ALL_TO_ALL", "dispatch", a2a_bytes),
             ("comp", "experts", compute_us), ("ALL_TO_ALL", "combine", a2a_bytes)]
    it = layer * layers + [("ALL_REDUCE", "allreduce", grad_bytes),
                           ("comp", "optimizer", compute_us)]
    return {r: _chain(it * iterations) for r in range(n)}


def _chain(steps: list[tuple[str, str, int]]) -> list[dict]:
    """Nodes that run one after the other: ``(kind or collective type, name, us or bytes)``."""
    out = []
    for i, (kind, name, x) in enumerate(steps):
        node = {"id": i + 1, "name": f"{name}{i}", "deps": [i] if i else []}
        node |= {"kind": "comp", "us": x} if kind == "comp" else \
            {"kind": "coll", "op": kind, "bytes": x}
        out.append(node)
    return out


def _chakra_bytes(row: dict, n: int) -> int:
    """A traced call's bytes as Chakra's ``comm_size`` (nccl-tests' sizes): testbed.c10d
    records an all-gather's input, one rank's part."""
    return int(row["bytes"]) * (n if row["op"] == "allgather" else 1)


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
    n = len(hosts)
    out, cache = [], {}
    for (gname, seq), members in sorted(by_seq.items()):
        group = gname or None
        first = members[0]
        ranks = group_ranks(group, groups or {}, n)
        ours = group is None and tj is not None and seq < len(paths) and \
            paths[seq].startswith("testbed:")
        algo = tj.algo if ours else "ring"  # gloo's collectives: predicted as the ring
        key = (first["op"], first["bytes"], algo, tuple(ranks))
        if key not in cache:
            cache[key] = None
            op = MODEL_OPS.get(first["op"])
            k = len(ranks)
            if first["op"] == "all_to_all" and k > 1:  # every pair's part at once, as gloo
                cache[key] = transfer_s([(a, b, first["bytes"] / k) for a in ranks
                                         for b in ranks if a != b])
            elif op and first["bytes"] >= 4 and first["bytes"] % 4 == 0 and k > 1:
                spec = CollectiveSpec(op=op, algo=algo, nbytes=first["bytes"])
                try:
                    cache[key] = flowmodel.predict(net.routed_topo, spec,
                                                   workers=[hosts[r] for r in ranks],
                                                   hop_latency_s=hop, time_dilation=f).time_s
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


def predict_jct(ranks: dict[int, list[Node]], collective_s: dict, transfer_s,
                scale: float = 1.0, groups: dict[str, list[int]] | None = None
                ) -> float | None:
    """The model's completion time of a trace replayed as :func:`replay` runs it: each rank
    takes its nodes one after the other in :func:`order`; a compute node lasts its duration
    times ``scale``; the k-th collective of the world (of communicator group ``g`` of
    ``groups``) starts when every rank (every member) reached it and lasts
    ``collective_s[k]`` (``collective_s[(g, k)]``); a send and its receive start when both
    ranks reached them and last ``transfer_s([(src, dst, bytes)])``. None when a collective
    or a transfer has no prediction."""
    return _schedule(ranks, groups or {}, collective_s, transfer_s, scale)[0]


def _schedule(ranks: dict[int, list[Node]], groups: dict[str, list[int]],
              collective_s: dict | None = None, transfer_s=None, scale: float = 1.0
              ) -> tuple[float | None, dict[int, Node]]:
    """Run the ranks' graphs as the replay does (timed with ``collective_s`` and
    ``transfer_s``, see :func:`predict_jct`; untimed without): (completion time, or None
    when something has no price or the ranks are stuck; the node each stuck rank waits at)."""
    n = len(ranks)
    graph = {r: order(nodes) for r, nodes in ranks.items()}
    pos = dict.fromkeys(graph, 0)
    clock = dict.fromkeys(graph, 0.0)
    done: dict[str | None, int] = {}  # collectives finished per group
    cache: dict[tuple, float | None] = {}
    timed, unpriced = collective_s is not None, False

    def head(r: int) -> Node | None:
        return graph[r][pos[r]] if pos[r] < len(graph[r]) else None

    moved = True
    while moved:
        moved = False
        for r in graph:  # run each rank up to its next communication
            while (x := head(r)) is not None and x.kind not in ("coll", "send", "recv"):
                clock[r] += x.duration_s * scale if x.kind == "comp" else 0.0
                pos[r] += 1
        heads = {r: head(r) for r in graph}
        for g in dict.fromkeys(x.group for x in heads.values()
                               if x is not None and x.kind == "coll"):
            members = group_ranks(g, groups, n)
            if not all(heads[m] is not None and heads[m].kind == "coll"
                       and heads[m].group == g for m in members):
                continue
            k = done.get(g, 0)
            t = (collective_s.get(k) if g is None else collective_s.get((g, k))) \
                if timed else 0.0
            if t is None:
                unpriced, t = True, 0.0
            end = max(clock[m] for m in members) + t
            for m in members:
                clock[m], pos[m], heads[m] = end, pos[m] + 1, None
            done[g], moved = k + 1, True
        for r, x in heads.items():
            y = heads.get(x.peer) if x is not None and x.kind == "send" else None
            if y is not None and y.kind == "recv" and y.peer == r and y.tag == x.tag:
                t = 0.0
                if timed:
                    key = (r, x.peer, x.bytes)
                    if key not in cache:
                        cache[key] = transfer_s([key])
                    t = cache[key]
                    if t is None:
                        unpriced, t = True, 0.0
                end = max(clock[r], clock[x.peer]) + t
                clock[r] = clock[x.peer] = end
                pos[r] += 1
                pos[x.peer] += 1
                heads[x.peer] = None
                moved = True
    stuck = {r: x for r in graph if (x := head(r)) is not None}
    total = None if stuck or unpriced else max(clock.values(), default=0.0)
    return total, stuck


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
    with open(Path(folder) / f"nodes{rank}.jsonl", "w") as log:
        for x in nodes:
            t0 = time.time()
            if x.kind == "comp":
                time.sleep(x.duration_s * compute_factor)
            elif x.kind == "coll":
                pg, members = subgroups[x.group] if x.group is not None else \
                    (None, list(range(n)))
                err = _collective(dist, torch, x, members, pg)
            elif x.kind == "send":
                dist.send(_buffer(torch, x.bytes), dst=x.peer, tag=x.tag)
            elif x.kind == "recv":
                dist.recv(_buffer(torch, x.bytes), src=x.peer, tag=x.tag)
            row = {"rank": rank, "node": x.id, "name": x.name, "kind": x.kind, "op": x.op,
                   "bytes": x.bytes, "peer": x.peer, "start_s": t0, "end_s": time.time()}
            if x.kind == "coll":
                row["group"], row["seq"] = x.group, seq.get(x.group, 0)
                row["max_abs_err"] = err
                seq[x.group] = row["seq"] + 1
            log.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _buffer(torch, nbytes: int):
    """float32 when the size allows (the testbed's algorithms take it), else bytes."""
    if nbytes % 4 == 0:
        return torch.ones(nbytes // 4, dtype=torch.float32)
    return torch.ones(nbytes, dtype=torch.uint8)


def _collective(dist, torch, x: Node, members: list[int], group=None) -> float | None:
    """``x`` among ``members`` (global ranks) on process group ``group`` (None: the world);
    an allreduce's largest error against the exact sum of its inputs (every rank sends ones:
    the sum is the member count), None for the others."""
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
            dist.all_to_all_single(torch.empty_like(whole), whole, group=group)
    return None


if __name__ == "__main__":
    _run_rank(sys.argv[1], sys.argv[2], float(sys.argv[3]))
