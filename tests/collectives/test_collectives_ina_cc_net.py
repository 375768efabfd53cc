"""The INA congestion response on an emulated network (Mininet, programmable dumbbell with a
10 Mb/s bottleneck): an allreduce with ``ina_cc="delay"`` across the thin link is exact, and
a small-message TCP ring sharing that link with an INA job is no longer slowed by the queue
INA keeps there (ratio of medians with a generous margin; the numbers live in
``testbed bench ina-sharing``)."""

from __future__ import annotations

import statistics

import pytest

from testbed.bench.ina_sharing import overlapped, together
from testbed.collectives import CollectiveSpec, run_collective
from testbed.collectives.testing import check_rows
from testbed.collectives.testing import leftovers as _ours_left

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def thin_net():
    """2 + 2 hosts on a programmable dumbbell, 100 Mb/s host links, a 10 Mb/s bottleneck;
    the aggregator on the left switch."""
    from testbed.topologies import Dumbbell, TestbedNet

    with TestbedNet(Dumbbell(2, 2, bw_mbps=100, bottleneck_mbps=10,
                             switch="programmable")) as net:
        yield net


def test_ina_with_delay_window_is_exact_across_a_thin_link(thin_net):
    spec = CollectiveSpec(algo="ina", nbytes=4 * 60_001, window=32, timeout_s=30,
                          repetitions=2, seed=3, ina_cc="delay")
    rows = run_collective(thin_net, spec)
    check_rows(rows, spec, 4)
    assert not _ours_left()


def test_delay_window_keeps_a_small_tcp_ring_at_its_pace(thin_net):
    """A 2-worker ring of 64 KiB allreduces across the bottleneck while a 2-worker INA job
    (one worker on each side, window 64) streams 4 MiB through it: without the congestion
    response every ring step waits behind the INA job's queue; with it the ring runs close to
    its own pace. Medians of the ring's repetitions, compared with each other."""
    ring = CollectiveSpec(algo="ring", nbytes=64 << 10, hosts=[1, 3], job_id=2, seed=2,
                          repetitions=8, timeout_s=60)
    medians = {}
    for cc in (None, "delay"):
        ina = CollectiveSpec(algo="ina", nbytes=4 << 20, hosts=[0, 2], window=64, job_id=1,
                             seed=1, timeout_s=60, ina_cc=cc)
        ends: dict = {}
        ina_rows, ring_rows = together(thin_net, ina, ring, 1.5, ends)
        assert all(r["correct"] for r in ina_rows + ring_rows)
        # the ring's allreduces ran inside the INA job's (else the comparison says nothing)
        assert overlapped(ends, ina_rows[0], ring_rows), (ends, ina_rows[0]["time_s"])
        medians[cc] = statistics.median(r["time_s"] for r in ring_rows)
    assert medians["delay"] < 0.75 * medians[None], medians
    assert not _ours_left()
