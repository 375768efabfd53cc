"""In-network aggregation on an emulated programmable star (Mininet, the data path's aggregate
program, real packets): sums for several n and sizes, exactness under 5 % seeded loss, and a
worker killed mid-collective."""

from __future__ import annotations

import time

import pytest

from testbed.collectives import CollectiveSpec, CollectiveTimeout, run_collective
from testbed.collectives.testing import check_rows, kill_process_later
from testbed.collectives.testing import leftovers as _ours_left

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def agg_net():
    """4 hosts on a programmable switch running the aggregate program, 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(4, bw_mbps=100, switch="programmable",
                programs={"switch": ["aggregate", "forward"]})
    with TestbedNet(topo) as net:
        yield net


def test_ina_sums_on_programmable_star(agg_net):
    for workers, nbytes in ((4, 4 * 40_001), (3, 4 * 1_000)):
        spec = CollectiveSpec(algo="ina", nbytes=nbytes, workers=workers, window=32,
                              timeout_s=20, repetitions=2, seed=11)
        rows = run_collective(agg_net, spec)
        check_rows(rows, spec, workers, bw_mbps=100)
        assert rows[0]["max_abs_err"] > 0  # fixed point is not exact, only within its bound
    assert not _ours_left()


def test_ina_exact_under_loss(agg_net):
    """5 % seeded loss of contributions and results (client-side drop): retransmissions and
    the shadow copy still give the right sum."""
    spec = CollectiveSpec(algo="ina", nbytes=4 * 30_000, window=16, loss=0.05, timeout_s=20,
                          seed=5)
    before = agg_net.counters()["datapath"]
    rows = run_collective(agg_net, spec)
    check_rows(rows, spec, 4, bw_mbps=100)
    after = agg_net.counters()["datapath"]
    sw = agg_net.aggregator["switch"]
    agg_b = before[sw]["stages"]["aggregate"]
    agg_a = after[sw]["stages"]["aggregate"]
    # lost results were recovered from the shadow copy
    assert agg_a["retransmissions_answered"] > agg_b["retransmissions_answered"]


def test_ina_dead_worker_times_out(agg_net):
    spec = CollectiveSpec(algo="ina", nbytes=16 << 20, window=32, timeout_s=3)
    t, killed = kill_process_later("tbw-tbh2", delay_s=1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeout, match=r"no RESULT from the aggregator"):
            run_collective(agg_net, spec)
    finally:
        t.join()
    assert killed
    assert time.monotonic() - t0 < 30
    assert not _ours_left()


@pytest.mark.parametrize("algo, compressor", [("ina", None), ("ina", "thc")])
def test_client_reuses_its_summed_lanes_buffer(algo, compressor):
    """The int32 buffer the RESULTs are summed into is touched when the client starts and
    reused by every later collective (a fresh one would be zeroed page by page inside the
    timed loop); a larger collective grows it."""
    import numpy as np

    from testbed.collectives.ina import InaClient

    spec = CollectiveSpec(algo=algo, nbytes=4 * 100_000, compressor=compressor)
    job = {"n": 2, "ranks": [{"host": f"h{r}", "ip": "127.0.0.1", "port": 47_000 + r,
                              "aggregator": {"ip": "127.0.0.2"}} for r in range(2)]}
    c = InaClient(job, spec, 0)
    try:
        first = c._payload(np.ones(spec.count, np.float32), np.empty(spec.count, np.float32), 0)
        assert first.qsum.size >= spec.count
        again = c._payload(np.ones(spec.count, np.float32), np.empty(spec.count, np.float32), 1)
        assert np.shares_memory(first.qsum, again.qsum)
        big = 3 * spec.count
        grown = c._payload(np.ones(big, np.float32), np.empty(big, np.float32), 2)
        assert grown.qsum.size >= big and not np.shares_memory(grown.qsum, first.qsum)
    finally:
        c.close()
