"""``testbed bench scale``'s options, refused before any network is built (no root)."""

from __future__ import annotations

import pytest

from testbed.bench.scale import measure

OPTS = {"mib": 0.25, "bw": 100.0, "time_dilation": 8.0}


@pytest.mark.parametrize(("workers", "topologies", "algos", "match"), [
    ("10", "leaf_spine", "ring", "multiple of 4"),
    ("64", "fat_tree", "ring", r"k\^3/4 hosts"),
    ("16", "torus", "ring", "leaf_spine or fat_tree"),
    ("16", "leaf_spine", "ring,hd", "not among ring, ina"),
    ("16", "leaf_spine", "", "not among ring, ina"),
    ("x", "leaf_spine", "ring", "comma-separated integers"),
])
def test_bad_options_are_refused_naming_them(workers, topologies, algos, match):
    with pytest.raises(ValueError, match=match):
        measure(lambda row: None, False, workers=workers, topologies=topologies,
                algos=algos, **OPTS)


@pytest.mark.parametrize("mib", [-1.0, 0.0, 1e-7])
def test_a_size_no_collective_takes_is_refused_before_any_network(mib):
    with pytest.raises(ValueError, match=rf"--mib {mib:g}, ring on 16 workers: .*nbytes"):
        measure(lambda row: None, False, workers="16", topologies="leaf_spine",
                algos="ring,ina", **{**OPTS, "mib": mib})
