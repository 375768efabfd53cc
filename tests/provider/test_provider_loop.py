"""The provider's loop around running jobs: collectives that run on the switch registration
the provider made (not their own), the re-plan reasons the co-operation rows count, and
telemetry measured against dilated link rates. (Plans applied mid-job: the training pool's
plan-change test and the co-operation experiment's Mininet test.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from testbed.collectives.runner import adopt_registration, run_collective
from testbed.collectives.spec import CollectiveSpec
from testbed.experiment.cooperation import replan_reasons
from testbed.provider.manager import PlanChange
from testbed.provider.schema import Hints, JobRequest, Plan
from testbed.provider.service import Telemetry, make_service
from testbed.topologies import Star

MEMORY = 1 << 20


def _registration(job_id: int = 1000) -> dict:
    agg = {"ip": "10.0.0.254", "mac": "00:00:00:00:00:fe", "switch": "tbs1", "port": 9000,
           "fallback_ips": []}
    return {"job_id": job_id, "tree": ["tbs1"], "seq0": 7, "fallbacks": [], "slots": 8,
            "mode": "static", "lanes": None,
            "ranks": [{"host": f"tbh{i + 1}", "port": 21000, "member": i, "aggregator": agg}
                      for i in range(2)]}


@pytest.mark.parametrize("change, words", [
    ({"job_id": 5}, "set CollectiveSpec.job_id"),
    ({"hosts": ["tbh2", "tbh1"]}, "registered hosts"),
    ({"placement": {"tree": ["tbs1"], "slots": 16}}, "at most 8"),
    ({"algo": "ring"}, "needs none"),
])
def test_a_registration_that_does_not_fit_is_refused(change, words):
    spec = CollectiveSpec(algo=change.get("algo", "ina"), nbytes=1 << 16,
                          job_id=change.get("job_id", 1000),
                          placement=change.get("placement", {"tree": ["tbs1"], "slots": 8})
                          if change.get("algo", "ina") == "ina" else {})
    workers = [SimpleNamespace(name=h) for h in change.get("hosts", ["tbh1", "tbh2"])]
    job = {"ranks": [{"host": w.name} for w in workers]}
    with pytest.raises(ValueError, match=words):
        adopt_registration(spec, job, workers, _registration())
    assert "seq0" not in job  # nothing filled in


def test_adopted_registration_fills_the_pool_job():
    spec = CollectiveSpec(algo="ina", nbytes=1 << 16, job_id=1000,
                          placement={"tree": ["tbs1"], "slots": 8})
    workers = [SimpleNamespace(name=h) for h in ("tbh1", "tbh2")]
    job = {"ranks": [{"host": w.name, "ip": f"10.0.0.{i + 1}"} for i, w in enumerate(workers)]}
    adopt_registration(spec, job, workers, _registration())
    assert (job["seq0"], job["tree"], job["fallbacks"]) == (7, ["tbs1"], [])
    assert [(r["port"], r["member"], r["aggregator"]["switch"]) for r in job["ranks"]] == [
        (21000, 0, "tbs1"), (21000, 1, "tbs1")]


def test_replans_are_counted_by_reason():
    p = Plan(job="a")
    log = [PlanChange(0, "a", None, p, "admitted: x"),
           PlanChange(1, "a", p, p, "re-plan on arrival of b: y"),
           PlanChange(2, "a", p, p, "re-plan on departure of b: y"),
           PlanChange(3, "a", p, p, "sustained congestion on s1->s2 (3 snapshots): y"),
           PlanChange(4, "a", p, p, "sustained congestion on s1->s2 (3 snapshots): y")]
    assert replan_reasons(log[1:]) == {"arrival": 1, "departure": 1, "hints": 0, "congestion": 2,
                                       "other": 0}
    # one snapshot judged a job's hints (two liars, "; " between them) and found congestion:
    # the re-plan counts under both causes (it counted as hints only, and a congestion test
    # that met the two together failed)
    both = PlanChange(5, "a", p, p, "hints disagree with telemetry: b declared 1 B, observed 9 "
                      "B; c declared 2 B, observed 9 B; sustained congestion on s1->s2 (3 "
                      "snapshots): y")
    assert replan_reasons([both]) == {"arrival": 0, "departure": 0, "hints": 1, "congestion": 1,
                                      "other": 0}
    odd = PlanChange(6, "a", p, p, "operator: moved by hand")
    assert replan_reasons([odd])["other"] == 1


def test_telemetry_refuses_a_bad_dilation():
    desc = Star(2, bw_mbps=100, switch="programmable").describe()
    with pytest.raises(ValueError, match="time_dilation"):
        Telemetry(desc, {"tbs1": MEMORY}, time_dilation=0.5)


@pytest.mark.mininet
def test_collective_runs_on_the_providers_registration():
    """The service registers an INA job on the switch; the collective runner adopts that
    registration (no registration of its own), the sums are exact, and the job stays on the
    switch until the provider removes it."""
    from testbed.topologies.net import TestbedNet

    with TestbedNet(Star(2, bw_mbps=100, switch="programmable", aggregator="tbs1")) as net:
        svc = make_service(net, MEMORY, policy="provider_only", net=net)
        try:
            req = JobRequest(job="t", hosts=["tbh1", "tbh2"],
                             hints=Hints(collective_bytes=64 << 10), lease_s=600)
            plan = svc.call(lambda m, now: m.admit(req, now))
            assert plan.algo == "ina", plan
            reg = svc.switches.registrations["t"]
            spec = CollectiveSpec(algo="ina", nbytes=64 << 10, job_id=reg["job_id"],
                                  repetitions=2, placement={"tree": plan.tree,
                                                            "slots": reg["slots"],
                                                            "mode": plan.mode})
            sw = net.mininet.get("tbs1").client()
            before = sw.counters()["stages"]["aggregate"]["jobs"][str(reg["job_id"])]
            rows = run_collective(net, spec, registration=reg)
            assert len(rows) == 2 and all(r["correct"] for r in rows), rows
            jobs = sw.counters()["stages"]["aggregate"]["jobs"]
            assert set(jobs) == {str(reg["job_id"])}  # the provider's, still there
            after = jobs[str(reg["job_id"])]
            assert after["memory_bytes"] == before["memory_bytes"] > 0
        finally:
            svc.stop()
        assert sw.counters()["stages"]["aggregate"]["jobs"] == {}


@pytest.mark.mininet
def test_a_job_that_reports_its_plan_keeps_the_old_registration_until_it_left_it(tmp_path):
    """A job whose tenant reports the plan version its workers run (``renew?running=V``, as
    ``testbed launch --provider`` does) keeps its INA registration through a plan change
    until they run the new plan (they may be inside a collective of the old one), also
    through a restart of the provider from its journal; a job id let go is not the next one
    given."""
    from testbed.provider.client import ProviderClient, ProviderRefused
    from testbed.provider.service import Server
    from testbed.topologies.net import TestbedNet

    hosts = [f"tbh{i}" for i in range(1, 7)]
    with TestbedNet(Star(6, bw_mbps=100, switch="programmable", aggregator="tbs1")) as net:
        sw = net.mininet.get("tbs1").client()

        def held() -> set[int]:
            return {int(j) for j in sw.counters()["stages"]["aggregate"]["jobs"]}

        # memory for one INA job and no plans on the shared pool: a bigger job's arrival
        # moves the first to the ring (hints on trust: its claim ranks before any judgment)
        journal = tmp_path / "provider.db"
        svc = make_service(net, 70_000, policy="cooperative_static", net=net, journal=journal,
                           probation=False)
        with Server(svc, socket_path=str(tmp_path / "p.sock")) as srv, \
                ProviderClient(srv.url) as pc:
            def admit(job, on, nbytes):
                return pc.admit(JobRequest(job=job, hosts=on, lease_s=600,
                                           hints=Hints(collective_bytes=nbytes)))

            assert admit("a", hosts[:3], 200_000).algo == "ina"
            first = pc.job("a")["registration"]
            assert first["version"] == 1 and held() == {first["job_id"]}
            pc.renew("a", running=1)
            with pytest.raises(ProviderRefused, match="running=9"):
                pc.renew("a", running=9)
            assert admit("b", hosts[3:], 2_000_000).algo == "ina"
            a, b = pc.job("a"), pc.job("b")
            assert a["plan"]["algo"] == "ring" and a["registration"] is None
            # a's workers have not said they left its INA plan: it stays on the switch
            assert a["retiring"] == [first["job_id"]]
            assert held() == {first["job_id"], b["registration"]["job_id"]}
        # the provider stops (as a kill would: its journal has every change) and starts
        # again from its journal: a's old registration is still one its workers may use
        svc.stop()
        svc = make_service(net, 70_000, policy="cooperative_static", net=net, journal=journal,
                           probation=False)
        assert svc.resumed["retiring"] == [["a", first["job_id"]]], svc.resumed
        assert held() == {first["job_id"], b["registration"]["job_id"]}
        with Server(svc, socket_path=str(tmp_path / "p.sock")) as srv, \
                ProviderClient(srv.url) as pc:
            assert pc.job("a")["retiring"] == [first["job_id"]]
            version = pc.next_plan("a", after=1, wait_s=0.1)["version"]
            pc.renew("a", running=version)
            assert pc.job("a")["retiring"] == [] and held() == {b["registration"]["job_id"]}

            pc.release("b")  # a aggregates in the network again, under an id not used yet
            again = pc.job("a")["registration"]
            assert again["version"] == version + 1
            assert again["job_id"] not in (first["job_id"], b["registration"]["job_id"])
            assert held() == {again["job_id"]}
            pc.release("a")
            assert held() == set()
        svc.stop()
