"""More INA workers than one switch's 32-member bitmap takes: a tree of switches (each at most
32 members), on a real network. (Its own module: the tree tests' module keeps a leaf-spine of
the same switch names up for its whole length.)"""

from __future__ import annotations

import pytest


@pytest.mark.mininet
def test_more_than_64_workers_aggregate_on_a_tree_and_run_a_ring():
    """68 workers on a 4-leaf, 2-spine leaf-spine: the 32-member bitmap bounds each switch,
    not the job; tree 'auto' aggregates at the leaves and a spine, exact. One switch for all
    is refused before anything runs, saying to use a tree. The ring over the same 68 hosts
    binds the large jobs' ports (ranks 64 and up, one per address) and is exact."""
    from testbed.collectives import CollectiveSpec, run_collective
    from testbed.collectives.ports import TCP_BIG_LO
    from testbed.topologies import make_topology
    from testbed.topologies.net import TestbedNet

    topo = make_topology("leaf_spine", leaves=4, spines=2, hosts_per_leaf=17, bw_mbps=100,
                         switch="programmable")
    with TestbedNet(topo, time_dilation=16) as net:
        (row,) = run_collective(net, CollectiveSpec(algo="ina", nbytes=256 << 10, timeout_s=60,
                                                    placement={"tree": "auto"}))
        assert row["correct"] and row["n"] == 68, row
        assert len(row["tree"]) == 5 and row["tree"][0].startswith("tbsp"), row
        with pytest.raises(ValueError, match="at most 32 members.*tree='auto'"):
            run_collective(net, CollectiveSpec(algo="ina", nbytes=256 << 10))
        spec = CollectiveSpec(algo="ring", nbytes=4 * 70_001, timeout_s=60)
        (row,) = run_collective(net, spec)
        assert row["correct"] and row["n"] == 68 and row["model_s"] > 0, row
    from testbed.collectives.ports import tcp_port

    assert tcp_port(spec.job_id, 66, 67) >= TCP_BIG_LO  # the ports that ring bound
