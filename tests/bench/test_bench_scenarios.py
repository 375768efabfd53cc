"""``testbed bench scenarios``: the draw covers what it says, and a drawn scenario runs on a real
network to a verdict with nothing left behind."""

from __future__ import annotations

import random

import pytest

from testbed.bench import scenarios
from testbed.topologies import make_topology


def test_the_draw_is_seeded_valid_and_covers_the_kinds():
    draws = [scenarios.draw(random.Random(i)) for i in range(300)]
    assert draws == [scenarios.draw(random.Random(i)) for i in range(300)]
    for kind, params, dilation, job in draws:
        make_topology(kind, **params)  # every drawn network is one the topologies build
        assert dilation in (1, 2, 4)
        if job["algo"] in ("ina", "nic"):
            assert params["switch"] == "programmable"
        if job["algo"] == "nic":
            assert params.get("smartnic")
        if params["delay_ms"] or params["loss_pct"]:
            assert params["switch"] == "programmable"  # no netem: the data path impairs
    assert {d[0] for d in draws} == {"star", "leaf_spine", "fat_tree", "dumbbell", "incast"}
    assert {d[3]["algo"] for d in draws} == {"ring", "hd", "rs", "ina", "nic"}
    assert {d[1]["switch"] for d in draws} == {"programmable", "bridge"}
    assert {d[3]["op"] for d in draws} == {"allreduce", "reduce_scatter", "allgather",
                                           "broadcast"}


@pytest.mark.mininet
def test_a_scenario_runs_to_a_verdict_and_leaves_nothing():
    row = scenarios.run_one(0, 0)
    assert row["status"] in ("ok", "refused"), row
    assert row["left"] == 0, row
    if row["status"] == "ok":
        assert row["correct"] and row["time_s"] > 0 and row["model_s"] > 0, row
