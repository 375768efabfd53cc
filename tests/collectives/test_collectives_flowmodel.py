"""The flow-level model: ECMP paths as the data path forwards, max-min rates, phases, and its
agreement with the closed-form alpha-beta model on a star (no network is built here)."""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest

from testbed.collectives import CollectiveSpec, hd, ring
from testbed.collectives import flowmodel as fm
from testbed.collectives import model as ab
from testbed.collectives.ports import tcp_tuple
from testbed.collectives.uet import MAX_WINDOW as UET_MAX_WINDOW
from testbed.kernels.wire import MTU_PAYLOAD
from testbed.topologies import Dumbbell, FatTree, LeafSpine, Star, routing
from testbed.topologies.base import AGGREGATOR_MAC, TCP_RTO_MIN_US, host_mac

MB = 1 << 20
HOP = 50e-6
G_TCP = ab.TCP_MSS / (ab.TCP_FRAME + ab.TCP_ACK_SHARE)  # payload share of a busy duplex link


# ------------------------------------------------------------------ paths = the data path's

def _tcp_frame(dst_mac: str, src_ip: str, dst_ip: str, sport: int, dport: int) -> bytes:
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 64, 6, 0,
                     bytes(int(b) for b in src_ip.split(".")),
                     bytes(int(b) for b in dst_ip.split(".")))
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 0, 0, 0x50, 0x10, 1000, 0, 0)
    return bytes.fromhex(dst_mac.replace(":", "")) + bytes(6) + b"\x08\x00" + ip + tcp


def _forward_hop(topo, plan, sw: str, prev: str, frame: bytes) -> str:
    """Run the switch's real forward stage (the settings TestbedNet pushes) on ``frame``
    arriving from ``prev``; return the neighbour it leaves towards."""
    from testbed.datapath.batch import Batch
    from testbed.datapath.forward import ForwardStage

    adj = routing.adjacency(topo)
    ports = [f"{sw}-eth{p}" for p in sorted(p for p, _ in adj[sw].values())]
    settings = dict(next(st for name, st in plan[sw] if name == "forward"))
    stage = ForwardStage(ports=ports, **settings)
    b = Batch(1)
    b.buf[0, :len(frame)] = np.frombuffer(frame, np.uint8)
    b.length[0] = len(frame)
    b.in_port[0] = ports.index(f"{sw}-eth{adj[sw][prev][0]}")
    b.n = 1
    stage.process(b, 0)
    out = ports[int(b.out_port[0])]
    return next(v for v, (p, _) in adj[sw].items() if f"{sw}-eth{p}" == out)


@pytest.mark.parametrize("topo", [
    FatTree(4, switch="programmable"),
    LeafSpine(leaves=3, spines=3, hosts_per_leaf=2, switch="programmable"),
], ids=["fattree4", "leafspine3x3"])
def test_flow_path_is_the_path_the_forward_kernel_takes(topo):
    """Every hop of flow_path, for many 5-tuples, is what the data path's forward stage,
    configured as TestbedNet configures it, does with a real frame of that flow."""
    from testbed.topologies.net import TestbedNet

    plan = TestbedNet(topo).programs_plan()  # no network: just the programs it would push
    tables = routing.forwarding_tables(topo)
    hosts = topo.host_names
    rng = np.random.default_rng(5)
    paths = set()
    for _ in range(40):
        a, b = rng.choice(len(hosts), 2, replace=False)
        sport, dport = (int(x) for x in rng.integers(6000, 20000, 2))
        path = routing.flow_path(topo, hosts[a], hosts[b], sport, dport, tables=tables)
        frame = _tcp_frame(host_mac(int(b)), f"10.0.0.{a + 1}", f"10.0.0.{b + 1}", sport, dport)
        for i in range(1, len(path) - 1):
            assert _forward_hop(topo, plan, path[i], path[i - 1], frame) == path[i + 1], path
        paths.add(tuple(path))
    assert len(paths) > 10  # many different paths were checked


def test_bridge_fabric_paths_follow_the_static_fdb():
    """A looped Linux-bridge fabric forwards by destination MAC (pick_port), whatever the
    ports; a loop-free one has a single path."""
    ls = LeafSpine(leaves=2, spines=4, hosts_per_leaf=2, seed=3)
    adj = routing.adjacency(ls)
    tables = routing.forwarding_tables(ls)
    group = tables["tbl1"][host_mac(2)]
    spine = next(v for v, (p, _) in adj["tbl1"].items()
                 if p == routing.pick_port(group, host_mac(2), 3))
    for sport in range(6000, 6040):
        assert routing.flow_path(ls, "tbh1", "tbh3", sport, 7000) == \
            ["tbh1", "tbl1", spine, "tbl2", "tbh3"]
    assert routing.flow_path(Dumbbell(2, 2), "tbh1", "tbh4", 1, 2) == \
        ["tbh1", "tbs1", "tbs2", "tbh4"]


def test_ina_flows_end_at_the_aggregator():
    ft = FatTree(4, switch="programmable")
    p = routing.flow_path(ft, "tbh16", "tbc1", fm.ina_worker_port(1), fm.INA_AGG_PORT, 17)
    assert p[0] == "tbh16" and p[-1] == "tbc1" and len(p) == 4  # edge, agg, core
    assert routing.node_address(ft, "tbc1") == ("10.0.0.254", AGGREGATOR_MAC)


def test_describe_dict_is_as_good_as_the_topology():
    ft = FatTree(4, switch="programmable", seed=2)
    desc = ft.describe()
    view = routing.as_topology(desc)
    assert view.host_names == ft.host_names and view.programmable == ft.programmable
    assert routing.forwarding_tables(view) == routing.forwarding_tables(ft)
    spec = CollectiveSpec(algo="hd", nbytes=4 * MB)
    assert fm.predict(desc, spec).time_s == pytest.approx(fm.predict(ft, spec).time_s)
    with pytest.raises(ValueError, match="lacks"):
        routing.as_topology({"kind": "star"})
    with pytest.raises(TypeError, match="describe"):
        routing.as_topology(42)


# ------------------------------------------------------------------ max-min by hand

def test_max_min_progressive_filling_by_hand():
    # three flows, two links of 10: f0 on A, f1 on A and B, f2 on B with weight 2
    w = [{"A": 1.0}, {"A": 1.0, "B": 1.0}, {"B": 2.0}]
    r = fm.max_min_rates(w, {"A": 10.0, "B": 10.0})
    # B fills first: r1 + 2 r2 = 10 with r1 = r2 -> 10/3; then f0 takes the rest of A
    assert r == pytest.approx([10 - 10 / 3, 10 / 3, 10 / 3])
    assert fm.max_min_rates([{"A": 1.0}], {"A": 8.0}, caps=[3.0]) == pytest.approx([3.0])
    with pytest.raises(ValueError, match="no shaped link"):
        fm.max_min_rates([{"X": 1.0}], {"A": 1.0})


# ------------------------------------------------------------------ star = closed form

@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op, algo", [
    ("allreduce", "ring"), ("allreduce", "hd"), ("allreduce", "ina"),
    ("reduce_scatter", "ring"), ("allgather", "ring"), ("broadcast", "ring"),
    ("reduce_scatter", "hd"), ("allgather", "hd"), ("broadcast", "hd"),
])
def test_star_agrees_with_the_closed_form(n, op, algo):
    topo = Star(n, bw_mbps=100, switch="programmable")
    spec = CollectiveSpec(op=op, algo=algo, nbytes=8 * MB)
    got = fm.predict(topo, spec, hop_latency_s=HOP).time_s
    want = ab.predict(op, algo, n, spec.nbytes, 100e6, 2 * HOP)
    # one-way transfers: a link direction carries data or ACKs, not both, so the payload
    # share is 1448/1514 where the closed form assumes duplex traffic (1448/1547)
    one_way = spec.nbytes / (100e6 / 8 * ab.TCP_MSS / ab.TCP_FRAME)
    if op == "broadcast" and algo == "hd":  # binomial rounds send one way
        want = math.ceil(math.log2(n)) * (2 * HOP + one_way)
    if op == "broadcast" and algo == "ring" and n == 2:  # a chain of one flow
        want = 2 * HOP + one_way
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("n, m", [(4, 4), (4, 2), (4, 1)])
def test_star_reduction_server_agrees_with_the_closed_form(n, m):
    topo = Star(n + m, bw_mbps=100)  # dedicated servers
    spec = CollectiveSpec(algo="rs", nbytes=8 * MB, workers=n, servers=m)
    got = fm.predict(topo, spec, hop_latency_s=HOP).time_s
    want = ab.predict("allreduce", "rs", n, spec.nbytes, 100e6, 2 * HOP, servers=m,
                      colocated=False)
    # pipeline fill: piece 0 of every worker must reach the server. The closed form charges
    # m pieces at the worker link's rate; the flows really share the busier server link, n
    # of them, so piece 0 takes n pieces' time when m < n
    piece = ab.rs_chunk_bytes(spec.nbytes, m)
    want += (n - m) * piece / (100e6 / 8 * G_TCP)
    assert got == pytest.approx(want, rel=1e-6)


def test_star_hd_fold_pays_its_one_way_exchanges():
    """n = 6: two folded pairs exchange the whole array one way (data one way, ACKs the
    other), then the power-of-two exchange of 4, then the sum back."""
    topo = Star(6, bw_mbps=100)
    spec = CollectiveSpec(algo="hd", nbytes=8 * MB)
    B = 100e6 / 8
    one_way = spec.nbytes / (B * ab.TCP_MSS / ab.TCP_FRAME)
    pow2 = ab.predict("allreduce", "hd", 4, spec.nbytes, 100e6, 2 * HOP)
    assert fm.predict(topo, spec, hop_latency_s=HOP).time_s == pytest.approx(
        pow2 + 2 * (one_way + 2 * HOP), rel=1e-6)


def test_star_compressed_ring_is_an_allgather_of_the_payloads():
    topo = Star(4, bw_mbps=100)
    spec = CollectiveSpec(algo="ring", nbytes=4 * MB, compressor="topk",
                          compressor_params={"ratio": 0.01})
    from testbed.kernels.compressors import get_compressor

    c = get_compressor("topk", ratio=0.01).payload_bytes(spec.count) + 8
    t = fm.predict(topo, spec, hop_latency_s=HOP).time_s
    assert t == pytest.approx(ab.predict("allgather", "ring", 4, 4 * c, 100e6, 2 * HOP))


@pytest.mark.parametrize("name, params", [("fp16", {}), ("thc", {}), ("randomk", {"ratio": 0.1})])
def test_star_summable_compressed_ring_is_a_ring_allreduce_of_the_payload(name, params):
    """Summable payloads are reduce-scattered and allgathered in their wire type (THC first
    agrees on a norm: n-1 steps of 8 bytes): the flow model, the closed form and the choice of
    ``compress.allreduce`` agree; fp16 now halves the plain allreduce's time."""
    from testbed.collectives import compress

    topo = Star(4, bw_mbps=100)
    spec = CollectiveSpec(algo="ring", nbytes=4 * MB, compressor=name, compressor_params=params)
    kind, elems, itemsize = compress.wire_plan(name, params, spec.count, 4)
    assert kind == "reduce_scatter"
    rounds = 1 if name == "thc" else 0
    closed = ab.predict_compressed(kind, 4, elems * itemsize, 100e6, 2 * HOP, rounds)
    t = fm.predict(topo, spec, hop_latency_s=HOP).time_s
    assert t == pytest.approx(closed, rel=1e-3)
    if name == "fp16":
        plain = fm.predict(topo, CollectiveSpec(algo="ring", nbytes=4 * MB),
                           hop_latency_s=HOP).time_s
        assert t < 0.55 * plain


def test_time_dilation_leaves_the_undilated_time():
    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, oversubscription=2)
    spec = CollectiveSpec(algo="ring", nbytes=4 * MB)
    base = fm.predict(topo, spec, hop_latency_s=HOP).time_s
    f = 5.0
    dil = fm.predict(topo, spec, hop_latency_s=HOP * f, time_dilation=f)
    assert dil.time_s == pytest.approx(base) and dil.time_dilation == f
    with pytest.raises(ValueError, match="time_dilation"):
        fm.predict(topo, spec, time_dilation=0.5)


@pytest.mark.parametrize("window", [4, 64])
def test_time_dilation_stretches_ina_timeouts_with_everything_else(window):
    """INA under loss: every term (bandwidth, round trips, the 10 ms timeout floor) is f times
    longer on the dilated network, so the undilated time is the same; a floor left unscaled
    would make the dilated prediction shorter."""
    topo = Star(4, bw_mbps=100, switch="programmable", loss_pct=1.0)
    spec = CollectiveSpec(algo="ina", nbytes=1 * MB, window=window, loss=0.01)
    base = fm.predict(topo, spec, hop_latency_s=HOP)
    f = 8.0
    dil = fm.predict(topo, spec, hop_latency_s=HOP * f, time_dilation=f)
    assert base.ina_extra_s > 0
    assert dil.time_s == pytest.approx(base.time_s) and dil.ina_extra_s == pytest.approx(
        base.ina_extra_s)


# ------------------------------------------------------------------ hand-worked fabrics

def _ports_for(topo, src, dst, want_mid: str):
    """A job id whose deterministic TCP ports send src -> dst through ``want_mid``."""
    r_src, r_dst = topo.host_names.index(src), topo.host_names.index(dst)
    for j in range(200):
        sp, dp = tcp_tuple(j, r_src, r_dst)
        if want_mid in routing.flow_path(topo, src, dst, sp, dp):
            return sp, dp
    raise AssertionError("no port pair takes that path")


def _phase_time(topo, flows):
    p = fm.Phase("hand", flows, trips=0.0)
    net = fm._Network(routing.as_topology(topo), 1.0)
    return fm._run_phase(net, p, 0.0)


def test_leaf_spine_colliding_and_separate_flows_by_hand():
    """Two flows leave leaf 1 for leaf 2 over uplinks of 40 Mb/s. On different spines each
    gets a whole uplink; on one spine they share it. Their ACKs come back leaf 2 -> leaf 1
    (the reverse paths), on links the data does not use."""
    ls = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, uplink_mbps=40, switch="programmable")
    S = 1 * MB
    up = 40e6 / 8
    a = _ports_for(ls, "tbh1", "tbh3", "tbsp1")
    b_same = _ports_for(ls, "tbh2", "tbh4", "tbsp1")
    b_other = _ports_for(ls, "tbh2", "tbh4", "tbsp2")
    f1 = fm.Flow("tbh1", "tbh3", S, *a)
    # separate spines: each flow has an uplink to itself (the ACKs return leaf 2 -> leaf 1,
    # the other direction of the links, which no data uses)
    res = _phase_time(ls, [f1, fm.Flow("tbh2", "tbh4", S, *b_other)])
    assert [r for _f, r, _p in res.rates] == pytest.approx([up / fm.TCP_WIRE] * 2)
    assert res.transfer_s == pytest.approx(S / (up / fm.TCP_WIRE))
    # one spine: the two flows split its uplink
    res = _phase_time(ls, [f1, fm.Flow("tbh2", "tbh4", S, *b_same)])
    assert [r for _f, r, _p in res.rates] == pytest.approx([up / 2 / fm.TCP_WIRE] * 2)
    assert res.transfer_s == pytest.approx(S / (up / 2 / fm.TCP_WIRE))
    assert res.bottleneck == ("tbl1", "tbsp1")


def test_acks_take_their_own_path_on_a_bridge_fabric_by_hand():
    """Leaf-spine 4:1 of Linux bridges (static FDB by destination): rank 4's data to rank 0
    crosses spine 2, its ACKs come back over spine 1, so the ACK bytes load tbl1 -> tbsp1
    (not tbl1 -> tbsp2, the data path reversed) and tbsp1 -> tbl3."""
    ls = LeafSpine(leaves=4, spines=2, hosts_per_leaf=2, oversubscription=4, bw_mbps=100,
                   switch={"tbsp1"})
    net = fm._Network(routing.as_topology(ls), 1.0)
    sp, dp = tcp_tuple(0, 4, 0)
    f = fm.Flow("tbh5", "tbh1", 1000.0, sp, dp)
    assert net.flow_path(f) == ["tbh5", "tbl3", "tbsp2", "tbl1", "tbh1"]
    assert net.ack_path(f) == ["tbh1", "tbl1", "tbsp1", "tbl3", "tbh5"]
    w = net.weights(f)
    data = [("tbh5", "tbl3"), ("tbl3", "tbsp2"), ("tbsp2", "tbl1"), ("tbl1", "tbh1")]
    acks = [("tbh1", "tbl1"), ("tbl1", "tbsp1"), ("tbsp1", "tbl3"), ("tbl3", "tbh5")]
    assert w == {**dict.fromkeys(data, fm.TCP_WIRE), **dict.fromkeys(acks, fm.TCP_ACK)}


def test_fat_tree_collision_on_an_edge_uplink_by_hand():
    """k=4, every link 100 Mb/s: two flows from the same edge switch to another pod collide
    on an edge uplink (half a link each) or not (a whole access link each). INA-style flows
    (no ACKs) keep the arithmetic plain."""
    ft = FatTree(4, switch="programmable")
    C = 100e6 / 8
    S = 2 * MB

    def flow(src, dst, sport):
        return fm.Flow(src, dst, S, sport, 41000, 17, fm.INA_WIRE, 0.0)

    by_agg: dict[str, list[int]] = {}
    for sport in range(20000, 20050):
        p = routing.flow_path(ft, "tbh1", "tbh13", sport, 41000, 17)
        by_agg.setdefault(p[2], []).append(sport)
    assert set(by_agg) == {"tba1", "tba2"}  # both uplinks of tbe1 are used by some ports
    (s1, s2), s3 = by_agg["tba1"][:2], by_agg["tba2"][0]
    # tbh2 -> tbh14 with the same ports hashes differently: search for its own agg
    q = {routing.flow_path(ft, "tbh2", "tbh14", s, 41000, 17)[2]: s
         for s in range(20000, 20050)}
    collide = _phase_time(ft, [flow("tbh1", "tbh13", s1), flow("tbh2", "tbh14", q["tba1"])])
    assert [r for _f, r, _p in collide.rates] == pytest.approx([C / 2 / fm.INA_WIRE] * 2)
    apart = _phase_time(ft, [flow("tbh1", "tbh13", s1), flow("tbh2", "tbh14", q["tba2"])])
    assert [r for _f, r, _p in apart.rates] == pytest.approx([C / fm.INA_WIRE] * 2)
    assert collide.transfer_s == pytest.approx(2 * apart.transfer_s)
    # one host, two flows: its access link is the bottleneck wherever they go
    same_src = _phase_time(ft, [flow("tbh1", "tbh13", s2), flow("tbh1", "tbh13", s3)])
    assert [r for _f, r, _p in same_src.rates] == pytest.approx([C / 2 / fm.INA_WIRE] * 2)
    assert same_src.bottleneck == ("tbh1", "tbe1")


def test_a_ring_pays_its_links_mean_latency_a_barrier_round_the_longest():
    """Fat-tree k=4, 16 ranks: a ring step's and the chain broadcast's ranks relay each
    other's data, so every extra second of hop latency costs them the mean hop count of
    their flows' paths per trip (the ring: 2 links under one edge switch, 4 between edge
    switches of a pod, 6 between pods); halving-doubling's rounds wait for their longest."""
    ft = FatTree(4, switch="programmable")
    hosts = [f"tbh{i}" for i in range(1, 17)]
    n = len(hosts)

    def latency(spec):
        return (fm.predict(ft, spec, workers=hosts, hop_latency_s=HOP).time_s
                - fm.predict(ft, spec, workers=hosts, hop_latency_s=0.0).time_s)

    ring_hops = [routing.path_hops(ft, hosts[r], hosts[(r + 1) % n]) for r in range(n)]
    assert sorted(set(ring_hops)) == [2, 4, 6]
    mean = sum(ring_hops) / n
    spec = CollectiveSpec(algo="ring", nbytes=64 << 10)
    assert latency(spec) == pytest.approx(2 * (n - 1) * mean * HOP, rel=1e-6)
    chain = sum(routing.path_hops(ft, hosts[r], hosts[r + 1]) for r in range(n - 1))
    bcast = CollectiveSpec(algo="ring", op="broadcast", nbytes=64 << 10)
    assert latency(bcast) == pytest.approx(chain * HOP, rel=1e-6)
    # halving-doubling: a pair exchange is a barrier, each round waits for its longest path
    rounds = fm.phases(CollectiveSpec(algo="hd", nbytes=64 << 10), hosts)
    longest = sum(max(routing.path_hops(ft, f.src, f.dst) for f in ph.flows)
                  * ph.trips for ph in rounds)
    assert latency(CollectiveSpec(algo="hd", nbytes=64 << 10)) == pytest.approx(
        longest * HOP, rel=1e-6)


def test_max_min_gives_the_leftover_to_the_unconstrained_flow():
    """Dumbbell 2+2, bottleneck 30 Mb/s, access 100 Mb/s: two flows cross it (15 each), a
    third stays on the left and gets the rest of the shared access link of tbh1."""
    d = Dumbbell(2, 2, bottleneck_mbps=30)
    C, Bn = 100e6 / 8, 30e6 / 8
    flows = [fm.Flow("tbh1", "tbh3", MB, 1, 2, 17, 1.0, 0.0),
             fm.Flow("tbh2", "tbh4", MB, 1, 2, 17, 1.0, 0.0),
             fm.Flow("tbh1", "tbh2", MB, 3, 4, 17, 1.0, 0.0)]
    res = _phase_time(d, flows)
    assert [r for _f, r, _p in res.rates] == pytest.approx([Bn / 2, Bn / 2, C - Bn / 2])
    # the fluid simulation: the local flow ends first, then nothing changes for the others
    assert res.transfer_s == pytest.approx(MB / (Bn / 2))


def test_oversubscribed_leaf_spine_orders_algorithms_by_their_real_flows():
    """4 leaves x 2 spines, 2 hosts per leaf, 4:1 (uplinks 25 Mb/s), all programmable:
    INA squeezes both workers of a leaf through the one uplink to the aggregator spine
    (12.5 Mb/s each); ring has one flow per leaf uplink pair; hd's d=2 and d=4 rounds put two
    flows on each leaf's uplinks, which collide when the hash picks one spine for both."""
    ls = LeafSpine(leaves=4, spines=2, hosts_per_leaf=2, oversubscription=4,
                   switch="programmable")
    S = 4 * MB
    t = {a: fm.predict(ls, CollectiveSpec(algo=a, nbytes=S, servers=8), hop_latency_s=HOP)
         for a in ("ring", "hd", "ina")}
    ina_rate = 25e6 / 8 / 2 / fm.INA_WIRE
    assert t["ina"].time_s == pytest.approx(S / ina_rate + 4 * 2 * HOP, rel=1e-6)
    ring_rate = min(r for ph in t["ring"].phases for _f, r, _p in ph.rates)
    assert ring_rate <= 25e6 / 8 / fm.TCP_WIRE * (1 + 1e-9)
    halving = {ph.name: ph for ph in t["hd"].phases}
    cross = [r for _f, r, p in halving["halving d=4"].rates if p[1] != p[-2]]
    assert cross and min(cross) < 25e6 / 8 / fm.TCP_WIRE  # some cross-leaf flows collide
    assert t["ring"].time_s < t["ina"].time_s < t["hd"].time_s


# ------------------------------------------------------------------ phases = the algorithms

@pytest.mark.parametrize("n", [2, 3, 5, 6, 8])
def test_phases_use_the_implementations_peers_and_bytes(n):
    hosts = [f"tbh{i + 1}" for i in range(n)]
    count = 1000 * n + 7
    spec = CollectiveSpec(algo="ring", nbytes=4 * count)
    ph = fm.phases(spec, hosts)
    assert len(ph) == 2 * (n - 1)
    sent = {h: 0.0 for h in hosts}
    for p in ph:
        for f in p.flows:
            a = hosts.index(f.src)
            assert f.dst == hosts[(a + 1) % n]
            assert hosts.index(f.dst) in ring.ring_peers(a, n)
            sent[f.src] += f.nbytes
    # every rank sends 2 (n-1)/n of the array (shards may differ by one element)
    for v in sent.values():
        assert abs(v - 2 * (n - 1) / n * spec.nbytes) <= 2 * (n - 1) * 4
    spec = CollectiveSpec(algo="hd", nbytes=4 * count)
    for p in fm.phases(spec, hosts):
        for f in p.flows:
            a, b = hosts.index(f.src), hosts.index(f.dst)
            assert b in hd.hd_peers(a, n, "allreduce")
            sp, dp = tcp_tuple(spec.job_id, a, b)
            assert (f.sport, f.dport) == (sp, dp)


def test_rs_colocated_servers_skip_their_own_shard():
    topo = Star(4, bw_mbps=100)
    spec = CollectiveSpec(algo="rs", nbytes=8 * MB, servers=4)
    workers, servers = fm.placement(topo.host_names, spec)
    assert servers == workers  # co-located, one per worker
    p = fm.predict(topo, spec, hop_latency_s=HOP)
    flows = p.phases[0].rates
    assert len(flows) == 2 * 4 * 3  # the 8 local flows use no link
    # each host link carries (n-1 + m-1)/m S each way: the closed form's co-located load
    t = 8 * MB / (100e6 / 8 * G_TCP)
    assert p.phases[0].transfer_s == pytest.approx(ab.rs_link_load(4, 4, True) * t)


def test_ina_window_and_loss_first_order():
    assert fm.ina_extra_s(n=4, packets=1000, window=64, p_up=0, p_down=0, frame_s=1e-4,
                         rtt_s=1e-3) == 0.0
    p, n, K, W, fs, rtt = 0.01, 4, 8192, 64, 9e-5, 4e-4
    rho = 1 - (1 - p) ** n * (1 - p)
    rto = max(0.010, 2 * (rtt + W * fs))
    # every member resends a round any member's loss stalled, again if the resend stalls:
    # rho / (1 - rho), not 2p, frames per frame
    want = K * rho / (1 - rho) * fs + max(0.0, K / W * (rtt + rho * rto) - K * fs) + \
        rto * (1 - (1 - rho) ** W)
    got = fm.ina_extra_s(n=n, packets=K, window=W, p_up=p, p_down=p, frame_s=fs, rtt_s=rtt)
    assert got == pytest.approx(want)
    assert fm.ina_extra_s(n=4, packets=1000, window=1, p_up=0, p_down=0, frame_s=1e-4,
                          rtt_s=1e-3) == pytest.approx(1000 * (1e-3 - 1e-4))
    # a small window cannot hide the stalls: the chain bound takes over
    small = fm.ina_extra_s(n=n, packets=K, window=4, p_up=p, p_down=p, frame_s=fs, rtt_s=rtt)
    assert small > got
    star = Star(4, bw_mbps=100, switch="programmable")
    clean = fm.predict(star, CollectiveSpec(algo="ina", nbytes=8 * MB), hop_latency_s=HOP)
    lossy = fm.predict(star, CollectiveSpec(algo="ina", nbytes=8 * MB, loss=0.01),
                       hop_latency_s=HOP)
    assert clean.ina_extra_s == 0 and lossy.ina_extra_s > 0
    assert lossy.time_s == pytest.approx(clean.time_s + lossy.ina_extra_s)
    # without loss, a window far below the round trip's worth of packets sets the pace
    tiny = fm.predict(star, CollectiveSpec(algo="ina", nbytes=8 * MB, window=1),
                      hop_latency_s=1e-3)
    K = 8 * MB // 1024
    assert tiny.time_s >= K * 2 * 1e-3


def test_incast_trimming_counts_the_bytes_that_cross():
    # 3 senders at 100 Mb/s into a 50 Mb/s trimming port: senders finish at line rate, the
    # port carries only what it can, plus a full data queue to drain at the end
    F, h, frames = 1100, 120, 240
    r = fm.incast_s(senders=3, frames=frames, frame_bytes=F, trimmed_bytes=h,
                    access_mbps=100, port_mbps=50, threshold_bytes=30_000)
    C, R = 100e6 / 8, 50e6 / 8
    assert r.time_s == pytest.approx(frames * F / C + 30_000 / R)
    assert 0 < r.trimmed_frac < 1
    assert r.bottleneck_bytes < 3 * frames * F
    untrimmed = 3 * frames * F / R
    assert r.time_s < untrimmed / 2  # what the old model missed
    dt = fm.incast_s(senders=3, frames=frames, frame_bytes=F, trimmed_bytes=h,
                     access_mbps=100, port_mbps=50, threshold_bytes=30_000, mode="drop_tail")
    assert dt.time_s is None and "NACK" in dt.note
    # no congestion: the model is plain serialisation, trimming or not
    calm = fm.incast_s(senders=1, frames=frames, frame_bytes=F, trimmed_bytes=h,
                       access_mbps=100, port_mbps=100, threshold_bytes=0, mode="drop_tail")
    assert calm.time_s == pytest.approx(frames * F / C) and calm.trimmed_frac == 0


def test_bad_input_is_named():
    star = Star(4, bw_mbps=100)
    with pytest.raises(ValueError, match="aggregator"):
        fm.predict(star, CollectiveSpec(algo="ina"))  # a bridge star has none
    with pytest.raises(ValueError, match="not hosts"):
        fm.predict(star, CollectiveSpec(algo="ring", workers=2), workers=["tbh1", "tbh9"])
    with pytest.raises(ValueError, match="no shaped link"):
        fm.predict(Star(4, bw_mbps=None), CollectiveSpec(algo="ring"))
    with pytest.raises(TypeError, match="CollectiveSpec"):
        fm.predict(star, {"algo": "ring"})


def test_ina_thc_counts_its_wire_bytes():
    """INA + THC: one int8 lane per (padded) element each way when the n-way sums fit int8;
    int16 RESULT lanes (packets of 512 lanes) when they may not."""
    star = Star(8, bw_mbps=100, switch="programmable")
    plain = fm.predict(star, CollectiveSpec(algo="ina", nbytes=8 << 20), hop_latency_s=HOP)
    small = fm.predict(star, CollectiveSpec(algo="ina", nbytes=8 << 20, compressor="thc"),
                       hop_latency_s=HOP)  # g = 16: 8 * 8 <= 127, int8 both ways
    wide = fm.predict(star, CollectiveSpec(algo="ina", nbytes=8 << 20, compressor="thc",
                                           compressor_params={"granularity": 64}),
                      hop_latency_s=HOP)  # 8 * 32 > 127: int16 results
    lat = 4 * 1 * HOP
    assert (small.time_s - lat) == pytest.approx((plain.time_s - lat) / 4, rel=1e-3)
    assert (wide.time_s - lat) == pytest.approx((plain.time_s - lat) / 2, rel=1e-3)


def test_concurrent_jobs_share_the_links_they_cross():
    """predict_concurrent: one job alone is predict's time; two equal rings across a
    dumbbell's bottleneck each take twice theirs; a ring started during an INA job takes
    twice its time per allreduce and the INA job its own plus the ring's; jobs on disjoint
    links do not slow each other."""
    d = Dumbbell(2, 2, bw_mbps=100, bottleneck_mbps=10, switch="programmable")
    r1 = CollectiveSpec(algo="ring", nbytes=1 << 20, job_id=1)
    r2 = CollectiveSpec(algo="ring", nbytes=1 << 20, job_id=2)
    alone = fm.predict(d, r1, workers=["tbh1", "tbh3"]).time_s
    (one,) = fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh3"])])
    assert one == pytest.approx(alone, rel=1e-9)
    both = fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh3"]),
                                     fm.ConcurrentJob(r2, ["tbh2", "tbh4"])])
    assert both == pytest.approx([2 * alone, 2 * alone], rel=0.02)
    # on one side of the bottleneck only: no shared link, no slowdown
    apart = fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh2"]),
                                      fm.ConcurrentJob(r2, ["tbh3", "tbh4"])])
    assert apart[0] == pytest.approx(fm.predict(d, r1, workers=["tbh1", "tbh2"]).time_s)
    ina = CollectiveSpec(algo="ina", nbytes=8 << 20, job_id=1)
    rings = CollectiveSpec(algo="ring", nbytes=64 << 10, job_id=2, repetitions=10)
    ina_alone = fm.predict(d, ina, workers=["tbh1", "tbh3"]).time_s
    ring_alone = fm.predict(d, dataclasses.replace(rings, repetitions=1),
                            workers=["tbh2", "tbh4"]).time_s
    t_ina, t_ring = fm.predict_concurrent(
        d, [fm.ConcurrentJob(ina, ["tbh1", "tbh3"]),
            fm.ConcurrentJob(rings, ["tbh2", "tbh4"], start_s=2.0)])
    assert t_ring == pytest.approx(10 * 2 * ring_alone, rel=0.05)
    assert t_ina == pytest.approx(ina_alone + 10 * ring_alone, rel=0.05)
    # a dilated network: the same undilated times
    t2 = fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh3"]),
                                   fm.ConcurrentJob(r2, ["tbh2", "tbh4"])], time_dilation=4)
    assert t2 == pytest.approx(both, rel=0.02)


def test_concurrent_jobs_in_a_steady_state_repeat_until_each_ended_enough():
    """until_each: a short ring starts over until the long one has ended its allreduces, so
    every repetition the caller averages ran beside the other job; rep_ends lists each
    repetition's end. Two equal rings across the bottleneck: every allreduce at half speed.
    A ring 16x shorter than the other: its allreduces while both run take twice its time
    alone, and it keeps going (more than 16 of them) until the long one ended 2."""
    d = Dumbbell(2, 2, bw_mbps=100, bottleneck_mbps=10, switch="programmable")
    r1 = CollectiveSpec(algo="ring", nbytes=1 << 20, job_id=1)
    r2 = CollectiveSpec(algo="ring", nbytes=1 << 20, job_id=2)
    alone = fm.predict(d, r1, workers=["tbh1", "tbh3"]).time_s
    ends: list = []
    fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh3"]),
                              fm.ConcurrentJob(r2, ["tbh2", "tbh4"])],
                          rep_ends=ends, until_each=3)
    assert min(len(e) for e in ends) == 3  # (one may start a 4th as the other ends its 3rd)
    assert np.diff([0.0, *ends[0][:3]]) == pytest.approx([2 * alone] * 3, rel=0.03)
    short = CollectiveSpec(algo="ring", nbytes=64 << 10, job_id=2)
    short_alone = fm.predict(d, short, workers=["tbh2", "tbh4"]).time_s
    assert 12 < alone / short_alone < 20
    fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh3"]),
                              fm.ConcurrentJob(short, ["tbh2", "tbh4"])],
                          rep_ends=ends, until_each=2)
    long_ends, short_ends = ends
    assert len(long_ends) == 2 and len(short_ends) > 16
    during = [e for e in short_ends if e <= long_ends[-1]]
    assert during[-1] / len(during) == pytest.approx(2 * short_alone, rel=0.1)
    # without until_each the repetitions asked for, as before
    fm.predict_concurrent(d, [fm.ConcurrentJob(r1, ["tbh1", "tbh3"])], rep_ends=ends)
    assert ends[0] == pytest.approx([alone], rel=1e-9)


def test_a_sprayed_transport_spreads_a_flow_over_every_ecmp_path():
    """transport='uet' sprays a message over 8 source ports: on a 4:1 leaf-spine with two
    spines the ring's leaf-crossing flows use both uplinks, so the model halves its time
    against TCP's one path per flow; a star (one path) changes only by the framing."""
    from testbed.collectives.flowmodel import UET_WIRE, _Network, _Ranks
    from testbed.topologies import LeafSpine, Star

    ls = LeafSpine(leaves=2, spines=2, hosts_per_leaf=4, oversubscription=4.0, bw_mbps=100,
                   switch="programmable")  # ECMP: a bridge fabric has one path
    tcp = fm.predict(ls, CollectiveSpec(algo="ring", nbytes=32 << 20))
    uet = fm.predict(ls, CollectiveSpec(algo="ring", nbytes=32 << 20, transport="uet"))
    assert 0.45 < uet.time_s / tcp.time_s < 0.55, (uet.time_s, tcp.time_s)
    flow = _Ranks(ls.host_names, 1, 4, "uet").tcp(3, 4, 1000)  # tbh4 -> tbh5: leaf to leaf
    w = _Network(ls, 1.0).weights(flow)
    ups = {k: v for k, v in w.items() if k[0] == "tbl1" and k[1].startswith("tbsp")}
    assert set(ups) == {("tbl1", "tbsp1"), ("tbl1", "tbsp2")}
    assert abs(sum(ups.values()) - UET_WIRE) < 1e-9
    star = Star(4, bw_mbps=100)
    a = fm.predict(star, CollectiveSpec(algo="ring", nbytes=8 << 20)).time_s
    b = fm.predict(star, CollectiveSpec(algo="ring", nbytes=8 << 20, transport="uet")).time_s
    assert abs(b / a - 1) < 0.05
    # a compressed ring over UET is sprayed too (its reduce-scatter in the wire type, or the
    # allgather of its blobs): it gains what the uncompressed one gains
    for comp, params in (("bf16", {}), ("thc", {"granularity": 16}), ("topk", {"ratio": 0.01})):
        t, u = (fm.predict(ls, CollectiveSpec(algo="ring", nbytes=32 << 20, transport=x,
                                              compressor=comp, compressor_params=params))
                for x in ("tcp", "uet"))
        assert 0.45 < u.time_s / t.time_s < 0.62, (comp, u.time_s, t.time_s)


# ------------------------------------------------------------------ impaired links

def _every_uplink(topo, **kw) -> list:
    """An ingress impairment at the switch on every host -> switch link of a star."""
    sw = topo.fabric_switches()[0]
    return [fm.LinkImpairment(h, sw, direction="ingress", **kw) for h in topo.host_names]


def test_an_impair_stage_is_priced_like_the_same_loss_on_the_links():
    """INA's loss term reads each edge's paths: records of loss p on every directed link of
    a star give the time the topology's ``loss_pct`` gives (the two impair the same links),
    and a loss only on the RESULTs' way costs less than on both ways."""
    spec = CollectiveSpec(algo="ina", nbytes=1 * MB, window=16)
    lossy = fm.predict(Star(4, bw_mbps=100, switch="programmable", loss_pct=2.0), spec,
                       hop_latency_s=HOP)
    topo = Star(4, bw_mbps=100, switch="programmable")
    both = [fm.LinkImpairment(a, b, loss=0.02) for s in topo.link_specs
            for a, b in ((s.a, s.b), (s.b, s.a))]
    staged = fm.predict(topo, spec, hop_latency_s=HOP, impairments=both)
    assert staged.ina_extra_s == pytest.approx(lossy.ina_extra_s) and staged.ina_extra_s > 0
    down = [i for i in both if i.src == "tbs1"]
    assert 0 < fm.predict(topo, spec, hop_latency_s=HOP,
                          impairments=down).ina_extra_s < staged.ina_extra_s
    # their dict form (rows, metadata) is taken too; a bad one is named
    assert fm.predict(topo, spec, hop_latency_s=HOP, impairments=[i.to_dict() for i in both]
                      ).time_s == pytest.approx(staged.time_s)
    with pytest.raises(ValueError, match="impairment"):
        fm.predict(topo, spec, hop_latency_s=HOP, impairments=[{"src": "tbh1", "loss": 0.1}])


def test_duplicates_load_the_links_after_the_point_they_are_copied():
    """A 10 % duplication at the switch's ingress from every host: the downlinks carry 1.1x
    a ring's bytes, the uplinks not; at the hosts' egress the uplinks do. A stage that
    impairs testbed frames only leaves TCP alone; an aggregating switch takes INA's copies."""
    topo = Star(4, bw_mbps=100, switch="programmable")
    ring = CollectiveSpec(algo="ring", nbytes=4 * MB)
    base = fm.predict(topo, ring, hop_latency_s=0.0).time_s
    ing = fm.predict(topo, ring, hop_latency_s=0.0,
                     impairments=_every_uplink(topo, dup=0.1)).time_s
    assert ing == pytest.approx(base * 1.1, rel=0.01)
    net = fm._Network(routing.as_topology(topo), 1.0, _every_uplink(topo, dup=0.1))
    flow = fm.Flow("tbh1", "tbh2", 1.0, 50000, 50001)
    w = net.weights(flow)
    assert w[("tbh1", "tbs1")] == pytest.approx(fm.TCP_WIRE)
    assert w[("tbs1", "tbh2")] == pytest.approx(fm.TCP_WIRE * 1.1)
    egress = [fm.LinkImpairment(h, "tbs1", dup=0.1) for h in topo.host_names]
    assert fm._Network(routing.as_topology(topo), 1.0, egress).weights(flow)[
        ("tbh1", "tbs1")] == pytest.approx(fm.TCP_WIRE * 1.1)
    assert fm.predict(topo, ring, hop_latency_s=0.0, impairments=_every_uplink(
        topo, dup=0.1, testbed_only=True)).time_s == pytest.approx(base)
    ina = CollectiveSpec(algo="ina", nbytes=4 * MB)
    assert fm.predict(topo, ina, hop_latency_s=HOP, impairments=_every_uplink(
        topo, dup=0.1)).time_s == pytest.approx(fm.predict(topo, ina, hop_latency_s=HOP).time_s)


def test_reordering_costs_ina_the_timeout_of_a_held_frame_in_the_last_window():
    topo = Star(4, bw_mbps=100, switch="programmable")
    spec = CollectiveSpec(algo="ina", nbytes=1 * MB, window=16)
    base = fm.predict(topo, spec, hop_latency_s=HOP)
    imps = _every_uplink(topo, reorder=0.1, reorder_timeout_s=0.01, testbed_only=True)
    held = fm.predict(topo, spec, hop_latency_s=HOP, impairments=imps)
    assert held.ina_extra_s - base.ina_extra_s == pytest.approx(0.01 * (1 - 0.9 ** 16))
    # on a dilated network the stage's timeout is dilated wall time like the rest
    dil = fm.predict(topo, spec, hop_latency_s=HOP * 4, time_dilation=4.0, impairments=[
        dataclasses.replace(i, reorder_timeout_s=0.04) for i in imps])
    assert dil.time_s == pytest.approx(held.time_s)


def test_tcp_loss_is_priced_where_the_flows_frames_are_lost():
    """A ring's loss term: on a path with loss (an impair stage or the topology's
    ``loss_pct``), not where only testbed frames are impaired or nothing is."""
    topo = Star(4, bw_mbps=100, switch="programmable")
    ring = CollectiveSpec(algo="ring", nbytes=1 * MB)

    def loss_s(imps, t=topo):
        return fm.predict(t, ring, hop_latency_s=HOP, impairments=imps).loss_s

    assert loss_s([]) == 0
    assert loss_s(_every_uplink(topo, loss=0.01)) > 0
    assert loss_s(_every_uplink(topo, loss=0.01, testbed_only=True)) == 0
    assert loss_s([], Star(4, bw_mbps=100, switch="programmable", loss_pct=1.0)) > 0


def test_tcp_loss_stalls_a_flow_a_round_trip_loaded_with_the_queue_before_its_acks():
    """The TCP loss term by hand on a ring of two (each step: h1 -> h2 and h2 -> h1 at once),
    only h1 -> h2's data lossy: h2 -> h1 keeps its whole window in flight, so h2's uplink
    queues what the base round trip does not hold, and h1 -> h2's ACKs wait behind it;
    h1 -> h2's own window is Reno's under loss. Each step that loses anything waits
    k = max(1, min(N p, T / rtt)) of those round trips."""
    p, nbytes = 0.01, 2 * MB
    topo = Star(2, bw_mbps=100, switch="programmable")
    spec = CollectiveSpec(algo="ring", nbytes=nbytes)
    pred = fm.predict(topo, spec, hop_latency_s=HOP,
                      impairments=[fm.LinkImpairment("tbs1", "tbh2", loss=p)])
    cap = 100e6 / 8
    rate = cap / (fm.TCP_WIRE + fm.TCP_ACK)  # both flows' data and the other's ACKs per link
    base = 2 * 2 * HOP
    window = ab.tcp_window_clamp("ring", cap * 8)
    ack_wait = (window - rate * base) * fm.TCP_WIRE / cap
    rtt = base + ack_wait
    step = nbytes / 2
    packets = step / ab.TCP_MSS
    k = max(1.0, min(packets * p, step / rate / rtt))
    per_step = (1 - (1 - p) ** packets) * k * rtt
    assert pred.loss_s == pytest.approx(2 * per_step, rel=1e-6)  # reduce-scatter, allgather
    # reordering on the path too: a lost retransmission waits out the retransmission timeout
    # (the kernel's floor, dilated with the network: the undilated time is the same)
    for f in (1.0, 4.0):
        held = fm.predict(topo, spec, hop_latency_s=HOP * f, time_dilation=f, impairments=[
            fm.LinkImpairment("tbs1", "tbh2", loss=p, reorder=0.05)])
        timeout = max(TCP_RTO_MIN_US / 1e6, 2 * rtt)
        assert held.loss_s - pred.loss_s == pytest.approx(
            2 * (1 - (1 - p) ** packets) * k * p * timeout, rel=1e-6)
    clean = fm.predict(topo, spec, hop_latency_s=HOP)
    assert pred.time_s == pytest.approx(clean.time_s + pred.loss_s)
    assert clean.loss_s == 0
    # the UET-like transport's flows stall the same way, on its own window (its largest
    # congestion window, or the same AIMD bound under loss) and frames; it ignores reordering
    uet_spec = dataclasses.replace(spec, transport="uet")
    uet = fm.predict(topo, uet_spec, hop_latency_s=HOP,
                     impairments=[fm.LinkImpairment("tbs1", "tbh2", loss=p)])
    rate = cap / (fm.UET_WIRE + fm.UET_ACK)
    # h2 -> h1 (lossless) keeps the sender's largest window in flight ahead of the ACKs
    rtt = base + (UET_MAX_WINDOW * MTU_PAYLOAD - rate * base) * fm.UET_WIRE / cap
    packets = step / MTU_PAYLOAD  # the transport's own packets
    k = max(1.0, min(packets * p, step / rate / rtt))
    assert uet.loss_s == pytest.approx(2 * (1 - (1 - p) ** packets) * k * rtt, rel=1e-6)
    assert not uet.notes
    reordered = fm.predict(topo, uet_spec, hop_latency_s=HOP, impairments=[
        fm.LinkImpairment("tbs1", "tbh2", loss=p, reorder=0.05)])
    assert reordered.loss_s == pytest.approx(uet.loss_s)
    # a full queue that cuts trimmable packets instead (a trimming plan's port) loses TCP's
    # frames, not UET's: those are NACKed and resent within a round trip
    cut = [fm.LinkImpairment("tbs1", "tbh2", loss=p, cuts_trimmable=True)]
    assert fm.predict(topo, uet_spec, hop_latency_s=HOP, impairments=cut).loss_s == 0
    assert fm.predict(topo, spec, hop_latency_s=HOP, impairments=cut).loss_s == pytest.approx(
        pred.loss_s)
    # ... while a random loss on the same link still stalls it
    both = cut + [fm.LinkImpairment("tbs1", "tbh2", loss=p)]
    assert fm.predict(topo, uet_spec, hop_latency_s=HOP, impairments=both).loss_s == (
        pytest.approx(uet.loss_s))


def test_concurrent_prediction_adds_the_loss_terms_of_every_repetition():
    """A job alone in ``predict_concurrent`` takes its repetitions' times as ``predict`` gives
    them, INA's window and loss and the host transports' loss included once per repetition
    (a UET ring's too where only testbed frames, its own among them, are impaired)."""
    topo = Star(4, bw_mbps=100, switch="programmable")
    every = [fm.LinkImpairment(h, "tbs1", loss=0.01, direction="ingress")
             for h in topo.host_names]
    testbed_only = [dataclasses.replace(i, testbed_only=True) for i in every]
    for spec, imps in ((CollectiveSpec(algo="ring", nbytes=MB), every),
                       (CollectiveSpec(algo="ina", nbytes=MB), every),
                       (CollectiveSpec(algo="ring", nbytes=MB, transport="uet"), testbed_only)):
        one = fm.predict(topo, spec, hop_latency_s=HOP, impairments=imps)
        assert one.loss_s + one.ina_extra_s > 0
        ends: list = []
        both = fm.predict_concurrent(
            topo, [fm.ConcurrentJob(dataclasses.replace(spec, repetitions=3),
                                    topo.host_names)],
            hop_latency_s=HOP, impairments=imps, rep_ends=ends)[0]
        assert both == pytest.approx(3 * one.time_s, rel=1e-6)
        assert ends[0][-1] == pytest.approx(both)
