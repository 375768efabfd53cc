"""Hierarchical and multi-tenant INA on real emulated fabrics (issue: aggregation across many
switches and many tenants): trees on leaf-spine and fat-tree, impairments at a mid-tree
switch, concurrent jobs in static partitions (admission refusal) and in a shared pool with
host fallback. Every row is checked against the numpy sum of the inputs."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from testbed.collectives import CollectiveError, CollectiveSpec, run_collective
from testbed.collectives.testing import check_rows, leftovers

pytestmark = pytest.mark.mininet

NBYTES = 4 * 40_009  # 157 INA packets: not a multiple of the window


def _spec(**kw) -> CollectiveSpec:
    return CollectiveSpec(**{"algo": "ina", "nbytes": NBYTES, "window": 16, "timeout_s": 30,
                             **kw})


def _switch_stats(net, sw: str) -> dict:
    return net.counters()["datapath"][sw]["stages"]["aggregate"]


@pytest.fixture(scope="module")
def leaf_spine():
    from testbed.topologies import LeafSpine, TestbedNet
    from testbed.topologies.pipeline import DatapathOptions, Impairment

    # a zero impairment on a leaf (a mid-tree switch of a spine-rooted tree), set per test
    imp = Impairment(node="tbl1", direction="ingress", filter="testbed")
    topo = LeafSpine(leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100, switch="programmable")
    with TestbedNet(topo, datapath=DatapathOptions(impairments=(imp,))) as net:
        yield net
    assert not leftovers()


def test_leaf_spine_tree_int32_and_thc(leaf_spine):
    net = leaf_spine
    plan = net.ina_plan(net.hosts, 20001, "auto")
    before = {s: _switch_stats(net, s) for s in plan.tree}
    spec = _spec(placement={"tree": "auto"}, repetitions=2)
    rows = run_collective(net, spec)
    check_rows(rows, spec, 4)
    for r in rows:
        assert r["tree"] == plan.tree and len(plan.tree) == 3
        assert r["in_network_fraction"] == 1.0 and r["host_fallback_chunks"] == 0
        assert r["switch_mem_bytes"] == 3 * 16 * 2 * 256 * 4  # W slots on each tree switch
    for leaf in plan.tree[1:]:  # each leaf sent its partial sums up, took the spine's results
        after = _switch_stats(net, leaf)
        assert after["upward_sent"] > before[leaf]["upward_sent"]
        assert after["parent_results"] > before[leaf]["parent_results"]
    thc = _spec(compressor="thc", placement={"tree": "auto"})
    check_rows(run_collective(net, thc), thc, 4)
    # an explicit tree: a leaf is the root, the other leaf aggregates below it
    ex = _spec(placement={"tree": ["tbl2", "tbl1"]}, job_id=3)
    rows = run_collective(net, ex)
    check_rows(rows, ex, 4)
    assert rows[0]["tree"] == ["tbl2", "tbl1"]
    # every job left every switch
    assert all(not _switch_stats(net, s)["jobs"] for s in ("tbl1", "tbl2", "tbsp1", "tbsp2"))


def test_tree_exact_with_loss_dup_reorder_at_a_mid_tree_switch(leaf_spine):
    spec = _spec(placement={"tree": "auto"}, repetitions=2, seed=5)
    check_rows(impaired_run(leaf_spine, "tbl1", spec, loss=0.05, dup=0.05, reorder=0.2, seed=4),
               spec, 4)


def impaired_run(net, switch: str, spec: CollectiveSpec, **impair) -> list[dict]:
    """Run ``spec`` while ``switch``'s ingress impair stage acts with ``impair`` (it is a zero
    impairment otherwise); checks it did lose, duplicate and reorder; returns the rows."""
    c = net.switch_client(switch)
    c.configure("impair", **impair)
    try:
        rows = run_collective(net, spec)
    finally:
        c.configure("impair", loss=0.0, dup=0.0, reorder=0.0)
    imp = net.counters()["datapath"][switch]["stages"]["impair"]["totals"]
    assert imp["lost"] > 0 and imp["duplicated"] > 0 and imp["reordered"] > 0  # it did act
    return rows


def test_the_model_prices_the_impairments_the_engines_apply_now(leaf_spine):
    """``net.link_impairments()`` reads what the leaf's impair stage does now (set at run
    time), one record per link into the leaf, and so does the provider's telemetry; a run's
    model prices them (its ``model_s`` is the model's with those records, longer than
    without), and none is left once they are switched off."""
    from testbed.collectives import flowmodel
    from testbed.provider.service import Telemetry

    net = leaf_spine
    c = net.switch_client("tbl1")
    c.configure("impair", loss=0.02, dup=0.05, reorder=0.2, seed=4)
    try:
        imps = net.link_impairments()
        spec = _spec(placement={"tree": "auto"}, seed=2)
        rows = run_collective(net, spec)
        # the provider's telemetry sees the same on the same links
        seen = Telemetry(net.topo.describe(), {})
        try:
            snap = seen.collect()
        finally:
            seen.close()
    finally:
        c.configure("impair", loss=0.0, dup=0.0, reorder=0.0)
    assert {lk.impairment for lk in snap.links if lk.impairment} == set(imps)
    check_rows(rows, spec, 4)
    assert {(i.src, i.dst) for i in imps} == {(p, "tbl1") for p in ("tbh1", "tbh2", "tbsp1",
                                                                   "tbsp2")}
    assert all(i.testbed_only and i.direction == "ingress" and i.loss == 0.02 and
               i.reorder_timeout_s > 0 for i in imps)
    workers = [h.name for h in net.hosts]

    def model(impairments):
        return flowmodel.predict(net.routed_topo, spec, workers=workers,
                                 hop_latency_s=net.hop_latency_s(),
                                 time_dilation=net.time_dilation, impairments=impairments)

    assert rows[0]["model_s"] == pytest.approx(model(imps).time_s)
    assert model(imps).ina_extra_s > model([]).ina_extra_s
    assert net.link_impairments() == []


def test_fat_tree_hierarchy_cuts_core_bytes():
    """8 workers in two pods of a fat-tree: at the core, the tree carries one partial-sum
    stream per pod each way, the single aggregator one per worker."""
    from testbed.topologies import FatTree, TestbedNet

    def core_bytes(net) -> int:
        ports = net.counters()["ports"]
        return sum(st.get("rx_bytes", 0) + st.get("tx_bytes", 0)
                   for name, st in ports.items() if name.startswith("tbc1-"))

    with TestbedNet(FatTree(4, switch="programmable", bw_mbps=100)) as net:
        moved = {}
        for tree in ("single", "auto"):
            spec = _spec(hosts=list(range(8)), placement={"tree": tree}, nbytes=256 << 10,
                         window=32)
            c0 = core_bytes(net)
            rows = run_collective(net, spec)
            moved[tree] = core_bytes(net) - c0
            check_rows(rows, spec, 8)
            assert (rows[0]["tree"] == ["tbc1"]) == (tree == "single")
        assert moved["auto"] <= 0.3 * moved["single"], moved
    assert not leftovers()


def _concurrent(net, specs: list[CollectiveSpec]) -> dict[int, list | Exception]:
    """Run the jobs at once, each in a thread: job id -> rows or the exception."""
    out: dict[int, list | Exception] = {}

    def go(spec):
        try:
            out[spec.job_id] = run_collective(net, spec)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[spec.job_id] = e

    threads = [threading.Thread(target=go, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def small_switch():
    """Six hosts on one switch with 80 KiB of aggregator memory: 64 KiB of static partitions
    (two jobs of 16 slots) and a shared pool of 16 entries (one round of 256 lanes each).
    Shared jobs keep the window they ask for (no fair-share cap), so the pool overflows."""
    from testbed.topologies import Star, TestbedNet
    from testbed.topologies.pipeline import DatapathOptions

    opts = DatapathOptions(aggregate={"memory_bytes": 80 << 10, "pool_bytes": 16 << 10,
                                      "pool_fair_share": False})
    with TestbedNet(Star(6, switch="programmable", bw_mbps=100), datapath=opts) as net:
        yield net
    assert not leftovers()


def _jobs(mode: str, k: int) -> list[CollectiveSpec]:
    return [_spec(job_id=10 + j, hosts=[2 * j, 2 * j + 1], seed=j, nbytes=4 * 60_013,
                  placement={"tree": "single", "mode": mode, "slots": 16}) for j in range(k)]


def test_static_partitions_admit_what_fits_and_refuse_the_rest(small_switch):
    net = small_switch
    two = _concurrent(net, _jobs("static", 2))
    for spec in _jobs("static", 2):
        check_rows(two[spec.job_id], spec, 2)
        assert two[spec.job_id][0]["switch_mem_bytes"] == 32 << 10
    three = _concurrent(net, _jobs("static", 3))
    refused = [j for j, r in three.items() if isinstance(r, Exception)]
    assert len(refused) == 1, three
    err = str(three[refused[0]])
    assert isinstance(three[refused[0]], CollectiveError)
    assert "tbs1" in err and "needs 32768 B" in err and "only 0 B are free" in err
    for spec in _jobs("static", 3):
        if spec.job_id not in refused:
            check_rows(three[spec.job_id], spec, 2)
            assert three[spec.job_id][0]["placement_mode"] == "static"
    assert not _switch_stats(net, "tbs1")["jobs"]
    # the tenant's own fallback: a refused job runs as ring on its hosts
    specs = [dataclasses.replace(s, placement={**s.placement, "refused": "ring"})
             for s in _jobs("static", 3)]
    out = _concurrent(net, specs)
    modes = sorted(out[s.job_id][0]["placement_mode"] for s in specs)
    assert modes == ["refused", "static", "static"], out
    for s in specs:
        rows = out[s.job_id]
        ring = rows[0]["placement_mode"] == "refused"
        assert rows[0]["algo"] == ("ring" if ring else "ina")
        assert rows[0]["refused_by"] == ("tbs1" if ring else None)
        assert all(r["correct"] for r in rows)


@pytest.mark.parametrize("k", [2, 3])
def test_shared_pool_with_host_fallback_is_exact(small_switch, k):
    """k jobs of 16 slots time-share a 16-entry pool (a job's window alone needs more): rounds
    whose entries are held run at the job's host aggregators, a slot's rounds alternating
    between switch and host; every job is exact and reports where its chunks were summed."""
    net = small_switch
    specs = _jobs("shared", k)
    out = _concurrent(net, specs)
    fallback = 0
    for spec in specs:
        rows = out[spec.job_id]
        assert not isinstance(rows, Exception), rows
        check_rows(rows, spec, 2)
        r = rows[0]
        assert 0.0 <= r["in_network_fraction"] <= 1.0 and r["tree"] == ["tbs1"]
        fallback += r["host_fallback_chunks"]
    assert fallback > 0
    assert not _switch_stats(net, "tbs1")["jobs"]


def test_shared_jobs_window_is_capped_at_its_fair_share_of_the_pool(small_switch):
    """With the provider's fair share on, a shared job asking for 16 slots of a 16-entry pool
    gets 16 / (4 x 2 jobs) = 2; a third shared job counts the two registered ones. The capped
    jobs are exact, and the cap is what the switch and the workers use."""
    from testbed.collectives.runner import register_ina_job

    net = small_switch
    c = net.switch_client("tbs1")
    c.configure("aggregate", pool_fair_share=True)
    handles = []
    try:
        for j, want in ((0, 2), (1, 2), (2, 1)):
            spec = _jobs("shared", 3)[j]
            workers = [net.hosts[h] for h in spec.hosts]
            job = {"spec": spec.to_json(), "ranks": [{"host": h.name} for h in workers]}
            handles.append(register_ina_job(net, spec, job, workers))
            assert handles[-1].spec.slots == want and job["spec"]["placement"]["slots"] == want
            assert _switch_stats(net, "tbs1")["jobs"][str(spec.job_id)]["slots"] == want
        for h in handles:
            h.release()
        handles = []
        specs = _jobs("shared", 2)
        out = _concurrent(net, specs)
        for spec in specs:
            assert not isinstance(out[spec.job_id], Exception), out[spec.job_id]
            check_rows(out[spec.job_id], spec, 2)
    finally:
        for h in handles:
            h.release()
        c.configure("aggregate", pool_fair_share=False)
    assert not _switch_stats(net, "tbs1")["jobs"]


