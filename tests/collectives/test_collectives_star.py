"""Host-based collectives on an emulated Linux-bridge star (Mininet, real packets):
correctness for n = 2..8 and uneven sizes, and a worker killed mid-collective.

Helpers are shared with test_collectives_ina.py / test_collectives_nic.py."""

from __future__ import annotations

import time

import pytest

from testbed.collectives import (
    CollectiveError,
    CollectiveSpec,
    run_collective,
)
from testbed.collectives.testing import check_rows, kill_process_later
from testbed.collectives.testing import leftovers as _ours_left

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def bridge_net():
    """8 hosts on a Linux bridge, 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(8, bw_mbps=100)) as net:
        yield net


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
    check_rows(run_collective(bridge_net, spec), spec, workers, bw_mbps=100)
    assert not _ours_left()


def test_a_message_the_machine_cannot_hold_is_refused_before_any_rank_starts(bridge_net):
    """A size past this machine's available memory (a '8GiB' typo) is refused naming the
    memory, before a rank allocates anything; the network runs the next collective."""
    from testbed.topologies.scale import mem_available_kb

    nbytes = mem_available_kb() * 1024 // 2 // 4 * 4  # 2 ranks x 2 copies: twice what is free
    spec = CollectiveSpec(algo="ring", nbytes=nbytes, workers=2, timeout_s=5)
    with pytest.raises(ValueError, match=r"nbytes=\d+: 2 ranks .* need at least .* GiB available"):
        run_collective(bridge_net, spec)
    assert not _ours_left()
    spec = CollectiveSpec(algo="ring", nbytes=4 * 1000, workers=2, timeout_s=20)
    check_rows(run_collective(bridge_net, spec), spec, 2, bw_mbps=100)


def test_killed_worker_fails_fast_and_cleanly(bridge_net):
    spec = CollectiveSpec(op="allreduce", algo="ring", nbytes=32 << 20, workers=4,
                          timeout_s=5)
    t, killed = kill_process_later("tbw-tbh3", delay_s=1.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveError, match=r"rank 2 \(tbh3\) died"):
            run_collective(bridge_net, spec)
    finally:
        t.join()
    assert killed
    assert time.monotonic() - t0 < 30
    assert not _ours_left()
