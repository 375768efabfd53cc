"""Smoke test of ``testbed bench kernels`` at a small size: row schema and positive numbers."""

from __future__ import annotations

import json

import pytest

from testbed.bench import run_benchmark
from testbed.kernels import bench

KEYS = {"kernel", "elements", "gbps", "anchor", "anchor_gbps", "ratio"}
OURS = ["fixedpoint.exponents", "fixedpoint.quantize", "fixedpoint.quantize[par]",
        "fixedpoint.aggregate", "fixedpoint.dequantize", "atp.quantize", "atp.aggregate",
        "atp.dequantize", "trimming.encode(b=1)", "trimming.decode(full)",
        "trimming.decode(trimmed)", "packets.build_batch", "packets.parse_batch",
        "trimming.trim_frame"]


def test_bench_json_rows_schema_and_positive_numbers(capsys):
    assert run_benchmark("kernels", {"elements": 20000}, json_out=True) == 0
    *rows, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert summary["summary"] and summary["status"] == 0 and summary["rows"] == len(rows)
    assert summary["notes"]["elements"] == 20000 and summary["notes"]["cpu"]
    names = [r["kernel"] for r in rows]
    for name in OURS:
        assert name in names, name
    for r in rows:
        assert KEYS <= set(r), r
        if r["gbps"] is None:  # a note row (compressor bench missing or failing) says why
            assert r.get("note"), r
            continue
        # ratio is rounded to 3 decimals: a tiny size on a loaded machine may show 0.0
        assert r["elements"] > 0 and r["gbps"] > 0 and r["anchor_gbps"] > 0 and r["ratio"] >= 0
        # gbps values are rounded to 3 decimals: allow for that in the ratio check
        rel = 0.0006 / r["gbps"] + 0.0006 / r["anchor_gbps"] + 0.002
        assert r["ratio"] == pytest.approx(r["gbps"] / r["anchor_gbps"], rel=rel, abs=0.002)
        assert isinstance(r["anchor"], str) and r["anchor"]
    ours = {r["kernel"]: r for r in rows if r["kernel"] in OURS}
    assert ours["fixedpoint.quantize"]["anchor"] == "numpy add"
    assert ours["fixedpoint.exponents"]["anchor"] == "numpy twin"
    assert ours["fixedpoint.quantize"]["elements"] == 20000
    assert ours["packets.parse_batch"]["elements"] == 78 * 256  # 78 whole frames


def test_bench_table_output(capsys):
    assert run_benchmark("kernels", {"elements": 600}) == 0
    out = capsys.readouterr().out
    assert "fixedpoint.quantize" in out and "ratio" in out and "numpy add" in out


def test_bench_rejects_bad_elements():
    with pytest.raises(ValueError, match="elements"):
        bench.rows(0)


def test_only_runs_the_named_groups_and_rejects_unknown_ones():
    got = bench.rows(2048, ("packets",))
    assert {r["kernel"] for r in got} == {"packets.build_batch", "packets.parse_batch",
                                          "trimming.trim_frame"}
    with pytest.raises(ValueError, match="unknown group.*nope.*choose from elementwise"):
        bench.rows(2048, ("nope",))
