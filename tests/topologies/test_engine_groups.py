"""``TestbedNet(engine_groups=n)``: a fabric's programmable switches served by n engine
processes, the links inside a group carried in memory (testbed.datapath.group). Collectives
stay exact (checked against the numpy sum), every port keeps its counters, and what a group
cannot do is refused with a reason."""

from __future__ import annotations

import os
import signal
import time

import pytest

from testbed.collectives.spec import CollectiveSpec
from testbed.datapath.control import RUN_DIR
from testbed.topologies import FatTree, LeafSpine, TopologyError, routing
from testbed.topologies.pipeline import DatapathOptions


def _leaf_spine(**kw) -> LeafSpine:
    return LeafSpine(**{"leaves": 2, "spines": 2, "hosts_per_leaf": 2, "bw_mbps": 100,
                        "switch": "programmable", **kw})


def test_partition_keeps_linked_nodes_together():
    topo = FatTree(k=4, switch="programmable")
    nodes = sorted(topo.programmable)
    assert routing.partition(topo, nodes, 1) == [nodes]
    groups = routing.partition(topo, nodes, 2)
    assert sorted(x for g in groups for x in g) == nodes and [len(g) for g in groups] == [10, 10]
    group_of = {x: i for i, g in enumerate(groups) for x in g}
    inside = sum(1 for s in topo.link_specs if s.a in group_of and s.b in group_of
                 and group_of[s.a] == group_of[s.b])
    assert inside >= 20  # of the 32 switch-to-switch links (a split by name keeps fewer)
    for bad in (0, 21, True, 1.5):
        with pytest.raises(ValueError, match="whole number from 1 to 20"):
            routing.partition(topo, nodes, bad)


def test_engine_groups_refuse_what_they_cannot_carry():
    from testbed.topologies import TestbedNet

    cases = [
        ({"engine_groups": 0}, "whole number from 1 to 4"),
        ({"engine_groups": 5}, "whole number from 1 to 4"),
        ({"engine_groups": 1, "engine_opts": {"io": "mmsg"}}, "io='ring'"),
        ({"engine_groups": 1, "datapath": DatapathOptions(shape_in_engine=False)},
         "shaped by the kernel's HTB"),
        ({"engine_groups": 1, "servers": ["localhost", "tbsrv2"]}, "servers"),
    ]
    for kw, message in cases:
        with pytest.raises(TopologyError, match=message):
            TestbedNet(_leaf_spine(), **kw)
    with pytest.raises(TopologyError, match="no programmable nodes"):
        TestbedNet(LeafSpine(leaves=2, spines=2, hosts_per_leaf=1), engine_groups=1)
    net = TestbedNet(_leaf_spine(), engine_groups=1)
    assert net.engine_groups == [["tbl1", "tbl2", "tbsp1", "tbsp2"]]
    assert len(net.memory_links) == 4  # every leaf-spine link; host links stay veths
    assert TestbedNet(_leaf_spine()).engine_groups == []


def _run_checked(net, spec: CollectiveSpec) -> list[dict]:
    from testbed.collectives import run_collective
    from testbed.collectives.testing import check_rows

    rows = run_collective(net, spec)
    check_rows(rows, spec, net.n)
    return rows


@pytest.mark.mininet
def test_one_engine_group_serves_a_leaf_spine_exactly_and_fails_together():
    """All four switches of a leaf-spine in one process: pings, ring and INA (a tree over
    both leaves) exact, the spines' ports are memory links that counted the traffic, a
    memory link cannot be failed nor one switch restarted (each says why), and a SIGKILL
    takes the whole group, which ``dead_engines`` names; nothing is left afterwards."""
    from testbed.cleanup import leftovers
    from testbed.topologies import TestbedNet

    with TestbedNet(_leaf_spine(), engine_groups=1) as net:
        switches = [net.mininet.get(n) for n in sorted(net.topo.programmable)]
        pids = {sw.engine_pid() for sw in switches}
        assert len(pids) == 1 and None not in pids
        assert net.pingall()["failed"] == []
        for algo, placement in (("ring", {}), ("ina", {"tree": "auto"})):
            rows = _run_checked(net, CollectiveSpec(algo=algo, nbytes=1 << 20, window=32,
                                                    timeout_s=60, placement=placement))
            assert all(r["correct"] for r in rows)
        # re-timed through every node's own control channel, the group keeps exactness
        net.set_time_dilation(2)
        assert {c.counters()["coalesce_us"] >= 100 for c in net.datapath_clients().values()} \
            == {True}
        rows = _run_checked(net, CollectiveSpec(algo="ring", nbytes=1 << 20, window=32,
                                                timeout_s=60))
        assert all(r["correct"] and r["time_dilation"] == 2 for r in rows)
        spine = net.datapath_clients()["tbsp1"].counters()
        assert spine["engine_group"] == ["tbl1", "tbl2", "tbsp1", "tbsp2"]
        assert {p["io"] for p in spine["ports"].values()} == {"memory"}
        assert sum(p["rx_packets"] for p in spine["ports"].values()) > 100
        with pytest.raises(TopologyError, match="carried in memory by an engine group"):
            net.link_down("tbl1", "tbsp1")
        with pytest.raises(RuntimeError, match="shares its engine process"):
            net.restart_engine("tbl1")
        os.kill(pids.pop(), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while len(net.dead_engines()) < 4:
            assert time.monotonic() < deadline, net.dead_engines()
            time.sleep(0.05)
        assert net.dead_engines() == {sw.name: -signal.SIGKILL for sw in switches}
    log = os.path.join(RUN_DIR, "tbl1.log")  # the group's log, kept: it was killed
    assert "kernels ready" in open(log).read()
    os.unlink(log)
    assert not any(leftovers().values())


@pytest.mark.mininet
@pytest.mark.parametrize("start", ["fork", "exec"])
def test_two_engine_groups_join_through_the_kernel_exactly(start, monkeypatch):
    """Two groups: the links between them stay veths, those inside are memory; a ring
    crossing both is exact, and both processes stop cleanly with every switch's counters,
    whether forked from the fork server or started as processes of their own."""
    from testbed.datapath.forks import START_ENV
    from testbed.topologies import TestbedNet

    monkeypatch.setenv(START_ENV, start)

    with TestbedNet(_leaf_spine(), engine_groups=2) as net:
        assert len(net.engine_groups) == 2
        assert len({net.mininet.get(n).engine_pid() for n in net.topo.programmable}) == 2
        rows = _run_checked(net, CollectiveSpec(algo="ring", nbytes=1 << 20, window=32,
                                                timeout_s=60))
        assert all(r["correct"] for r in rows)
        io = {p["io"] for c in net.counters()["datapath"].values()
              for p in c["ports"].values()}
        assert io == {"memory", "ring"}
    assert set(net.final_counters) == set(net.topo.programmable)
    assert all(c and c["engine_group"] for c in net.final_counters.values())
