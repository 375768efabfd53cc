"""Collectives on emulated stars (Mininet, real packets): correctness for n = 2..8, uneven
sizes, INA under seeded loss, and a worker killed mid-collective."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest

from testbed.collectives import (
    REPORT_COLUMNS,
    CollectiveError,
    CollectiveSpec,
    CollectiveTimeout,
    run_collective,
)
from testbed.collectives.runner import RUN_DIR

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def bridge_net():
    """8 hosts on a Linux bridge, 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(8, bw_mbps=100)) as net:
        yield net


@pytest.fixture(scope="module")
def agg_net():
    """4 hosts on a programmable switch running the aggregate program, 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(4, bw_mbps=100, switch="programmable",
                programs={"switch": ["aggregate", "forward"]})
    with TestbedNet(topo) as net:
        yield net


def _ours_left() -> list[str]:
    """Our worker/server processes and job folders still around."""
    left = []
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(("tbw-", "tbr-")):
            left.append(f"{comm}: {name}")
    left += glob.glob(os.path.join(RUN_DIR, f"coll-{os.getpid()}-*"))
    return left


def _check(rows, spec, n):
    assert len(rows) == spec.repetitions
    for r in rows:
        assert tuple(r) == REPORT_COLUMNS
        assert r["correct"], r
        assert r["n"] == n and r["bytes"] == spec.nbytes
        assert r["time_s"] > 0 and r["model_s"] > 0
        assert r["bw_mbps"] == pytest.approx(100)


@pytest.mark.parametrize("op, algo, workers, servers, nbytes", [
    ("allreduce", "ring", 2, 1, 4 * 30_001),
    ("allreduce", "ring", 8, 1, 4 * 30_001),
    ("allreduce", "hd", 3, 1, 4 * 20_011),
    ("allreduce", "hd", 8, 1, 4 * 20_011),
    ("allreduce", "rs", 5, 2, 4 * 20_011),  # dedicated servers on tbh6, tbh7
    ("allreduce", "rs", 8, 3, 4 * 20_011),  # co-located
    ("reduce_scatter", "ring", 6, 1, 4 * 20_011),
    ("allgather", "hd", 4, 1, 4 * 20_011),
    ("broadcast", "ring", 7, 1, 4 * 20_011),
    ("broadcast", "hd", 5, 1, 4 * 20_011),
])
def test_host_collectives_on_star(bridge_net, op, algo, workers, servers, nbytes):
    spec = CollectiveSpec(op=op, algo=algo, nbytes=nbytes, workers=workers, servers=servers,
                          chunk_bytes=16 << 10, timeout_s=20, repetitions=1, seed=3)
    _check(run_collective(bridge_net, spec), spec, workers)
    assert not _ours_left()


def test_killed_worker_fails_fast_and_cleanly(bridge_net):
    spec = CollectiveSpec(op="allreduce", algo="ring", nbytes=32 << 20, workers=4,
                          timeout_s=5)
    killed = []

    def killer():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            for comm in glob.glob("/proc/[0-9]*/comm"):
                try:
                    with open(comm) as f:
                        if f.read().strip() == "tbw-tbh3":
                            time.sleep(1.5)  # let the collective get going
                            pid = int(comm.split("/")[2])
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                            return
                except OSError:
                    continue
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveError, match=r"rank 2 \(tbh3\) died"):
            run_collective(bridge_net, spec)
    finally:
        t.join()
    assert killed
    assert time.monotonic() - t0 < 30
    assert not _ours_left()


def test_ina_sums_on_programmable_star(agg_net):
    for workers, nbytes in ((4, 4 * 40_001), (3, 4 * 1_000)):
        spec = CollectiveSpec(algo="ina", nbytes=nbytes, workers=workers, window=32,
                              timeout_s=20, repetitions=2, seed=11)
        rows = run_collective(agg_net, spec)
        _check(rows, spec, workers)
        assert rows[0]["max_abs_err"] > 0  # fixed point is not exact, only within its bound
    assert not _ours_left()


def test_ina_exact_under_loss(agg_net):
    """5 % seeded loss of contributions and results (client-side drop): retransmissions and
    the shadow copy still give the right sum."""
    spec = CollectiveSpec(algo="ina", nbytes=4 * 30_000, window=16, loss=0.05, timeout_s=20,
                          seed=5)
    before = agg_net.counters()["datapath"]
    rows = run_collective(agg_net, spec)
    _check(rows, spec, 4)
    after = agg_net.counters()["datapath"]
    sw = agg_net.aggregator["switch"]
    agg_b = before[sw]["stages"]["aggregate"]
    agg_a = after[sw]["stages"]["aggregate"]
    # lost results were recovered from the shadow copy
    assert agg_a["retransmissions_answered"] > agg_b["retransmissions_answered"]


def test_ina_dead_worker_times_out(agg_net):
    spec = CollectiveSpec(algo="ina", nbytes=16 << 20, window=32, timeout_s=3)
    killed = []

    def killer():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for comm in glob.glob("/proc/[0-9]*/comm"):
                try:
                    with open(comm) as f:
                        if f.read().strip() == "tbw-tbh2":
                            time.sleep(1.0)
                            pid = int(comm.split("/")[2])
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                            return
                except OSError:
                    continue
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeout, match=r"no RESULT from the aggregator"):
            run_collective(agg_net, spec)
    finally:
        t.join()
    assert killed
    assert time.monotonic() - t0 < 30
    assert not _ours_left()


def test_nic_offloaded_allreduce():
    """SmartNIC-offloaded INA: hosts send float32, their NICs (nic_codec, fixed32) quantise
    for the switch's int32 aggregation and turn the result back into float32."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(3, bw_mbps=100, switch="programmable", smartnic=True,
                programs={"smartnic": ["nic_codec"]})
    with TestbedNet(topo) as net:
        spec = CollectiveSpec(algo="nic", nbytes=4 * 20_001, window=16, timeout_s=20,
                              repetitions=2)
        rows = run_collective(net, spec)
        _check(rows, spec, 3)
        nics = {k: v for k, v in net.counters()["datapath"].items() if k.startswith("tbn")}
        assert nics and all(v["stages"]["nic_codec"]["encoded"] > 0 for v in nics.values())
    assert not _ours_left()
