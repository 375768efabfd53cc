"""Training jobs on an emulated network (Mininet, real packets): small jobs per communication
config and a trace of jobs sharing the fabric (the experiment runner's side is in
test_workloads_experiment.py: it builds its own network)."""

from __future__ import annotations

import pytest

from testbed.collectives.testing import leftovers
from testbed.workloads import TrainingSpec, run_trace, run_training
from testbed.workloads.rows import ITERATION_COLUMNS

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def star():
    """4 hosts on a programmable switch (the aggregator), 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(4, bw_mbps=100, switch="programmable")) as net:
        yield net


@pytest.mark.parametrize("kw", [
    {"algo": "ring"},
    {"algo": "ina"},
    {"algo": "ina", "compressor": "thc"},
    {"algo": "ring", "compressor": "fp16"},
], ids=lambda kw: "+".join(str(v) for v in kw.values()))
def test_small_job_per_config(star, kw):
    spec = TrainingSpec(iterations=12, eval_every=6, target_accuracy=0.5, **kw)
    res = run_training(star, spec)
    s = res.summary
    assert s["correct"] and s["replicas_agree"], s
    assert s["iterations"] == 12 and len(res.iterations) == 12
    assert all(tuple(r)[-len(ITERATION_COLUMNS):] == ITERATION_COLUMNS for r in res.iterations)
    assert s["final_accuracy"] > 0.5 and s["jct_s"] > 0 and s["model_comm_s"] > 0
    # the hosts' interfaces saw at least what the algorithm sends: ring 2(n-1)/n of the
    # gradient per host, INA all of it once, fp16 half of the ring's, THC a byte per element;
    # less up to the frames a host's queue still held when its allreduce returned (the ring's
    # last segments: a rank returns when it has received, not when its own queue is empty;
    # they count in the next iteration)
    per_host = {"ring": 1.5, "ina": 1.0, "ina+thc": 0.25, "ring+fp16": 0.75}[spec.label()]
    queued = 4 * 2 * 1514
    assert min(r["bytes_on_wire"] for r in res.iterations) >= 4 * per_host * s["bytes"] - queued
    assert sum(r["bytes_on_wire"] for r in res.iterations) >= \
        len(res.iterations) * 4 * per_host * s["bytes"] - queued
    assert not leftovers()


def test_trace_of_jobs_on_their_own_hosts(star):
    specs = [TrainingSpec(name="a", algo="ring", hosts=[0, 1], iterations=15, job_id=3),
             TrainingSpec(name="b", algo="ina", hosts=[2, 3], iterations=10, start_s=0.5,
                          job_id=4)]
    a, b = run_trace(star, specs)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.summary["hosts"] == "tbh1,tbh2" and b.summary["hosts"] == "tbh3,tbh4"
    assert b.summary["start_s"] >= 0.5 > a.summary["start_s"]
    assert a.summary["correct"] and b.summary["correct"]
    assert {r["job"] for r in a.iterations} == {0} and len(b.iterations) == 10
    with pytest.raises(ValueError, match=r"job 1 \(b\): .*host 1 is already used by job 0"):
        run_trace(star, [specs[0], TrainingSpec(name="b", hosts=[1, 2], job_id=4)])
    assert not leftovers()



def _kill_engine_when(star, comm: str, delay_s: float):
    """SIGKILL the switch's engine ``delay_s`` after a process named ``comm`` appears."""
    import os
    import signal

    from testbed.collectives.testing import when_process_appears

    return when_process_appears(
        comm, delay_s, lambda _pid: os.kill(star.mininet.get("tbs1").engine_pid(),
                                            signal.SIGKILL))[0]


def test_a_ring_training_job_rides_out_a_switch_restart_and_ina_is_named(star):
    """A switch engine killed mid-training: the TCP ring's connections retransmit what it
    lost while it is started again, and the job ends exact, the restart in its summary; an
    INA job, whose rounds died with the switch, fails naming the engine and why."""
    from testbed.workloads import TrainingError

    spec = TrainingSpec(algo="ring", hosts=[0, 1], iterations=40, compute_ms=20.0, job_id=7)
    t = _kill_engine_when(star, "tbw-tbh1", 0.3)
    try:
        res = run_training(star, spec)
    finally:
        t.join()
    assert res.summary["correct"] and res.summary["iterations"] == 40, res.summary
    (node, code, took), = res.summary["engine_restarts"]
    assert node == "tbs1" and code == -9 and 0 < took < 10
    ina = TrainingSpec(algo="ina", hosts=[0, 1], iterations=40, compute_ms=20.0, job_id=8)
    t = _kill_engine_when(star, "tbw-tbh1", 0.3)
    try:
        with pytest.raises(TrainingError, match=r"tbs1 \(exit status -9\).*aggregate in the "
                                                r"network"):
            run_training(star, ina)
    finally:
        t.join()
    if star.dead_engines():  # nothing restarts it after a failure: the next test needs it
        star.restart_engine("tbs1")
