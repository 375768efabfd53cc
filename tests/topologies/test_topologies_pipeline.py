"""Pipeline composition (``testbed.topologies.pipeline``): a pure function, no network built."""

from __future__ import annotations

import pytest

from testbed.topologies import FatTree, LeafSpine, Star, TopologyError, netem_available
from testbed.topologies.base import AGGREGATOR_MAC, host_mac, switch_identity
from testbed.topologies.pipeline import (
    DatapathOptions,
    Impairment,
    Trimming,
    compose,
    node_ports,
    node_seed,
)

no_netem = pytest.mark.skipif(netem_available(), reason="netem present: delay goes on the links")


def names(plan: dict) -> dict[str, list[str]]:
    return {n: [p for p, _ in progs] for n, progs in plan.items()}


def stage(plan: dict, node: str, program: str, k: int = 0) -> dict:
    return [s for p, s in plan[node] if p == program][k]


def test_star_aggregator_and_forwarding_table():
    plan = compose(Star(3, switch="programmable"))
    assert names(plan) == {"tbs1": ["aggregate", "forward", "shape"]}
    fwd = stage(plan, "tbs1", "forward")
    assert fwd["learn"] is False
    assert fwd["l2"] == {host_mac(r): [f"tbs1-eth{r + 1}"] for r in range(3)}
    # the aggregator's own switch consumes the aggregator MAC: no route for it
    assert AGGREGATOR_MAC not in fwd["l2"]
    assert compose(Star(3)) == {}  # Linux bridges run no data path
    assert names(compose(Star(3, switch="programmable", aggregator=None))) == {
        "tbs1": ["forward", "shape"]}


def test_leaf_spine_generic_override_ecmp_and_mixed_bridges():
    plan = compose(LeafSpine(2, 2, 2, switch="programmable",
                             programs={"switch": ["aggregate", ("forward", {"learn": True})]}))
    # every programmable switch aggregates (any can be in a job's tree)
    assert names(plan) == {s: ["aggregate", "forward", "shape"]
                           for s in ("tbl1", "tbl2", "tbsp1", "tbsp2")}
    leaf = stage(plan, "tbl1", "forward")
    assert leaf["learn"] is True  # the override's own setting wins over the default
    # a host on the other leaf: one ECMP member per spine; the aggregator only via tbsp1
    assert leaf["l2"][host_mac(2)] == ["tbl1-eth3", "tbl1-eth4"]
    assert leaf["l2"][host_mac(0)] == ["tbl1-eth1"]
    assert leaf["l2"][AGGREGATOR_MAC] == ["tbl1-eth3"]
    mixed = compose(LeafSpine(2, 2, 1, switch={"tbsp1", "tbsp2"}))
    assert names(mixed) == {"tbsp1": ["aggregate", "forward", "shape"],
                            "tbsp2": ["aggregate", "forward", "shape"]}


def test_fat_tree_every_switch_routes_every_host():
    topo = FatTree(4, switch="programmable")
    plan = compose(topo)
    assert len(plan) == 20 and topo.aggregator_switch == "tbc1"
    assert all("aggregate" in progs for progs in names(plan).values())
    identities = {switch_identity(topo, s)[0] for s in plan}
    assert len(identities) == 20  # one aggregator identity per switch, each routed everywhere
    for node in plan:
        l2 = stage(plan, node, "forward")["l2"]
        assert {host_mac(r) for r in range(16)} <= set(l2), node
        assert identities - {switch_identity(topo, node)[0]} <= set(l2), node
        ports = node_ports(topo, node)
        assert all(set(group) <= set(ports) for group in l2.values()), node
    # edge switch: its own two hosts directly, everyone else over both aggregation switches
    edge = stage(plan, "tbe1", "forward")["l2"]
    assert edge[host_mac(0)] == ["tbe1-eth1"] and edge[host_mac(1)] == ["tbe1-eth2"]
    assert all(edge[host_mac(r)] == ["tbe1-eth3", "tbe1-eth4"] for r in range(2, 16))


def test_smartnic_nodes_and_codec():
    topo = Star(2, switch="programmable", smartnic=True)
    assert names(compose(topo)) == {"tbs1": ["aggregate", "forward", "shape"],
                                    "tbn1": ["wire", "shape"], "tbn2": ["wire", "shape"]}
    plan = compose(topo, DatapathOptions(nic_codec={"codec": "fixed32"}))
    assert names(plan)["tbn1"] == ["nic_codec", "shape"]
    assert stage(plan, "tbn2", "nic_codec") == {"codec": "fixed32"}
    # a SmartNIC runs the data path on a bridge fabric too
    assert names(compose(Star(2, smartnic=[1]))) == {"tbn2": ["wire", "shape"]}


def test_codec_overrides_merge_or_fail():
    over = Star(2, switch="programmable", smartnic=True,
                programs={"smartnic": [("nic_codec", {"codec": "fp16", "mtu": 1400})]})
    plan = compose(over, DatapathOptions(nic_codec={"codec": "bf16"}))
    assert stage(plan, "tbn1", "nic_codec") == {"codec": "bf16", "mtu": 1400}
    assert stage(compose(over), "tbn1", "nic_codec") == {"codec": "fp16", "mtu": 1400}
    wire = Star(2, switch="programmable", smartnic=True, programs={"tbn1": ["wire"]})
    with pytest.raises(TopologyError, match=r"programs\['tbn1'\] has no 'nic_codec'"):
        compose(wire, DatapathOptions(nic_codec={"codec": "fp16"}))
    with pytest.raises(TopologyError, match="needs SmartNIC nodes"):
        compose(Star(2, switch="programmable"), DatapathOptions(nic_codec={"codec": "fp16"}))


def test_impairments_directions_ports_and_names():
    topo = Star(3, switch="programmable")
    lone = compose(topo, DatapathOptions(impairments=(
        Impairment("tbs1", loss=0.05, ports=(1, "tbs1-eth3"), seed=7),)))
    assert names(lone)["tbs1"] == ["impair", "aggregate", "forward", "shape"]
    imp = stage(lone, "tbs1", "impair")
    assert imp["direction"] == "ingress" and imp["seed"] == 7
    assert imp["loss"] == {"tbs1-eth2": 0.05, "tbs1-eth3": 0.05}
    assert imp["delay_ms"] == {"tbs1-eth2": 0.0, "tbs1-eth3": 0.0}
    both = compose(topo, DatapathOptions(impairments=(
        Impairment("tbs1", loss=0.01), Impairment("tbs1", direction="egress", delay_ms=2.0))))
    assert names(both)["tbs1"] == ["impair_ingress", "aggregate", "forward", "impair", "shape"]
    assert stage(both, "tbs1", "impair")["delay_ms"] == 2.0
    assert stage(both, "tbs1", "impair_ingress")["loss"] == 0.01
    with pytest.raises(TopologyError, match=r"port index 3 is outside 0\.\.2"):
        compose(topo, DatapathOptions(impairments=(Impairment("tbs1", ports=(3,)),)))
    with pytest.raises(TopologyError, match="'tbs2-eth1' is not one of its ports"):
        compose(topo, DatapathOptions(impairments=(Impairment("tbs1", ports=("tbs2-eth1",)),)))
    with pytest.raises(TopologyError, match="node 'tbs9' is not a programmable node"):
        compose(topo, DatapathOptions(impairments=(Impairment("tbs9"),)))


def test_trimming_is_last_with_link_rates():
    topo = Star(3, switch="programmable", bw_mbps=50,
                programs={"tbs1": ["forward"]})
    opts = DatapathOptions(trimming=(Trimming("tbs1", threshold_bytes=9000),),
                           impairments=(Impairment("tbs1", direction="egress"),))
    plan = compose(topo, opts)
    assert names(plan)["tbs1"] == ["aggregate", "forward", "impair", "trim"]
    assert stage(plan, "tbs1", "trim") == {"mode": "trim", "queue_slots": 256,
                                           "rate_mbps": 50.0, "threshold_bytes": 9000}
    one = compose(topo, DatapathOptions(trimming=(
        Trimming("tbs1", mode="drop_tail", rate_mbps=20, ports=("tbs1-eth2",)),)))
    trim = stage(one, "tbs1", "trim")
    assert trim["mode"] == "drop_tail"
    assert trim["rate_mbps"] == {"tbs1-eth1": 50.0, "tbs1-eth2": 20, "tbs1-eth3": 50.0}
    assert trim["threshold_bytes"]["tbs1-eth2"] == 30_000
    assert trim["threshold_bytes"]["tbs1-eth1"] > 1e9
    with pytest.raises(TopologyError, match="give rate_mbps"):
        compose(Star(2, switch="programmable", bw_mbps=None),
                DatapathOptions(trimming=(Trimming("tbs1"),)))


def test_engines_shape_their_shaped_links():
    from testbed.topologies.pipeline import engine_shaped_ports

    # the leaf-spine's uplinks run at 40 / 4 Mb/s: each port drains at its own link's rate
    topo = LeafSpine(2, 1, 2, bw_mbps=40, oversubscription=4.0, switch="programmable")
    plan = compose(topo)
    shape = stage(plan, "tbl1", "shape")
    assert shape == {"rate_mbps": {"tbl1-eth1": 40.0, "tbl1-eth2": 40.0, "tbl1-eth3": 20.0}}
    assert engine_shaped_ports(topo, plan) == {p for n in plan for p in node_ports(topo, n)}
    # a sized queue: bw x queue_ms bytes per port, in slots enough for 512 B frames
    deep = stage(compose(Star(2, switch="programmable", bw_mbps=20, queue_ms=50)), "tbs1",
                 "shape")
    assert deep["threshold_bytes"] == {"tbs1-eth1": 125_000, "tbs1-eth2": 125_000}
    assert deep["threshold_pkts"] == 0 and deep["queue_slots"] == 245
    # nothing shaped, a trimming queue (it drains at the link rates), an own queue stage,
    # explicit programs, or shaping left to the kernel: no shape stage
    assert names(compose(Star(2, switch="programmable", bw_mbps=None))) == {
        "tbs1": ["aggregate", "forward"]}
    trimmed = compose(Star(2, switch="programmable"), DatapathOptions(
        trimming=(Trimming("tbs1"),)))
    assert names(trimmed) == {"tbs1": ["aggregate", "forward", "trim"]}
    assert engine_shaped_ports(Star(2, switch="programmable"), trimmed) == set()
    own = Star(2, switch="programmable", programs={"tbs1": ["forward", ("shape", {
        "rate_mbps": {1: 5.0}})]})
    assert names(compose(own)) == {"tbs1": ["aggregate", "forward", "shape"]}
    assert engine_shaped_ports(own, compose(own)) == {"tbs1-eth2"}
    assert names(compose(Star(2, switch="programmable"), DatapathOptions(
        shape_in_engine=False))) == {"tbs1": ["aggregate", "forward"]}


def test_bad_overrides_name_the_node():
    with pytest.raises(TopologyError, match=r"programs\['tbs1'\]: unknown program 'forwrd'"):
        compose(Star(2, switch="programmable", programs={"tbs1": ["forwrd"]}))
    with pytest.raises(TopologyError, match=r"programs\['switch'\]: program entry 42"):
        compose(Star(2, switch="programmable", programs={"switch": [42]}))
    with pytest.raises(TopologyError, match=r"programs\['tbs1'\]: no programs configured"):
        compose(Star(2, switch="programmable", programs={"tbs1": []}))
    own_impair = Star(2, switch="programmable", programs={"tbs1": ["forward", "impair"]})
    with pytest.raises(TopologyError, match="has its own 'impair' stage"):
        compose(own_impair, DatapathOptions(impairments=(Impairment("tbs1"),)))
    own_trim = Star(2, switch="programmable", programs={"tbs1": ["forward", "trim"]})
    with pytest.raises(TopologyError, match="has its own 'trim' stage"):
        compose(own_trim, DatapathOptions(trimming=(Trimming("tbs1"),)))
    # module:Class programs pass the name check (the engine resolves them)
    custom = compose(Star(2, switch="programmable",
                          programs={"tbs1": ["testbed.datapath.forward:WireStage"]}))
    assert names(custom)["tbs1"] == ["aggregate", "testbed.datapath.forward:WireStage", "shape"]


@no_netem
def test_link_impairments_in_the_data_path():
    plan = compose(Star(2, switch="programmable", loss_pct=10, delay_ms=1, smartnic=[0],
                        seed=4))
    assert names(plan) == {"tbs1": ["impair_ingress", "aggregate", "forward", "impair", "shape"],
                           "tbn1": ["impair_ingress", "wire", "impair", "shape"]}
    # tbs1-tbn1: both ends programmable, each impairs its egress; tbh2-tbs1: tbs1 both ways
    assert stage(plan, "tbs1", "impair")["loss"] == {"tbs1-eth1": 0.1, "tbs1-eth2": 0.1}
    assert stage(plan, "tbs1", "impair_ingress")["loss"] == {"tbs1-eth1": 0.0, "tbs1-eth2": 0.1}
    assert stage(plan, "tbn1", "impair_ingress")["delay_ms"] == {"tbn1-eth1": 1.0,
                                                                  "tbn1-eth2": 0.0}
    seeds = {stage(plan, n, p)["seed"] for n in plan for p in ("impair", "impair_ingress")}
    assert len(seeds) == 4 and node_seed(4, "tbs1", "egress") in seeds
    with pytest.raises(TopologyError, match="has its own 'impair' stage"):
        compose(Star(2, switch="programmable", delay_ms=1,
                     programs={"tbs1": ["forward", "impair"]}))



@no_netem
def test_the_impairments_of_one_direction_are_one_stage():
    """The topology's loss and delay in the data path and the Impairment entries of the same
    node and direction run as one stage (the engine counts and configures stages by name: a
    second ``impair`` stage hid the first from the counters and so from the models): per port
    the probabilities of independent draws in sequence, delays added, jitters in quadrature."""
    topo = Star(3, switch="programmable", loss_pct=10, delay_ms=1, seed=4)
    mixed = compose(topo, DatapathOptions(impairments=(
        Impairment("tbs1", direction="egress", dup=0.1, ports=(0,), seed=3),
        Impairment("tbs1", direction="egress", loss=0.2, delay_ms=2, jitter_ms=0.3, ports=(0,)),
        Impairment("tbs1", direction="egress", jitter_ms=0.4, ports=(0,)))))
    assert names(mixed)["tbs1"] == ["impair_ingress", "aggregate", "forward", "impair", "shape"]
    egress = stage(mixed, "tbs1", "impair")
    assert egress["loss"] == {"tbs1-eth1": pytest.approx(1 - 0.9 * 0.8), "tbs1-eth2": 0.1,
                              "tbs1-eth3": 0.1}
    assert egress["dup"] == {"tbs1-eth1": 0.1, "tbs1-eth2": 0.0, "tbs1-eth3": 0.0}
    assert egress["delay_ms"] == {"tbs1-eth1": 3.0, "tbs1-eth2": 1.0, "tbs1-eth3": 1.0}
    assert egress["jitter_ms"]["tbs1-eth1"] == pytest.approx(0.5)
    assert egress["direction"] == "egress" and egress["filter"] == "all"
    assert egress["seed"] == node_seed(4, "tbs1", "egress") + 3
    # the ingress stage is the topology's alone, as without the entries
    assert stage(mixed, "tbs1", "impair_ingress") == stage(compose(topo), "tbs1",
                                                           "impair_ingress")
    # two entries of one direction without the topology's: one stage too
    two = compose(Star(2, switch="programmable"), DatapathOptions(impairments=(
        Impairment("tbs1", loss=0.02), Impairment("tbs1", dup=0.03))))
    assert names(two)["tbs1"] == ["impair", "aggregate", "forward", "shape"]
    assert stage(two, "tbs1", "impair")["loss"] == {"tbs1-eth1": 0.02, "tbs1-eth2": 0.02}
    assert stage(two, "tbs1", "impair")["dup"] == {"tbs1-eth1": 0.03, "tbs1-eth2": 0.03}
    # a stage filters one way: the topology's impairs every frame
    with pytest.raises(TopologyError, match=r"impairments on 'tbs1' \(egress\).*filter "
                                            r"different traffic \(\['all', 'testbed'\]\)"):
        compose(topo, DatapathOptions(impairments=(
            Impairment("tbs1", direction="egress", filter="testbed"),)))


def test_the_links_own_loss_is_left_out_of_the_records_the_models_price():
    """A star whose data path applies the topology's 10 % loss (no netem) in the switch's
    stages, and a run-time stage that adds loss on one port and duplicates on another: with
    ``own_loss_applied`` the records keep only what the stages add beyond the 10 % (the
    models price that from the topology); without it they say all the stages do."""
    from testbed.topologies.base import link_impairments

    topo = Star(2, switch="programmable", loss_pct=10, seed=4)

    def ports(loss1, loss2, dup2=0.0):
        return {"tbs1-eth1": {"loss": loss1, "dup": 0.0, "reorder": 0.0},
                "tbs1-eth2": {"loss": loss2, "dup": dup2, "reorder": 0.0}}

    def stage(direction, p):
        return {"direction": direction,
                "settings": {"ports": p, "filter": "all", "reorder_timeout_ms": 0.0}}

    # the egress stage: 10 % on both ports, and 1 - 0.9 * 0.8 = 28 % on eth1 (an extra 20 %);
    # the ingress stage: 10 % and 10 % plus duplicates on eth2
    counters = {"tbs1": {"stages": {"impair": stage("egress", ports(0.28, 0.1)),
                                    "impair_ingress": stage("ingress",
                                                            ports(0.1, 0.1, 0.05))}}}
    hosts = dict(zip(("tbs1-eth1", "tbs1-eth2"), topo.host_names, strict=True))
    assert all(s.loss_pct == 10 for s in topo.link_specs)
    full = {(i.src, i.dst): i for i in link_impairments(topo.link_specs, counters)}
    assert len(full) == 4 and full[("tbs1", hosts["tbs1-eth1"])].loss == pytest.approx(0.28)
    beyond = {(i.src, i.dst): i for i in link_impairments(topo.link_specs, counters,
                                                          own_loss_applied=True)}
    assert set(beyond) == {("tbs1", hosts["tbs1-eth1"]), (hosts["tbs1-eth2"], "tbs1")}
    assert beyond[("tbs1", hosts["tbs1-eth1"])].loss == pytest.approx(0.2)
    dup = beyond[(hosts["tbs1-eth2"], "tbs1")]
    assert dup.loss == 0.0 and dup.dup == 0.05


def test_explicit_programs_run_as_written():
    topo = Star(2, switch="programmable", programs={"tbs1": [("forward", {})]})
    assert compose(topo, DatapathOptions(explicit_programs=True)) == {
        "tbs1": [("forward", {})]}


def test_compose_is_pure_and_testbednet_uses_it():
    from testbed.topologies.net import TestbedNet

    topo = LeafSpine(2, 2, 1, switch="programmable", smartnic=[1])
    opts = DatapathOptions(impairments=(Impairment("tbl1", direction="egress", dup=0.1),),
                           trimming=(Trimming("tbsp2", rate_mbps=10),),
                           nic_codec={"codec": "fp16"})
    first = compose(topo, opts)
    stage(first, "tbl1", "forward")["l2"].clear()  # callers may change what they get
    assert compose(topo, opts) != first
    assert TestbedNet(topo, datapath=opts).programs_plan() == compose(topo, opts)
    with pytest.raises(TopologyError, match="not a programmable node"):
        TestbedNet(Star(2), datapath=DatapathOptions(trimming=(Trimming("tbs1"),)))
