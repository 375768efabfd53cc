"""The plan-change exchange between a launcher and its ranks (``testbed.launch.JobPlans``,
``testbed.c10d.Replans``), driven in one process: the ranks' boundaries called as each rank
would call them (no network: ring and hd plans register nothing on a switch)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from testbed.c10d import Replans  # noqa: E402
from testbed.launch import JobPlans, backend_settings  # noqa: E402

NET = SimpleNamespace(time_dilation=1.0)  # what JobPlans reads of a network for TCP plans


def _job(n: int) -> dict:
    return {"torch": {}, "n": n, "m": 0,
            "ranks": [{"host": f"h{r}", "ip": f"10.0.0.{r + 1}"} for r in range(n)]}


def test_every_rank_switches_at_the_call_rank_0_names_and_old_plans_are_released(tmp_path):
    wanted = [backend_settings("hd", None, None, False, 1)]
    ring = backend_settings("ring", None, None, False, 1)
    job = _job(4)
    with JobPlans(NET, job, [None] * 4, ring, tmp_path,
                  lambda: wanted.pop() if wanted else None) as plans:
        assert job["replan"] == str(tmp_path)
        ranks = [Replans(tmp_path, r) for r in range(4)]
        for r in (1, 2, 3, 0):  # call 1 everywhere: no plan yet
            assert ranks[r].boundary() is None
        plans.tick()  # the launcher offers plan 1 (hd) under a job id of its own
        assert json.loads((tmp_path / "plan.json").read_text())["job"]["torch"]["job_id"] == 257
        # call 2: rank 1 starts it before rank 0 decided, rank 0 names call 3, the others
        # read that before they start call 3 (none can finish call 2 without rank 0)
        assert ranks[1].boundary() is None
        assert ranks[0].boundary() is None
        assert ranks[2].boundary() is None and ranks[3].boundary() is None
        switched = [ranks[r].boundary() for r in (3, 0, 2, 1)]  # call 3
        assert all(j["torch"]["algo"] == "hd" for j in switched)
        assert {r.epoch for r in ranks} == {1}
        for r in ranks[:3]:
            r.ack()
        plans.tick()
        assert plans.history[0]["released_s"] is None  # rank 3 has not left plan 0
        ranks[3].ack()
        plans.tick()
        assert plans.history[0]["released_s"] is not None
        assert plans.tick() is None and plans.epoch == 1  # nothing new: nothing offered
    assert [(p["algo"], p["from_call"]) for p in plans.history] == [("ring", 1), ("hd", 3)]
    assert plans.errors == [] and not list(tmp_path.iterdir())  # the exchange's files gone


def test_a_plan_offered_too_late_is_named_not_applied_and_a_rank_past_its_call_fails(tmp_path):
    ring = backend_settings("ring", None, None, False, 1)
    wanted = [backend_settings("hd", None, None, False, 1)]
    with JobPlans(NET, _job(2), [None] * 2, ring, tmp_path,
                  lambda: wanted.pop() if wanted else None) as plans:
        r0, r1 = Replans(tmp_path, 0), Replans(tmp_path, 1)
        plans.tick()
        assert r0.boundary() is None  # rank 0 names call 2; the job ends before it
        assert r1.boundary() is None
        r1.full += 1  # a rank that skipped a call it should have counted
        with pytest.raises(RuntimeError, match="applies from collective 2, read at 3"):
            r1.boundary()
    assert plans.history[1]["from_call"] is None  # offered, never run by every rank


def test_a_source_that_cannot_be_followed_is_recorded(tmp_path):
    def bad():
        raise ValueError("the provider planned trimming")
    ring = backend_settings("ring", None, None, False, 1)
    with JobPlans(NET, _job(2), [None] * 2, ring, tmp_path, bad) as plans:
        plans.tick()
        plans.tick()
    assert plans.errors == ["plan 1 not applied: the provider planned trimming"] * 2
    assert [p["algo"] for p in plans.history] == ["ring"]
