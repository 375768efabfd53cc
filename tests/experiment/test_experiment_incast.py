"""The incast's report row and the rate its model uses (no network built)."""

from __future__ import annotations

import pytest

from testbed.collectives.report import REPORT_COLUMNS, Measured, make_row
from testbed.experiment.incast import receiver_rate_bps
from testbed.topologies import Incast, Star, net
from testbed.topologies.pipeline import DatapathOptions, Trimming


def test_incast_row_is_a_report_row():
    m = Measured(op="incast", algo="trim1", nbytes=1 << 20, count=1 << 18, seed=3)
    row = make_row(m, n=4, time_s=0.5, model_s=0.4, cpu_bound=True, max_abs_err=0.1,
                   correct=True, rep=0, bw_mbps=100.0)
    assert tuple(row) == REPORT_COLUMNS
    assert row["algbw"] == pytest.approx((1 << 20) * 8 / 0.5 / 1e9)
    # four senders' bytes crossed the receiver's link in that time
    assert row["busbw"] == pytest.approx(4 * row["algbw"])
    assert row["fidelity"] == pytest.approx(1.25) and row["cpu_bound"] is True
    assert row["op"] == "incast" and row["seed"] == 3 and row["compressor"] is None


def test_receiver_rate_from_the_net():
    assert receiver_rate_bps(net.TestbedNet(Incast(3, bw_mbps=100))) == pytest.approx(100e6)
    assert receiver_rate_bps(net.TestbedNet(Incast(3, bw_mbps=100, receiver_mbps=40))) == \
        pytest.approx(40e6)
    # the senders' own links limit them when together they are slower than the receiver's
    assert receiver_rate_bps(net.TestbedNet(Incast(2, bw_mbps=10, receiver_mbps=100))) == \
        pytest.approx(20e6)
    topo = Incast(3, bw_mbps=100, switch="programmable")
    # a trim stage draining the receiver's port slower than its link is the bottleneck ...
    slow = DatapathOptions(trimming=(Trimming("tbs1", rate_mbps=30, ports=("tbs1-eth1",)),))
    assert receiver_rate_bps(net.TestbedNet(topo, datapath=slow)) == pytest.approx(30e6)
    every = DatapathOptions(trimming=(Trimming("tbs1", rate_mbps=25),))
    assert receiver_rate_bps(net.TestbedNet(topo, datapath=every)) == pytest.approx(25e6)
    # ... one on another port is not
    other = DatapathOptions(trimming=(Trimming("tbs1", rate_mbps=30, ports=("tbs1-eth2",)),))
    assert receiver_rate_bps(net.TestbedNet(topo, datapath=other)) == pytest.approx(100e6)
    with pytest.raises(ValueError, match="unshaped"):
        receiver_rate_bps(net.TestbedNet(Star(3, bw_mbps=None)))
