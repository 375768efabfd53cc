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
