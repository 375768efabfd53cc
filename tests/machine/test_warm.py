"""``testbed warm`` compiles every kernel family the testbed's processes use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed import warm
from testbed.datapath.programs import stage_names
from testbed.kernels.compressors import COMPRESSORS


def test_every_stage_and_compressor_is_a_family():
    names = [f for f, _ in warm.families()]
    assert len(names) == len(set(names))
    for s in stage_names():
        assert f"stage {s}" in names
    for c in COMPRESSORS:
        assert f"compressor {c}" in names
    assert {"ina worker", "host fallback", "trimmed gather", warm.GROUP_FAMILY} <= set(names)


def test_a_failing_family_is_reported_and_the_others_still_run(monkeypatch, capsys):
    ran = []

    def broken():
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(warm, "families", lambda: [("a", lambda: ran.append("a")),
                                                   ("b", broken),
                                                   ("c", lambda: ran.append("c"))])
    assert warm.main(["--quiet"]) == 1
    out = capsys.readouterr().out
    assert ran == ["a", "c"]
    assert "b" in out and "RuntimeError: no such kernel" in out
    assert "warmed 2/3 kernel families" in out and "failed: b" in out


@pytest.mark.quiet_cpu  # after the suite's own background compile: loads the caches
def test_command_warms_every_family():
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "warm", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(warm.families())
    assert f"warmed {n}/{n} kernel families" in r.stdout
