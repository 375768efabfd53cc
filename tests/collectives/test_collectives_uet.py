"""The UET-like transport (``testbed.collectives.uet``) on the loopback: the Comm calls, exact
collectives over it, loss recovered by its timer, strangers ignored, clear errors."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from testbed.collectives import hd, ring
from testbed.collectives.testing import run_ranks
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.collectives.uet import UetComm
from testbed.kernels.wire import TESTBED_UDP_PORT, pack_header


def addresses(n: int) -> list[str]:
    """One loopback address per rank (the transport takes one rank per address), derived
    from this process's pid so test processes running at once do not share them."""
    pid = os.getpid()
    return [f"127.{200 + r}.{(pid >> 8) & 255}.{1 + (pid & 255) % 254}" for r in range(n)]


def mesh(n: int, job: int = 5, **kw) -> list[UetComm]:
    ips = addresses(n)
    timeout_s = kw.pop("timeout_s", 10.0)
    comms = [UetComm(r, [f"h{i}" for i in range(n)], timeout_s, job_id=job, seed=r, **kw)
             for r in range(n)]
    try:
        addrs = {r: (ips[r], c.listen(ips[r])) for r, c in enumerate(comms)}
        for r, c in enumerate(comms):
            c.connect([p for p in range(n) if p != r], addrs)
    except BaseException:
        for c in comms:
            c.close()
        raise
    return comms


@pytest.mark.parametrize("algo", ["ring", "hd"])
@pytest.mark.parametrize("loss", [0.0, 0.03])
def test_allreduce_over_uet_equals_the_numpy_sum(algo, loss):
    n, m = 4, 300_001  # not a multiple of a packet's payload
    comms = mesh(n, loss=loss)
    try:
        xs = [np.random.default_rng([7, r]).standard_normal(m).astype(np.float32)
              for r in range(n)]
        outs = [np.full(m, np.nan, np.float32) for _ in range(n)]
        fn = ring.allreduce if algo == "ring" else hd.allreduce
        run_ranks(comms, lambda r, c: fn(c, xs[r], outs[r], n, 1 << 15))
        exact = np.sum(np.array(xs, np.float64), axis=0)
        for o in outs:
            np.testing.assert_allclose(o, exact, rtol=1e-5, atol=1e-5)
        stats = [c.stats() for c in comms]
        lost = sum(s["timeouts"] + s["fast_retransmits"] for s in stats)
        if loss:
            assert lost > 0, "a lossy run retransmits (SACK holes, timeouts)"
        assert sum(s["strangers"] for s in stats) == 0
        assert sum(s["nacks_received"] for s in stats) == 0  # nothing trimmed on the loopback
    finally:
        for c in comms:
            c.close()


def test_the_stream_keeps_order_across_message_boundaries():
    """recv() takes bytes as TCP delivers them: two sends read back in other cut points."""
    a, b = mesh(2)
    try:
        x = np.arange(10_000, dtype=np.int32)
        y = np.arange(10_000, 13_000, dtype=np.int32)
        f1, f2 = a.send(1, x), a.send(1, y)
        parts = [np.empty(n, np.int32) for n in (1, 4_999, 5_500, 0, 2_500)]
        for p in parts:
            b.recv(0, p)
        f1.result(10)
        f2.result(10)
        np.testing.assert_array_equal(np.concatenate(parts), np.concatenate([x, y]))
        a.drain(1)
    finally:
        a.close()
        b.close()


def test_strangers_are_counted_and_ignored():
    a, b = mesh(2, job=6)
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dst = (addresses(2)[1], TESTBED_UDP_PORT)
        s.sendto(b"garbage", dst)
        s.sendto(pack_header(job_id=99, worker_id=0) + bytes(8), dst)  # another job
        s.sendto(pack_header(job_id=6, worker_id=7) + bytes(8), dst)  # no such rank
        s.close()
        x = np.arange(5000, dtype=np.float32)
        fut = a.send(1, x)
        got = np.empty_like(x)
        b.recv(0, got)
        fut.result(10)
        np.testing.assert_array_equal(got, x)
        deadline = time.monotonic() + 5
        while b.stats()["strangers"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.stats()["strangers"] == 3
    finally:
        a.close()
        b.close()


def test_a_second_rank_on_one_address_is_refused_with_what_to_do():
    ip = addresses(1)[0]
    a = UetComm(0, ["h0", "h1"], 5.0, job_id=8)
    b = UetComm(1, ["h0", "h1"], 5.0, job_id=8)
    try:
        a.listen(ip)
        with pytest.raises(CollectiveError, match="one rank per address|one rank per host"):
            b.listen(ip)
    finally:
        a.close()
        b.close()


def test_a_dead_peer_times_out_naming_it():
    a, b = mesh(2, timeout_s=1.0)
    b.close()  # the peer is gone: nothing ACKs
    try:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"rank 1 \(h1\)"):
            a.send(1, np.zeros(50_000, np.float32)).result(10)
        assert time.monotonic() - t0 < 5
        with pytest.raises(CollectiveTimeout, match=r"rank 1 \(h1\)"):
            a.recv(1, np.empty(10, np.float32))
    finally:
        a.close()


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="min_window"):
        UetComm(0, ["h0"], 1.0, min_window=8, init_window=4)
    with pytest.raises(ValueError, match="entropies"):
        UetComm(0, ["h0"], 1.0, entropies=0)
    with pytest.raises(ValueError, match="time_dilation"):
        UetComm(0, ["h0"], 1.0, time_dilation=0.5)


def test_the_timeout_floor_is_stretched_with_the_networks_dilation():
    """A dilated network's round trips are that much longer in wall time: the timer floor
    and the timeout before a round trip is measured are too (as the hosts' TCP floor)."""
    plain, dilated = UetComm(0, ["h0"], 1.0), UetComm(0, ["h0"], 1.0, time_dilation=4)
    assert (plain.rto_min_s, plain.rto_initial_s) == (0.2, 0.2)
    assert dilated.rto_min_s == pytest.approx(0.8)
    assert dilated.rto_initial_s == pytest.approx(0.8)
    short = UetComm(0, ["h0"], 1.0, rto_min_s=0.05, time_dilation=2)
    assert (short.rto_min_s, short.rto_initial_s) == (pytest.approx(0.1), pytest.approx(0.4))
