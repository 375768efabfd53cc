"""Aggregation trees (:mod:`testbed.topologies.aggtree`): pure functions of the topology."""

from __future__ import annotations

import pytest

from testbed.collectives import CollectiveSpec
from testbed.collectives import flowmodel as fm
from testbed.topologies import FatTree, LeafSpine, Star, TopologyError, aggtree, routing
from testbed.topologies.base import host_ip, switch_identity

PORT = 20001


def test_single_switch_is_a_tree_of_one():
    topo = Star(4, switch="programmable")
    p = aggtree.plan(topo, [0, 1, 2, 3], PORT)
    assert p.tree == ["tbs1"] and p.depth() == 1
    members = p.nodes["tbs1"]["members"]
    assert [m["ip"] for m in members] == [host_ip(r) for r in range(4)]
    assert [m["ingress"] for m in members] == [f"tbs1-eth{r + 1}" for r in range(4)]
    assert p.nodes["tbs1"]["parent"] is None
    assert [w["member"] for w in p.workers] == [0, 1, 2, 3]
    assert aggtree.plan(topo, [0, 1, 2, 3], PORT, "auto").tree == ["tbs1"]


def test_leaf_spine_auto_tree_leaves_under_a_spine():
    topo = LeafSpine(2, 2, 2, switch="programmable")
    p = aggtree.plan(topo, [0, 1, 2, 3], PORT, "auto")
    assert p.root in ("tbsp1", "tbsp2") and sorted(p.tree[1:]) == ["tbl1", "tbl2"]
    assert p.depth() == 2
    for leaf, ranks in (("tbl1", [0, 1]), ("tbl2", [2, 3])):
        node = p.nodes[leaf]
        assert [m["ip"] for m in node["members"]] == [host_ip(r) for r in ranks]
        par = node["parent"]
        mac, ip = switch_identity(topo, p.root)
        assert (par["switch"], par["mac"], par["ip"]) == (p.root, mac, ip)
        # the parent's members are the leaves, in the order of their first worker
        assert p.nodes[p.root]["members"][par["index"]]["ip"] == switch_identity(topo, leaf)[1]
        # the ports are the ones the fabric's ECMP really uses between the two switches
        hops = routing.flow_hops(topo, leaf, p.root, 41000, 41000, 17)
        assert par["egress"] == f"{leaf}-eth{hops[0][2]}"
    assert [w["switch"] for w in p.workers] == ["tbl1", "tbl1", "tbl2", "tbl2"]
    # two workers on one leaf: that leaf alone (a tree of one, no spine)
    assert aggtree.plan(topo, [0, 1], PORT, "auto").tree == ["tbl1"]


def test_fat_tree_auto_tree_prunes_relays_and_explicit_trees():
    topo = FatTree(4, switch="programmable")
    p = aggtree.plan(topo, list(range(16)), PORT, "auto")
    assert p.depth() == 3 and p.root.startswith("tbc")
    assert sum(s.startswith("tbe") for s in p.tree) == 8
    assert sum(s.startswith("tba") for s in p.tree) == 4  # one per pod: the others only relay
    # one pod: its edge switches under one aggregation switch
    pod = aggtree.plan(topo, [0, 1, 2, 3], PORT, "auto")
    assert pod.root.startswith("tba") and pod.depth() == 2
    # explicit: the core alone (classic), or edges under the core (aggregation switches relay)
    assert aggtree.plan(topo, [0, 4], PORT, ["tbc1"]).tree == ["tbc1"]
    ex = aggtree.plan(topo, [0, 1, 4, 5], PORT, ["tbc1", "tbe1", "tbe3"])
    assert ex.nodes["tbe1"]["parent"]["switch"] == "tbc1" and ex.depth() == 2


def test_bad_trees_name_the_problem():
    topo = LeafSpine(2, 2, 2, switch="programmable")
    # a leaf under the other leaf: its partial sums cross a spine (ECMP); the root's RESULT
    # leaves by the port they came in on, so it comes back over the same spine
    for seed in range(4):
        t = LeafSpine(2, 2, 2, switch="programmable", seed=seed)
        par = aggtree.plan(t, [0, 2], PORT, ["tbl2", "tbl1"]).nodes["tbl1"]["parent"]
        assert par["ingress"] == par["egress"], (seed, par)
    with pytest.raises(TopologyError, match="not programmable switches"):
        aggtree.plan(topo, [0, 2], PORT, ["tbsp1", "tbx9"])
    with pytest.raises(TopologyError, match="aggregate nobody's contributions"):
        aggtree.plan(topo, [0, 1], PORT, ["tbsp1", "tbl1", "tbl2"])
    # any switch may be the root: tbh3's contributions cross tbl2 and a spine to reach tbl1
    far = aggtree.plan(topo, [0, 2], PORT, ["tbl1"])
    assert far.tree == ["tbl1"] and far.nodes["tbl1"]["members"][1]["ingress"] in (
        "tbl1-eth3", "tbl1-eth4")
    with pytest.raises(TopologyError, match="tree must be"):
        aggtree.plan(topo, [0, 2], PORT, 7)
    with pytest.raises(TopologyError, match="aggregator"):
        aggtree.plan(LeafSpine(2, 2, 2, switch="programmable", aggregator=None), [0, 2], PORT)
    bridges = LeafSpine(2, 2, 2, switch={"tbsp1"})
    with pytest.raises(TopologyError, match="not programmable"):
        aggtree.plan(bridges, [0, 2], PORT, ["tbsp1", "tbl1"])


def test_flow_model_of_a_tree_relieves_the_core():
    """16 workers on a fat-tree: at the core every pod's 4 streams share one link; the tree
    sends one partial sum per pod, so the bandwidth time falls by ~4x."""
    topo = FatTree(4, switch="programmable", bw_mbps=100)
    single = fm.predict(topo, CollectiveSpec(algo="ina", nbytes=16 << 20))
    tree = fm.predict(topo, CollectiveSpec(algo="ina", nbytes=16 << 20,
                                           placement={"tree": "auto"}))
    assert 3.5 < single.time_s / tree.time_s < 4.5
    ph = tree.phases[0]
    # every edge of the tree carries one stream each way
    assert len(ph.rates) == 2 * (16 + 8 + 4)
    with pytest.raises(ValueError, match="placement"):
        fm.predict(topo, CollectiveSpec(algo="ina", nbytes=1 << 20,
                                        placement={"tree": ["tbc1", "tbq1"]}))


def test_a_tree_aggregates_more_than_32_workers_each_switch_at_most_32():
    """64 workers of a 4-leaf, 2-spine leaf-spine: no one switch is on every path, so a
    single-switch placement is refused naming what to do; tree 'auto' plans the leaves (16
    members each) under one spine (4 members)."""
    from testbed.topologies import aggtree, make_topology, routing
    from testbed.topologies.base import TopologyError

    topo = make_topology("leaf_spine", leaves=4, spines=2, hosts_per_leaf=16, bw_mbps=100,
                         switch="programmable")
    tables = routing.forwarding_tables(topo)
    with pytest.raises(TopologyError, match="no one aggregating switch .* tree='auto'"):
        aggtree.plan(topo, list(range(64)), 40000, None, tables)
    plan = aggtree.plan(topo, list(range(64)), 40000, "auto", tables)
    regs = plan.registrations(1, 0, 1)
    assert plan.root in ("tbsp1", "tbsp2") and len(regs) == 5
    assert all(len(r["members"]) <= 32 for r in regs.values())
    assert sum(len(r["members"]) for sw, r in regs.items() if sw != plan.root) == 64
    assert routing.bottleneck_mbps(topo, topo.host_names, "ina", plan.root) > 0
