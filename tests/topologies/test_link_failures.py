"""Link failures on multipath fabrics (issue 35, item 2): ``TestbedNet.link_down|link_up``
recompute the routes over the links left, collectives stay exact across a failure, later INA
trees avoid the failed link, the flow model prices the degraded fabric, and a failure that
would cut a host off is refused. Every collective row is checked against the numpy sum."""

from __future__ import annotations

import time

import pytest

from testbed.collectives.spec import CollectiveSpec
from testbed.topologies import LeafSpine, TopologyError, routing

DOWN = ("tbl1", "tbsp1")


def _leaf_spine(**kw) -> LeafSpine:
    return LeafSpine(**{"leaves": 2, "spines": 2, "hosts_per_leaf": 2, "bw_mbps": 100,
                        "switch": "programmable", **kw})


# ----- routing over a degraded fabric (no network) -----------------------------------------

def test_routes_of_a_degraded_fabric_avoid_the_failed_link():
    topo = _leaf_spine(hosts_per_leaf=4)
    degraded = routing.without_links(topo, [("tbsp1", "tbl1")])  # either order
    assert len(degraded.link_specs) == len(topo.link_specs) - 1
    assert len(topo.link_specs) == 12  # the topology itself is untouched
    assert routing.without_links(topo, []) is topo
    port = next(s.port_a if s.a == "tbl1" else s.port_b for s in topo.link_specs
                if {s.a, s.b} == set(DOWN))
    intact, now = routing.forwarding_tables(topo), routing.forwarding_tables(degraded)
    moved = {m for m, g in now["tbl1"].items() if g != intact["tbl1"][m]}
    assert moved and all(port not in now["tbl1"][m] and len(now["tbl1"][m]) == 1 for m in moved)
    # every destination is still reached (tbsp1 too, the long way round)
    assert set(now["tbl1"]) == set(intact["tbl1"])
    assert routing.unreachable_hosts(degraded) == []
    # the flow model prices it: halving-doubling's cross-leaf pairs now share one uplink of
    # tbl1, the ring's one flow per direction does not notice
    hd, ring = (CollectiveSpec(algo=a, nbytes=4 << 20) for a in ("hd", "ring"))
    from testbed.collectives import flowmodel

    assert flowmodel.predict_s(degraded, hd) > 1.1 * flowmodel.predict_s(topo, hd)
    assert flowmodel.predict_s(degraded, ring) == pytest.approx(
        flowmodel.predict_s(topo, ring))


def test_cut_off_hosts_and_unknown_links_are_named():
    topo = _leaf_spine()
    assert routing.unreachable_hosts(routing.without_links(topo, [("tbh1", "tbl1")])) == ["tbh1"]
    both = routing.without_links(topo, [("tbl2", "tbsp1"), ("tbl2", "tbsp2")])
    assert routing.unreachable_hosts(both) == ["tbh3", "tbh4"]
    # a spine with no link left is simply not used
    alone = routing.without_links(topo, [("tbl1", "tbsp2"), ("tbl2", "tbsp2")])
    assert routing.unreachable_hosts(alone) == []
    for sport in range(40000, 40016):  # whichever ECMP member a flow would have hashed to
        assert "tbsp2" not in routing.flow_path(alone, "tbh1", "tbh3", sport, 5201)
    with pytest.raises(ValueError, match="no node 'tbq9'"):
        routing.links_between(topo, "tbq9", "tbl1")
    with pytest.raises(ValueError, match=r"no link between tbl1 and tbl2; tbl1's links go to"):
        routing.links_between(topo, "tbl1", "tbl2")


# ----- on a real network ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def fabric():
    from testbed.topologies import TestbedNet

    with TestbedNet(_leaf_spine()) as net:
        yield net


@pytest.fixture
def net(fabric):
    yield fabric
    for a, b in fabric.links_down:  # whatever a failing test left down comes back
        fabric.link_up(a, b)


def _down_port(net) -> str:
    s = routing.links_between(net.topo, *DOWN)[0]
    return f"tbl1-eth{s.port_a if s.a == 'tbl1' else s.port_b}"


def _tx(net, intf: str) -> int:
    node = intf.split("-")[0]
    return net.counters()["datapath"][node]["ports"][intf]["tx_packets"]


def _run_checked(net, spec: CollectiveSpec) -> list[dict]:
    from testbed.collectives import run_collective
    from testbed.collectives.testing import check_rows

    rows = run_collective(net, spec)
    # a rerun's rows say so beyond the report's columns (checked by the caller)
    check_rows([{k: v for k, v in r.items() if k not in ("rerun", "fallback_s", "aborted_s")}
                for r in rows], spec, net.n)
    return rows


@pytest.mark.mininet
def test_collectives_stay_exact_around_a_failed_link_and_use_it_again(net):
    port = _down_port(net)
    answer = net.link_down(*DOWN)
    assert answer["state"] == "down" and answer["routes_changed"] > 0
    assert sorted(answer["interfaces"]) == sorted([port, next(
        i for i in answer["interfaces"] if i.startswith("tbsp1-"))])
    assert net.links_down == [("tbl1", "tbsp1")]
    assert net.describe()["links_down"] == ["tbl1-tbsp1"]
    with open(f"/sys/class/net/{port}/operstate") as f:
        assert f.read().strip() == "down"
    assert net.pingall()["failed"] == []
    before = _tx(net, port)
    for algo in ("ring", "hd"):
        rows = _run_checked(net, CollectiveSpec(algo=algo, nbytes=256 << 10, repetitions=1))
        # priced on the degraded fabric
        assert rows[0]["model_s"] > 0
    ina = CollectiveSpec(algo="ina", nbytes=4 * 40_009, window=16, timeout_s=30,
                         placement={"tree": "auto"})
    plan = net.ina_plan(net.hosts, 20001, "auto")
    for node in plan.nodes.values():  # no tree edge rides the failed link
        assert node["parent"] is None or port not in (node["parent"]["egress"],
                                                      node["parent"]["ingress"])
    _run_checked(net, ina)
    # no route and no flood uses the dead port any more
    assert all(port not in [f"tbl1-eth{p}" for p in g] for g in net._tables["tbl1"].values())
    assert port not in net.switch_client("tbl1").config()["flood_ports"]
    assert net.link_up(*DOWN)["state"] == "up" and net.links_down == []
    assert net._tables == routing.forwarding_tables(net.topo)  # the intact routes again
    assert net.routed_topo is net.topo
    _run_checked(net, CollectiveSpec(algo="hd", nbytes=256 << 10, repetitions=1))
    assert _tx(net, port) > before  # the link carries traffic again


@pytest.mark.mininet
@pytest.mark.parametrize("algo", ["ring", "ina"])
def test_a_link_failing_mid_collective_costs_time_not_correctness(net, algo):
    # about a second of transfer at 100 Mb/s
    spec = CollectiveSpec(algo=algo, nbytes=(16 if algo == "ina" else 8) << 20,
                          repetitions=1, timeout_s=60,
                          **({"window": 16, "placement": {"tree": "auto"}}
                             if algo == "ina" else {}))
    from testbed.collectives.testing import when_process_appears

    # the link fails 0.3 s after the collective's first rank process starts
    thread, answers = when_process_appears(
        "tbw-tbh1", 0.3, lambda _pid: {**net.link_down(*DOWN), "t": time.monotonic()})
    try:
        rows = _run_checked(net, spec)
        t_end = time.monotonic()
    finally:
        thread.join()
    assert answers and answers[0]["state"] == "down" and answers[0]["t"] < t_end, \
        "the link was not failed mid-run"
    if algo == "ina":  # its tree rode the link: run again on one around it, from its start
        assert rows[0]["rerun"] is True and 0 <= rows[0]["fallback_s"] < 5, rows[0]
        assert rows[0]["aborted_s"] > 0  # the attempt given up, beside the rerun's time_s
        assert rows[0]["in_network_fraction"] == 1.0


@pytest.mark.mininet
def test_link_failures_that_cannot_be_are_refused_with_why(net):
    with pytest.raises(TopologyError, match=r"would cut \['tbh1'\] off"):
        net.link_down("tbh1", "tbl1")
    with pytest.raises(TopologyError, match="no link between tbl1 and tbl2"):
        net.link_down("tbl1", "tbl2")
    with pytest.raises(TopologyError, match="no node 'tbs7'"):
        net.link_down("tbs7", "tbl1")
    with pytest.raises(TopologyError, match="is not down"):
        net.link_up(*DOWN)
    net.link_down(*DOWN)
    with pytest.raises(TopologyError, match="is down already"):
        net.link_down("tbsp1", "tbl1")
    # the second uplink of the same leaf would split the fabric in two halves
    with pytest.raises(TopologyError, match=r"would cut \['tbh3', 'tbh4'\] off"):
        net.link_down("tbl1", "tbsp2")
    assert net.links_down == [("tbl1", "tbsp1")]
