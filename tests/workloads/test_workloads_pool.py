"""The training pool exactly as the runner starts it (``python -m testbed.workloads.pool``), on
this namespace's loopback (no Mininet): the ranks train, allreduce every gradient in-process,
the pool checks sampled allreduces against numpy and the replicas against each other."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from testbed.collectives.testing import loopback_ip
from testbed.collectives.worker import ControlLine
from testbed.workloads import TrainingSpec
from testbed.workloads.data import load_dataset
from testbed.workloads.loop import train_reference
from testbed.workloads.replan import epoch_job_id
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
    # the allreduce right after an evaluation is timed on clocks moved back by the slowest
    # worker's evaluation (rows._shifted), which on a loaded machine can overshoot: not judged
    evaluated = {it for it, _acc, _secs in r["logs"][0]["evals"]}
    assert len(rows) == 40
    assert all(row["comm_s"] > 0 for row in rows if row["iteration"] - 1 not in evaluated), \
        [(row["iteration"], row["comm_s"]) for row in rows]
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


def test_plan_changes_apply_at_a_boundary_and_are_checked(tmp_path):
    """The runner's plan channel moves a running job ring -> ring+fp16 -> halving-doubling:
    every rank switches at the iteration rank 0 chose, the first sum under each plan is
    checked against numpy with that plan's bound, and the replicas still agree bit for bit."""
    n = 3
    spec = TrainingSpec(iterations=30, eval_every=10, seed=2, compute_ms=30.0)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()}
             for i in range(n)]
    ours, theirs = socket.socketpair()
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"train": spec.to_json(), "n": n, "m": 0, "ranks": ranks,
                               "t_popen": time.monotonic(), "plan_fd": theirs.fileno()}))
    p = subprocess.Popen([sys.executable, "-m", "testbed.workloads.pool", "--job", str(job)],
                         env=pool_env(), pass_fds=[theirs.fileno()],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    theirs.close()
    ch = ControlLine(ours)
    plans = [dataclasses.replace(spec, compressor="fp16", job_id=epoch_job_id(1, 1)),
             dataclasses.replace(spec, algo="hd", job_id=epoch_job_id(1, 2))]
    ch.send({"type": "plan", "epoch": 1, "job": {"train": plans[0].to_json(), "ranks": ranks}})
    ours.settimeout(120)
    reports, progress = [], []
    while (msgs := ch.feed()) is not None:
        progress += [m["iteration"] for m in msgs if m["type"] == "progress"]
        msgs = [m for m in msgs if m["type"] != "progress"]
        reports += msgs
        if {"type": "switched", "epoch": 1} in [{k: m[k] for k in ("type", "epoch")}
                                                for m in msgs]:
            ch.send({"type": "plan", "epoch": 2,
                     "job": {"train": plans[1].to_json(), "ranks": ranks}})
    out = p.communicate(timeout=120)[0]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["error"] is None, r["error"] + out.decode(errors="replace")[-2000:]
    assert r["replicas_agree"]
    sw = r["plan_switches"]
    assert [(s["epoch"], s["algo"], s["compressor"]) for s in sw] == [
        (1, "ring", "fp16"), (2, "hd", None)]
    assert 0 < sw[0]["at"] < sw[1]["at"] < spec.iterations
    assert [m["type"] for m in reports] == ["switching", "switched"] * 2
    # rank 0 reported every finished iteration but the last (the runner learns the end anyway)
    assert progress == list(range(spec.iterations - 1))
    checked = {(c["iteration"], c["algo"], c["compressor"]) for c in r["checks"]}
    mid = (("hd", None) if sw[1]["at"] <= 15 else ("ring", "fp16") if sw[0]["at"] <= 15
           else ("ring", None))  # the plan in force at the middle check iteration
    assert {(sw[0]["at"], "ring", "fp16"), (sw[1]["at"], "hd", None), (0, "ring", None),
            (15, *mid)} == checked
    assert all(c["correct"] for c in r["checks"]), r["checks"]
    assert all(len(log["t0"]) == spec.iterations for log in r["logs"])
