"""The pytest plugin: baseline record/compare through pytester, fidelity assertion, cheap load."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from testbed.experiment.checks import assert_all_ok, assert_fidelity

pytest_plugins = ["pytester"]

INNER = """
import pandas as pd

def test_against_baseline(testbed_baseline):
    df = pd.read_csv("current.csv")
    testbed_baseline.check(df, "star")
"""


def _rows(time_scale=1.0, correct=True, drop_last=False):
    rows = []
    for algo, t in (("ring", 0.50), ("ina", 0.30)):
        for nbytes in (65536, 262144):
            for rep in range(2):
                rows.append({"label": algo, "op": "allreduce", "algo": algo, "n": 4,
                             "bytes": nbytes, "compressor": None, "rep": rep,
                             "time_s": t * nbytes / 65536 * time_scale * (1 + 0.02 * rep),
                             "fidelity": 1.05, "max_abs_err": 1e-6, "correct": correct,
                             "status": "ok"})
    if drop_last:
        rows = [r for r in rows if not (r["algo"] == "ina" and r["bytes"] == 262144)]
    return pd.DataFrame(rows)


# In-process and without the unrelated heavy plugins: each inner run then takes ~0.1 s.
_LEAN = ("-p", "no:nbmake", "-p", "no:hypothesispytest", "-p", "no:cacheprovider")


def _run(pytester, df, *args):
    df.to_csv(pytester.path / "current.csv", index=False)
    return pytester.runpytest_inprocess(*_LEAN, *args)


def test_baseline_record_then_compare(pytester):
    pytester.makepyfile(test_inner=INNER)
    base = pytester.path / "baselines" / "star.csv"

    r = _run(pytester, _rows())
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*no baseline*star.csv*--testbed-update-baselines*"])
    assert not base.exists()

    r = _run(pytester, _rows(), "--testbed-update-baselines")
    r.assert_outcomes(passed=1)
    recorded = pd.read_csv(base)
    assert len(recorded) == 4  # one row per (label, bytes), repetitions averaged
    assert {"label", "algo", "n", "bytes", "time_s", "correct"} <= set(recorded.columns)
    ring64 = recorded[(recorded.label == "ring") & (recorded.bytes == 65536)]["time_s"].item()
    assert ring64 == pytest.approx(0.505)

    _run(pytester, _rows(time_scale=1.3)).assert_outcomes(passed=1)  # inside ±50 %

    r = _run(pytester, _rows(time_scale=1.8))
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*differ from baseline*4 differences*",
                            "*label=ring*bytes=65536*time_s = 0.909*baseline 0.505*+80%*"])

    r = _run(pytester, _rows(correct=False))
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*correct = False, baseline True*"])

    r = _run(pytester, _rows(drop_last=True))
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*label=ina*bytes=262144*in the baseline but not in the results*"])

    # updating rewrites the baseline; the new numbers then pass
    _run(pytester, _rows(time_scale=1.8), "--testbed-update-baselines").assert_outcomes(passed=1)
    _run(pytester, _rows(time_scale=1.8)).assert_outcomes(passed=1)


def test_plugin_is_registered_and_cheap():
    code = ("import sys, testbed.experiment.pytest_plugin as p; "
            "heavy = [m for m in ('pandas', 'numpy', 'numba', 'mininet', 'pydantic', "
            "'testbed.collectives', 'testbed.topologies') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert eps.get("testbed") == "testbed.experiment.pytest_plugin"


def test_assert_fidelity_lists_every_offender():
    df = _rows()
    df["fidelity"] = [1.0, 1.1, 1.3, 0.7, 1.0, 0.95, 1.19, 1.21]
    df["model_s"] = df["time_s"] / df["fidelity"]
    df["cpu_bound"] = [False] * 7 + [True]
    with pytest.raises(AssertionError) as ei:
        assert_fidelity(df, tol=0.2)
    msg = str(ei.value)
    assert msg.startswith("2 of 7 runs")  # the cpu_bound 1.21 is left out
    assert "fidelity 1.300" in msg and "fidelity 0.700" in msg
    with pytest.raises(AssertionError, match="3 of 8"):
        assert_fidelity(df, tol=0.2, skip_cpu_bound=False)
    assert_fidelity(df, tol=0.31)
    with pytest.raises(ValueError, match="tol="):
        assert_fidelity(df, tol=-1)


def test_assert_all_ok_reports_errors_and_wrong_results():
    df = _rows()
    assert_all_ok(df)
    df.loc[1, "correct"] = False
    df.loc[2, "status"] = "error"
    df["error"] = ""
    df.loc[2, "error"] = "CollectiveTimeout: rank 2 silent"
    df["run"] = range(len(df))
    with pytest.raises(AssertionError) as ei:
        assert_all_ok(df)
    assert "rank 2 silent" in str(ei.value) and "not correct" in str(ei.value)


FIDELITY = """
import pandas as pd

def test_fidelity(testbed_baseline):
    testbed_baseline.assert_fidelity(pd.read_csv("current.csv"), tol=0.2)
"""


def test_fidelity_check_that_could_not_run_fails_and_is_reported(pytester):
    """All runs cpu_bound: nothing could be judged, which fails the test (not a skip, not a
    pass); the terminal summary lists every fidelity check with what it judged."""
    pytester.makepyfile(test_inner=FIDELITY)
    df = _rows()
    df["model_s"] = df["time_s"] / df["fidelity"]
    df["time_dilation"] = 4.0
    df["cpu_bound"] = True
    df["cpu_why"] = "cores saturated (97% busy)"
    r = _run(pytester, df)
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "*fidelity not checked: all 8 runs were cpu_bound (cores saturated (97% busy))*",
        "*testbed fidelity checks*",
        "*test_fidelity: NOT CHECKED: 0 runs judged within ±20% of the model, 8 left out as "
        "cpu_bound, time dilation 4*"])
    df.loc[:5, "cpu_bound"] = False
    r = _run(pytester, df)
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*test_fidelity: 6 runs judged within ±20% of the model, 2 left "
                            "out as cpu_bound, time dilation 4*"])
