"""A rank receiving a large message is woken once per share of its receive buffer, not once per
arriving segment (``SO_RCVLOWAT``), receives it exactly, and leaves the socket as it found it."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from testbed.collectives.testing import connected_mesh
from testbed.collectives.transport import _LOWAT_MIN_BYTES, CollectiveTimeout


def _wakeups() -> int:
    """This thread's voluntary context switches so far (each wait that slept)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc/thread-self/status")


def _trickle(sock: socket.socket, data: bytes, piece: int, gap_s: float) -> None:
    for i in range(0, len(data), piece):
        sock.sendall(data[i:i + piece])
        time.sleep(gap_s)


def test_a_trickled_message_wakes_the_receiver_a_few_times_and_arrives_exact():
    a, b = connected_mesh(91, ["127.0.9.1", "127.0.9.2"])
    try:
        data = np.random.default_rng(1).integers(0, 256, 96 << 10, dtype=np.uint8)
        out = np.zeros_like(data)
        piece = 256  # 384 sends, each its own segment (TCP_NODELAY), 0.3 ms apart
        sender = threading.Thread(target=_trickle, args=(a.socks[1], data.tobytes(), piece,
                                                         3e-4))
        before = _wakeups()
        sender.start()
        b.recv(0, out)
        woken = _wakeups() - before
        sender.join()
        np.testing.assert_array_equal(out, data)
        # without the mark the receiver slept and woke for every piece (384); with it, once
        # per share of the buffer (~2.7 KiB of 87 KiB at first, more as autotuning grows it)
        assert woken < len(data) // piece // 3, woken
        # the mark is back at 1: a peer polling this socket sees its next byte at once
        assert b.socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        a.close()
        b.close()


def test_a_small_message_and_a_silent_peer_keep_the_old_behaviour():
    a, b = connected_mesh(92, ["127.0.9.3", "127.0.9.4"], timeout_s=0.5)
    try:
        small = np.arange(_LOWAT_MIN_BYTES // 8, dtype=np.float32)  # below the threshold
        a.send(1, small).result()
        got = np.empty_like(small)
        b.recv(0, got)
        np.testing.assert_array_equal(got, small)
        # a large message of which only a part arrives: the timeout still names what came
        part = np.ones(64 << 10, dtype=np.uint8)
        a.send(1, part[:1000]).result()
        try:
            b.recv(0, part.copy())
            raise AssertionError("expected a timeout")
        except CollectiveTimeout as e:
            assert "1000/65536 B" in str(e), e
        assert b.socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        a.close()
        b.close()


def test_a_peer_slower_than_the_mark_per_timeout_is_slow_not_silent():
    """A thin link fills the mark (here ~2.7 KiB) more slowly than the timeout (0.2 s): the
    rank takes what came and waits on, failing only when nothing at all came for that long."""
    a, b = connected_mesh(93, ["127.0.9.5", "127.0.9.6"], timeout_s=0.2)
    try:
        data = np.random.default_rng(2).integers(0, 256, _LOWAT_MIN_BYTES, dtype=np.uint8)
        out = np.zeros_like(data)
        # 128 B every 20 ms: 6.4 kB/s, every byte within the timeout of the one before
        sender = threading.Thread(target=_trickle, args=(a.socks[1], data.tobytes(), 128,
                                                         0.02))
        sender.start()
        b.recv(0, out)
        sender.join()
        np.testing.assert_array_equal(out, data)
        assert b.socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        a.close()
        b.close()
