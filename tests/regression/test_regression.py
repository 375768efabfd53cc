"""The repository's own regression experiments, run through the testbed pytest plugin.

Baselines live in ``baselines/``; after an intended change re-record them with
``pytest tests/regression --testbed-update-baselines`` and commit the CSVs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.mininet
@pytest.mark.testbed
def test_star_small_regression(testbed_experiment, testbed_baseline):
    res = testbed_experiment(HERE / "star_small.toml")
    testbed_baseline.assert_all_ok(res)
    # correctness must match exactly; times may drift within a factor of 2 on a shared machine
    testbed_baseline.check(res, "star_small", tolerances={"time_s": 1.0})
    # dilated runs (the experiment's time_dilation), reported in undilated time
    assert (res.ok["time_dilation"] == 8).all()
    big = res.ok[res.ok["bytes"] == res.ok["bytes"].max()]
    # the model's fidelity for large messages (small ones are dominated by per-message
    # software costs); Mininet's own test_hifi allows ±20 %, we allow ±50 % on 2 shared
    # cores. Runs still cpu_bound are left out; if all are, the check fails (not checked).
    testbed_baseline.assert_fidelity(big, tol=0.5)
