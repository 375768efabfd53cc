"""``testbed bench tenancy``: the experiments it runs take the bench's size and time dilation,
and its targets are computed from the rows as the issue states them."""

from __future__ import annotations

from testbed.bench import tenancy


def test_experiments_take_the_size_and_the_dilation():
    exp = tenancy._load("multitenant_ina.toml", 1 << 20, "auto")
    assert exp.time_dilation == "auto" and {j.nbytes for j in exp.jobs} == {1 << 20}
    assert tenancy._load("hierarchical_ina.toml", 4 << 20).time_dilation == 8.0  # the file's


def _row(experiment, label, modes="-", **kw):
    return {"experiment": experiment, "label": label, "modes": modes, "correct": True,
            "cpu_bound": False, "placement_mode": "static", **kw}


def test_targets_from_rows():
    rows = [_row("hierarchical", "ina-core", port_bytes_core=1000.0, time_s=2.0),
            _row("hierarchical", "ina-tree", port_bytes_core=250.0, time_s=1.0),
            _row("multitenant", "a", "static/static", time_s=0.5),
            _row("multitenant", "b", "static/static", time_s=0.7, placement_mode="refused"),
            _row("multitenant", "a", "shared/shared", time_s=0.6, placement_mode="shared"),
            _row("multitenant", "b", "shared/shared", time_s=0.7, placement_mode="shared")]
    t = tenancy.targets(rows)
    assert t["core_bytes_tree/single <= 1/4"] == (True, "0.250")
    assert t["time_tree/single <= 1"][0]
    assert t["two tenants: every row exact"] == (True, "4/4")
    met, detail = t["sum shared <= sum static (one refused -> ring)"]
    assert not met and detail.startswith("1.30 s vs 1.20 s (1 refused)")
    rows[-1]["correct"] = False
    assert tenancy.targets(rows)["two tenants: every row exact"] == (False, "3/4")
