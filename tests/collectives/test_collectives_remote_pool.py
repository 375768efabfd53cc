"""The coordinator and another server's pool (``testbed.collectives.remotepool``) on the
loopback of this namespace: the pool is started as a plain process instead of over ssh
(``argv``), so the protocol, the split checks and the failure paths run here in seconds;
tests/topologies/test_cluster.py runs the same over ssh on a netns server."""

from __future__ import annotations

import os
import sys
import time

import pytest

from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import loopback_ip
from testbed.collectives.worker import run_pool

REMOTE = [sys.executable, "-m", "testbed.collectives.remotepool"]


def _run(n: int, m: int, elsewhere: list[int], argv=REMOTE, **kw) -> dict:
    spec = CollectiveSpec(timeout_s=10, chunk_bytes=4096, **kw)
    spec.validate(n + m)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()}
             for i in range(n + m)]
    return run_pool({"spec": spec.to_json(), "n": n, "m": m, "ranks": ranks,
                     "remote": [{"server": "srv2", "ranks": elsewhere, "argv": argv}]})


@pytest.mark.parametrize("n, m, elsewhere, kw", [
    (4, 0, [2, 3], {"algo": "ring", "dtype": "int32"}),
    (3, 2, [1, 4], {"algo": "rs", "servers": 2}),  # a worker and a reduction server there
    (4, 0, [0, 3], {"op": "reduce_scatter", "algo": "hd"}),  # per-rank references
])
def test_split_job_is_exact_and_reaped(n, m, elsewhere, kw):
    r = _run(n, m, elsewhere, nbytes=4 * 10_001, repetitions=2, **kw)
    assert r["error"] is None, r["error"]
    assert [rep["correct"] for rep in r["reps"]] == [True, True], r["reps"]
    assert all(rep["time_s"] > 0 for rep in r["reps"])
    if kw.get("dtype") == "int32":
        assert all(rep["max_abs_err"] == 0.0 for rep in r["reps"])
    pool = r["pools"]["srv2"]
    assert pool["ranks"] == elsewhere and pool["pid"] not in (None, os.getpid())
    assert len(set(r["pids"].values())) == n + m  # every rank had a process of its own
    for pid in [pool["pid"], *r["pids"].values()]:
        assert not os.path.exists(f"/proc/{pid}"), f"process {pid} left behind"


def test_remote_outputs_are_checked_there():
    """A compressed ring split over two pools: the other pool replays every worker's
    compressor to check its own ranks' outputs (lossy against the raw sum)."""
    r = _run(4, 0, [1, 2], algo="ring", compressor="qsgd", nbytes=4 * 10_001,
             repetitions=2, error_feedback=True)
    assert r["error"] is None, r["error"]
    assert all(rep["correct"] and rep["max_abs_err"] > 0 for rep in r["reps"]), r["reps"]


def test_a_pool_that_dies_is_an_error_naming_server_and_ranks():
    t0 = time.monotonic()
    r = _run(3, 0, [1, 2], argv=[sys.executable, "-c", "import sys; sys.exit(3)"],
             algo="ring", nbytes=4 * 1000)
    assert "server srv2 (ranks [1, 2]: tbh2, tbh3)" in r["error"], r["error"]
    assert "exit status 3" in r["error"], r["error"]
    assert time.monotonic() - t0 < 30  # the grace after a failure, never the full timeouts
    assert not r["reps"]


def test_failing_ranks_there_are_named():
    """Ranks of the other pool that cannot start (no such host process to enter) fail the
    run with their own errors, relayed by their pool."""
    spec = CollectiveSpec(algo="ring", nbytes=4 * 1000, timeout_s=5)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()} for i in range(3)]
    ranks[2]["pid"] = 2 ** 22 + 1  # beyond pid_max: no namespace to enter
    r = run_pool({"spec": spec.to_json(), "n": 3, "m": 0, "ranks": ranks,
                  "remote": [{"server": "srv2", "ranks": [2], "argv": REMOTE}]})
    assert "server srv2 (ranks [2]: tbh3): rank 2 (tbh3): FileNotFoundError" in r["error"], \
        r["error"]
