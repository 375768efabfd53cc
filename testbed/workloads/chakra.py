"""MLCommons Chakra execution traces: read, checked, scheduled, written.

A trace is one file per rank, ``<prefix>.<rank>.et``: a ``GlobalMetadata`` message and then
``Node`` messages (Chakra's ``et_def.proto``, each length-delimited), the format ASTRA-sim,
SimAI and ATLAHS take. This module knows the format and nothing of networks: it loads a trace
and checks it before anything runs (:func:`load_trace`: missing or extra rank files, a
truncated or undecodable protobuf, duplicate ids, dependencies on nodes that do not exist,
cycles, unknown node or collective types, communicator groups the configuration lacks or a
rank outside its group, collectives a group's ranks would not issue in one order, ranks that
would wait on each other forever, sends without their receive; :class:`TraceError` names the
file, the node and the problem), orders a rank's graph as the replay runs it (:func:`order`),
prices a whole trace from per-collective times (:func:`predict_jct`), derives a tenant's
hints (:func:`trace_hints`), and writes traces with Chakra's own schema and writer
(:func:`write_trace`, :func:`export`, the :func:`ddp_graphs` / :func:`moe_graphs` shapes).
Running a trace on the emulated fabric is :mod:`testbed.replay`'s. Needs the ``[traces]``
extra (``mlc-chakra``), imported on use.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import re
from pathlib import Path

#: Chakra's collective types that are replayed, by the name ``torch.distributed`` gives them.
COLLECTIVES = {"ALL_REDUCE": "all_reduce", "ALL_GATHER": "all_gather",
               "REDUCE_SCATTER": "reduce_scatter", "ALL_TO_ALL": "all_to_all",
               "BROADCAST": "broadcast", "BARRIER": "barrier"}
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
    # the k-th send from one rank to another with a tag meets the k-th such receive
    p2p: dict[tuple, tuple[list, list]] = {}
    for r, nodes in ranks.items():
        for x in order(nodes):
            if x.kind in ("send", "recv"):
                p2p.setdefault(_transfer(r, x), ([], []))[x.kind == "recv"].append(x.bytes)
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
    for (src, dst, tag), (sent, received) in sorted(p2p.items()):
        if len(sent) != len(received):
            raise TraceError(f"{prefix}: sends from rank {src} to rank {dst} (tag {tag}: "
                             f"{len(sent)}) do not match that rank's receives in number "
                             f"({len(received)})")
        k = next((i for i, (a, b) in enumerate(zip(sent, received, strict=True)) if a != b),
                 None)
        if k is not None:
            raise TraceError(f"{prefix}: send #{k} from rank {src} to rank {dst} (tag {tag}) "
                             f"is {sent[k]} B, and the receive it meets expects "
                             f"{received[k]} B")
    stuck = _schedule(ranks, groups)[1]
    if stuck:
        raise TraceError(f"{prefix}: the ranks would wait on each other forever: "
                         + "; ".join(f"rank {r} at node {x.id} ({x.name!r}, {x.kind}"
                                     + (f" on group {x.group!r}" if x.group else "") + ")"
                                     for r, x in sorted(stuck.items())[:6]))
    return ranks


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


def _transfer(rank: int, x: Node) -> tuple[int, int, int]:
    """(source, destination, tag) of the transfer that send or receive ``x`` of ``rank`` is
    an end of: its sends and receives meet in order."""
    return (rank, x.peer, x.tag) if x.kind == "send" else (x.peer, rank, x.tag)


def predict_jct(ranks: dict[int, list[Node]], collective_s: dict, transfer_s,
                scale: float = 1.0, groups: dict[str, list[int]] | None = None
                ) -> float | None:
    """The model's completion time of a trace replayed as :func:`replay` runs it.

    Each rank walks its nodes one after the other in :func:`order`, a node once the nodes it
    depends on ended; a compute node lasts its duration times ``scale``. Communication does
    not hold the walk up (as ASTRA-sim issues every ready node, and a GPU's kernels run
    beside its communication stream): a collective joins the rank's collective stream, where
    the k-th collective of the world (of communicator group ``g`` of ``groups``) starts once
    it heads every rank's (every member's) stream and lasts ``collective_s[k]``
    (``collective_s[(g, k)]``); a send or receive is posted (``isend``/``irecv``) and the
    transfer starts when both ends are (the k-th send from a rank to another with a tag meets
    the k-th such receive), lasting ``transfer_s([(src, dst, bytes)])``. So a backward pass
    whose next layer does not wait for the previous bucket's allreduce overlaps it. None when
    a collective or a transfer has no prediction."""
    return _schedule(ranks, groups or {}, collective_s, transfer_s, scale)[0]


def _schedule(ranks: dict[int, list[Node]], groups: dict[str, list[int]],
              collective_s: dict | None = None, transfer_s=None, scale: float = 1.0
              ) -> tuple[float | None, dict[int, Node]]:
    """Run the ranks' graphs as the replay does (timed with ``collective_s`` and
    ``transfer_s``, see :func:`predict_jct`; untimed without): (completion time, or None
    when something has no price or the ranks are stuck; the node each stuck rank waits at:
    the collective its stream waits in, else a node waiting for what it depends on, else a
    send or receive posted and never matched)."""
    n = len(ranks)
    graph = {r: order(nodes) for r, nodes in ranks.items()}
    pos = dict.fromkeys(graph, 0)
    clock = dict.fromkeys(graph, 0.0)  # the rank's walk (its compute)
    stream = dict.fromkeys(graph, 0.0)  # when the rank's collective stream is free
    ended: dict[int, dict[int, float]] = {r: {} for r in graph}  # communication's end
    posted: dict[int, dict[int, Node]] = {r: {} for r in graph}  # communication not ended
    colls: dict[int, list[tuple[Node, float]]] = {r: [] for r in graph}  # the stream's queue
    queues: dict[tuple, tuple[list, list]] = {}  # (src, dst, tag) -> (sends, receives)
    done: dict[str | None, int] = {}  # collectives finished per group
    cache: dict[tuple, float | None] = {}
    timed, unpriced = collective_s is not None, False

    def head(r: int) -> Node | None:
        return graph[r][pos[r]] if pos[r] < len(graph[r]) else None

    def ready_at(r: int, x: Node) -> float | None:
        """When ``x`` can start on rank ``r`` (None: communication it needs is under way)."""
        if any(d in posted[r] for d in x.deps):
            return None
        return max([clock[r]] + [ended[r][d] for d in x.deps if d in ended[r]])

    moved = True
    while moved:
        moved = False
        for r in graph:  # each rank's walk, up to a node that waits for communication
            while (x := head(r)) is not None and (at := ready_at(r, x)) is not None:
                clock[r] = at + (x.duration_s * scale if x.kind == "comp" else 0.0)
                if x.kind in ("coll", "send", "recv"):  # under way; the walk goes on
                    posted[r][x.id] = x
                if x.kind == "coll":  # onto the rank's stream
                    colls[r].append((x, at))
                elif x.kind in ("send", "recv"):  # isend/irecv
                    queues.setdefault(_transfer(r, x), ([], []))[x.kind == "recv"].append(
                        (r, x, at))
                pos[r] += 1
                moved = True
        for (src, dst, _tag), (sends, recvs) in queues.items():  # in posting order
            while sends and recvs:
                (_, xs, ts), (_, xr, tr) = sends.pop(0), recvs.pop(0)
                t = 0.0
                if timed:
                    key = (src, dst, xs.bytes)
                    if key not in cache:
                        cache[key] = transfer_s([key])
                    t = cache[key]
                    if t is None:
                        unpriced, t = True, 0.0
                ended[src][xs.id] = ended[dst][xr.id] = max(ts, tr) + t
                del posted[src][xs.id], posted[dst][xr.id]
                moved = True
        # a group's collective runs once it heads every member's stream
        heads = {r: q[0] for r, q in colls.items() if q}
        for g in dict.fromkeys(x.group for x, _at in heads.values()):
            members = group_ranks(g, groups, n)
            if not all(m in heads and heads[m][0].group == g for m in members):
                continue
            k = done.get(g, 0)
            t = (collective_s.get(k) if g is None else collective_s.get((g, k))) \
                if timed else 0.0
            if t is None:
                unpriced, t = True, 0.0
            end = max(max(heads[m][1], stream[m]) for m in members) + t
            for m in members:
                x, _at = colls[m].pop(0)
                stream[m] = ended[m][x.id] = end
                del posted[m][x.id], heads[m]
            done[g], moved = k + 1, True
    stuck = {r: x for r in graph
             if (x := (colls[r][0][0] if colls[r] else None) or head(r)
                 or next(iter(posted[r].values()), None)) is not None}
    ends = [t for e in ended.values() for t in e.values()]
    total = None if stuck or unpriced else max([*clock.values(), *ends], default=0.0)
    return total, stuck
