"""Chakra execution traces: built with Chakra's own schema and writer in each test, checked
before anything runs, and replayed on emulated networks (needs the ``[torch]`` and
``[traces]`` extras)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")
pb = pytest.importorskip("chakra.schema.protobuf.et_def_pb2",
                         reason="the [traces] extra (mlc-chakra) is not installed")
protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")

from testbed.replay import replay  # noqa: E402
from testbed.workloads.chakra import TraceError, load_trace  # noqa: E402


def _attr(node, name, **value):
    node.attr.append(pb.AttributeProto(name=name, **value))
    return node


def comp(i, us, deps=()):
    return pb.Node(id=i, name=f"comp{i}", type=pb.COMP_NODE, duration_micros=us,
                   data_deps=list(deps))


def coll(i, ctype, size, deps=()):
    n = pb.Node(id=i, name=f"{pb.CollectiveCommType.Name(ctype).lower()}{i}",
                type=pb.COMM_COLL_NODE, data_deps=list(deps))
    _attr(n, "comm_type", int64_val=ctype)
    return _attr(n, "comm_size", int64_val=size)


def send(i, dst, size, deps=()):
    n = _attr(pb.Node(id=i, name=f"send{i}", type=pb.COMM_SEND_NODE, data_deps=list(deps)),
              "comm_dst", int64_val=dst)
    return _attr(n, "comm_size", int64_val=size)


def recv(i, src, size, deps=()):
    n = _attr(pb.Node(id=i, name=f"recv{i}", type=pb.COMM_RECV_NODE, data_deps=list(deps)),
              "comm_src", int64_val=src)
    return _attr(n, "comm_size", int64_val=size)


def write(prefix: Path, graphs: dict) -> Path:
    for r, nodes in graphs.items():
        with open(f"{prefix}.{r}.et", "wb") as f:
            protolib.encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
            for n in nodes:
                protolib.encodeMessage(f, n)
    return prefix


def ddp(n: int, sizes=(256 << 10, 1 << 20), compute_us=3000) -> dict:
    """A DDP-like step: backward compute, then each bucket's allreduce as soon as its
    gradient is ready, then the next compute after every allreduce."""
    graphs = {}
    for r in range(n):
        nodes, prev = [], []
        for k, size in enumerate(sizes):
            c = comp(10 * k + 1, compute_us, prev[-1:])
            a = coll(10 * k + 2, pb.ALL_REDUCE, size, [c.id])
            nodes += [c, a]
            prev = [a.id]
        nodes.append(comp(99, compute_us, prev))
        graphs[r] = nodes
    return graphs


# -- checked before anything runs ----------------------------------------------------------

def test_a_well_formed_trace_loads(tmp_path):
    ranks = load_trace(write(tmp_path / "t", ddp(3)))
    assert sorted(ranks) == [0, 1, 2]
    assert [x.op for x in ranks[0] if x.kind == "coll"] == ["all_reduce", "all_reduce"]


@pytest.mark.parametrize("case, match", [
    ("missing_rank", r"rank files \[1\] are missing"),
    ("cycle", r"nodes \[1, 2\] form a cycle"),
    ("dangling", r"node 2 \('all_reduce2'\) depends on nodes \[7\]"),
    ("unknown_collective", r"collective type 'GATHER' is not replayed"),
    ("order", r"collective #0 of the world \('all_gather', 1024\) differs from rank 0's "
              r"\('all_reduce', 1024\)"),
    ("unmatched_send", r"sends from rank 0 to rank 1 .* do not match"),
    ("p2p_size", r"send #0 from rank 0 to rank 1 \(tag 0\) is 64 B, and the receive it "
                 r"meets expects 32 B"),
    ("group", r"communicator group 'tp', which the group configuration lacks"),
    ("not_member", r"rank 1 is not a member of communicator group '1' \[0\]"),
    ("group_order", r"collective #0 of communicator group '1' \('all_reduce', 64\) differs "
                    r"from rank 0's \('all_reduce', 32\)"),
    ("deadlock", r"would wait on each other forever: rank 0 at node 3 .* on group '1'"),
    ("truncated", r"truncated file"),
    ("bad_peer", r"comm_dst 5 is not a rank of this trace"),
])
def test_bad_traces_are_named_before_anything_runs(tmp_path, case, match):
    prefix = tmp_path / case
    groups = {"1": [0, 1]}
    g = {0: [comp(1, 10), coll(2, pb.ALL_REDUCE, 1024, [1])],
         1: [comp(1, 10), coll(2, pb.ALL_REDUCE, 1024, [1])]}
    if case == "missing_rank":
        g[2] = g.pop(1)
    elif case == "cycle":
        g[0] = [comp(1, 10, [2]), coll(2, pb.ALL_REDUCE, 1024, [1])]
    elif case == "dangling":
        g[0] = [comp(1, 10), coll(2, pb.ALL_REDUCE, 1024, [7])]
    elif case == "unknown_collective":
        g[1] = [comp(1, 10), coll(2, pb.GATHER, 1024, [1])]
    elif case == "order":
        g[1] = [comp(1, 10), coll(2, pb.ALL_GATHER, 1024, [1])]
    elif case == "unmatched_send":
        g[0].append(send(3, 1, 64, [2]))
    elif case == "p2p_size":
        g[0].append(send(3, 1, 64, [2]))
        g[1].append(recv(3, 0, 32, [2]))
    elif case == "group":
        _attr(g[1][1], "pg_name", string_val="tp")
    elif case == "not_member":
        groups = {"1": [0]}
        _attr(g[1][1], "pg_name", string_val="1")
        _attr(g[0][1], "pg_name", string_val="1")
    elif case == "group_order":
        for r, size in ((0, 32), (1, 64)):
            g[r].append(_attr(coll(3, pb.ALL_REDUCE, size, [2]), "pg_name", string_val="1"))
    elif case == "deadlock":  # rank 0 waits in group 1 for rank 1, which waits in the world
        g[0] = [_attr(coll(3, pb.ALL_REDUCE, 64), "pg_name", string_val="1"),
                coll(4, pb.ALL_REDUCE, 1024, [3])]
        g[1] = [coll(4, pb.ALL_REDUCE, 1024),
                _attr(coll(5, pb.ALL_REDUCE, 64, [4]), "pg_name", string_val="1")]
    elif case == "bad_peer":
        g[0].append(send(3, 5, 64, [2]))
    write(prefix, g)
    if case == "truncated":
        path = Path(f"{prefix}.1.et")
        path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(TraceError, match=match):
        load_trace(prefix, groups)


def test_communicator_groups_as_astra_sim_takes_them(tmp_path):
    from testbed.workloads.chakra import predict_jct, read_groups

    path = tmp_path / "groups.json"
    path.write_text('{"1": [0, 1], "2": [2, 3]}')
    groups = read_groups(path)
    g = tensor_parallel(4)
    ranks = load_trace(write(tmp_path / "tp", g), groups)
    assert [x.group for x in ranks[2] if x.kind == "coll"] == ["2", None]
    # each group's allreduce waits only for its members: group 2's ranks compute longer
    t = predict_jct(ranks, {0: 0.004, ("1", 0): 0.001, ("2", 0): 0.002}, lambda t: None,
                    groups=groups)
    assert t == pytest.approx(0.043 + 0.002 + 0.004)
    for bad, match in (('{"1": [0, 0]}', "distinct rank numbers"),
                       ('{"1": [0, 9]}', r"names ranks \[9\], but the trace has ranks 0..3"),
                       ('[1, 2]', "expected a JSON object")):
        path.write_text(bad)
        with pytest.raises(TraceError, match=match):
            load_trace(tmp_path / "tp", read_groups(path))


def tensor_parallel(n: int) -> dict:
    """Pairs of ranks allreduce within their tensor-parallel group (pg_name "1": ranks 0, 1;
    "2": ranks 2, 3), then every rank allreduces in the world (data parallel)."""
    graphs = {}
    for r in range(n):
        # group 2 computes 40 ms longer: far more than the ranks' start-up skew on a busy
        # machine (3 ms against 6 ms was once overtaken by it)
        c = comp(1, 3000 if r < 2 else 43000)
        tp = _attr(coll(2, pb.ALL_REDUCE, 64 << 10, [1]), "pg_name",
                   string_val="1" if r < 2 else "2")
        graphs[r] = [c, tp, coll(3, pb.ALL_REDUCE, 256 << 10, [2])]
    return graphs


def test_the_models_completion_time_of_a_trace():
    """Compute lasts its duration (times the scale), a send and its receive start when both
    ranks reached them, a collective when every rank did; what has no prediction gives None."""
    from testbed.workloads.chakra import Node, predict_jct

    ranks = {0: [Node(1, "c", "comp", duration_s=0.010), Node(2, "s", "send", (1,), bytes=8,
                                                               peer=1),
                 Node(3, "c", "comp", (2,), duration_s=0.005),
                 Node(4, "ar", "coll", (3,), op="all_reduce", bytes=64)],
             1: [Node(2, "r", "recv", bytes=8, peer=0),
                 Node(3, "c", "comp", (2,), duration_s=0.020),
                 Node(4, "ar", "coll", (3,), op="all_reduce", bytes=64)]}
    transfers = []

    def transfer_s(t):
        transfers.append(t)
        return 0.002

    # rank 0 sends at 10 ms, the transfer ends at 12 ms; rank 1 computes until 32 ms, rank 0
    # until 17; the allreduce starts at 32 and lasts 3 ms
    assert predict_jct(ranks, {0: 0.003}, transfer_s) == pytest.approx(0.035)
    assert transfers == [[(0, 1, 8)]]
    assert predict_jct(ranks, {0: 0.003}, transfer_s, scale=2.0) == pytest.approx(0.065)
    assert predict_jct(ranks, {0: None}, transfer_s) is None
    assert predict_jct(ranks, {0: 0.003}, lambda t: None) is None


def test_sends_and_receives_are_posted_without_holding_their_rank_up(tmp_path):
    """A ring exchange whose every rank sends before it receives (a pipeline's
    batch_isend_irecv) loads and is priced as ASTRA-sim runs it: the sends and receives are
    posted at once and the three transfers overlap; a node waits only for the transfers it
    depends on."""
    from testbed.workloads.chakra import predict_jct

    n = 3
    g = {r: [send(1, (r + 1) % n, 4096), recv(2, (r - 1) % n, 4096), comp(3, 5000, [2]),
             comp(4, 1000, [1])] for r in range(n)}
    ranks = load_trace(write(tmp_path / "ring", g))
    # each transfer 2 ms from 0; node 3 after its receive (2 + 5 ms); node 4 after its send
    # and after node 3, the rank's one thread (7 + 1 ms)
    assert predict_jct(ranks, {}, lambda t: 0.002) == pytest.approx(0.008)
    # each rank's send needs the receive of the other's: that still waits forever
    g = {r: [recv(1, 1 - r, 4096), send(2, 1 - r, 4096, [1])] for r in range(2)}
    with pytest.raises(TraceError, match=r"forever: rank 0 at node 2 \('send2', send\); "
                                         r"rank 1 at node 2"):
        load_trace(write(tmp_path / "wait", g))


def overlapped_backward(n: int, compute_us: int, size: int) -> dict:
    """A backward pass as PyTorch's execution traces record it: layer 2's gradient compute
    does not wait for layer 1's bucket allreduce, the optimizer waits for both buckets."""
    return {r: [comp(1, compute_us), coll(2, pb.ALL_REDUCE, size, [1]),
                comp(3, compute_us, [1]), coll(4, pb.ALL_REDUCE, size, [3]),
                comp(5, 1000, [2, 4])] for r in range(n)}


def test_compute_overlaps_the_collectives_it_does_not_wait_for(tmp_path):
    """The model runs a rank's collectives on a stream of their own, in its walk's order: the
    second layer's compute runs during the first bucket's allreduce, the second allreduce
    starts once the first ended and its compute did, the optimizer after both."""
    from testbed.workloads.chakra import Node, predict_jct

    ranks = load_trace(write(tmp_path / "bw", overlapped_backward(2, 10_000, 4096)))
    # layer 1 until 10 ms, its allreduce 10-18 while layer 2 computes 10-20; the second
    # allreduce 20-28, the optimizer 28-29 (one after the other: 10 + 8 + 10 + 8 + 1 = 37)
    assert predict_jct(ranks, {0: 0.008, 1: 0.008}, lambda t: None) == pytest.approx(0.029)
    # two collectives posted at once run one after the other on the stream
    both = {r: [Node(1, "a", "coll", op="all_reduce", bytes=64),
                Node(2, "b", "coll", op="all_reduce", bytes=64)] for r in range(2)}
    assert predict_jct(both, {0: 0.003, 1: 0.004}, lambda t: None) == pytest.approx(0.007)


# -- replayed on emulated networks --------------------------------------------------------

@pytest.mark.mininet
def test_ddp_trace_through_the_testbed_ring_against_the_model(tmp_path):
    compute_us = 3000
    res = replay(write(tmp_path / "ddp", ddp(4, compute_us=compute_us)), algo="ring",
                 out=tmp_path / "out", echo=lambda line: None)
    assert res.launched.returncode == 0, res.launched.failures
    assert len(res.nodes) == 4 * 5 and {r["rank"] for r in res.nodes} == {0, 1, 2, 3}
    for rank in range(4):  # dependencies held: each node started after what it waits for
        mine = {r["node"]: r for r in res.nodes if r["rank"] == rank}
        for deps, node in (((1,), 2), ((2,), 11), ((11,), 12), ((12,), 99)):
            assert all(mine[node]["start_s"] >= mine[d]["end_s"] - 1e-6 for d in deps)
        assert all(mine[c]["time_s"] >= compute_us * 1e-6 for c in (1, 11, 99))
    assert [c["bytes"] for c in res.collectives] == [256 << 10, 1 << 20]
    assert all(c["path"] == "testbed:ring" and c["model_s"] > 0 for c in res.collectives)
    assert [v["op"] for v in res.validation] == ["all_reduce", "all_reduce"]
    assert res.geomean_error_pct is not None and res.geomean_error_pct >= 0
    assert res.jct_s >= 3 * compute_us * 1e-6
    assert res.model_jct_s >= 3 * compute_us * 1e-6 + sum(c["model_s"] for c in res.collectives)
    for name in ("nodes.csv", "collectives.csv", "validation.csv", "timeline.json",
                 "replay.json"):
        assert (res.folder / name).exists(), name


@pytest.mark.mininet
def test_a_backward_pass_computes_while_its_bucket_is_allreduced(tmp_path):
    """Replayed through the testbed's ring (a backend that runs each allreduce to the end in
    the call): layer 2's compute starts before layer 1's allreduce ended, the optimizer after
    both, and each rank's run and the model take less than its nodes one after the other
    (by the overlap: the shorter of layer 2 and the first allreduce)."""
    compute_us = 60_000
    res = replay(write(tmp_path / "bw", overlapped_backward(3, compute_us, 1 << 20)),
                 algo="ring", out=tmp_path / "out", echo=lambda line: None)
    assert res.launched.returncode == 0, res.launched.failures
    at = {(r["rank"], r["node"]): r for r in res.nodes}
    for rank in range(3):
        assert at[(rank, 3)]["start_s"] < at[(rank, 2)]["end_s"]  # overlapped
        assert at[(rank, 4)]["start_s"] >= at[(rank, 2)]["end_s"] - 1e-6  # the stream's order
        assert at[(rank, 5)]["start_s"] >= at[(rank, 4)]["end_s"] - 1e-6
        mine = [at[(rank, k)] for k in range(1, 6)]
        span = mine[-1]["end_s"] - mine[0]["start_s"]
        one_after_another = sum(r["end_s"] - r["start_s"] for r in mine)
        overlap = min(compute_us * 1e-6, at[(rank, 2)]["end_s"] - at[(rank, 2)]["start_s"])
        assert span < one_after_another - 0.5 * overlap, (rank, span, one_after_another)
    serial = 2 * compute_us * 1e-6 + 1e-3 + sum(c["model_s"] for c in res.collectives)
    assert res.model_jct_s < serial - 0.9 * compute_us * 1e-6
    assert all(c["path"] == "testbed:ring" for c in res.collectives)


@pytest.mark.mininet
def test_a_trace_whose_messages_the_machine_cannot_hold_is_refused_before_its_ranks(tmp_path):
    """A trace's allreduce larger than this machine's memory (e.g. a comm_size in bits, not
    bytes) is named before a rank allocates it; nothing is left behind."""
    from testbed.collectives.testing import leftovers
    from testbed.topologies.scale import mem_available_kb

    size = mem_available_kb() * 1024 // 2 // 4 * 4  # 2 ranks x 2 copies: twice what is free
    prefix = write(tmp_path / "big", ddp(2, sizes=(4096, size)))
    with pytest.raises(TraceError, match=r"big: 2 ranks each holding .* GiB available"):
        replay(prefix, algo="ring", out=tmp_path / "out", echo=lambda line: None)
    assert not leftovers()


@pytest.mark.mininet
def test_tensor_parallel_groups_beside_a_data_parallel_world(tmp_path):
    """Each tensor-parallel pair allreduces on its own subgroup (gloo), the world's allreduce
    through the testbed's ring; each is priced on its own members' hosts."""
    res = replay(write(tmp_path / "tp", tensor_parallel(4)), algo="ring",
                 groups={"1": [0, 1], "2": [2, 3]}, out=tmp_path / "out",
                 echo=lambda line: None)
    assert res.launched.returncode == 0, res.launched.failures
    by = {(c["group"], c["seq"]): c for c in res.collectives}
    assert set(by) == {("1", 0), ("2", 0), (None, 0)}
    assert by[("1", 0)]["ranks"] == by[("2", 0)]["ranks"] == 2
    assert by[("1", 0)]["path"] == "gloo" and by[(None, 0)]["path"] == "testbed:ring"
    assert by[(None, 0)]["ranks"] == 4
    assert all(c["model_s"] > 0 for c in res.collectives)
    assert by[("1", 0)]["model_s"] < by[(None, 0)]["model_s"]
    at = {(r["rank"], r["node"]): r for r in res.nodes}
    # group 1's allreduce did not wait for group 2's longer compute
    assert at[(0, 2)]["start_s"] < at[(2, 1)]["end_s"]
    assert res.model_jct_s is not None


@pytest.mark.mininet
@pytest.mark.parametrize("algo", [None, "ring"], ids=["gloo", "ring"])
def test_pipeline_and_moe_trace(tmp_path, algo):
    """Send/recv between pipeline stages, then an all-to-all (MoE), an all-gather, a
    reduce-scatter and a broadcast, on 3 ranks: over gloo, or through the testbed (its
    all-to-all by pairwise exchange: parts of 128 KiB), every all-to-all part where it
    belongs."""
    size = 3 * (128 << 10)
    g = {0: [comp(1, 2000), send(2, 1, 65536, [1])],
         1: [recv(2, 0, 65536), comp(3, 2000, [2]), send(4, 2, 65536, [3])],
         2: [recv(4, 1, 65536), comp(5, 2000, [4])]}
    for r, nodes in g.items():
        last = nodes[-1].id
        nodes += [coll(20, pb.ALL_TO_ALL, size, [last]), coll(21, pb.ALL_GATHER, size, [20]),
                  coll(22, pb.REDUCE_SCATTER, size, [21]), coll(23, pb.BROADCAST, size, [22]),
                  # a ring exchange, every rank's send first: posted together, not stuck
                  send(30, (r + 1) % 3, 65536, [23]), recv(31, (r - 1) % 3, 65536, [23]),
                  comp(32, 1000, [31])]
    res = replay(write(tmp_path / "pp", g), algo=algo, out=tmp_path / "out",
                 echo=lambda line: None)
    assert res.launched.returncode == 0, res.launched.failures
    at = {(r["rank"], r["node"]): r for r in res.nodes}
    assert at[(1, 2)]["end_s"] >= at[(0, 1)]["end_s"] - 1e-6  # stage 1 waited for stage 0
    assert at[(2, 5)]["start_s"] >= at[(1, 3)]["end_s"] - 1e-6  # and stage 2 for stage 1
    for r in range(3):  # each receive ended after its sender posted, before what needs it
        assert at[(r, 31)]["end_s"] >= at[((r - 1) % 3, 30)]["start_s"] - 1e-6
        assert at[(r, 32)]["start_s"] >= at[(r, 31)]["end_s"] - 1e-6
    assert [c["op"] for c in res.collectives] == ["all_to_all", "all_gather",
                                                  "reduce_scatter", "broadcast"]
    paths = [c["path"] for c in res.collectives]
    if algo is None:
        assert paths == ["gloo"] * 4
    else:  # the all-to-all is the testbed's pairwise exchange, the broadcast gloo's
        assert paths == ["testbed:pairwise"] + ["testbed:ring"] * 2 + ["gloo"]
    assert all(c["ranks"] == 3 for c in res.collectives)
    assert res.collectives[0]["max_abs_err"] == 0.0  # every part where it belongs
    assert all(c["model_s"] > 0 for c in res.collectives)  # the all-to-all: its exchange
    assert res.model_jct_s >= 3 * 0.002 + sum(c["model_s"] for c in res.collectives)


# -- several traces at once (tenants) -------------------------------------------------------

def test_tenants_are_checked_before_anything_runs(tmp_path):
    """Every tenant is checked (and named) before a network is built: these fail at once."""
    from testbed.replay import Tenant, replay_tenants

    a = write(tmp_path / "a", ddp(2))
    for tenants, match in (
            ([], "no traces"),
            ([Tenant(a), Tenant(a)], "two tenants of one name"),
            ([Tenant(a, arrival_s=-1)], r"arrival_s=-1 must be a number >= 0"),
            ([Tenant(a, scale=float("nan"))], r"scale=nan"),
            ([Tenant(a, algo="ring", hints={"tolerance": "exact"})],
             "hints are for algo 'auto'"),
            ([Tenant(a, algo="auto", hints={"tolerance": "sloppy"})], "hints: tolerance")):
        with pytest.raises(ValueError, match=match):
            replay_tenants(tenants, out=tmp_path / "out")
    # a bad trace among good ones is named by its own file
    g = {0: [coll(1, pb.ALL_REDUCE, 4096)], 1: [coll(1, pb.ALL_REDUCE, 8192)]}
    bad = write(tmp_path / "bad", g)
    with pytest.raises(TraceError, match=r"bad\.1\.et: its collective #0"):
        replay_tenants([Tenant(a, name="a"), Tenant(bad, name="b")], out=tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_trace_hints_of_a_ddp_trace(tmp_path):
    from testbed.workloads.chakra import load_trace, trace_hints

    ranks = load_trace(write(tmp_path / "ddp", ddp(2, sizes=(4096, 8192), compute_us=1000)))
    assert trace_hints(ranks) == {"iterations": 1, "collective_bytes": 4096 + 8192,
                                  "compute_s": pytest.approx(0.003)}


def test_replay_cli_refuses_bad_tenant_options(tmp_path):
    from typer.testing import CliRunner

    from testbed.cli import app

    a, b = write(tmp_path / "a", ddp(2)), write(tmp_path / "b", ddp(2))
    for argv, match in (
            ([str(a), str(b), "--arrivals", "0"], "--arrivals has 1 times for 2 traces"),
            ([str(a), str(b), "--arrivals", "0,x"], "give seconds, comma-separated"),
            ([str(a), "--tolerance", "exact"], "--tolerance is a hint for --algo auto"),
            ([str(a), str(b), "--comm-groups", "g.json"], "once per trace")):
        r = CliRunner().invoke(app, ["replay", *argv, "--out", str(tmp_path / "out")])
        assert r.exit_code == 2 and match in r.output, (argv, r.output)


@pytest.mark.mininet
def test_two_traces_at_once_admitted_through_the_provider(tmp_path):
    """Two DDP traces share a leaf-spine, the second arriving later; the provider plans each
    on admission beside the other (INA, exact), and each runs on hosts of its own."""
    from testbed.replay import Tenant, replay_tenants

    a = write(tmp_path / "a", ddp(2, sizes=(64 << 10, 256 << 10), compute_us=2000))
    b = write(tmp_path / "b", ddp(2, sizes=(128 << 10,), compute_us=2000))
    res = replay_tenants(
        [Tenant(a, algo="auto", name="first", hints={"tolerance": "exact"}),
         Tenant(b, algo="auto", arrival_s=0.5, name="second", hints={"tolerance": "exact"})],
        topology={"kind": "leaf_spine", "leaves": 2, "spines": 1, "hosts_per_leaf": 2,
                  "bw_mbps": 100}, out=tmp_path / "out", echo=lambda line: None)
    first, second = res.tenants
    assert not first["failed"] and not second["failed"], res.tenants
    assert set(first["hosts"]).isdisjoint(second["hosts"]) and len(first["hosts"]) == 2
    assert first["plan"]["algo"] and second["plan"]["algo"]
    assert second["start_s"] >= 0.5 and first["start_s"] >= 0  # on one clock, from arrival
    for r in res.replayed:  # every allreduce exact (ones from each rank: the sum is 2)
        assert r.collectives and all(c["max_abs_err"] == 0 for c in r.collectives)
        assert r.model_jct_s is not None and r.jct_s > 0
    assert [len(r.collectives) for r in res.replayed] == [2, 1]
    assert (res.folder / "tenants.csv").exists()
    assert {p.name for p in res.folder.iterdir()} >= {"first", "second"}


def _a_newcomer_takes_the_memory(tmp_path, policy: str):
    """Two 4-rank tenants on a switch whose memory holds one job's INA: the first arrives
    alone, the second (higher priority) 4.5 s later; the provider runs ``policy``."""
    from testbed.replay import Tenant, replay_tenants

    a = write(tmp_path / "a", ddp(4, sizes=(256 << 10,) * 60, compute_us=20_000))
    b = write(tmp_path / "b", ddp(4, sizes=(256 << 10,) * 20, compute_us=2000))
    res = replay_tenants(
        [Tenant(a, algo="auto", name="first", hints={"tolerance": "exact"}),
         Tenant(b, algo="auto", arrival_s=4.5, name="second",
                hints={"tolerance": "exact", "priority": 3})],
        topology={"n_hosts": 8, "switch_memory": 150_000}, out=tmp_path / "out",
        echo=lambda line: None, policy=policy)
    first, second = res.tenants
    assert not first["failed"] and not second["failed"], res.tenants
    assert first["planned"] == "ina" and second["planned"] == "ina"
    for r in res.replayed:  # every allreduce exact (ones from each rank: the sum is 4)
        assert r.collectives and all(c["max_abs_err"] == 0 for c in r.collectives)
    assert {c["path"] for c in res.replayed[1].collectives} == {"testbed:ina"}
    return res, json.loads((res.replayed[0].folder / "launch.json").read_text())["plans"]


@pytest.mark.mininet
def test_a_tenant_the_provider_re_plans_moves_to_its_new_plan_while_it_runs(tmp_path):
    """The switch's memory holds one job's INA (and the policy plans nothing on the shared
    pool): the first tenant gets it, and when a tenant of higher priority arrives the
    provider gives it to the newcomer and re-plans the first to the ring. The first moves to
    the ring at a collective every rank agrees on, gives its switch memory back, and the
    newcomer's INA runs on it; every allreduce stays exact."""
    res, plans = _a_newcomer_takes_the_memory(tmp_path, "cooperative_static")
    assert [p["algo"] for p in plans[:2]] == ["ina", "ring"], plans
    _back_to_static_once_it_left(plans)
    switch = plans[1]["from_call"]
    paths = [c["path"] for c in res.replayed[0].collectives]
    until = plans[2]["from_call"] - 1 if len(plans) > 2 and plans[2]["from_call"] else len(paths)
    assert 1 < switch <= len(paths)
    assert set(paths[:switch - 1]) == {"testbed:ina"} and set(paths[switch - 1:until]) == \
        {"testbed:ring"}, (switch, paths)
    first, second = res.tenants
    assert first["replans"].startswith(f"ring from collective {switch}")
    assert second["replans"] is None


def _back_to_static_once_it_left(plans: list[dict]) -> None:
    """A first tenant still running when the newcomer has ended (a slow machine) gets the
    switch's memory back: any plan after its second is INA on static memory again."""
    assert all((p["algo"], (p.get("placement") or {}).get("mode")) == ("ina", "static")
               for p in plans[2:]), plans


@pytest.mark.mininet
def test_a_tenant_left_without_switch_memory_moves_onto_the_shared_pool(tmp_path):
    """As above with the cooperative policy and its shared pool: the first tenant, whose
    static memory goes to the newcomer, is re-planned onto INA on the switch's shared pool
    (its window a fair share of the pool, its overflow at host fallbacks its launcher
    serves) rather than the ring; it moves at a collective every rank agrees on, and every
    allreduce of both stays in the network and exact."""
    res, plans = _a_newcomer_takes_the_memory(tmp_path, "cooperative")
    assert {c["path"] for c in res.replayed[0].collectives} == {"testbed:ina"}
    assert [(p["algo"], p["placement"]["mode"]) for p in plans[:2]] == [("ina", "static"),
                                                                         ("ina", "shared")]
    _back_to_static_once_it_left(plans)
    assert plans[1]["placement"]["slots"] < plans[0]["placement"]["slots"]
    assert 1 < plans[1]["from_call"] <= len(res.replayed[0].collectives)


# -- [[replay]] in experiment files ----------------------------------------------------------

def _replay_problems(entries: list[dict], **point) -> list[str]:
    from testbed.experiment.spec import ExperimentError, parse_experiment

    try:
        parse_experiment({"topology": {"kind": "star", "n_hosts": 4}, **point,
                          "replay": entries})
    except ExperimentError as e:
        return e.problems
    return []


def test_replay_entries_of_an_experiment_are_checked_before_anything_runs(tmp_path):
    """``[[replay]]``: each trace loads and passes the format's checks (named by its entry
    and file), the tenants' ranks fit the hosts, names differ, one provider means one policy,
    an offload needs an aggregator; a valid file plans the point's traces as one run."""
    from testbed.experiment.runner import REPLAY, plan_runs
    from testbed.experiment.spec import expand_sweep, parse_experiment

    a, b = write(tmp_path / "a", ddp(2)), write(tmp_path / "b", ddp(2))
    bad = write(tmp_path / "bad", {0: [coll(1, pb.ALL_REDUCE, 4096)],
                                   1: [coll(1, pb.ALL_REDUCE, 8192)]})
    (tmp_path / "groups.json").write_text('{"1": [0, 7]}')
    exp = parse_experiment({"topology": {"kind": "star", "n_hosts": 4},
                            "replay": [{"trace": str(a)}, {"trace": str(b), "arrival_s": 1}],
                            "sweep": {"replay.0.algo": ["ring", "hd"]}})
    plan = plan_runs(expand_sweep(exp))
    assert [(p[0], p[5], [j.label() for j in p[4]]) for p in plan] == \
        [(0, REPLAY, ["a", "b"]), (1, REPLAY, ["a", "b"])]
    assert [p[4][0].algo for p in plan] == ["ring", "hd"]
    for entries, point, match in (
            ([{"trace": str(tmp_path / "nope")}], {}, "replay.0.trace: no trace files"),
            ([{"trace": str(a)}, {"trace": str(bad)}], {},
             r"replay.1.trace: .*bad\.1\.et: its collective #0"),
            ([{"trace": str(a)}, {"trace": str(b)}, {"trace": str(a), "name": "c"}], {},
             "replay: the traces have 6 ranks in all (a rank per host), but the topology "
             "has 4 hosts"),
            ([{"trace": str(a)}, {"trace": str(a)}], {}, "replay.1.name: 'a' is also "
                                                         "replay.0's name"),
            ([{"trace": str(a), "algo": "auto"},
              {"trace": str(b), "algo": "auto", "policy": "oracle"}], {},
             "one provider for policies ['cooperative', 'oracle']"),
            ([{"trace": str(a), "hints": {"tolerance": "exact"}}], {},
             "hints are for algo 'auto'"),
            ([{"trace": str(a), "algo": "ina"}], {"topology": {"kind": "star", "n_hosts": 4,
                                                               "switch": "bridge"}},
             "replay.0.algo: 'ina' aggregates in a programmable switch"),
            ([{"trace": str(a), "comm_groups": str(tmp_path / "nogroups.json")}], {},
             "replay.0.comm_groups: "),
            ([{"trace": str(a), "comm_groups": str(tmp_path / "groups.json")}], {},
             r"replay.0.trace: .*communicator group '1' names ranks \[7\]"),
            ([{"trace": str(a), "arrival_s": -1}], {}, "replay.0.arrival_s"),
            ([{"trace": str(a)}], {"faults": [{"switch": "tbs1",
                                               "at_s": 0.1}]},
             "faults: only collective jobs")):
        problems = _replay_problems(entries, **point)
        assert any(match in p or re.search(match, p) for p in problems), (match, problems)


@pytest.mark.mininet
def test_replay_entries_run_as_tenants_of_an_experiments_network(tmp_path):
    """Two ``[[replay]]`` of one point: one run on the point's network, a row per trace
    (hosts of its own, from its arrival, every allreduce exact, JCT against the model's),
    each trace's tables under ``replay/run<NNNN>/<name>/`` with the table of tenants."""
    from testbed.experiment import run

    a = write(tmp_path / "a", ddp(2, sizes=(64 << 10, 256 << 10), compute_us=2000))
    b = write(tmp_path / "b", ddp(2, sizes=(128 << 10,), compute_us=2000))
    exp = {"name": "replay-tenants", "topology": {"kind": "star", "n_hosts": 4,
                                                  "switch": "bridge", "bw_mbps": 100},
           "replay": [{"trace": str(a), "algo": "ring", "name": "first"},
                      {"trace": str(b), "arrival_s": 0.5, "name": "second"}]}
    res = run(exp, out_dir=tmp_path / "r", progress=False, doctor=False)
    df = res.df
    assert list(df["label"]) == ["first", "second"] and (df["run"] == 0).all()
    assert (df["status"] == "ok").all() and df["correct"].all(), df["error"].tolist()
    assert list(df["algo"]) == ["ring", "gloo"] and list(df["collectives"]) == [2, 1]
    assert (df["max_abs_err"] == 0).all()
    assert df["hosts"].iloc[0] == "tbh1,tbh2" and df["hosts"].iloc[1] == "tbh3,tbh4"
    assert df["start_s"].iloc[1] >= 0.5 and (df["time_s"] > 0).all()
    assert (df["model_s"] > 0).all()
    folder = tmp_path / "r" / "replay" / "run0000"
    assert (folder / "tenants.csv").exists()
    for name in ("first", "second"):
        assert (folder / name / "validation.csv").exists()
        assert (folder / name / "timeline.json").exists()
