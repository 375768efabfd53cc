"""More INA workers than one switch's 32-member bitmap takes: a tree of switches (each at most
32 members), on a real network. (Its own module: the tree tests' module keeps a leaf-spine of
the same switch names up for its whole length.)"""

from __future__ import annotations

import pytest


@pytest.mark.mininet
def test_more_than_32_workers_aggregate_on_a_tree():
    """36 workers on a 4-leaf, 2-spine leaf-spine: the 32-member bitmap bounds each switch,
    not the job; tree 'auto' aggregates at the leaves and a spine, exact. One switch for all
    is refused before anything runs, saying to use a tree."""
    from testbed.collectives import CollectiveSpec, run_collective
    from testbed.topologies import make_topology
    from testbed.topologies.net import TestbedNet

    topo = make_topology("leaf_spine", leaves=4, spines=2, hosts_per_leaf=9, bw_mbps=100,
                         switch="programmable")
    with TestbedNet(topo, time_dilation=8) as net:
        (row,) = run_collective(net, CollectiveSpec(algo="ina", nbytes=256 << 10, timeout_s=60,
                                                    placement={"tree": "auto"}))
        assert row["correct"] and row["n"] == 36, row
        assert len(row["tree"]) == 5 and row["tree"][0].startswith("tbsp"), row
        with pytest.raises(ValueError, match="at most 32 members.*tree='auto'"):
            run_collective(net, CollectiveSpec(algo="ina", nbytes=256 << 10))
