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
    changed = m.observe(tel.snapshot(), now=10)
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
    tel.iterate("cheat", cheat, 10)
    assert m.observe(tel.snapshot(), now=11) == []
    # the verdict survives a restart of the provider
    again = FabricManager(inventory_of(TOPO, ONE_INA), "cooperative", model)
    again.restore(m.state())
    assert again.jobs()["cheat"]["hints_check"] == jobs["cheat"]["hints_check"]
    assert again.plans() == m.plans()


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
    m.observe(tel.snapshot(), now=10)
    jobs = m.jobs()
    assert jobs["a"]["hints_check"]["verdict"] == "consistent"
    assert jobs["quiet"]["hints_check"] is None and jobs["nohints"]["hints_check"] is None


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
    """On a real network: two ring jobs allreduce 1 MiB per iteration; the one that declared
    1 MiB is found consistent from the engines' port counters, the one that declared 10 MiB
    is found misreported at about a tenth, and the log says why."""
    from testbed.collectives.runner import run_collective
    from testbed.collectives.spec import CollectiveSpec
    from testbed.topologies.net import TestbedNet

    true_bytes, reps = 1 << 20, CHECK_ITERATIONS + 1
    with TestbedNet(Star(6, bw_mbps=100, switch="programmable", aggregator="tbs1")) as net:
        svc = make_service(net, 1 << 20, policy="tenant_only", net=net)
        try:
            for job, hosts, declared in (("honest", [0, 1, 2], true_bytes),
                                         ("cheat", [3, 4, 5], 10 * true_bytes)):
                names = [net.topo.host_names[h] for h in hosts]
                svc.call(lambda m, now, j=job, n=names, d=declared: m.admit(
                    _req(j, n, collective_bytes=d), now))
                svc.call(lambda m, now, j=job: m.renew(j, now, iteration=0))
            svc.observe()  # the baselines
            svc.observe()
            for job, hosts, _declared in (("honest", [0, 1, 2], 0), ("cheat", [3, 4, 5], 0)):
                rows = run_collective(net, CollectiveSpec(algo="ring", nbytes=true_bytes,
                                                          hosts=hosts, repetitions=reps))
                assert all(r["correct"] for r in rows), rows
                svc.call(lambda m, now, j=job: m.renew(j, now, iteration=reps))
            svc.observe()
            jobs = svc.call(lambda m, now: m.jobs())
        finally:
            svc.stop()
    honest, cheat = jobs["honest"]["hints_check"], jobs["cheat"]["hints_check"]
    print(f"observed/expected: honest {honest['ratio']}, cheat {cheat['ratio']}")
    assert honest["verdict"] == "consistent", honest
    assert cheat["verdict"] == "misreported" and cheat["ratio"] < 1 / HINT_FACTOR, cheat
    assert 0.7 < honest["ratio"] < 1.5 and 0.07 < cheat["ratio"] < 0.15, (honest, cheat)
    assert jobs["cheat"]["planned_hints"]["priority"] == 0


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
