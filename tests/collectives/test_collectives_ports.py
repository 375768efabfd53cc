"""Deterministic ports: the mapping itself, and real TCP connections that use it."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from testbed.collectives import hd, ring
from testbed.collectives.ports import (
    FALLBACK_JOB_SLOTS,
    INA_AGG_PORT,
    MAX_BIG_RANKS,
    MAX_RANKS,
    MAX_TREE_DEPTH,
    TCP_BIG_LO,
    TCP_BIG_SLOTS,
    TCP_JOB_SLOTS,
    TCP_PORT_HI,
    TCP_PORT_LO,
    fallback_port,
    ina_worker_port,
    tcp_port,
    tcp_tuple,
)
from testbed.collectives.testing import connected_mesh
from testbed.collectives.transport import CollectiveError, Comm


def test_ports_stay_out_of_reserved_ranges():
    ports = {tcp_port(j, s, d) for j in range(TCP_JOB_SLOTS) for d in range(MAX_RANKS)
             for s in range(d + 1)}
    assert min(ports) >= TCP_PORT_LO and max(ports) <= TCP_PORT_HI
    assert not any(32768 <= p <= 60999 or 20000 <= p <= 29999 or 5201 <= p <= 5399
                   for p in ports)
    assert tcp_port(1, 3, 7) == tcp_port(1 + TCP_JOB_SLOTS, 3, 7)
    assert tcp_port(1, 3, 7) != tcp_port(2, 3, 7)
    assert ina_worker_port(7) == 20007 and ina_worker_port(10007) == 20007
    assert INA_AGG_PORT == 41000
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="job_id"):
            tcp_port(bad, 0, 1)
    with pytest.raises(ValueError, match="ranks"):
        tcp_port(1, 0, MAX_BIG_RANKS)
    with pytest.raises(ValueError, match="itself"):
        tcp_tuple(1, 2, 2)


def test_host_fallbacks_bind_a_port_per_job_and_depth():
    """A host serves one tree switch per depth of a job, and several jobs (or one job's plans,
    each under a job id of its own): every (job, depth) has its UDP port, clear of the INA
    workers', the aggregator's and the large jobs' TCP ports."""
    got = {fallback_port(j, d) for j in range(FALLBACK_JOB_SLOTS) for d in range(MAX_TREE_DEPTH)}
    assert len(got) == FALLBACK_JOB_SLOTS * MAX_TREE_DEPTH
    assert min(got) > INA_AGG_PORT and max(got) < TCP_BIG_LO
    assert fallback_port(5, 1) == fallback_port(5 + FALLBACK_JOB_SLOTS, 1)
    with pytest.raises(ValueError, match="levels"):
        fallback_port(1, MAX_TREE_DEPTH)
    with pytest.raises(ValueError, match="job_id"):
        fallback_port(-1, 0)


def test_every_port_of_a_job_is_its_own():
    """Each (src, dst) pair and each listener has a port of its own, so ranks sharing an
    address (co-located servers, tests on the loopback) never collide."""
    job = 3
    ports = [tcp_port(job, s, d) for d in range(MAX_RANKS) for s in range(d + 1)]
    assert len(ports) == len(set(ports)) == MAX_RANKS * (MAX_RANKS + 1) // 2
    with pytest.raises(ValueError, match="lower rank"):
        tcp_port(job, 4, 1)
    # the two ends of each flow see each other's ports
    assert tcp_tuple(job, 1, 4) == tcp_tuple(job, 4, 1)[::-1]
    assert tcp_tuple(job, 1, 4) == (tcp_port(job, 1, 4), tcp_port(job, 4, 4))
    # what ring / hd / rs ranks bind: distinct for every algorithm's peers
    for n in (5, 8):
        for peers in (lambda r, n=n: ring.ring_peers(r, n),
                      lambda r, n=n: hd.hd_peers(r, n, "allreduce")):
            bound = [tcp_port(job, r, p) for r in range(n) for p in peers(r) + [r] if p >= r]
            assert len(bound) == len(set(bound))


def test_a_job_of_more_than_64_ranks_has_a_port_per_peer_on_each_address():
    """Ranks 64..255 take ports above the ephemeral range, a block per job slot; every rank
    of a 256-rank job, one per address, binds each port once on its address (its listener
    and one per peer it connects to), and pairs below 64 keep their ports."""
    n, job = MAX_BIG_RANKS, 7
    big = {tcp_port(j, s, d) for j in range(TCP_BIG_SLOTS) for d in range(MAX_RANKS, n)
           for s in range(d + 1)}
    assert min(big) >= TCP_BIG_LO > 60999 and max(big) <= 65535
    assert tcp_port(job, 3, 7) == tcp_port(job, 3, 7) < TCP_BIG_LO
    for r in range(n):
        mine = [tcp_port(job, r, r)] + [tcp_port(job, r, p) for p in range(r + 1, n)]
        assert len(mine) == len(set(mine)), r
    # both ends of a pair with rank 70 bind block + 70: on two addresses
    assert tcp_tuple(job, 3, 70) == tcp_tuple(job, 70, 3)[::-1] == (tcp_port(job, 3, 70),
                                                                    tcp_port(job, 70, 70))


def _time_wait(ports: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-Htan", "state", "time-wait"], capture_output=True,
                         text=True, check=False).stdout
    return [ln for ln in out.splitlines()
            if any(f":{p} " in ln + " " for p in ports)]


@pytest.mark.skipif(subprocess.run(["which", "ss"], capture_output=True).returncode != 0,
                    reason="needs ss (iproute2)")
def test_connections_use_the_mapped_ports_and_leave_no_time_wait():
    """Three ranks on three loopback addresses: every socket's ends are the mapped ports,
    data flows, and closing leaves no TIME_WAIT, so the same job connects again at once."""
    n, job = 3, 41
    ips = [f"127.0.3.{r + 1}" for r in range(n)]
    ports = {tcp_port(job, s, d) for d in range(n) for s in range(d + 1)}
    for _round in range(2):
        comms = connected_mesh(job, ips)
        try:
            for r, c in enumerate(comms):
                for p, s in c.socks.items():
                    mine, peer = s.getsockname(), s.getpeername()
                    assert (mine[1], peer[1]) == tcp_tuple(job, r, p)
                    assert (mine[0], peer[0]) == (ips[r], ips[p])
            x = np.arange(1000, dtype=np.float32)
            got = np.empty_like(x)
            fut = comms[0].send(2, x)
            comms[2].recv(0, got)
            fut.result()
            assert np.array_equal(got, x)
        finally:
            for c in comms:
                c.close()
        assert _time_wait(ports) == []


def test_a_port_in_use_is_a_clear_error():
    c = Comm(0, ["h0", "h1"], 2.0, job_id=5)
    c.listen("127.0.3.9")
    try:
        other = Comm(0, ["h0", "h1"], 2.0, job_id=5 + TCP_JOB_SLOTS)
        with pytest.raises(CollectiveError, match="job_id"):
            other.listen("127.0.3.9")
    finally:
        c.close()
