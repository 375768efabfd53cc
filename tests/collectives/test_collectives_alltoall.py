"""The testbed's all-to-all (``collectives.alltoall``) against its numpy twin over real TCP
connections on the loopback, its lazily completed mesh in a rank's communicator, and its flow
model (no root, no network)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from testbed.collectives import alltoall, flowmodel, ring
from testbed.collectives.ports import a2a_port, tcp_tuple
from testbed.collectives.spec import HD_RENDEZVOUS_BYTES
from testbed.collectives.testing import connected_mesh, loopback_ip, run_ranks
from testbed.collectives.transport import Comm
from testbed.topologies.star import Star

_JOB = iter(range(300, 10_000))


def _run(comms, inputs: list[np.ndarray], call) -> list[np.ndarray]:
    outs = [np.empty_like(x) for x in inputs]
    try:
        run_ranks(comms, lambda r, comm: call(r, comm, inputs[r], outs[r]))
    finally:
        for c in comms:
            c.close()
    return outs


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
@pytest.mark.parametrize("part", [0, 7, 20_000])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_all_to_all_matches_its_twin(n, part, dtype):
    """Every rank's parts, eager (small) or pairwise (>= the rendezvous size: 20,000 float32
    or int64 elements), land where the numpy twin puts them, bit for bit, in any dtype."""
    seed = n * 1000 + part
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(0, 250, n * part).astype(dtype) for _ in range(n)]
    comms = connected_mesh(next(_JOB), [loopback_ip()] * n)
    outs = _run(comms, inputs, lambda r, comm, x, out: alltoall.all_to_all(comm, x, out, n,
                                                                           4096))
    for got, want in zip(outs, alltoall.reference(inputs), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_both_forms_are_exercised_by_the_sizes_above():
    """The twin test's sizes cover both sides of the switch to pairwise exchange."""
    assert not alltoall.pairwise(7 * 8) and not alltoall.pairwise(20_000 * 1)
    assert alltoall.pairwise(20_000 * 4) and 20_000 < HD_RENDEZVOUS_BYTES


def test_bad_shapes_are_refused_naming_them():
    comms = connected_mesh(next(_JOB), [loopback_ip()])
    try:
        with pytest.raises(ValueError, match="do not split into 3 equal parts"):
            alltoall.all_to_all(comms[0], np.zeros(10), np.zeros(10), 3, 16)
        with pytest.raises(ValueError, match="one dtype and size"):
            alltoall.all_to_all(comms[0], np.zeros(9), np.zeros(9, np.float32), 3, 16)
    finally:
        comms[0].close()


def test_a_rank_communicator_completes_its_mesh_at_the_first_all_to_all():
    """A ring job's ranks hold connections to their neighbours only; the first all-to-all
    makes its own to every other rank (on the all-to-all's ports, with its small window),
    even while a late rank still waits for its neighbours; the second reuses them; both
    exact."""
    pytest.importorskip("torch", reason="the [torch] extra is not installed")
    from testbed.launch import backend_settings
    from testbed.torch import TestbedComm

    n, job_id = 5, next(_JOB)
    ip = loopback_ip()
    job = {"ranks": [{"host": f"h{r}", "ip": ip} for r in range(n)]}
    tj = backend_settings("ring", None, None, False, job_id)
    comms: list = [None] * n
    rng = np.random.default_rng(3)
    sizes = (n * 40_000, n * 5)  # pairwise, then eager
    inputs = [[rng.standard_normal(size).astype(np.float32) for _ in range(n)]
              for size in sizes]
    outs = [[np.empty_like(x) for x in xs] for xs in inputs]
    ring_only = []

    def rank(r: int, _unused) -> None:
        if r == 3:  # late: ranks 0 and 1 reach the all-to-all and connect to it first
            time.sleep(0.3)
        comms[r] = TestbedComm(job, tj, r)
        if r == 0:
            ring_only.append(set(comms[r].comm.socks))
        for k in range(len(sizes)):
            comms[r].all_to_all(inputs[k][r], outs[k][r])

    try:
        run_ranks([None] * n, rank)
        assert ring_only == [set(ring.ring_peers(0, n))]
        for k in range(len(sizes)):
            for got, want in zip(outs[k], alltoall.reference(inputs[k]), strict=True):
                np.testing.assert_array_equal(got, want)
        assert all(set(c.a2a.socks) == set(range(n)) - {r} for r, c in enumerate(comms))
        assert set(comms[0].comm.socks) == set(ring.ring_peers(0, n))  # the ring's, as before
        sock = comms[1].a2a.socks[0]
        assert (sock.getsockname()[1], sock.getpeername()[1]) == tcp_tuple(job_id, 1, 0,
                                                                           a2a_port)
        # the clamp set before the handshake: window scale 0, so never above 64 KiB (the
        # kernel's autotuning may raise the clamp itself later, not the scale)
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        assert info[6] >> 4 == 0  # tcpi_rcv_wscale
        ring_sock = comms[0].comm.socks[1]
        assert ring_sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)[6] >> 4 > 0
    finally:
        for c in comms:
            if c is not None:
                c.close()


def test_a_connection_for_a_later_call_is_kept_until_that_call():
    """Rank 0 finishes its ring connections and connects its missing pairs (as a job of more
    than 64 ranks completes its mesh for an all-to-all) while ranks 2 and 3 are still late for
    their ring: rank 3's listener then holds rank 0's
    connection before rank 2's, and keeps it for its own later call instead of failing."""
    n, job_id = 5, next(_JOB)
    ip = loopback_ip()
    comms = [Comm(r, [f"h{i}" for i in range(n)], 5.0, job_id=job_id) for r in range(n)]
    try:
        addrs = {r: (ip, comms[r].listen(ip)) for r in range(n)}

        def rank(r: int, comm: Comm) -> None:
            time.sleep({2: 0.15, 3: 0.3}.get(r, 0.0))
            comm.connect(ring.ring_peers(r, n), addrs)
            comm.connect(sorted(set(range(n)) - set(comm.socks) - {r}), addrs)

        run_ranks(comms, rank)
        assert all(set(c.socks) == set(range(n)) - {r} for r, c in enumerate(comms))
        inputs = [np.arange(n * 3, dtype=np.int64) + 100 * r for r in range(n)]
        outs = _run(comms, inputs, lambda r, comm, x, out: alltoall.all_to_all(comm, x, out,
                                                                               n, 2))
        for got, want in zip(outs, alltoall.reference(inputs), strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        for c in comms:
            c.close()


def test_flow_model_prices_the_pairwise_steps_and_the_eager_form():
    """On a star of 4 at 100 Mb/s: large parts take n-1 steps, each a part at the line rate
    plus two trips (ready, then data): above the fluid all-at-once time by those trips only;
    small parts are every pair at once, as the transfers' model of the same flows."""
    topo = Star(4, bw_mbps=100)
    hosts = [f"tbh{i}" for i in range(1, 5)]
    big = 4 * 256 << 10
    pair = flowmodel.all_to_all_s(topo, hosts, big, hop_latency_s=1e-4)
    fluid = flowmodel.transfers_s(topo, [(a, b, big / 4) for a in hosts for b in hosts
                                         if a != b], hop_latency_s=1e-4)
    assert fluid < pair < fluid + 3 * 4 * 2 * 1e-4 + 1e-3
    small = 4 * 1000
    assert flowmodel.all_to_all_s(topo, hosts, small, hop_latency_s=1e-4) == pytest.approx(
        flowmodel.transfers_s(topo, [(a, b, small / 4) for a in hosts for b in hosts
                                     if a != b], hop_latency_s=1e-4))
    assert flowmodel.all_to_all_s(topo, hosts[:1], big) == 0.0
    with pytest.raises(ValueError, match="not hosts of this topology"):
        flowmodel.all_to_all_s(topo, ["tbh9"], big)
