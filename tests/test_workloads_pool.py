"""The training pool exactly as the runner starts it (``python -m testbed.workloads.pool``), on
this namespace's loopback (no Mininet): the ranks train, allreduce every gradient in-process,
the pool checks sampled allreduces against numpy and the replicas against each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from testbed.collectives.testing import loopback_ip
from testbed.workloads import TrainingSpec
from testbed.workloads.data import load_dataset
from testbed.workloads.loop import train_reference
from testbed.workloads.rows import iteration_rows, summary_row
from testbed.workloads.runner import pool_env


def _pool(tmp_path, spec: TrainingSpec, n: int) -> dict:
    spec.validate(n)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()}
             for i in range(n)]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": spec.to_json(), "n": n, "m": 0, "ranks": ranks,
                               "t_popen": time.monotonic()}))
    p = subprocess.run([sys.executable, "-m", "testbed.workloads.pool", "--job", str(job)],
                       capture_output=True, text=True, timeout=240, env=pool_env())
    res = tmp_path / "result.json"
    assert res.exists(), p.stdout + p.stderr
    return json.loads(res.read_text())


def test_ring_job_follows_the_exact_twin(tmp_path):
    spec = TrainingSpec(iterations=40, eval_every=10, seed=2, target_accuracy=0.8)
    r = _pool(tmp_path, spec, 3)
    assert r["error"] is None, r["error"]
    assert r["replicas_agree"]
    assert [c["iteration"] for c in r["checks"]] == [0, 20]
    assert all(c["correct"] for c in r["checks"]), r["checks"]
    rows = iteration_rows(spec, r["logs"])
    assert len(rows) == 40 and all(row["comm_s"] > 0 for row in rows)
    ref = train_reference(spec, load_dataset("digits", seed=2), 3)
    got = [(row["iteration"], row["accuracy"]) for row in rows if row["accuracy"] is not None]
    assert [it for it, _ in got] == [it for it, _ in ref]
    for (_, a), (_, b) in zip(got, ref, strict=True):  # float32 sums vs the exact sum
        assert abs(a - b) <= 0.01
    s = summary_row(spec, rows)
    assert s["final_accuracy"] == got[-1][1] and s["tta_s"] is not None
    assert 0 < s["comm_fraction"] <= 1.0


@pytest.mark.parametrize("kw", [
    {"compressor": "fp16"},  # summable: reduce-scatter + allgather in float16
    {"compressor": "topk", "compressor_params": {"ratio": 0.05}, "error_feedback": True},
    {"compressor": "thc", "algo": "ring"},  # summable after agreeing on the norm
])
def test_compressed_jobs_are_checked_against_their_contributions(tmp_path, kw):
    spec = TrainingSpec(iterations=12, eval_every=6, seed=1, **kw)
    r = _pool(tmp_path, spec, 3)
    assert r["error"] is None, r["error"]
    assert r["replicas_agree"] and len(r["checks"]) == 2
    assert all(c["correct"] for c in r["checks"]), r["checks"]


def test_emulated_compute_time_pads_each_iteration(tmp_path):
    spec = TrainingSpec(iterations=5, eval_every=5, compute_ms=30.0, time_dilation=2.0)
    r = _pool(tmp_path, spec, 2)
    assert r["error"] is None, r["error"]
    rows = iteration_rows(spec, r["logs"])
    # 60 ms of wall time per compute phase (30 ms dilated 2x), reported undilated
    assert all(row["compute_s"] >= 0.030 for row in rows), rows


def test_bad_job_fails_with_the_ranks_message(tmp_path):
    """A rank that cannot start (its host's namespace is gone) fails the job with a message
    naming it, and the pool still writes a result."""
    spec = TrainingSpec(iterations=3)
    spec.validate(2)
    ranks = [{"host": "tbh1", "pid": os.getpid(), "ip": loopback_ip()},
             {"host": "tbh2", "pid": 2 ** 22 + 7, "ip": loopback_ip()}]  # no such process
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": spec.to_json(), "n": 2, "m": 0, "ranks": ranks}))
    subprocess.run([sys.executable, "-m", "testbed.workloads.pool", "--job", str(job)],
                   capture_output=True, text=True, timeout=120)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["error"] and "rank 1" in r["error"], r["error"]
