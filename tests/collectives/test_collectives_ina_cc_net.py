"""The INA congestion response on an emulated network (Mininet, programmable dumbbell with a
10 Mb/s bottleneck): an allreduce with ``ina_cc="delay"`` across the thin link is exact,
one without it is not resent behind its own queue there, and a small-message TCP ring
sharing that link with an INA job is no longer slowed by the queue INA keeps there (ratio of
medians with a generous margin; the numbers live in ``testbed bench ina-sharing``)."""

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


def test_without_a_congestion_response_a_window_queued_at_a_thin_link_is_not_resent(thin_net):
    """Plain INA (window 64, no ``ina_cc``) through the bottleneck: two workers' windows queue
    there, most packets answered later than SwitchML's 10 ms timeout after their send. No
    link loses anything, so the switch sees next to no retransmission. With a floor that
    ignored the path and an estimator started from scratch each collective, the timers
    resent every window whole, again and again: 2897 resends for 2560 contributions, and
    the collective took up to twice the model's time."""
    sw = thin_net.aggregator["switch"]

    def aggregate():
        return thin_net.counters()["datapath"][sw]["stages"]["aggregate"]

    before = aggregate()
    spec = CollectiveSpec(algo="ina", nbytes=4 * 65_536, window=64, timeout_s=30,
                          repetitions=2, seed=4)
    rows = run_collective(thin_net, spec)
    check_rows(rows, spec, 4)
    after = aggregate()
    sent = after["contributions"] - before["contributions"]
    resent = after["retransmissions_answered"] + after["duplicates"] - (
        before["retransmissions_answered"] + before["duplicates"])
    assert sent >= 4 * 256 * 2, (before, after)
    assert resent <= 0.05 * sent, (resent, sent)
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
