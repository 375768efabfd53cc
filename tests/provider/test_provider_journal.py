"""A provider that survives restarts (its SQLite journal) and pushes plan changes (long poll).

Without a network: the manager's state round-trips through the journal exactly; a journal of
another fabric or an earlier boot is refused with what to do; ``testbed provider serve
--journal`` killed with SIGKILL and started again resumes its jobs with their leases (a lease
that ran out meanwhile is reaped at once). A tenant waiting on ``/plan/next`` gets a change
as it happens, scheduled at the iteration the service names, and learns when its job is gone.
(The restart on a running network, with the switches reconciled, is in
``test_provider_restart.py``.)
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from testbed.provider.client import PlanFollower, ProviderClient, ProviderRefused
from testbed.provider.journal import Journal, JournalError
from testbed.provider.manager import APPLY_AFTER_ITERATIONS, FabricManager, inventory_of
from testbed.provider.schema import Hints, JobRequest, Plan
from testbed.provider.service import ProviderService, Server, make_service
from testbed.topologies import Star

MEMORY = 1 << 20


def _topo(n: int = 6) -> Star:
    return Star(n, bw_mbps=100, switch="programmable", aggregator="tbs1")


def _req(job: str, hosts: list[str], lease_s: float = 600, **hints) -> JobRequest:
    return JobRequest(job=job, hosts=hosts, hints=Hints(**hints), lease_s=lease_s)


def _manager(policy="provider_only") -> FabricManager:
    return FabricManager(inventory_of(_topo(), MEMORY), policy)


def test_state_round_trips_through_the_journal(tmp_path):
    m = _manager()
    m.admit(_req("a", ["tbh1", "tbh2"], collective_bytes=1 << 20), now=1.0)
    m.admit(_req("b", ["tbh3", "tbh4"], lease_s=5), now=2.0)
    m.renew("a", now=3.0, iteration=7)
    m.admit(_req("c", ["tbh5", "tbh6"]), now=4.0)
    m.release("b", now=5.0)
    j = Journal(tmp_path / "p.db")
    j.save(m.state(), {})
    j.close()

    state, regs = Journal(tmp_path / "p.db").load()
    again = _manager()
    again.restore(state)
    assert regs == {}
    assert again.plans() == m.plans() and again.jobs() == m.jobs()
    assert [c.to_json() for c in again.log] == [c.to_json() for c in m.log]
    assert again.memory() == m.memory()
    assert again.plan_version("a") == m.plan_version("a") >= 1
    assert again.jobs()["a"]["iteration"] == 7
    # the restored manager goes on: a later change is appended to the same journal
    again.release("c", now=6.0)
    j = Journal(tmp_path / "p.db")
    j.save(again.state(), {})
    assert len(j.load()[0]["log"]) == len(again.log) > len(m.log)
    assert sqlite3.connect(tmp_path / "p.db").execute(
        "select count(*) from jobs").fetchone()[0] == 1


def test_registrations_a_job_is_leaving_round_trip_through_the_journal(tmp_path):
    """A job re-planned while its workers may still run its old plan keeps that plan's
    registration (``retiring``, with the plan version that replaced it) and the version its
    workers reported (``following``); the journal keeps both, also for a job whose current
    plan has no registration, and drops them once saved without."""
    reg = {"job_id": 1000, "tree": ["tbs1"], "seq0": 5, "ranks": [], "version": 1}
    regs = {"a": {"retiring": [{"job_id": 1000, "version": 2,
                                "registration": {"job_id": 1000, "tree": ["tbs1"],
                                                 "fallbacks": []}}],
                  "following": 1},
            "b": {"job_id": 1001, "plan": {"algo": "ina"}, "registration": reg,
                  "retiring": [{"job_id": 1003, "version": 4, "registration": {
                      "job_id": 1003, "tree": ["tbs1"], "fallbacks": []}},
                               {"job_id": 1002, "version": 3, "registration": {
                                   "job_id": 1002, "tree": ["tbs1"], "fallbacks": []}}]}}
    j = Journal(tmp_path / "p.db")
    j.save(_manager().state(), regs)
    _state, back = Journal(tmp_path / "p.db").load()
    assert back["a"] == regs["a"]
    assert back["b"]["registration"] == reg and [x["job_id"] for x in back["b"]["retiring"]] \
        == [1002, 1003]  # in the order they were replaced
    j.save(_manager().state(), {"b": {k: regs["b"][k] for k in ("job_id", "plan",
                                                                "registration")}})
    assert j.load()[1] == {"b": {k: regs["b"][k] for k in ("job_id", "plan", "registration")}}


def test_a_journal_of_another_fabric_or_boot_is_refused(tmp_path):
    m = _manager()
    m.admit(_req("a", ["tbh1", "tbh2"]), now=1.0)
    j = Journal(tmp_path / "p.db")
    j.save(m.state(), {})
    other = FabricManager(inventory_of(Star(4, bw_mbps=100, switch="programmable",
                                            aggregator="tbs1"), MEMORY), "provider_only")
    with pytest.raises(ValueError, match="not of this one"):
        other.restore(j.load()[0])
    assert other.jobs() == {}  # nothing changed
    with sqlite3.connect(tmp_path / "p.db") as db:
        db.execute("update meta set value = 'an-earlier-boot' where key = 'boot_id'")
    with pytest.raises(JournalError, match="booted"):
        Journal(tmp_path / "p.db").load()
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(JournalError, match="not a provider journal"):
        Journal(tmp_path / "junk.db")


def _serve(exp, journal, sock):
    return subprocess.Popen(
        [sys.executable, "-m", "testbed.cli", "provider", "serve", str(exp), "--no-network",
         "--socket", str(sock), "--policy", "provider_only", "--memory-bytes", str(MEMORY),
         "--journal", str(journal)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_up(proc, address: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with ProviderClient(address, timeout=2) as pc:
                pc.health()
                return
        except Exception:  # noqa: BLE001 - not up yet
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.2)


def test_killed_provider_resumes_its_jobs_from_the_journal(tmp_path):
    exp = tmp_path / "fabric.toml"
    exp.write_text('name = "fabric"\n[topology]\nkind = "star"\nn_hosts = 6\nbw_mbps = 100\n'
                   'switch = "programmable"\naggregator = "tbs1"\n'
                   '[[jobs]]\nname = "x"\nalgo = "ring"\nnbytes = "1MiB"\n')
    journal, sock = tmp_path / "provider.db", tmp_path / "p.sock"
    address = f"unix:{sock}"
    procs = [_serve(exp, journal, sock)]
    try:
        _wait_up(procs[0], address)
        with ProviderClient(address) as pc:
            plan_a = pc.admit(_req("a", ["tbh1", "tbh2"], collective_bytes=1 << 20))
            pc.admit(_req("short", ["tbh3", "tbh4"], lease_s=2))
            pc.renew("a", iteration=3)
            before = pc.jobs()
            log = pc.log()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].communicate(timeout=30)
        time.sleep(2.5)  # the short lease runs out while no provider runs
        procs.append(_serve(exp, journal, sock))
        _wait_up(procs[1], address)
        with ProviderClient(address) as pc:
            jobs = pc.jobs()
            assert set(jobs) == {"a"}, jobs  # "short" expired while the provider was down
            assert jobs["a"]["expires_s"] == before["a"]["expires_s"]  # the same lease
            assert jobs["a"]["iteration"] == 3
            assert pc.plan("a") == plan_a
            assert pc.log()[:len(log)] == log
            assert pc.log()[-1]["job"] == "short" and pc.log()[-1]["reason"] == "lease expired"
            assert "short" not in pc.memory()["tbs1"]["allocated"]
            pc.release("a")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=30)
    assert procs[1].returncode == 0


class TwoWays:
    """A policy whose plan of a job depends on how many jobs run: INA alone, ring with
    company (so that an arrival or a departure re-plans the others)."""

    name = "two_ways"

    def plan(self, jobs, snapshot):
        alone = len(jobs) == 1
        return {r.job: Plan(job=r.job, algo="ina" if alone else "ring",
                            tree="single" if alone else None, slots=4 if alone else 0,
                            reason="alone" if alone else "shared")
                for r in jobs}


@pytest.fixture
def pushed(tmp_path):
    m = FabricManager(inventory_of(_topo(), MEMORY), TwoWays())
    svc = ProviderService(m, reap_period_s=0.05)
    with Server(svc, socket_path=str(tmp_path / "p.sock")) as srv, \
            ProviderClient(srv.url) as pc:
        yield srv, pc


def test_plan_changes_are_pushed_with_the_iteration_they_apply_from(pushed):
    srv, pc = pushed
    first = pc.admit(_req("a", ["tbh1", "tbh2"]))
    assert first.algo == "ina"
    # nothing changes: the long poll answers after wait_s with changed False
    t0 = time.monotonic()
    out = pc.next_plan("a", after=1, wait_s=0.5)
    assert not out["changed"] and out["version"] == 1 and time.monotonic() - t0 >= 0.45
    # a version the tenant lacks is answered at once
    assert pc.next_plan("a", after=0, wait_s=30)["plan"] == first

    with PlanFollower(srv.url, "a", first) as follow:
        for it in range(3):
            assert follow.plan_for(it) == first
            follow.done(it)
        got = []
        waiter = threading.Thread(target=lambda: got.append(
            pc.next_plan("a", after=1, wait_s=30)))
        waiter.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        pc.admit(_req("b", ["tbh3", "tbh4"]))  # a has company now: ring
        waiter.join(timeout=10)
        assert got and got[0]["changed"] and time.monotonic() - t0 < 2
        assert got[0]["plan"].algo == "ring"
        assert got[0]["applies_at"] == 2 + APPLY_AFTER_ITERATIONS
        deadline = time.monotonic() + 10
        while not follow._pending:  # the follower's own long poll got it too
            assert time.monotonic() < deadline, "the follower never heard of the change"
            time.sleep(0.02)
        assert follow.plan_for(3).algo == "ina"  # not yet: iteration 4 is the boundary
        assert follow.plan_for(4).algo == "ring" and follow.applied == [(4, 2)]
        follow.done(4)
        pc.release("b")  # alone again: back to INA from iteration 6
        deadline = time.monotonic() + 10
        while follow.plan_for(5).algo != "ring" or not follow._pending:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert follow.plan_for(6).algo == "ina" and follow.applied[-1] == (6, 3)
        pc.release("a")
        deadline = time.monotonic() + 10
        while follow.error is None:  # the job is gone: the follower says so
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "404" in follow.error
    with pytest.raises(ProviderRefused, match="404"):
        pc.next_plan("a", after=0, wait_s=1)
    with pytest.raises(ProviderRefused, match="422"):
        pc.next_plan("a", after=0, wait_s=10_000)


def test_a_renew_reporting_an_earlier_iteration_is_refused(pushed):
    _srv, pc = pushed
    pc.admit(_req("a", ["tbh1", "tbh2"]))
    pc.renew("a", iteration=5)
    with pytest.raises(ProviderRefused, match="before the last one reported"):
        pc.renew("a", iteration=4)
    with pytest.raises(ProviderRefused, match="422"):
        pc.renew("a", iteration=-1)


def test_make_service_with_a_journal_saves_every_change(tmp_path):
    svc = make_service(_topo(), MEMORY, policy="provider_only", journal=tmp_path / "j.db")
    svc.call(lambda m, now: m.admit(_req("a", ["tbh1", "tbh2"]), now))
    state, _ = Journal(tmp_path / "j.db").load()
    assert set(state["jobs"]) == {"a"}
    svc.stop()
    again = make_service(_topo(), MEMORY, policy="provider_only", journal=tmp_path / "j.db")
    assert again.resumed == {"jobs": ["a"], "expired": []} and set(again.manager.jobs()) == {"a"}
    again.stop()
