"""Distributed sweeps on a Dask LocalCluster (two worker processes): the same rows as a local
run, the worker's machine in every row, and a point whose worker dies retried or reported."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from testbed.experiment import run
from testbed.experiment.results import cpu_model, machine_info
from testbed.netlock import emulation_lock

distributed = pytest.importorskip("distributed", reason="the [distributed] extra is not "
                                  "installed: pip install -e '.[distributed]'")
dask = pytest.importorskip("dask")

from testbed.experiment.distributed import run_distributed  # noqa: E402 - needs the extra

pytestmark = pytest.mark.mininet

#: Two points on small bridge stars, each capturing its first host's port (files that must
#: come back from the workers).
SWEEP = {"name": "dist", "seed": 11,
         "topology": {"kind": "star", "n_hosts": 2, "bw_mbps": 100, "switch": "bridge"},
         "jobs": [{"algo": "ring", "nbytes": "16KiB"}],
         "capture": {"interfaces": ["tbh1-eth0"], "max_packets": 200},
         "sweep": {"jobs.0.algo": ["ring", "hd"]}}
#: What must be equal between a local and a distributed run (timings differ, naturally).
SAME = ["run", "point", "job", "label", "jobs.0.algo", "op", "algo", "n", "bytes", "count",
        "seed", "correct", "max_abs_err", "status"]


@pytest.fixture(scope="module")
def cluster():
    # one point per worker at a time (saturation 1.0), a point given up after its second dead
    # worker (allowed-failures 1)
    with dask.config.set({"distributed.scheduler.worker-saturation": 1.0,
                          "distributed.scheduler.allowed-failures": 1}):
        cl = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      dashboard_address=None)
    try:
        yield cl
    finally:
        cl.close()


def test_sweep_through_dask_gives_the_rows_of_a_local_run(cluster, tmp_path):
    local = run(SWEEP, out_dir=tmp_path / "local", progress=False, doctor=False)
    dist = run_distributed(SWEEP, cluster, out_dir=tmp_path / "dist", progress=False,
                           doctor=False)
    assert len(dist.df) == 2 and dist.df["correct"].all(), dist.df[["status", "error"]]
    assert local.df[SAME].equals(dist.df[SAME])  # same seeds: same data, same error
    assert dist.metadata["status"] == "completed"
    assert dist.metadata["executor"]["kind"] == "dask"
    # the worker's machine in every row, and per point in the metadata
    assert set(dist.df["worker_host"]) == {machine_info()["hostname"]}
    assert set(dist.df["worker_cpu"]) == {cpu_model()}
    assert set(dist.df["attempts"]) == {1}
    with distributed.Client(cluster, set_as_default=False) as client:
        pids = set(client.run(os.getpid).values())
    machines = dist.metadata["machines"]
    assert sorted(m["point"] for m in machines) == [0, 1]
    assert {m["pid"] for m in machines} <= pids and all(m["git"]["commit"] for m in machines)
    assert len(dist.metadata["networks"]) == 2
    # files come back under the run numbers of the local run
    assert sorted(p.name for p in (tmp_path / "dist" / "pcap").iterdir()) == \
        sorted(p.name for p in (tmp_path / "local" / "pcap").iterdir())


def _starts(client, topics_before: set) -> dict[int, list[dict]]:
    """Each point's starts so far in the sweep that began after ``topics_before``."""
    out: dict[int, list[dict]] = {}
    for topic, events in client.get_events().items():
        if topic.startswith("testbed-sweep-") and topic not in topics_before:
            for _, msg in events:
                out.setdefault(msg["point"], []).append(msg)
    return out


def _wait_start(client, topics_before: set, point: int, count: int) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        starts = _starts(client, topics_before).get(point, [])
        if len(starts) >= count:
            return starts[count - 1]
        time.sleep(0.1)
    pytest.fail(f"point {point} was not started {count} time(s) within 60 s")


def test_a_dead_workers_point_is_retried_or_reported_failed(cluster, tmp_path):
    exp = {**SWEEP, "capture": None}
    done: dict = {}
    with distributed.Client(cluster, set_as_default=False) as client:
        before = set(client.get_events())
        # The points wait for this machine's emulation lock on their workers while this test
        # holds it: each worker is killed in the middle of its point, before any network.
        with emulation_lock(timeout=120):
            sweep = threading.Thread(target=lambda: done.update(res=run_distributed(
                exp, client, out_dir=tmp_path / "r", progress=False, doctor=False)))
            sweep.start()
            first = {p: _wait_start(client, before, p, 1) for p in (0, 1)}
            os.kill(first[0]["pid"], signal.SIGKILL)  # point 0 dies once: run elsewhere
            _wait_start(client, before, 0, 2)
            os.kill(first[1]["pid"], signal.SIGKILL)  # point 1 dies twice: given up
            second = _wait_start(client, before, 1, 2)
            os.kill(second["pid"], signal.SIGKILL)
            time.sleep(0.5)
        sweep.join(timeout=120)
    res = done["res"]
    df = res.df.set_index("point")
    assert len(res.df) == res.metadata["planned_runs"] == 2  # no run lost
    assert df.loc[0, "status"] == "ok" and bool(df.loc[0, "correct"])
    assert df.loc[0, "attempts"] == 2
    assert df.loc[1, "status"] == "error" and df.loc[1, "attempts"] == 2
    assert "WorkerDied" in df.loc[1, "error"] and "died 2 time(s)" in df.loc[1, "error"]
    assert res.metadata["status"] == "completed_with_errors"
    assert [f["run"] for f in res.failures] == [1]
