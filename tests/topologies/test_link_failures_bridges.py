"""Link failures on a looped fabric of Linux bridges (issue 35, item 2): the static FDB and
the flood ports follow the routes recomputed around the failed link (its own module: the
leaf-spine of test_link_failures stays up for its whole module, with the same names)."""

from __future__ import annotations

import pytest

from testbed.collectives import run_collective
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import check_rows
from testbed.topologies import LeafSpine, TestbedNet, TopologyError


@pytest.mark.mininet
def test_bridges_of_a_looped_fabric_reroute_too():
    with TestbedNet(LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100,
                               switch="bridge")) as net:
        assert net.forwarding_mode == "static-fdb"
        net.link_down("tbl2", "tbsp1")
        assert net.pingall()["failed"] == []
        spec = CollectiveSpec(algo="ring", nbytes=256 << 10, repetitions=1)
        check_rows(run_collective(net, spec), spec, net.n)
        # tbl1 would keep tbsp1 only, tbl2 tbsp2 only: two halves
        with pytest.raises(TopologyError, match=r"would cut \['tbh3', 'tbh4'\] off"):
            net.link_down("tbl1", "tbsp2")
        net.link_up("tbl2", "tbsp1")
        assert net.pingall()["failed"] == []
