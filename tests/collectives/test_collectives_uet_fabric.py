"""The UET-like transport on fabrics of its own (Mininet, root): an incast through a UET
trimming port against the same port in drop-tail mode, one flow sprayed over both spines of a
leaf-spine, a dilated network's timer. (Own module: the star of test_collectives_uet_net
stays up for its whole module, and these networks reuse its switch name.)"""

from __future__ import annotations

import pytest

from testbed.collectives import CollectiveSpec, run_collective
from testbed.experiment.flows import run_flows
from testbed.topologies import LeafSpine, Star, TestbedNet
from testbed.topologies.dumbbell import Incast
from testbed.topologies.pipeline import DatapathOptions, Trimming

pytestmark = pytest.mark.mininet


def test_a_uet_incast_has_no_timeout_where_drop_tail_has_losses():
    """8:1 incast through the receiver's port: UET trimming recovers every cut by a NACK;
    the same queue in drop-tail mode drops and the transport must find the losses itself."""
    dp = DatapathOptions(trimming=(Trimming(node="tbs1", mode="uet", threshold_bytes=16 << 10,
                                            ports=("tbs1-eth1",)),))
    with TestbedNet(Incast(n_senders=8, bw_mbps=50, switch="programmable"), datapath=dp,
                    time_dilation=8) as net:
        uet = run_flows(net, "uet", 32 << 10)
        assert uet["timeouts"] == 0
        assert uet["uet"]["nacks_received"] > 0
        assert uet["uet"]["nacks_received"] == uet["uet"]["trimmed_received"]
        net.switch_client("tbs1").configure("trim", mode="drop_tail")
        before = net.switch_client("tbs1").counters()["stages"]["trim"]["totals"]["dropped"]
        dt = run_flows(net, "uet", 32 << 10)
        after = net.switch_client("tbs1").counters()["stages"]["trim"]["totals"]["dropped"]
        assert after > before
        assert dt["uet"]["nacks_received"] == 0
        assert dt["uet"]["fast_retransmits"] + dt["timeouts"] > 0
        assert len(uet["fct_s"]) == len(dt["fct_s"]) == 8


def test_one_flow_is_sprayed_over_both_spines():
    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=1, bw_mbps=100, switch="programmable")
    with TestbedNet(topo) as net:
        def spine_packets():
            c = net.counters()["datapath"]
            return [sum(p.get("rx_packets", 0) for p in c[s]["ports"].values())
                    for s in ("tbsp1", "tbsp2")]
        for transport, both in (("tcp", False), ("uet", True)):
            before = spine_packets()
            (row,) = run_collective(net, CollectiveSpec(algo="ring", nbytes=4 << 20,
                                                        transport=transport, timeout_s=60))
            assert row["correct"]
            moved = [a - b for a, b in zip(spine_packets(), before, strict=True)]
            # 4 MiB each way is ~2900 data packets per direction
            if both:
                assert min(moved) > 1000, moved
            else:  # one path per direction: the two directions may or may not share a spine
                assert max(moved) > 2000, moved


def test_a_dilated_network_stretches_the_uet_retransmission_timer():
    """The sender's timeout floor (200 ms, TCP's) is stretched with the network's time
    dilation, as the hosts' TCP floor is: a window queued on a slow dilated link takes longer
    than 200 ms of wall time to drain, and an unstretched timer fired on it (a 2 MiB ring of
    a leaf-spine at dilation 12: 14-20 timeouts per run and 1.3-1.5x the model, 0 and 1.04x
    stretched). Here a window of 64 packets queues about 0.6 s on a 10 Mb/s link at
    dilation 8."""
    with TestbedNet(Star(2, bw_mbps=10, switch="programmable"), time_dilation=8) as net:
        (row,) = run_collective(net, CollectiveSpec(algo="ring", nbytes=1 << 20,
                                                    transport="uet", timeout_s=60))
    assert row["correct"], row["max_abs_err"]
    assert row["uet_timeouts"] == 0
