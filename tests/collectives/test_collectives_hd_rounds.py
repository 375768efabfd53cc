"""Halving-doubling's rounds on real sockets: a round ends when its message left the socket
(``Comm.drain``), a large round starts with a rendezvous, and the per-round trace carries the
bytes the flow model charges (the traced sizes mix rounds with and without rendezvous)."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from testbed.collectives import flowmodel as fm
from testbed.collectives import hd
from testbed.collectives import spec as spec_mod
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import connected_mesh, run_ranks
from testbed.collectives.transport import CollectiveError, CollectiveTimeout, Comm


def _small_window(c: Comm, peer: int) -> None:
    """Shrink the receive buffer of ``c``'s socket to ``peer``: unread data stays unacked."""
    c.socks[peer].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)


def _big_send_buffer(c: Comm, peer: int) -> None:
    """Let ``c``'s socket to ``peer`` buffer a whole message (``sendall`` returns at once)."""
    c.socks[peer].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)


def test_drain_returns_only_after_the_peer_took_the_data():
    a, b = connected_mesh(61, ["127.0.6.1"] * 2)
    try:
        _small_window(b, 0)
        _big_send_buffer(a, 1)
        data = (np.arange(256 << 10) % 251).astype(np.uint8)
        done = {}

        def sender():
            a.send(1, data).result()
            done["buffered"] = time.monotonic()
            a.drain(1)
            done["drained"] = time.monotonic()

        t = threading.Thread(target=sender)
        t.start()
        time.sleep(0.3)  # the receiver reads nothing yet: the sender's bytes stay unacked
        assert "drained" not in done
        t_read = time.monotonic()
        got = np.empty_like(data)
        b.recv(0, got)
        t.join(5)
        assert done["buffered"] < t_read <= done["drained"]  # sendall alone is not enough
        assert np.array_equal(got, data)
        a.drain(1)  # nothing outstanding: returns at once
    finally:
        a.close()
        b.close()


def test_drain_times_out_when_the_peer_never_reads():
    a, b = connected_mesh(62, ["127.0.6.2"] * 2, timeout_s=0.5)
    try:
        _small_window(b, 0)
        a.send(1, np.zeros(2 << 20, dtype=np.uint8))  # fills the window, never read
        time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="unsent"):
            a.drain(1)
        assert time.monotonic() - t0 < 5
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("n", [4, 6])
def test_traced_rounds_move_the_bytes_the_model_charges(n, tmp_path, monkeypatch):
    """hd allreduce among n threads on loopback: the sum is the numpy sum, and every rank's
    trace line per round sends and receives exactly what the model's phase gives that rank."""
    monkeypatch.setenv(hd.TRACE_ENV, str(tmp_path))
    count = 10_000 * n + 3
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    outs = [np.empty(count, np.float32) for _ in range(n)]
    comms = connected_mesh(63 + n, ["127.0.6.3"] * n)
    try:
        run_ranks(comms, lambda r, comm: hd.allreduce(comm, xs[r], outs[r], n, 4096), join_s=30)
    finally:
        for c in comms:
            c.close()
    want = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for o in outs:
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-4)

    hosts = [f"h{i}" for i in range(n)]
    spec = CollectiveSpec(algo="hd", nbytes=4 * count)
    rounds = [p for p in fm.phases(spec, hosts) if p.name.startswith(("halving", "doubling"))]
    p2, rem, new, _old = hd.fold(n)
    for r in range(n):
        path = tmp_path / f"hd-rank{r}.jsonl"
        if new(r) is None:  # folded away: no power-of-two rounds
            assert not path.exists()
            continue
        trace = [json.loads(line) for line in path.read_text().splitlines()]
        assert [t["round"] for t in trace] == [p.name for p in rounds]
        for t, p in zip(trace, rounds, strict=True):
            out = [f for f in p.flows if f.src == hosts[r]]
            back = [f for f in p.flows if f.dst == hosts[r]]
            assert len(out) == len(back) == 1
            assert hosts[t["partner"]] == out[0].dst == back[0].src
            assert t["sent"] == out[0].nbytes and t["got"] == back[0].nbytes
            assert t["t0"] <= t["t_recv"] <= t["t_end"] and t["t_sent"] <= t["t_end"]


@pytest.mark.parametrize("n", [5, 8])
def test_broadcast_sends_one_round_at_a_time_as_the_model_phases(n, tmp_path, monkeypatch):
    """Binomial broadcast among n threads on loopback: every rank gets the root's array, each
    round moves the bytes of the model's phase of that name, and a rank's send of round 2d
    starts only once its send of round d left the socket (queued at once, a rank's sends
    shared its uplink: 4 MiB on a star of 8 took twice the model's binomial tree)."""
    monkeypatch.setenv(hd.TRACE_ENV, str(tmp_path))
    x = (np.arange(300_001) % 997).astype(np.float32)
    outs = [np.full(x.size, np.nan, np.float32) for _ in range(n)]
    comms = connected_mesh(70 + n, ["127.0.6.4"] * n)
    for c in comms:  # unread bytes stay unacked: a drain then waits for its receiver
        for peer in c.socks:
            _small_window(c, peer)
    try:
        run_ranks(comms, lambda r, comm: hd.broadcast(comm, x, outs[r], n, 4096), join_s=30)
    finally:
        for c in comms:
            c.close()
    for o in outs:
        assert np.array_equal(o, x)

    hosts = [f"h{i}" for i in range(n)]
    phases = fm.phases(CollectiveSpec(algo="hd", op="broadcast", nbytes=x.nbytes), hosts)
    for r in range(n):
        trace = [json.loads(line) for line in (tmp_path / f"hd-rank{r}.jsonl").read_text()
                 .splitlines()]
        want = [(p.name, f.dst if f.src == hosts[r] else f.src, f.nbytes if f.src == hosts[r]
                 else 0, f.nbytes if f.dst == hosts[r] else 0)
                for p in phases for f in p.flows if hosts[r] in (f.src, f.dst)]
        assert [(t["round"], hosts[t["partner"]], t["sent"], t["got"]) for t in trace] == want
        sends = [t for t in trace if t["sent"]]
        for a, b in zip(sends, sends[1:], strict=False):
            assert a["t_sent"] <= b["t0"]  # the next send starts once the last one drained
        assert all(t["t_sent"] >= t["t0"] for t in sends)


def test_a_large_round_waits_for_the_partner_to_enter_it():
    """The rendezvous: rank 0 may not send a large round's data before rank 1 said it entered
    the round (else that data would share rank 1's downlink with rank 1's previous round)."""
    a, b = connected_mesh(70, ["127.0.6.10"] * 2)
    big = spec_mod.HD_RENDEZVOUS_BYTES
    try:
        done = {}

        def early():
            hd._meet(a, 1, big, big - 4)
            done["a"] = time.monotonic()

        t = threading.Thread(target=early)
        t.start()
        time.sleep(0.3)
        assert "a" not in done  # still waiting for rank 1
        t_enter = time.monotonic()
        hd._meet(b, 0, big - 4, big)  # the same pair of sizes seen from the other side
        t.join(5)
        assert done["a"] >= t_enter
        # small rounds send eagerly: no message, so a lone rank does not wait
        t0 = time.monotonic()
        hd._meet(a, 1, big - 1, big - 1)
        assert time.monotonic() - t0 < 0.1
        # a partner that sends anything but "entered" is a protocol error, not data
        b.send(0, np.full(1, 7, np.uint8)).result()
        b.send(0, np.ones(1, np.uint8)).result()
        with pytest.raises(CollectiveError, match="rendezvous"):
            hd._meet(a, 1, big, big)
    finally:
        a.close()
        b.close()
