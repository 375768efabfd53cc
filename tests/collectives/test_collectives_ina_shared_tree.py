"""Shared-pool INA on multi-switch trees: every tree switch in shared mode on its own pool,
with host fallbacks of its own, relaying its host rounds (docs/protocol.md, F3). A module of its
own: its network has the names of ``test_collectives_ina_tree.py``'s leaf-spine."""

from __future__ import annotations

import dataclasses

import pytest
from test_collectives_ina_tree import _concurrent, _spec, _switch_stats, impaired_run

from testbed.collectives.testing import check_rows, leftovers

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def small_pools():
    """Two leaves of three hosts under one spine, every switch with a shared pool of 4 entries
    (one round of 256 lanes each) and no fair-share cap: a tree's every level overflows."""
    from testbed.topologies import LeafSpine, TestbedNet
    from testbed.topologies.pipeline import DatapathOptions, Impairment

    opts = DatapathOptions(aggregate={"memory_bytes": 64 << 10, "pool_bytes": 4 << 10,
                                      "pool_fair_share": False},
                           impairments=(Impairment(node="tbl2", direction="ingress",
                                                   filter="testbed"),))
    topo = LeafSpine(leaves=2, spines=1, hosts_per_leaf=3, bw_mbps=100, switch="programmable")
    with TestbedNet(topo, datapath=opts) as net:
        yield net
    assert not leftovers()


def test_shared_pools_on_a_tree_fall_back_per_level_and_stay_exact(small_pools):
    """Two jobs in shared mode on trees of the spine and both leaves (one by 'auto', one
    given), at once and sharing two hosts, with pools too small at every level: each
    switch's rounds that find its pool held go to that switch's host fallbacks (on a shared
    host, each job's on ports of its own), whose partial sums and results the switch relays;
    every job is exact, also with loss, duplication and reordering at a leaf."""
    net = small_pools
    specs = [_spec(job_id=20, hosts=[0, 1, 3, 4], placement={"tree": "auto", "mode": "shared",
                                                             "slots": 16}),
             _spec(job_id=21, hosts=[1, 2, 4, 5], seed=1, placement={
                 "tree": ["tbsp1", "tbl1", "tbl2"], "mode": "shared", "slots": 16})]
    before = {s: _switch_stats(net, s) for s in ("tbsp1", "tbl1", "tbl2")}
    out = _concurrent(net, specs)
    for spec in specs:
        rows = out[spec.job_id]
        assert not isinstance(rows, Exception), rows
        check_rows(rows, spec, len(spec.hosts))
        r = rows[0]
        assert r["tree"] == ["tbsp1", "tbl1", "tbl2"] and r["placement_mode"] == "shared"
        assert r["host_fallback_chunks"] > 0 and 0.0 <= r["in_network_fraction"] < 1.0
    for sw in ("tbsp1", "tbl1", "tbl2"):  # every level overflowed and relayed the host's
        after = _switch_stats(net, sw)
        assert after["pool_collisions"] > before[sw]["pool_collisions"], sw
        assert after["fallback_relayed"] > before[sw]["fallback_relayed"], sw
    spec = dataclasses.replace(specs[0], repetitions=2, seed=3)
    rows = impaired_run(net, "tbl2", spec, loss=0.03, dup=0.03, reorder=0.1, seed=7)
    check_rows(rows, spec, 4)
    assert rows[0]["host_fallback_chunks"] > 0
    assert all(not _switch_stats(net, s)["jobs"] for s in ("tbsp1", "tbl1", "tbl2"))


def test_a_training_job_on_the_shared_pools_serves_its_host_fallbacks(small_pools):
    """A training job's ranks run outside the collectives' pool, so its control plane
    (``offload_job``) serves its host fallbacks itself: exact, replicas agree, every tree
    switch sent host rounds to them, and nothing of it is left running. With the fair share
    on, the window the switches hold (capped at registration: 1 slot of a 4-entry pool) is
    the one its ranks use (a rank sending on a slot the switches do not hold would stall)."""
    import subprocess

    from testbed.workloads import TrainingSpec, run_training

    net = small_pools
    spec = TrainingSpec(algo="ina", hosts=[0, 1, 3, 4], iterations=6, eval_every=3,
                        target_accuracy=0.5, job_id=23,
                        placement={"tree": "auto", "mode": "shared", "slots": 16})
    before = {s: _switch_stats(net, s) for s in ("tbsp1", "tbl1", "tbl2")}
    res = run_training(net, spec)
    s = res.summary
    assert res.error is None and s["correct"] and s["replicas_agree"], (res.error, s)
    for sw in ("tbsp1", "tbl1", "tbl2"):
        after = _switch_stats(net, sw)
        assert after["fallback_forwarded"] > before[sw]["fallback_forwarded"], sw
        assert not after["jobs"]
    clients = [net.switch_client(s) for s in ("tbsp1", "tbl1", "tbl2")]
    for c in clients:
        c.configure("aggregate", pool_fair_share=True)
    try:
        res = run_training(net, dataclasses.replace(spec, iterations=3, job_id=24))
    finally:
        for c in clients:
            c.configure("aggregate", pool_fair_share=False)
    assert res.error is None and res.summary["correct"], res.error
    ps = subprocess.run(["pgrep", "-f", "testbed.collectives.fallback"], capture_output=True)
    assert ps.stdout == b""
