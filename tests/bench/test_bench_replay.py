"""``testbed bench replay``'s options, refused before any network is built (no root)."""

from __future__ import annotations

import pytest

from testbed.bench.replay import measure

OPTS = {"ranks": 8, "buckets": "1048576", "a2a_bytes": 1 << 20, "layers": 2, "iterations": 3,
        "compute_us": 5000, "topology": "leaf_spine", "bw": 100.0, "time_dilation": 8.0}


@pytest.mark.parametrize(("changes", "match"), [
    ({"traces": "ddp,resnet"}, r"\['resnet'\] not among ddp, moe, export"),
    ({"traces": ""}, "not among"),
    ({"traces": "export", "algo": "gloo"}, "export runs a training job"),
    ({"traces": "ddp", "algo": "carrier-pigeon"}, "algo='carrier-pigeon'"),
    ({"traces": "ddp", "ranks": 7}, "an even number"),
    ({"traces": "ddp", "topology": "torus"}, "leaf_spine or star"),
])
def test_bad_options_are_refused_naming_them(changes, match):
    with pytest.raises(ValueError, match=match):
        measure(lambda row: None, False, **{**OPTS, "algo": "ring", **changes})
