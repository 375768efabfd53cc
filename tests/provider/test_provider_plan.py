"""The fabric manager and its policies on plain data: a leaf-spine's inventory, hints, and
hand-made telemetry snapshots (no network is built; the flow model costs the plans)."""

from __future__ import annotations

import pytest

from testbed.provider import policies
from testbed.provider.manager import (
    CONGESTED_UTIL,
    SUSTAINED_SNAPSHOTS,
    BadRequest,
    Conflict,
    FabricManager,
    NoFeasiblePlan,
    UnknownJob,
    inventory_of,
)
from testbed.provider.policies import (
    POLICIES,
    FabricView,
    PlanModel,
    background,
    candidates,
    compressor_error,
    make_policy,
    own_traffic,
    plan_memory,
)
from testbed.provider.schema import Hints, JobRequest, LinkState, Plan
from testbed.topologies import make_topology

KIB = 1024


@pytest.fixture(scope="module")
def topo():
    # 2 leaves x 5 hosts, one spine; uplinks 20 Mb/s (5:1 oversubscribed core)
    return make_topology("leaf_spine", leaves=2, spines=1, hosts_per_leaf=5, bw_mbps=20,
                         oversubscription=5.0, switch="programmable")


@pytest.fixture(scope="module")
def model(topo):
    return PlanModel(topo)


def _inv(topo, mem=96 * KIB):
    return inventory_of(topo, mem)


SMALL = JobRequest(job="small", hosts=["tbh1", "tbh6"],
                   hints=Hints(collective_bytes=40_000, iterations=100))
BIG = JobRequest(job="big", hosts=["tbh2", "tbh3", "tbh7", "tbh8"],
                 hints=Hints(collective_bytes=400_000, iterations=100, tolerance="exact"))
TOL = JobRequest(job="tol", hosts=["tbh4", "tbh9"],
                 hints=Hints(collective_bytes=400_000, iterations=100, tolerance="lossy",
                             error_budget=0.25))
SILENT = JobRequest(job="silent", hosts=["tbh5", "tbh10"])


def _state(fm):
    return (fm.plans(), fm.jobs(), fm.memory(), len(fm.log))


def test_inventory_and_candidate_trees(topo):
    inv = _inv(topo)
    assert sorted(inv.hosts) == sorted(topo.host_names)
    assert {s.name for s in inv.switches} == {"tbl1", "tbl2", "tbsp1"}
    view = FabricView(inv)
    assert view.trees(["tbh1", "tbh2"]) == [["tbl1"]]  # one leaf: a tree of one
    # root first, as the data path takes a list of switches
    assert view.trees(["tbh1", "tbh6"]) == [["tbsp1"], ["tbsp1", "tbl1", "tbl2"]]
    # an exact job is offered no compressor; a tolerant one only those within its budget
    assert all(c.compressor is None for c in candidates(BIG, view))
    tol = [c for c in candidates(TOL, view) if c.compressor]
    assert tol and all(compressor_error(c.compressor, tuple(sorted(
        c.compressor_params.items()))) <= 0.25 for c in tol)
    tight = TOL.model_copy(update={"hints": TOL.hints.model_copy(update={"error_budget": 1e-6})})
    assert all(c.compressor is None for c in candidates(tight, view))


def test_candidate_trees_of_a_fat_tree_are_the_data_paths_trees():
    """On a fat-tree k=4 a job within one pod is rooted at that pod's aggregation switches and
    a job across pods at the core switches, on a dumbbell at either switch (no switch is
    adjacent to all their edge switches: they were offered the ring alone); each tree is the
    one the data path builds from the list, its root first: the root aggregates the edge
    switches' partial sums."""
    from testbed.topologies import aggtree

    ft = make_topology("fat_tree", k=4, bw_mbps=20, switch="programmable")
    view = FabricView(_inv(ft))
    names = ft.host_names
    assert view.trees(names[:2]) == [["tbe1"]]
    pod = view.trees([names[0], names[2]])  # two edge switches of pod 1
    assert sorted(t[0] for t in pod if len(t) == 1) == ["tba1", "tba2"]
    cross = view.trees([names[0], names[4], names[8], names[13]])
    cores = sorted(t[0] for t in cross if len(t) == 1)
    assert cores == sorted(s for s in ft.programmable if s.startswith("tbc")) and \
        len(cores) == 4
    for tree in cross:
        plan = aggtree.plan(ft, [0, 4, 8, 13], 40000, tree)
        assert plan.root == tree[0] and set(plan.tree) == set(tree)
        assert plan.depth() == (1 if len(tree) == 1 else 2)
    # a dumbbell: either edge switch is the root, alone or above the other
    bell = make_topology("dumbbell", n_left=2, n_right=2, switch="programmable")
    assert FabricView(_inv(bell)).trees(bell.host_names) == [
        ["tbs1"], ["tbs2"], ["tbs1", "tbs2"], ["tbs2", "tbs1"]]
    assert any(c.algo == "ina" and len(c.tree) == 5 for c in candidates(
        JobRequest(job="x", hosts=[names[i] for i in (0, 4, 8, 13)],
                   hints=Hints(collective_bytes=400_000, iterations=10)), view))


def test_policies_plan_from_hints(topo, model):
    jobs = [SMALL, BIG, TOL, SILENT]
    snap = _inv(topo)
    plans = {name: make_policy(name, model, **({"trace": jobs} if name == "oracle" else {}))
             .plan(jobs, snap) for name in POLICIES}
    # tenant_only: ring everywhere, nothing compressed
    assert all(p.algo == "ring" and p.compressor is None for p in plans["tenant_only"].values())
    # provider_only: first come first served: the first job takes the memory
    po = plans["provider_only"]
    assert po["small"].algo == "ina" and po["big"].algo == "ring"
    assert all(p.compressor is None for p in po.values())
    # cooperative: memory to the job it helps most, compression only where tolerated
    co = plans["cooperative"]
    assert co["big"].algo == "ina" and co["small"].algo == "ring"
    assert co["tol"].compressor is not None and co["big"].compressor is None
    assert co["silent"].compressor is None  # no hints: exact
    for name in ("cooperative", "oracle"):
        total = {n: sum(plans[n][j.job].predicted_comm_s * j.hints.iterations
                        for j in jobs[:3]) for n in plans}
        assert total[name] < total["tenant_only"] and total[name] < total["provider_only"]
    # every plan fits the memory; predictions come from the model
    for name, pl in plans.items():
        used: dict = {}
        for j in jobs:
            for sw, b in plan_memory(pl[j.job], len(j.hosts)).items():
                used[sw] = used.get(sw, 0) + b
        assert all(b <= 96 * KIB for b in used.values()), (name, used)
        assert all(pl[j.job].predicted_comm_s > 0 for j in jobs[:3])
        assert pl["silent"].predicted_comm_s is None  # no collective_bytes: nothing to cost


def test_replan_on_arrival_and_departure(topo, model):
    fm = FabricManager(_inv(topo), "provider_only", model)
    assert fm.admit(SMALL, now=0).algo == "ina"
    assert fm.admit(BIG, now=1).algo == "ring"  # memory full
    assert fm.memory()["tbsp1"]["allocated"] == {"small": 64 * KIB}
    fm.release("small", now=5)
    assert fm.plans()["big"].algo == "ina"  # the memory went to the job still running
    assert fm.memory()["tbsp1"]["allocated"] == {"big": 64 * KIB}
    log = [(e.time_s, e.job, e.old and e.old.algo, e.new and e.new.algo) for e in fm.log]
    assert log == [(0, "small", None, "ina"), (1, "big", None, "ring"),
                   (5, "small", "ina", None), (5, "big", "ring", "ina")]
    assert "departure of small" in fm.log[-1].reason


def test_lease_expiry_reclaims_memory(topo, model):
    fm = FabricManager(_inv(topo), "cooperative", model)
    fm.admit(BIG.model_copy(update={"lease_s": 10.0}), now=0)
    fm.admit(TOL.model_copy(update={"lease_s": 10.0}), now=0)
    assert fm.memory()["tbsp1"]["allocated"] == {"big": 64 * KIB}
    assert fm.renew("tol", now=8) == 18
    assert fm.expire(now=9.9) == []
    assert fm.expire(now=10) == ["big"]  # the vanished tenant; the renewed one stays
    assert fm.memory()["tbsp1"]["allocated"] == {} and list(fm.plans()) == ["tol"]
    assert fm.log[-1].reason == "lease expired" or any(e.reason == "lease expired"
                                                       for e in fm.log)
    assert fm.expire(now=18) == ["tol"] and fm.plans() == {}


def test_refusals_leave_state_unchanged(topo, model):
    fm = FabricManager(_inv(topo), "cooperative", model)
    fm.admit(BIG, now=0)
    before = _state(fm)
    bad = [
        (BIG, Conflict),  # duplicate job
        (JobRequest(job="x", hosts=["tbh2", "tbh5"]), Conflict),  # tbh2 is BIG's
        (JobRequest(job="x", hosts=["tbh1", "nope"]), BadRequest),  # unknown host
        (JobRequest(job="x", hosts=["tbh1", "tbh1"]), BadRequest),  # a host twice
        (JobRequest(job="x", hosts=["tbh1", "tbh6"], hints=Hints(version=99)), BadRequest),
    ]
    for req, err in bad:
        with pytest.raises(err) as e:
            fm.admit(req, now=1)
        assert 400 <= e.value.status < 500
        assert _state(fm) == before
    for call in (lambda: fm.release("nope", now=1), lambda: fm.renew("nope", now=1)):
        with pytest.raises(UnknownJob):
            call()
        assert _state(fm) == before


def test_sustained_congestion_replans():
    # an unoversubscribed core: INA on the spine beats the ring until the uplink fills up
    # (INA sends every worker's stream over it, the ring only its crossing steps)
    topo = make_topology("leaf_spine", leaves=2, spines=1, hosts_per_leaf=2, bw_mbps=20,
                         oversubscription=1.0, switch="programmable")
    model = PlanModel(topo)
    fm = FabricManager(inventory_of(topo, {"tbsp1": 96 * KIB}), "cooperative", model)
    req = JobRequest(job="a", hosts=["tbh1", "tbh2", "tbh3", "tbh4"],
                     hints=Hints(collective_bytes=400_000, iterations=100))
    first = fm.admit(req, now=0)
    assert first.algo == "ina" and first.tree == ["tbsp1"]

    def snap(util):
        links = [lk.model_copy(update={"utilisation": util})
                 if {lk.src, lk.dst} == {"tbl1", "tbsp1"} else lk for lk in fm.inventory.links]
        return fm.inventory.model_copy(update={"links": links})

    # congestion below the threshold, or not sustained long enough: no re-plan
    for k in range(SUSTAINED_SNAPSHOTS + 1):
        assert fm.observe(snap(CONGESTED_UTIL - 0.05), now=1 + k) == []
    for k in range(SUSTAINED_SNAPSHOTS - 1):
        assert fm.observe(snap(0.97), now=10 + k) == []
    assert fm.observe(snap(0.2), now=20) == []  # quiet: the count restarts
    for k in range(SUSTAINED_SNAPSHOTS - 1):
        assert fm.observe(snap(0.97), now=30 + k) == []
    assert fm.plans()["a"] == first and len(fm.log) == 1
    assert fm.observe(snap(0.97), now=40) == ["a"]
    assert fm.log[-1].time_s == 40 and "sustained congestion" in fm.log[-1].reason
    assert fm.plans()["a"].algo == "ring" and fm.memory()["tbsp1"]["allocated"] == {}
    # the new plan is cheaper than the old one on the congested fabric
    hot = snap(0.97)
    assert model.comm_s(req, fm.plans()["a"], hot) < model.comm_s(req, first, hot)
    # once per episode: more hot snapshots change nothing
    assert fm.observe(snap(0.97), now=41) == [] and len(fm.log) == 2
    # a link off the job's paths never triggers a re-plan
    fm2 = FabricManager(inventory_of(topo, {"tbsp1": 96 * KIB}), "cooperative", model)
    fm2.admit(JobRequest(job="b", hosts=["tbh1", "tbh2"],
                         hints=Hints(collective_bytes=400_000)), now=0)
    for k in range(SUSTAINED_SNAPSHOTS + 2):
        assert fm2.observe(snap(0.99), now=k) == []
    assert len(fm2.log) == 1



def test_a_replan_for_another_cause_that_moves_a_job_off_congestion_names_it():
    """The policy prices telemetry's load whatever asks for a re-plan: a hints verdict reached
    while a burst is on a job's links, before the burst is sustained, moves the job to a plan
    that loads them less (here INA's every stream to the ring's crossing steps). That move
    counts as a congestion re-plan too, and the sustained episode that follows finds nothing
    left to move."""
    from testbed.experiment.cooperation import replan_reasons

    topo = make_topology("leaf_spine", leaves=2, spines=1, hosts_per_leaf=2, bw_mbps=20,
                         oversubscription=1.0, switch="programmable")
    fm = FabricManager(inventory_of(topo, {"tbsp1": 96 * KIB}), "cooperative", PlanModel(topo))
    req = JobRequest(job="a", hosts=["tbh1", "tbh2", "tbh3", "tbh4"],
                     hints=Hints(collective_bytes=400_000, iterations=100))
    assert fm.admit(req, now=0).algo == "ina"

    def snap(util):
        links = [lk.model_copy(update={"utilisation": util})
                 if {lk.src, lk.dst} == {"tbl1", "tbsp1"} else lk for lk in fm.inventory.links]
        return fm.inventory.model_copy(update={"links": links})

    # quiet: a re-plan that changes nothing names nothing
    fm.observe(snap(0.1), now=1)
    assert fm.update_hints("a", {"iterations": 90}, "hints confirmed by telemetry", now=2) == []
    for k in range(SUSTAINED_SNAPSHOTS - 1):
        assert fm.observe(snap(0.97), now=10 + k) == []
    assert fm.update_hints("a", {"iterations": 80}, "hints confirmed by telemetry",
                           now=20) == ["a"]
    change = fm.log[-1]
    assert change.new.algo == "ring"
    assert change.reason.startswith("hints confirmed by telemetry; eases congestion on ")
    assert f"tbl1->tbsp1 ({SUSTAINED_SNAPSHOTS - 1} snapshots)" in change.reason
    assert "tbsp1->tbl1" in change.reason  # INA's results come back over it
    assert replan_reasons([change])["congestion"] == 1 == replan_reasons([change])["hints"]
    assert fm.observe(snap(0.97), now=21) == [] and fm.log[-1] is change

    # the baseline without congestion re-plans counts no congestion re-plan
    blind = FabricManager(inventory_of(topo, {"tbsp1": 96 * KIB}), "cooperative_no_congestion",
                          PlanModel(topo))
    blind.admit(req, now=0)
    for k in range(SUSTAINED_SNAPSHOTS - 1):
        blind.observe(snap(0.97), now=10 + k)
    blind.update_hints("a", {"iterations": 80}, "hints confirmed by telemetry", now=20)
    assert all("congestion" not in e.reason for e in blind.log)

def test_drops_count_as_congestion(topo, model):
    fm = FabricManager(_inv(topo), "tenant_only", model)
    fm.admit(SMALL, now=0)
    links = list(fm.inventory.links)
    k = next(i for i, lk in enumerate(links) if (lk.src, lk.dst) == ("tbh1", "tbl1"))
    for t in range(1, SUSTAINED_SNAPSHOTS + 1):
        links[k] = LinkState(src="tbh1", dst="tbl1", rate_mbps=20, drops=t * 10)
        fm.observe(fm.inventory.model_copy(update={"links": list(links)}), now=t)
    assert fm.congested() == {"tbh1->tbl1": SUSTAINED_SNAPSHOTS}
    fm.observe(fm.inventory.model_copy(update={"links": list(links)}), now=9)  # no new drops
    assert fm.congested() == {}
    assert fm.plans()["small"].algo == "ring"  # tenant_only keeps the ring whatever it sees


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("greedy")


class _Greedy:
    """A policy that puts every job on the spine, memory or not (the manager must refuse)."""

    name = "greedy"

    def plan(self, jobs, snapshot):
        return {j.job: Plan(job=j.job, algo="ina", tree=["tbsp1"], slots=32) for j in jobs}


def test_infeasible_plans_are_refused_with_nothing_changed(topo, model):
    fm = FabricManager(_inv(topo), _Greedy(), model)
    fm.admit(SMALL, now=0)
    before = _state(fm)
    with pytest.raises(NoFeasiblePlan, match="tbsp1") as e:
        fm.admit(BIG, now=1)  # 2 x 64 KiB > 96 KiB on the spine
    assert e.value.status == 503 and _state(fm) == before
    assert fm.plans()["small"].predicted_comm_s > 0  # the manager filled in the model's time


def test_a_job_filling_its_own_links_is_not_congested_but_one_sharing_them_is_moved():
    """Telemetry cannot tell whose bytes fill a link; a full link is congested only where
    what each job's own traffic explains (the model's bytes per link under its plan, at the
    rate its hosts' uplinks send now) leaves a fifth of it to others. A ring that fills its
    spine's links itself stays where it is; the same links full of another tenant's burst,
    the ring's hosts now sending at half its rate, move it to INA on the other spine."""
    topo = make_topology("leaf_spine", leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=20,
                         oversubscription=1.0, switch="programmable")
    model = PlanModel(topo)
    fm = FabricManager(inventory_of(topo, {"tbsp1": 96 * KIB, "tbsp2": 96 * KIB}),
                       "cooperative", model)
    req = JobRequest(job="a", hosts=["tbh1", "tbh2", "tbh3", "tbh4"],
                     hints=Hints(collective_bytes=400_000, iterations=100))
    first = fm.admit(req, now=0)
    per_link = model.link_bytes(req, first)
    assert first.algo == "ring" and per_link[("tbl1", "tbsp2")] > 0  # ECMP: via tbsp2
    assert ("tbl1", "tbsp1") not in per_link

    def snap(util):
        return fm.inventory.model_copy(update={"links": [
            lk.model_copy(update={"utilisation": util.get((lk.src, lk.dst), 0.0)})
            for lk in fm.inventory.links]})

    # its own traffic, 95 % of its busiest link: explained as its own, nothing to move
    busiest = max(per_link.values())
    own = snap({k: 0.95 * b / busiest for k, b in per_link.items()})
    explained = own_traffic(model, [(req, first)], own)["a"]
    assert explained[("tbl1", "tbsp2")] == pytest.approx(0.95)
    for k in range(SUSTAINED_SNAPSHOTS + 2):
        assert fm.observe(own, now=1 + k) == []
    assert fm.plans()["a"] == first and len(fm.log) == 1
    # a re-plan on that snapshot would have moved it (to INA): only the trigger keeps it
    assert model.comm_s(req, Plan(job="a", algo="ina", tree=["tbsp1"], slots=32), own) < \
        model.comm_s(req, first, own)

    # another tenant's burst fills tbsp2's links; the ring's hosts send at half the rate
    burst = {k: 0.475 * b / busiest for k, b in per_link.items()}
    burst.update({("tbl1", "tbsp2"): 1.0, ("tbsp2", "tbl2"): 1.0})
    for k in range(SUSTAINED_SNAPSHOTS - 1):
        assert fm.observe(snap(burst), now=10 + k) == []
    assert fm.observe(snap(burst), now=20) == ["a"]
    moved = fm.plans()["a"]
    assert moved.algo == "ina" and moved.tree == ["tbsp1"], moved
    assert fm.log[-1].reason.startswith("sustained congestion on tbl1->tbsp2, tbsp2->tbl2")

    # the same policy blind to congestion counts the episode and keeps the ring
    blind = FabricManager(inventory_of(topo, {"tbsp1": 96 * KIB, "tbsp2": 96 * KIB}),
                          "cooperative_no_congestion", PlanModel(topo))
    assert blind.admit(req, now=0) == first
    for k in range(SUSTAINED_SNAPSHOTS + 1):
        assert blind.observe(snap(burst), now=10 + k) == []
    assert blind.congested()["tbl1->tbsp2"] > SUSTAINED_SNAPSHOTS
    assert blind.plans()["a"] == first and len(blind.log) == 1


def test_jobs_priced_together_pay_for_the_links_they_share(topo, model):
    """The joint price (flowmodel.predict_concurrent) of jobs crossing the same thin core is
    above each one's price alone; jobs on links of their own pay nothing for each other; a
    job alone, or with jobs that give no bytes, gets its price alone."""
    a = JobRequest(job="a", hosts=["tbh1", "tbh6"], hints=Hints(collective_bytes=400_000))
    b = JobRequest(job="b", hosts=["tbh2", "tbh7"], hints=Hints(collective_bytes=400_000))
    ring_a, ring_b = Plan(job="a"), Plan(job="b")
    alone = [model.comm_s(a, ring_a), model.comm_s(b, ring_b)]
    shared = model.joint_s([(a, ring_a), (b, ring_b)])
    assert all(s > 1.5 * t for s, t in zip(shared, alone, strict=True)), (shared, alone)
    # one leaf each: no link in common
    c = JobRequest(job="c", hosts=["tbh1", "tbh2"], hints=Hints(collective_bytes=400_000))
    d = JobRequest(job="d", hosts=["tbh6", "tbh7"], hints=Hints(collective_bytes=400_000))
    apart = model.joint_s([(c, Plan(job="c")), (d, Plan(job="d"))])
    assert apart == pytest.approx([model.comm_s(c, Plan(job="c")),
                                   model.comm_s(d, Plan(job="d"))], rel=1e-6)
    assert model.joint_s([(a, ring_a), (SILENT, Plan(job="silent"))]) == [alone[0], None]


def test_background_leaves_what_no_job_explains(topo, model):
    """Telemetry less the jobs' own traffic: the links a ring fills itself look idle to the
    policies (they price the ring themselves); another tenant's load on them stays."""
    req = JobRequest(job="a", hosts=["tbh1", "tbh6"], hints=Hints(collective_bytes=400_000))
    plan = Plan(job="a")
    per = model.link_bytes(req, plan)
    busiest = max(per.values())
    inv = _inv(topo)

    def snap(extra=0.0):
        return inv.model_copy(update={"links": [
            lk.model_copy(update={"utilisation": 0.8 * per.get((lk.src, lk.dst), 0.0) / busiest
                                  + (extra if (lk.src, lk.dst) == ("tbl1", "tbsp1") else 0)})
            for lk in inv.links]})

    util = {(lk.src, lk.dst): lk.utilisation for lk in background(model, [(req, plan)],
                                                                  snap()).links}
    assert max(util.values()) == pytest.approx(0.0, abs=1e-9)
    util = {(lk.src, lk.dst): lk.utilisation for lk in background(model, [(req, plan)],
                                                                  snap(0.15)).links}
    assert util[("tbl1", "tbsp1")] == pytest.approx(0.15)
    assert background(model, [], snap()) == snap()  # no job: the snapshot as it is
    # the manager plans on it: the running ring's own bytes do not slow its own price
    fm = FabricManager(inv, "cooperative", model)
    fm.admit(req.model_copy(update={"hints": req.hints.model_copy(
        update={"iterations": 10})}), now=0)
    fm.observe(snap(), now=1)
    assert max(lk.utilisation for lk in fm.planning_fabric().links) < 1e-9
    assert max(lk.utilisation for lk in fm.fabric().links) == pytest.approx(0.8)


def test_cooperative_plans_jobs_together_where_alone_prices_mislead(monkeypatch):
    """Two spines: priced alone, INA on either spine costs the same and the policy takes the
    first; priced together with the ring beside it, whose flows the fabric's ECMP hash puts
    through one spine, INA goes through the other, and every job's weighted time drops. The
    policy's predictions are the joint times; the oracle, which prices combinations
    together too, agrees."""
    topo = make_topology("leaf_spine", leaves=2, spines=2, hosts_per_leaf=4, bw_mbps=20,
                         oversubscription=2.0, switch="programmable")
    model = PlanModel(topo)
    snap = inventory_of(topo, 96 * KIB)
    ring = JobRequest(job="ring", hosts=["tbh3", "tbh8"],
                      hints=Hints(collective_bytes=200_000, iterations=20))
    ina = JobRequest(job="ina", hosts=["tbh7", "tbh1"],
                     hints=Hints(collective_bytes=40_000, iterations=100, priority=1,
                                 tolerance="lossy", error_budget=0.25))
    jobs = [ring, ina]
    spines = {a for a, _b in model.link_bytes(ring, Plan(job="ring")) if a.startswith("tbsp")}
    assert len(spines) == 1  # the ring's flows cross one spine
    pol = make_policy("cooperative", model)
    together = pol.plan(jobs, snap)
    monkeypatch.setattr(policies, "JOINT_GAIN", 1.0)  # the refinement off: priced alone
    alone = pol.plan(jobs, snap)
    assert together["ring"].algo == alone["ring"].algo == "ring"
    assert alone["ina"].algo == together["ina"].algo == "ina"
    assert alone["ina"].tree == ["tbsp1"]  # a tie alone: the first spine
    assert together["ina"].tree[0] not in spines, together["ina"]
    assert "priced with the jobs sharing its links" in together["ina"].reason
    assert pol.weighted_s(jobs, together, snap) < 0.9 * pol.weighted_s(jobs, alone, snap)
    assert [together[j.job].predicted_comm_s for j in jobs] == \
        model.joint_s([(j, together[j.job]) for j in jobs], snap)
    monkeypatch.undo()
    oracle = make_policy("oracle", model, trace=jobs).plan(jobs, snap)
    assert oracle["ina"].tree[0] not in spines


def test_jobs_sharing_a_full_link_are_not_congested_by_each_other(topo, model):
    """Two rings whose own traffic together fills the core (each half of it) were priced
    together when planned: no congestion episode. The same rings at a third of it each and
    another tenant's quarter on top: one."""
    a = JobRequest(job="a", hosts=["tbh1", "tbh6"], hints=Hints(collective_bytes=400_000))
    b = JobRequest(job="b", hosts=["tbh2", "tbh7"], hints=Hints(collective_bytes=400_000))
    fm = FabricManager(_inv(topo), "tenant_only", model)
    fm.admit(a, now=0)
    fm.admit(b, now=0)
    per = {j.job: model.link_bytes(j, fm.plans()[j.job]) for j in (a, b)}
    core = ("tbl1", "tbsp1")
    assert core in per["a"] and core in per["b"]

    def snap(each: float, extra: float = 0.0):
        util = {}
        for p in per.values():
            for k, v in p.items():
                util[k] = util.get(k, 0.0) + each * v / p[core]
        util[core] += extra
        return fm.inventory.model_copy(update={"links": [lk.model_copy(update={
            "utilisation": min(1.0, util.get((lk.src, lk.dst), 0.0))})
            for lk in fm.inventory.links]})

    assert {(lk.src, lk.dst): lk.utilisation for lk in snap(0.475).links}[core] == \
        pytest.approx(0.95)
    for k in range(SUSTAINED_SNAPSHOTS + 1):
        fm.observe(snap(0.475), now=1 + k)
    assert fm.congested() == {}
    fm.observe(snap(0.35, 0.25), now=10)
    assert fm.congested() == {"tbl1->tbsp1": 1}


def test_a_job_left_without_static_memory_aggregates_on_the_shared_pools(topo, model):
    """Static memory for one INA job, a 64-entry pool on every switch: the cooperative policy
    gives the memory to one aggregating job and puts the next on the shared pools of its tree
    (window: its fair share beside the other shared jobs, as the data path's registration
    caps it; priced at the model's time x SHARED_MARGIN, and only where that beats its
    memory-free plan); without pools (or as cooperative_static) those jobs ring."""
    big2 = BIG.model_copy(update={"job": "big2", "hosts": ["tbh4", "tbh5", "tbh9", "tbh10"]})
    pools = inventory_of(topo, 96 * KIB, 64)
    assert all(s.pool_entries == 64 for s in pools.switches)
    shared = [c for c in candidates(big2, FabricView(pools)) if c.mode == "shared"]
    assert [c.tree for c in shared] == [["tbsp1"], ["tbsp1", "tbl1", "tbl2"]]
    assert all(c.algo == "ina" and c.slots == 8 and not plan_memory(c, 4) for c in shared)
    assert not [c for c in candidates(big2, FabricView(_inv(topo))) if c.mode == "shared"]
    co = make_policy("cooperative", model).plan([BIG, big2], pools)
    static, pooled = sorted(co.values(), key=lambda p: p.mode != "static")
    assert static.algo == pooled.algo == "ina" and pooled.mode == "shared"
    assert static.mode == "static" and pooled.slots == 8 and "shared pools" in pooled.reason
    ring = make_policy("cooperative_static", model).plan([BIG, big2], pools)[pooled.job]
    assert ring.algo == "ring" and ring.predicted_comm_s > pooled.predicted_comm_s
    assert pooled.predicted_comm_s > static.predicted_comm_s  # the margin, and its window
    # three plans on the pools: every shared window shrinks to the fair share among three
    three = {j: pooled.model_copy(update={"job": j}) for j in "abc"}
    assert [p.slots for p in policies.shared_windows(three, pools).values()] == [5] * 3
    assert "cooperative_static" in POLICIES and POLICIES["cooperative_static"].baseline


def test_the_policies_price_the_loss_telemetry_shows(topo, model):
    """Telemetry that shows loss on a job's links (``LinkState.impairment``) raises what its
    ring costs (TCP's loss recovery) more than what INA costs: two equal two-host jobs run
    rings on the clean fabric (INA moves the same bytes, with more headers), and the one
    whose links lose 2 % of their packets moves to INA, whichever came first."""
    from testbed.topologies.base import LinkImpairment

    a = JobRequest(job="a", hosts=["tbh1", "tbh6"],
                   hints=Hints(collective_bytes=400_000, iterations=100, tolerance="exact"))
    b = a.model_copy(update={"job": "b", "hosts": ["tbh2", "tbh7"]})
    clean = _inv(topo)
    lossy = clean.model_copy(update={"links": [
        lk.model_copy(update={"impairment": LinkImpairment(lk.src, lk.dst, loss=0.02)})
        if lk.src in b.hosts else lk for lk in clean.links]})
    ring = Plan(job="b", algo="ring")
    ina = next(p for p in candidates(b, FabricView(clean)) if p.algo == "ina")
    ring_more = model.comm_s(b, ring, lossy) - model.comm_s(b, ring, clean)
    ina_more = model.comm_s(b, ina, lossy) - model.comm_s(b, ina, clean)
    assert ring_more > 0.1 * model.comm_s(b, ring, clean) and 0 < ina_more < ring_more
    for order in ([a, b], [b, a]):
        policy = make_policy("cooperative", model)
        assert {p.algo for p in policy.plan(order, clean).values()} == {"ring"}
        plans = policy.plan(order, lossy)
        assert plans["b"].algo == "ina" and plans["a"].algo == "ring", plans
        # its price is the one with the loss
        assert plans["b"].predicted_comm_s > model.comm_s(b, plans["b"], clean)


def test_a_job_whose_workers_run_uet_gets_its_ring_sprayed_with_trimming_where_it_pays():
    """Trimming as a plan: a job that declares the UET-like transport gets its ring over UET
    on a two-spine fabric, where a TCP ring's cross-leaf flows each take one spine and UET's
    packets take both (priced with UET_MARGIN); the same job without the transport, or on one
    spine (nothing to spray over), keeps TCP; a job on a host twice or behind a switch that
    cannot trim is never offered it."""
    from testbed.collectives import flowmodel
    from testbed.provider.trimming import trim_ports

    two = make_topology("leaf_spine", leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100,
                        oversubscription=2.0, switch="programmable")
    m2 = PlanModel(two)
    hosts = ["tbh1", "tbh2", "tbh3", "tbh4"]

    def plan(topo, model, transports, policy="cooperative"):
        req = JobRequest(job="j", hosts=hosts, hints=Hints(
            collective_bytes=4 << 20, tolerance="exact", transports=transports))
        return FabricManager(inventory_of(topo, 0), make_policy(policy, model), model).admit(
            req, now=0.0), req

    uet, req = plan(two, m2, ["tcp", "uet"])
    tcp, _ = plan(two, m2, ["tcp"])
    assert (uet.algo, uet.transport, tcp.transport) == ("ring", "uet", "tcp")
    assert "trimming" in uet.reason
    from testbed.provider.ctl import _plan_text  # what `testbed provider jobs` shows

    assert _plan_text(uet.model_dump()) == "ring, over uet, ports trimming"
    assert _plan_text(tcp.model_dump()) == "ring"
    alone = m2.comm_s(req, tcp)
    raw = flowmodel.predict(two.describe(), m2._spec(req, uet, 4 << 20), workers=hosts).time_s
    assert uet.predicted_comm_s == pytest.approx(policies.UET_MARGIN * raw)
    assert uet.predicted_comm_s < 0.8 * alone  # the cross-leaf flows get both spines
    assert plan(two, m2, ["tcp", "uet"], "oracle")[0].transport == "uet"
    assert plan(two, m2, ["tcp", "uet"], "tenant_only")[0].transport == "tcp"
    one = make_topology("leaf_spine", leaves=2, spines=1, hosts_per_leaf=2, bw_mbps=100,
                        oversubscription=2.0, switch="programmable")
    assert plan(one, PlanModel(one), ["tcp", "uet"])[0].transport == "tcp"
    view = FabricView(inventory_of(two, 0))
    twice = JobRequest(job="t", hosts=["tbh1", "tbh1", "tbh3"],
                       hints=Hints(transports=["tcp", "uet"]))
    assert not any(c.transport == "uet" for c in candidates(twice, view))
    bridged = make_topology("leaf_spine", leaves=2, spines=2, hosts_per_leaf=2, bw_mbps=100,
                            switch="bridge")
    assert not FabricView(inventory_of(bridged, 0)).can_trim(hosts)
    with pytest.raises(ValueError, match="every job's workers run TCP"):
        Hints(transports=["uet"])
    # the ports that trim: every path of the ring's messages one way and of its ACKs the
    # other, at every switch, host-facing ports marked as UET's last hop
    ports = trim_ports(two, hosts)
    assert sorted(ports) == ["tbl1", "tbl2", "tbsp1", "tbsp2"]
    assert ports["tbl1"] == {"tbl1-eth1": True, "tbl1-eth2": True, "tbl1-eth3": False,
                             "tbl1-eth4": False}
    assert trim_ports(two, ["tbh1", "tbh2"]) == {"tbl1": {"tbl1-eth1": True,
                                                          "tbl1-eth2": True}}
    # a job that tolerates compression: its compressed rings are offered over UET as well,
    # sprayed alike, and the best of them is chosen over the same ring on TCP
    lossy = JobRequest(job="c", hosts=hosts, hints=Hints(
        collective_bytes=4 << 20, tolerance="lossy", transports=["tcp", "uet"]))
    offered = candidates(lossy, view)
    for c in (c for c in offered if c.compressor and c.transport == "tcp"):
        assert any(u.transport == "uet" and (u.compressor, u.compressor_params)
                   == (c.compressor, c.compressor_params) for u in offered), c
        over = next(u for u in offered if u.transport == "uet" and u.compressor ==
                    c.compressor and u.compressor_params == c.compressor_params)
        assert m2.comm_s(lossy, over) < 0.8 * m2.comm_s(lossy, c)
    best = FabricManager(inventory_of(two, 0), make_policy("cooperative", m2), m2).admit(
        lossy, now=0.0)
    assert best.compressor is not None and best.transport == "uet", best
    assert _plan_text(best.model_dump()).endswith("over uet, ports trimming")
    assert not any(c.transport == "uet" for c in candidates(
        lossy.model_copy(update={"hints": lossy.hints.model_copy(
            update={"transports": ("tcp",)})}), view))


def test_queue_drops_telemetry_shows_move_a_uet_capable_ring_onto_trimming_ports():
    """Congestion that drops packets (``LinkState.drop_rate`` at a queue) is priced as loss:
    a TCP ring through it stalls on its recoveries, a UET ring through ports that trim does
    not (its packets are cut and resent within a round trip). On one spine, where spraying
    gains nothing, a UET-capable job keeps TCP on a quiet fabric and moves to UET with
    trimming once the spine's queues drop a few packets in a thousand; a TCP-only job's ring
    is priced slower there."""
    one = make_topology("leaf_spine", leaves=2, spines=1, hosts_per_leaf=2, bw_mbps=100,
                        oversubscription=2.0, switch="programmable")
    m = PlanModel(one)
    inv = inventory_of(one, 0)
    hosts = ["tbh1", "tbh2", "tbh3", "tbh4"]

    def plan(rate, transports):
        links = [lk.model_copy(update={"drop_rate": rate if "tbsp1" in (lk.src, lk.dst)
                                       else 0.0}) for lk in inv.links]
        req = JobRequest(job="j", hosts=hosts, hints=Hints(
            collective_bytes=4 << 20, tolerance="exact", transports=transports))
        return make_policy("cooperative", m).plan(
            [req], inv.model_copy(update={"links": links}))["j"]

    quiet, dropping = plan(0.0, ["tcp", "uet"]), plan(0.005, ["tcp", "uet"])
    assert (quiet.transport, dropping.transport) == ("tcp", "uet")
    assert dropping.predicted_comm_s == pytest.approx(quiet.predicted_comm_s
                                                      * policies.UET_MARGIN, rel=0.02)
    tcp_quiet, tcp_dropping = plan(0.0, ["tcp"]), plan(0.005, ["tcp"])
    assert tcp_dropping.transport == "tcp"
    assert tcp_dropping.predicted_comm_s > 1.25 * tcp_quiet.predicted_comm_s
    # below MIN_DROP_RATE a drop is noise: nothing priced
    assert plan(policies.MIN_DROP_RATE / 2, ["tcp"]).predicted_comm_s == pytest.approx(
        tcp_quiet.predicted_comm_s)
