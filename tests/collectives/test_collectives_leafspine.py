"""Collectives across an emulated leaf-spine (2 leaves x 2 spines, 2 hosts per leaf)."""

from __future__ import annotations

import pytest

from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.testing import check_rows, leftovers

pytestmark = pytest.mark.mininet


def test_host_algorithms_on_bridge_leaf_spine():
    from testbed.topologies import LeafSpine, TestbedNet

    with TestbedNet(LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100)) as net:
        for algo, workers in (("ring", 4), ("hd", 3), ("rs", 4)):
            spec = CollectiveSpec(algo=algo, nbytes=4 * 30_011, workers=workers, servers=2,
                                  timeout_s=20, seed=2)
            check_rows(run_collective(net, spec), spec, workers)
    assert not leftovers()


def test_ina_on_programmable_leaf_spine():
    """Workers on both leaves aggregate on the spine tbsp1 (packets cross a leaf first)."""
    from testbed.topologies import LeafSpine, TestbedNet

    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100, switch="programmable")
    with TestbedNet(topo) as net:
        assert net.aggregator["switch"] == "tbsp1"
        spec = CollectiveSpec(algo="ina", nbytes=4 * 30_011, window=16, timeout_s=20,
                              repetitions=2)
        check_rows(run_collective(net, spec), spec, 4)
    assert not leftovers()
