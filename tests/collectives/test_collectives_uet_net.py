"""The UET-like transport through a real UET trimming switch (Mininet, root): trimmed packets
NACKed and resent without a timeout, results exact; TCP through the same switch is never cut.
Incast and spraying: test_collectives_uet_fabric."""

from __future__ import annotations

import pytest

from testbed.collectives import CollectiveSpec, run_collective
from testbed.topologies import Star, TestbedNet
from testbed.topologies.pipeline import DatapathOptions, Trimming

pytestmark = pytest.mark.mininet


def _trim_totals(net, node: str) -> dict:
    return net.switch_client(node).counters()["stages"]["trim"]["totals"]


@pytest.fixture(scope="module")
def uet_star():
    # a shallow queue (8 KiB) on every port of the switch, drained at half the hosts' rate:
    # every flow queues, and trims
    dp = DatapathOptions(trimming=(Trimming(node="tbs1", mode="uet", threshold_bytes=8 << 10,
                                            trim_bytes=128, rate_mbps=25),))
    with TestbedNet(Star(4, bw_mbps=50, switch="programmable"), datapath=dp,
                    time_dilation=4) as net:
        yield net


@pytest.mark.parametrize("algo", ["ring", "hd"])
def test_trimmed_packets_are_nacked_and_resent_and_the_sum_is_exact(uet_star, algo):
    before = _trim_totals(uet_star, "tbs1")
    (row,) = run_collective(uet_star, CollectiveSpec(algo=algo, nbytes=2 << 20,
                                                     transport="uet", timeout_s=60))
    after = _trim_totals(uet_star, "tbs1")
    assert row["correct"], row["max_abs_err"]
    assert row["transport"] == "uet"
    cut = after["trimmed"] - before["trimmed"]
    assert cut > 0, "a shallow UET queue must trim some of a ring's packets"
    # every cut packet reached its receiver, was NACKed and resent: none waited for a timer
    assert row["uet_trimmed"] == cut
    assert row["uet_nack_retransmits"] == cut
    assert row["uet_lasthop_nacks"] == cut  # a star's switch is every packet's last hop
    assert row["uet_timeouts"] == 0


def test_tcp_through_a_uet_switch_is_best_effort_never_cut(uet_star):
    before = _trim_totals(uet_star, "tbs1")
    (row,) = run_collective(uet_star, CollectiveSpec(algo="ring", nbytes=2 << 20,
                                                     timeout_s=60))
    after = _trim_totals(uet_star, "tbs1")
    assert row["correct"]
    assert after["trimmed"] == before["trimmed"]  # DSCP 0: not trimmable

