"""Hints checked against telemetry, and per-tenant quotas.

A job that reports its iterations is judged on what its hosts' uplinks carried per iteration
against what the model expects of its declared bytes under its plan: within the factor it is
"consistent"; beyond it, "misreported", re-planned on the observed bytes with priority 0, and
the change is logged with why. Quotas refuse (403) a tenant's extra job or a priority above
its own, and move a tenant's jobs beyond its switch memory or tree quota to the hosts.
"""

from __future__ import annotations

import pytest

from testbed.provider.client import ProviderClient, ProviderRefused
from testbed.provider.manager import (
    APPLY_AFTER_ITERATIONS,
    CHECK_ITERATIONS,
    HINT_FACTOR,
    FabricManager,
    ProviderError,
    Quota,
    QuotaExceeded,
    inventory_of,
)
from testbed.provider.policies import PlanModel, plan_memory
from testbed.provider.schema import FabricSnapshot, Hints, JobRequest, LinkState, Plan
from testbed.provider.service import Server, make_service
from testbed.topologies import Star

TOPO = Star(6, bw_mbps=100, switch="programmable", aggregator="tbs1")
ONE_INA = plan_memory(Plan(job="x", algo="ina", tree=["tbs1"], slots=32), 3)["tbs1"]


def _req(job, hosts, tenant=None, **hints) -> JobRequest:
    return JobRequest(job=job, hosts=hosts, tenant=tenant, hints=Hints(**hints), lease_s=600)


class Uplinks:
    """Telemetry of the hosts' uplinks: each job's hosts send, per iteration, ``factor`` times
    what the model expects of ``true_bytes`` under the job's current plan."""

    def __init__(self, manager: FabricManager):
        self.m = manager
        self.sent = dict.fromkeys(manager.inventory.hosts, 0)

    def iterate(self, job: str, true_bytes: int, iteration: int) -> None:
        req = JobRequest(job=job, hosts=self.m.jobs()[job]["hosts"])
        for h, b in self.m.model.sent_bytes(req, self.m.plans()[job], true_bytes).items():
            self.sent[h] += int(b)
        self.m.renew(job, iteration=iteration)

    def snapshot(self) -> FabricSnapshot:
        links = [LinkState(src=h, dst="tbs1", rate_mbps=100, bytes=b)
                 for h, b in self.sent.items()]
        return self.m.inventory.model_copy(update={"links": links})


def test_a_job_overstating_its_traffic_and_priority_is_replanned_on_what_it_sends():
    model = PlanModel(TOPO)
    m = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    honest, cheat = 4 << 20, 1 << 20  # true bytes per iteration
    m.admit(_req("cheat", ["tbh1", "tbh2", "tbh3"], collective_bytes=10 * cheat, priority=7,
                 iterations=100, tolerance="exact"), now=0)
    m.admit(_req("honest", ["tbh4", "tbh5", "tbh6"], collective_bytes=honest, iterations=100,
                 tolerance="exact"), now=0)
    assert m.plans()["cheat"].algo == "ina" and m.plans()["honest"].algo == "ring"
    tel = Uplinks(m)
    for it in range(CHECK_ITERATIONS + 1):
        m.observe(tel.snapshot(), now=it)
        tel.iterate("cheat", cheat, it)
        tel.iterate("honest", honest, it)
    changed = m.observe(tel.snapshot(), now=100)
    jobs = m.jobs()
    assert jobs["cheat"]["hints_check"]["verdict"] == "misreported"
    assert jobs["cheat"]["hints_check"]["ratio"] == pytest.approx(0.1, rel=0.05)
    assert jobs["cheat"]["planned_hints"]["collective_bytes"] == pytest.approx(cheat, rel=0.05)
    assert jobs["cheat"]["planned_hints"]["priority"] == 0
    assert jobs["honest"]["hints_check"]["verdict"] == "consistent"
    assert jobs["honest"]["planned_hints"] == jobs["honest"]["hints"]
    # on the true figures the switch memory goes where it saves the most: the honest job
    assert set(changed) == {"cheat", "honest"}
    assert m.plans()["honest"].algo == "ina" and m.plans()["cheat"].algo == "ring"
    reason = m.log[-1].reason
    assert "hints disagree with telemetry" in reason and "cheat declared" in reason
    # judged once: nothing more happens on later snapshots
    tel.iterate("cheat", cheat, 100)
    assert m.observe(tel.snapshot(), now=101) == []
    # the verdict survives a restart of the provider
    again = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    again.restore(m.state())
    assert again.jobs()["cheat"]["hints_check"] == jobs["cheat"]["hints_check"]
    assert again.plans() == m.plans()


def _run_until_judged(m: FabricManager, tel: Uplinks, jobs: dict[str, int], first_it: int,
                      now: float) -> list[str]:
    """Report iterations of ``jobs`` (name -> true bytes per iteration), reading the counters
    at each report, until each is judged; returns every job whose plan changed."""
    changed, it = [], first_it
    while any(m.jobs()[j]["hints_check"] is None for j in jobs):
        for j, b in jobs.items():
            tel.iterate(j, b, it)
        changed += m.check_hints(tel.sent, now=now + it / 100)
        it += 1
        assert it < first_it + 3 * CHECK_ITERATIONS
    return changed


def test_on_probation_no_unchecked_claim_takes_switch_memory_from_another_job():
    """Where hints are judged (``probation=True``), a job's claims rank it for static memory
    only once telemetry confirmed them: until then memory goes in admission order and its
    priority counts as 0. So a tenant that lies gets nothing its lie claimed, and an honest
    job beside it gets the memory when its own figures are confirmed, as beside an honest
    twin of the liar."""
    model = PlanModel(TOPO)
    small, big = 256 << 10, 4 << 20  # true bytes per iteration
    # without probation the claims rank at once: the big job takes the memory on arrival
    m0 = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    m0.admit(_req("small", ["tbh1", "tbh2", "tbh3"], collective_bytes=small, iterations=100,
                  tolerance="exact"), now=0)
    m0.admit(_req("big", ["tbh4", "tbh5", "tbh6"], collective_bytes=big, iterations=100,
                  tolerance="exact"), now=0)
    assert m0.plans()["big"].algo == "ina" and m0.plans()["small"].algo == "ring"
    for liar in (False, True):
        m = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model, probation=True)
        m.admit(_req("small", ["tbh1", "tbh2", "tbh3"], iterations=100, tolerance="exact",
                     collective_bytes=small * (40 if liar else 1), priority=7 if liar else 0),
                now=0)
        m.admit(_req("big", ["tbh4", "tbh5", "tbh6"], collective_bytes=big, iterations=100,
                     tolerance="exact"), now=0)
        assert m.unverified() == ["small", "big"]
        # first come, first served: the claims of either rank nothing yet
        assert m.plans()["small"].algo == "ina" and m.plans()["big"].algo == "ring"
        tel = Uplinks(m)
        # the small job is judged first (the big one reports nothing yet): judged or caught,
        # it keeps the memory, which no unchecked claim takes from it
        _run_until_judged(m, tel, {"small": small}, 0, 0.0)
        assert m.jobs()["small"]["hints_check"]["verdict"] == (
            "misreported" if liar else "consistent")
        assert m.unverified() == ["big"]
        assert m.plans()["small"].algo == "ina" and m.plans()["big"].algo == "ring"
        # once the big job's figures are confirmed they rank: the memory goes where it saves
        # the most, logged with why
        changed = _run_until_judged(m, tel, {"big": big, "small": small}, CHECK_ITERATIONS + 2,
                                    1.0)
        assert m.jobs()["big"]["hints_check"]["verdict"] == "consistent"
        assert set(changed) == {"small", "big"} and m.unverified() == []
        assert m.plans()["big"].algo == "ina" and m.plans()["small"].algo == "ring"
        assert "hints confirmed by telemetry: big" in m.log[-1].reason
    # a priority claim on probation counts as 0: the job admitted first keeps the memory
    m = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model, probation=True)
    m.admit(_req("big", ["tbh4", "tbh5", "tbh6"], collective_bytes=big, iterations=100,
                 tolerance="exact"), now=0)
    m.admit(_req("loud", ["tbh1", "tbh2", "tbh3"], collective_bytes=big, iterations=100,
                 tolerance="exact", priority=7), now=0)
    assert m.plans()["big"].algo == "ina" and m.plans()["loud"].algo == "ring"
    # nor does an earlier job's claim, made once a later one holds the memory
    m = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model, probation=True)
    m.admit(_req("early", ["tbh1", "tbh2", "tbh3"], iterations=100, tolerance="exact"), now=0)
    m.admit(_req("later", ["tbh4", "tbh5", "tbh6"], collective_bytes=small, iterations=100,
                 tolerance="exact"), now=0)
    assert m.plans()["later"].algo == "ina" and m.plans()["early"].algo == "ring"
    m.update_hints("early", {"collective_bytes": big}, "measured", now=1)
    assert m.unverified() == ["later", "early"]
    assert m.plans()["later"].algo == "ina" and m.plans()["early"].algo == "ring"


def test_hints_within_the_factor_and_unchecked_jobs_are_left_alone():
    m = FabricManager(inventory_of(TOPO, 1 << 20), "cooperative", PlanModel(TOPO))
    m.admit(_req("a", ["tbh1", "tbh2"], collective_bytes=1 << 20), now=0)
    m.admit(_req("quiet", ["tbh3", "tbh4"], collective_bytes=1 << 20), now=0)  # no reports
    m.admit(_req("nohints", ["tbh5", "tbh6"]), now=0)
    tel = Uplinks(m)
    for it in range(CHECK_ITERATIONS + 2):
        m.observe(tel.snapshot(), now=it)
        tel.iterate("a", int((1 << 20) * HINT_FACTOR * 0.9), it)
        m.renew("nohints", iteration=it)
    m.observe(tel.snapshot(), now=100)
    jobs = m.jobs()
    assert jobs["a"]["hints_check"]["verdict"] == "consistent"
    assert jobs["quiet"]["hints_check"] is None and jobs["nohints"]["hints_check"] is None


def test_hints_are_judged_at_iteration_reports_and_the_count_restarts_with_a_new_plan():
    """Counters read as the iterations are reported judge a job after CHECK_ITERATIONS of
    its own iterations, whatever the snapshot period; bytes sent under an earlier plan, or
    before the iteration a new plan applies at, never enter the judgment."""
    model = PlanModel(TOPO)
    m = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    cheat = 1 << 20
    m.admit(_req("cheat", ["tbh1", "tbh2", "tbh3"], collective_bytes=10 * cheat, priority=7,
                 iterations=100, tolerance="exact"), now=0)
    assert m.hints_pending() == {}  # no iteration reported yet
    tel = Uplinks(m)
    tel.iterate("cheat", cheat, 0)
    assert m.hints_pending() == {"cheat": ["tbh1", "tbh2", "tbh3"]}
    # the plan it was admitted with is its plan from the start: the first report is the
    # baseline, and CHECK_ITERATIONS - 1 iterations later it is one short
    for it in range(0, CHECK_ITERATIONS):
        if it:
            tel.iterate("cheat", cheat, it)
        assert m.check_hints(tel.sent, now=0.1 + it / 100) == []
    assert m.jobs()["cheat"]["hints_check"] is None
    it0 = CHECK_ITERATIONS - 1
    # a plan change (a job of higher priority takes the switch memory) restarts the count,
    # from the iteration it applies at; the old plan's iterations are not the new plan's
    m.admit(_req("big", ["tbh4", "tbh5", "tbh6"], collective_bytes=40 << 20, priority=7,
                 iterations=100, tolerance="exact"), now=0.2)
    version, start = m.plan_version("cheat"), m.applies_at("cheat")
    assert version == 2 and start == it0 + APPLY_AFTER_ITERATIONS and \
        m.plans()["cheat"].algo == "ring"
    it = it0
    while it < start + CHECK_ITERATIONS - 1:  # the baseline at start, then one short
        it += 1
        for h in ("tbh1", "tbh2", "tbh3"):
            tel.sent[h] += 50 * cheat if it < start else 0  # wildly off under the old plan
        tel.iterate("cheat", cheat, it)
        assert m.check_hints(tel.sent, now=0.3 + it / 100) == []
    assert m.jobs()["cheat"]["hints_check"] is None and m.plan_version("cheat") == version
    tel.iterate("cheat", cheat, it + 1)
    m.check_hints(tel.sent, now=1.0)
    check = m.jobs()["cheat"]["hints_check"]
    assert check["verdict"] == "misreported" and check["ratio"] == pytest.approx(0.1, rel=0.05)
    assert check["iterations"] == CHECK_ITERATIONS
    assert m.jobs()["cheat"]["planned_hints"]["priority"] == 0
    assert m.hints_pending() == {}  # judged once
    # a plan changed before the job reported any iteration is in force from
    # APPLY_AFTER_ITERATIONS after its first report: the iterations before are not judged
    m3 = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    m3.admit(_req("cheat", ["tbh1", "tbh2", "tbh3"], collective_bytes=10 * cheat, priority=7,
                  iterations=100, tolerance="exact"), now=0)
    m3.admit(_req("big", ["tbh4", "tbh5", "tbh6"], collective_bytes=40 << 20, priority=7,
                  iterations=100, tolerance="exact"), now=0)
    assert m3.plan_version("cheat") == 2 and m3.applies_at("cheat") is None
    tel3 = Uplinks(m3)
    last = APPLY_AFTER_ITERATIONS + CHECK_ITERATIONS
    for it in range(last):
        tel3.iterate("cheat", cheat, it)
        if it < APPLY_AFTER_ITERATIONS:  # the old plan's iterations: wildly off
            for h in ("tbh1", "tbh2", "tbh3"):
                tel3.sent[h] += 50 * cheat
        m3.check_hints(tel3.sent, now=it)
    assert m3.jobs()["cheat"]["hints_check"] is None
    tel3.iterate("cheat", cheat, last)
    m3.check_hints(tel3.sent, now=last)
    assert m3.jobs()["cheat"]["hints_check"]["ratio"] == pytest.approx(0.1, rel=0.05)
    # a job that says which plan version its workers run (renew running=V) is judged on
    # that version's iterations only, however long its move to a new plan takes
    m4 = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    m4.admit(_req("cheat", ["tbh1", "tbh2", "tbh3"], collective_bytes=10 * cheat, priority=7,
                  iterations=100, tolerance="exact"), now=0)
    m4.renew("cheat", now=0, running=1)
    m4.admit(_req("big", ["tbh4", "tbh5", "tbh6"], collective_bytes=40 << 20, priority=7,
                  iterations=100, tolerance="exact"), now=0)
    with pytest.raises(ProviderError, match="running=3"):
        m4.renew("cheat", now=0, running=3)
    tel4 = Uplinks(m4)
    for it in range(3 * CHECK_ITERATIONS):  # still on version 1: wildly off, not judged
        for h in ("tbh1", "tbh2", "tbh3"):
            tel4.sent[h] += 50 * cheat
        m4.renew("cheat", now=it, iteration=it)
        m4.check_hints(tel4.sent, now=it)
    assert m4.jobs()["cheat"]["hints_check"] is None
    m4.renew("cheat", now=50, running=2)
    for it in range(3 * CHECK_ITERATIONS, 4 * CHECK_ITERATIONS + 1):
        tel4.iterate("cheat", cheat, it)
        m4.check_hints(tel4.sent, now=it)
    check = m4.jobs()["cheat"]["hints_check"]
    assert check["iterations"] == CHECK_ITERATIONS
    assert check["ratio"] == pytest.approx(0.1, rel=0.05)
    # a host whose uplink cannot be read leaves the job unjudged
    m2 = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    m2.admit(_req("x", ["tbh1", "tbh2"], collective_bytes=cheat), now=0)
    for it in range(APPLY_AFTER_ITERATIONS + CHECK_ITERATIONS + 2):
        m2.renew("x", now=it, iteration=it)
        m2.check_hints({"tbh1": 10 ** 9 * it}, now=it)
    assert m2.jobs()["x"]["hints_check"] is None


def test_tenant_quotas_refuse_or_move_to_the_hosts():
    quotas = {"acme": Quota(jobs=1, priority=3), "*": Quota(trees_per_switch=1),
              "small": {"memory_bytes": ONE_INA // 2}}
    m = FabricManager(inventory_of(TOPO, 1 << 24), "provider_only", PlanModel(TOPO), quotas)
    with pytest.raises(QuotaExceeded, match="priority 5 is above tenant 'acme'"):
        m.admit(_req("a1", ["tbh1", "tbh2"], tenant="acme", priority=5))
    m.admit(_req("a1", ["tbh1", "tbh2"], tenant="acme", priority=3))
    with pytest.raises(QuotaExceeded, match=r"tenant 'acme' holds 1 job\(s\) \['a1'\]"):
        m.admit(_req("a2", ["tbh3", "tbh4"], tenant="acme"))
    assert set(m.jobs()) == {"a1"} and QuotaExceeded.status == 403
    # "*": one tree per switch per tenant; the tenant's second job runs on the hosts
    m.admit(_req("b1", ["tbh3", "tbh4"], tenant="bee"))
    m.admit(_req("b2", ["tbh5", "tbh6"], tenant="bee"))
    plans = m.plans()
    assert plans["a1"].algo == "ina" and plans["b1"].algo == "ina"
    assert plans["b2"].algo == "ring" and "tenant 'bee' quota" in plans["b2"].reason
    t = m.tenants()
    assert t["bee"]["jobs"] == ["b1", "b2"] and t["bee"]["trees_per_switch"] == {"tbs1": 1}
    assert t["acme"]["quota"]["jobs"] == 1
    m.release("b1")  # b2 may have the tree now
    assert m.plans()["b2"].algo == "ina"
    m.release("a1")
    m.admit(_req("s1", ["tbh1", "tbh2"], tenant="small"))
    assert m.plans()["s1"].algo == "ring" and "B > its" in m.plans()["s1"].reason
    with pytest.raises(ValueError, match="memory_bytes"):
        Quota(memory_bytes=-1)


def test_quotas_over_http(tmp_path):
    svc = make_service(TOPO, 1 << 24, policy="provider_only",
                       quotas={"acme": {"jobs": 1}})
    with Server(svc, socket_path=str(tmp_path / "p.sock")) as srv, \
            ProviderClient(srv.url) as pc:
        pc.admit(_req("a1", ["tbh1", "tbh2"], tenant="acme"))
        with pytest.raises(ProviderRefused, match="403") as e:
            pc.admit(_req("a2", ["tbh3", "tbh4"], tenant="acme"))
        assert "release one first" in e.value.detail
        assert pc.tenants()["acme"]["jobs"] == ["a1"]
        assert pc.jobs()["a1"]["tenant"] == "acme"


def test_quotas_file_errors_name_the_tenant(tmp_path):
    from testbed.provider.ctl import load_quotas

    good = tmp_path / "q.toml"
    good.write_text('[acme]\njobs = 2\npriority = 3\n["*"]\ntrees_per_switch = 1\n')
    assert load_quotas(str(good)) == {"acme": Quota(jobs=2, priority=3),
                                      "*": Quota(trees_per_switch=1)}
    bad = tmp_path / "b.toml"
    bad.write_text("[acme]\njobz = 2\n")
    with pytest.raises(ValueError, match="tenant 'acme'"):
        load_quotas(str(bad))
    bad.write_text("[acme]\njobs = -2\n")
    with pytest.raises(ValueError, match="jobs must be an integer >= 0"):
        load_quotas(str(bad))


@pytest.mark.mininet
def test_hints_checked_against_a_running_fabric(tmp_path):
    """On a real network: two ring jobs allreduce 1 MiB per iteration and report their
    iterations in HTTP renews; at those reports the service reads their hosts' uplink
    counters from the engines: the one that declared 1 MiB is found consistent, the one
    that declared 10 MiB misreported at about a tenth. The counters
    read at a report are those a telemetry snapshot shows."""
    from testbed.collectives.runner import run_collective
    from testbed.collectives.spec import CollectiveSpec
    from testbed.provider.manager import uplink_bytes
    from testbed.provider.policies import FabricView
    from testbed.topologies.net import TestbedNet

    true_bytes, reps = 1 << 20, CHECK_ITERATIONS
    with TestbedNet(Star(6, bw_mbps=100, switch="programmable", aggregator="tbs1")) as net, \
            Server(svc := make_service(net, 1 << 20, policy="tenant_only", net=net,
                                       telemetry_period_s=3600),  # no snapshot judges
                   socket_path=str(tmp_path / "p.sock")) as srv, \
            ProviderClient(srv.url) as pc:
        jobs_hosts = {"honest": [0, 1, 2], "cheat": [3, 4, 5]}
        for job, hosts in jobs_hosts.items():
            names = [net.topo.host_names[h] for h in hosts]
            pc.admit(_req(job, names,
                          collective_bytes=true_bytes * (10 if job == "cheat" else 1)))
            pc.renew(job, iteration=0)  # the baseline: its counters read now
        assert all(j["hints_check"] is None for j in pc.jobs().values())
        for job, hosts in jobs_hosts.items():
            rows = run_collective(net, CollectiveSpec(algo="ring", nbytes=true_bytes,
                                                      hosts=hosts, repetitions=reps))
            assert all(r["correct"] for r in rows), rows
            pc.renew(job, iteration=reps)
        jobs = pc.jobs()
        names = [net.topo.host_names[h] for h in range(6)]
        snap = uplink_bytes(svc.telemetry.collect(), FabricView(svc.manager.inventory))
        assert svc.telemetry.uplink_bytes(names) == {h: snap[h] for h in names}
    honest, cheat = jobs["honest"]["hints_check"], jobs["cheat"]["hints_check"]
    print(f"observed/expected: honest {honest['ratio']}, cheat {cheat['ratio']}")
    assert honest["verdict"] == "consistent", honest
    assert cheat["verdict"] == "misreported" and cheat["ratio"] < 1 / HINT_FACTOR, cheat
    assert 0.7 < honest["ratio"] < 1.5 and 0.07 < cheat["ratio"] < 0.15, (honest, cheat)
    assert jobs["cheat"]["planned_hints"]["priority"] == 0
    assert cheat["iterations"] == honest["iterations"] == reps  # judged at the reports


def test_hints_derived_while_a_job_runs_re_plan_it_and_bad_ones_are_refused():
    """A job admitted with its tolerance only gets the ring (nothing shows that switch memory
    pays); the bytes its launcher measured move it to INA, logged with the reason given. A
    hint the schema refuses changes nothing."""
    m = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", PlanModel(TOPO))
    m.admit(_req("job", ["tbh1", "tbh2", "tbh3"], tolerance="exact"), now=0)
    assert m.plans()["job"].algo == "ring" and m.plan_version("job") == 1
    with pytest.raises(ProviderError, match="collective_bytes"):
        m.update_hints("job", {"collective_bytes": -5}, "measured", now=1)
    assert m.jobs()["job"]["hints"]["collective_bytes"] is None
    assert m.update_hints("job", {"collective_bytes": 4 << 20, "iteration_s": 0.2},
                          "measured by its launcher", now=2) == ["job"]
    assert m.plans()["job"].algo == "ina" and m.plan_version("job") == 2
    assert m.jobs()["job"]["hints"]["tolerance"] == "exact"  # the stated hints stay
    assert m.log[-1].reason.startswith("measured by its launcher: ")
    with pytest.raises(ProviderError, match="no admitted job"):
        m.update_hints("gone", {"collective_bytes": 1}, "measured")
