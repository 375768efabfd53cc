"""SmartNIC-offloaded allreduce on an emulated star with a SmartNIC per host (Mininet)."""

from __future__ import annotations

import pytest

from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.testing import check_rows
from testbed.collectives.testing import leftovers as _ours_left

pytestmark = pytest.mark.mininet


def test_nic_offloaded_allreduce():
    """SmartNIC-offloaded INA: hosts send float32, their NICs (nic_codec, fixed32) quantise
    for the switch's int32 aggregation and turn the result back into float32."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(3, bw_mbps=100, switch="programmable", smartnic=True,
                programs={"smartnic": ["nic_codec"]})
    with TestbedNet(topo) as net:
        spec = CollectiveSpec(algo="nic", nbytes=4 * 20_001, window=16, timeout_s=20,
                              repetitions=2)
        rows = run_collective(net, spec)
        check_rows(rows, spec, 3, bw_mbps=100)
        nics = {k: v for k, v in net.counters()["datapath"].items() if k.startswith("tbn")}
        assert nics and all(v["stages"]["nic_codec"]["encoded"] > 0 for v in nics.values())
    assert not _ours_left()
