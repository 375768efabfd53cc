"""Trimming as a plan on a running network: the provider plans a UET ring for a job whose
workers run that transport, its switch ports trim while the plan runs (and only they), the
job's workers decode the cut packets (NACKed and resent: the sum stays exact), and the ports
go back to drop-tail when the job leaves or a provider starts afresh."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.spec import communication_of
from testbed.provider.schema import Hints, JobRequest
from testbed.provider.service import make_service
from testbed.provider.trimming import PortTrimmer, trim_ports
from testbed.topologies import make_topology

pytestmark = pytest.mark.mininet

HOSTS = ["tbh1", "tbh2", "tbh3", "tbh4"]


def _modes(net) -> dict[str, dict[str, str]]:
    """Per programmable switch, the mode of each port of its ``shape`` stage."""
    return {sw: {p: c["mode"] for p, c in cl.counters()["stages"]["shape"]["ports"].items()}
            for sw, cl in net.datapath_clients().items()}


def _trimmed(net) -> int:
    return sum(c["stages"]["shape"]["totals"]["trimmed"]
               for c in (cl.counters() for cl in net.datapath_clients().values()))


def test_the_provider_trims_the_ports_a_uet_plan_crosses_and_the_sum_stays_exact():
    from testbed.topologies.net import TestbedNet

    topo = make_topology("leaf_spine", leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=50,
                         oversubscription=2.0, switch="programmable")
    with TestbedNet(topo, time_dilation=2) as net:
        svc = make_service(net, 0, policy="cooperative", net=net)
        # a shallow trimmable-only threshold (two frames), so that the ring's own bursts are
        # cut where two of its flows meet: the cuts are what this test is about
        svc.switches.trimmer.threshold_bytes = 3000
        try:
            req = JobRequest(job="uet", hosts=HOSTS, hints=Hints(
                collective_bytes=1 << 20, tolerance="exact", transports=["tcp", "uet"]))
            plan = svc.call(lambda m, now: m.admit(req, now))
            assert (plan.algo, plan.transport) == ("ring", "uet"), plan.reason
            want = trim_ports(topo, HOSTS)
            modes = _modes(net)
            for sw, ports in modes.items():
                for port, mode in ports.items():
                    assert mode == ("uet" if port in want.get(sw, {}) else "drop_tail"), \
                        (sw, port)
            assert svc.switches.trimmer.by_job["uet"] == {sw: sorted(p)
                                                          for sw, p in want.items()}
            before = _trimmed(net)
            spec = CollectiveSpec(op="allreduce", nbytes=1 << 20, hosts=[0, 1, 2, 3],
                                  timeout_s=60, seed=3, **communication_of(plan))
            (row,) = run_collective(net, spec)
            assert row["correct"] and row["transport"] == "uet"
            assert _trimmed(net) > before  # cut, NACKed, resent: still exact
            assert row["uet_trimmed"] > 0 and row["uet_nack_retransmits"] > 0
            # a queue that drops: telemetry says what share of its packets it dropped, and the
            # model prices that as loss (a TCP ring through it is slower than on a quiet one)
            for sw in ("tbl1", "tbl2"):  # two frames of queue on every port of the leaves
                net.switch_client(sw).configure("shape", threshold_pkts=2)
            svc.telemetry.collect()
            tcp = CollectiveSpec(op="allreduce", nbytes=1 << 20, hosts=[0, 1, 2, 3],
                                 timeout_s=60, seed=4)
            assert run_collective(net, tcp)[0]["correct"]
            snap = svc.telemetry.collect()
            dropping = [lk for lk in snap.links if lk.drop_rate > 0]
            assert dropping and all(lk.src in ("tbl1", "tbl2") for lk in dropping), dropping
            assert all(lk.drop_rate <= 1 for lk in snap.links)
            model, ring = svc.manager.model, plan.model_copy(update={"transport": "tcp"})
            assert model.comm_s(req, ring, snap) > model.comm_s(req, ring, None)
            for sw in ("tbl1", "tbl2"):
                net.switch_client(sw).configure("shape", threshold_pkts=1000)
            svc.call(lambda m, now: m.release("uet", now))
            assert set(np.concatenate([list(p.values()) for p in _modes(net).values()])) \
                == {"drop_tail"}
            # a port a provider that died left trimming is set right by the next one's first
            # sync
            net.switch_client("tbl1").configure("shape", mode={"tbl1-eth3": "uet"})
            assert _modes(net)["tbl1"]["tbl1-eth3"] == "uet"
            PortTrimmer(net).sync({}, {})
            assert _modes(net)["tbl1"]["tbl1-eth3"] == "drop_tail"
        finally:
            svc.stop()
