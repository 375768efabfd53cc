"""Scale measurement: set-up/teardown time and memory of a star, on small sizes only.

The full table (n = 2..32, bridge and programmable) comes from
``python -m testbed.topologies.scale 2 4 8 16 32``; here we check that the measurement
itself is real: every size pings, processes are counted and cost memory, and more hosts
mean more processes.
"""

from __future__ import annotations

import pytest

from testbed.topologies.scale import descendants, measure


def test_descendants_sees_a_child():
    import subprocess

    p = subprocess.Popen(["sleep", "5"])
    try:
        assert p.pid in descendants()
    finally:
        p.kill()
        p.wait()


@pytest.mark.mininet
def test_measure_star_bridge_small():
    rows = measure([2, 4], "bridge")
    assert [r["n"] for r in rows] == [2, 4]
    for r in rows:
        assert r["ping_failed"] == 0 and r["ping_pairs"] == r["n"] * (r["n"] - 1)
        assert r["setup_s"] > 0 and r["teardown_s"] > 0
        # one shell per host + one per switch
        assert r["processes"] >= r["n"] + 1
        assert r["children_rss_mb"] > 0
    assert rows[1]["processes"] > rows[0]["processes"]


@pytest.mark.mininet
def test_measure_star_programmable_counts_the_engine():
    pytest.importorskip("testbed.datapath.nodes")
    (row,) = measure([2], "programmable")
    assert row["ping_failed"] == 0
    # host shells + switch shell + the engine (a Python process: tens of MB)
    assert row["processes"] >= 4
    assert row["children_rss_mb"] > 50


def test_measure_rejects_unknown_switch():
    with pytest.raises(ValueError, match="switch must be 'bridge' or 'programmable'"):
        measure([2], "ovs")
