"""Packet I/O: the PACKET_MMAP ring walks against their plain-Python twins, and real frames
through ring ports on a veth pair."""

from __future__ import annotations

import contextlib
import struct
import subprocess

import numpy as np
import pytest

from testbed.datapath.engine import Engine
from testbed.datapath.io import (
    TP_STATUS_AVAILABLE,
    TP_STATUS_SEND_REQUEST,
    TP_STATUS_SENDING,
    TP_STATUS_USER,
    copy_bytes,
    ring_rx,
    ring_tx,
    ring_tx_cancel,
    ring_tx_pending,
)
from testbed.datapath.reference import io as ref

FS = 2048  # slot size, as the ports use


def _rx_ring(rng, nframes: int, head: int) -> bytearray:
    """An RX ring whose slots from ``head`` on hold a run of frames (random lengths and MAC
    offsets), then a slot the kernel owns, then more frames the walk must not reach."""
    ring = bytearray(nframes * FS)
    ready = int(rng.integers(0, nframes + 1))
    for k in range(nframes):
        h = (head + k) % nframes
        if k == ready:
            continue  # kernel's: the walk stops here
        mac = int(rng.choice([66, 82, 98]))
        snap = int(rng.integers(1, FS - mac + 1))
        struct.pack_into("<IIIHH", ring, h * FS, TP_STATUS_USER, snap + 4, snap, mac, mac + 14)
        ring[h * FS + mac: h * FS + mac + snap] = rng.bytes(snap)
    return ring


@pytest.mark.parametrize("seed", range(12))
def test_ring_rx_matches_twin(seed):
    """Frames copied to the batch rows, lengths, slots handed back and the next head agree
    with the twin, including frames cut to a row and a walk that wraps around the ring."""
    rng = np.random.default_rng(seed)
    nframes = int(rng.integers(1, 40))
    head = int(rng.integers(0, nframes))
    row_bytes = int(rng.choice([1024, 2048]))
    max_count = int(rng.integers(0, nframes + 3))
    ring = _rx_ring(rng, nframes, head)
    twin_ring = bytearray(ring)
    frames, twin_head = ref.ring_rx(twin_ring, FS, nframes, head, max_count, row_bytes)

    arr = np.frombuffer(bytearray(ring), np.uint8).copy()
    buf = np.zeros((max_count + 3, row_bytes), np.uint8)
    lengths = np.zeros(max_count + 3, np.int32)
    got, new_head = ring_rx(arr, arr.view("<u4"), FS, nframes, head, buf, 2, max_count, lengths)
    assert (got, new_head) == (len(frames), twin_head)
    assert [bytes(buf[2 + i, : lengths[2 + i]]) for i in range(got)] == frames
    assert arr.tobytes() == bytes(twin_ring)


@pytest.mark.parametrize("seed", range(12))
def test_ring_tx_matches_twin(seed):
    """Slots filled and marked, refused frames (empty, longer than a slot holds), the stop at
    the first slot the kernel still holds, and the next head agree with the twin."""
    rng = np.random.default_rng(100 + seed)
    nframes = int(rng.integers(1, 40))
    base = int(rng.choice([0, 4 * FS]))
    head = int(rng.integers(0, nframes))
    ring = bytearray(base + nframes * FS)
    busy = int(rng.integers(0, nframes + 1))  # first slot (from head) the kernel still holds
    for k in range(busy, nframes):
        h = (head + k) % nframes
        held = (TP_STATUS_SEND_REQUEST, TP_STATUS_SENDING)
        st = rng.choice(held) if k == busy else rng.choice(held + (TP_STATUS_AVAILABLE,))
        struct.pack_into("<I", ring, base + h * FS, int(st))
    count = int(rng.integers(0, nframes + 5))
    # mostly frames that fit a slot; some empty or longer than a slot's 2016 bytes
    lens = np.where(rng.random(count) < 0.7, rng.integers(60, 1515, count),
                    rng.integers(0, 2049, count))
    buf = np.zeros((count + 1, 2048), np.uint8)
    for i, n in enumerate(lens):
        buf[i, :n] = rng.integers(0, 256, n)
    frames = [bytes(buf[i, :n]) for i, n in enumerate(lens)]
    twin_ring = bytearray(ring)
    want = ref.ring_tx(twin_ring, base, FS, nframes, head, frames)

    arr = np.frombuffer(bytearray(ring), np.uint8).copy()
    rows = np.arange(count, dtype=np.int64)
    got = ring_tx(arr, arr.view("<u4"), base, FS, nframes, head, buf, rows,
                  lens.astype(np.int32), count)
    assert tuple(got) == want
    assert arr.tobytes() == bytes(twin_ring)
    # every slot it filled waits for a send(); cancelling (the link went down) gives them all
    # back and moves the head back to the first, where the kernel stopped, as its twin does
    w32 = arr.view("<u4")
    pending = ring_tx_pending(w32, base, FS, nframes, got[1], got[0])
    assert pending == got[0]
    want = ref.ring_tx_cancel(twin_ring, base, FS, nframes, got[1])
    assert tuple(ring_tx_cancel(w32, base, FS, nframes, got[1])) == want
    assert arr.tobytes() == bytes(twin_ring)
    # what it filled is freed (and any marked slots just before them: the kernel's run)
    assert want[0] >= got[0]
    slots = w32[base // 4::FS // 4][:nframes]
    assert all(slots[(got[1] - 1 - k) % nframes] == TP_STATUS_AVAILABLE for k in range(want[0]))
    assert want[0] == nframes or slots[(want[1] - 1) % nframes] != TP_STATUS_SEND_REQUEST


def test_copy_bytes_is_a_memcpy_at_any_offset():
    """``copy_bytes`` equals numpy slicing for unaligned offsets and lengths, into 2-D rows."""
    from numba import njit

    @njit
    def cp(dst, doff, src, soff, n):
        copy_bytes(dst, doff, src, soff, n)

    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 10_000).astype(np.uint8)
    for soff, doff, n in ((0, 0, 0), (1, 3, 17), (66, 2048, 1514), (9_000, 4_095, 1_000)):
        dst = np.zeros((4, 2048), np.uint8)
        cp(dst, doff, src, soff, n)
        flat = dst.reshape(-1)
        assert np.array_equal(flat[doff:doff + n], src[soff:soff + n])
        assert not flat[:doff].any() and not flat[doff + n:].any()


def test_engine_io_settings_are_checked():
    """Bad I/O settings fail with a message naming the setting."""
    with pytest.raises(ValueError, match="io must be"):
        Engine({"ports": ["x"], "programs": ["forward"], "io": "xdp"})
    with pytest.raises(ValueError, match="rx_ring_frames"):
        Engine({"ports": ["x"], "programs": ["forward"], "rx_ring_frames": 8})
    with pytest.raises(ValueError, match="tx_ring_frames"):
        Engine({"ports": ["x"], "programs": ["forward"], "tx_ring_frames": 1 << 20})
    assert Engine({"ports": ["x"], "programs": ["forward"], "tx_ring_frames": 0}).ring_frames["tx_ring_frames"] == 0


def _frames(n: int, seed: int = 0) -> list[bytes]:
    from testbed.datapath.aggclient import udp_frame

    rng = np.random.default_rng(seed)
    return [udp_frame(b"\x02\0\0\0\0\1", b"\x02\0\0\0\0\2", bytes([10, 0, 0, 1]),
                      bytes([10, 0, 0, 2]), 1000 + k, 9,
                      k.to_bytes(4, "little") + rng.bytes(int(rng.integers(20, 1400))))
            for k in range(n)]


def _rows(frames: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``frames`` as the rows of a send buffer and their lengths."""
    buf = np.zeros((len(frames), 2048), np.uint8)
    lens = np.zeros(len(frames), np.int32)
    for i, f in enumerate(frames):
        buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        lens[i] = len(f)
    return buf, lens


@contextlib.contextmanager
def _veth(a: str, b: str):
    """A veth pair ``a``-``b``, both up, under the emulation lock; yields a list whose ports
    are closed (and the pair deleted) however the block ends."""
    from testbed.netlock import emulation_lock

    with emulation_lock():
        subprocess.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=True)
        ports: list = []
        try:
            for d in (a, b):
                subprocess.run(["ip", "link", "set", d, "up"], check=True)
            yield ports
        finally:
            for p in ports:
                p.close()
            subprocess.run(["ip", "link", "del", a], check=False)


@pytest.mark.mininet
@pytest.mark.parametrize("tx_frames", [512, 0])
def test_ring_ports_move_real_frames_exactly(tx_frames):
    """Frames sent through a TX ring (or sendmmsg) arrive byte for byte, in order, through the
    peer's RX ring and through a plain recvmmsg port; nothing is refused or dropped."""
    from testbed.datapath.io import PacketPort, RingPort, probe_rings
    from testbed.doctor import run_checks

    assert probe_rings()[0], "this kernel has no PACKET_MMAP rings"
    assert {c["name"]: c["status"] for c in run_checks()}["packet-mmap"] == "ok"
    frames = _frames(300)
    tx_buf, lens = _rows(frames)
    with _veth("tbio0", "tbio1") as ports:
        rx_buf = np.zeros((1024, 2048), np.uint8)
        rx_len = np.zeros(1024, np.int32)
        ring_rx_port = RingPort("tbio1", rx_buf, rx_frames=1024, tx_frames=32)
        mmsg_rx_port = PacketPort("tbio1", np.zeros((1024, 2048), np.uint8))
        # a send-only port (no RX ring), or an RX ring and sendmmsg
        sender = RingPort("tbio0", tx_buf, rx_frames=0 if tx_frames else 32,
                          tx_frames=tx_frames)
        ports += [ring_rx_port, mmsg_rx_port, sender]
        if tx_frames:
            assert sender.recv_burst(0, 10, np.zeros(10, np.int32)) == 0
        sent = 0
        for lo in range(0, len(frames), 64):
            sent += sender.send_rows(np.arange(lo, min(lo + 64, len(frames))), lens)
        assert sent == len(frames) and sender.tx_errors == 0
        got = []
        for _ in range(200):
            n = ring_rx_port.recv_burst(0, 1024, rx_len)
            got += [bytes(rx_buf[i, :rx_len[i]]) for i in range(n)]
            if sum(g[12:14] == b"\x08\x00" for g in got) >= len(frames):
                break
            __import__("time").sleep(0.01)
        ours = [g for g in got if g[12:14] == b"\x08\x00"]  # the veth's IPv6 chatter aside
        assert ours == frames
        assert ring_rx_port.stats()["drops"] == 0
        m_len = np.zeros(1024, np.int32)
        n = mmsg_rx_port.recv_burst(0, 1024, m_len)
        plain = [bytes(mmsg_rx_port.buf[i, :m_len[i]]) for i in range(n)]
        assert [g for g in plain if g[12:14] == b"\x08\x00"] == frames
        ring_rx_port.send_one(frames[0])  # the slow path goes through the TX ring too
        assert ring_rx_port.tx_errors == 0


def test_coalescing_wait_adapts_to_the_engines_cpu_between_its_bounds():
    """The wait doubles while the engine is busy, up to its ceiling, and halves back to the
    configured one once it is mostly idle; in between it stays."""
    from testbed.datapath.engine import COALESCE_MAX_FACTOR, adapt_hold

    base = 50e-6
    hold = base
    for _ in range(5):
        hold = adapt_hold(hold, 0.9, base)
    assert hold == pytest.approx(base * COALESCE_MAX_FACTOR)
    assert adapt_hold(hold, 0.4, base) == hold
    for _ in range(5):
        hold = adapt_hold(hold, 0.1, base)
    assert hold == pytest.approx(base)
    assert adapt_hold(0.0, 0.9, 0.0) == 0.0  # coalescing off stays off


@pytest.mark.mininet
def test_ring_ports_send_again_after_their_link_went_down_and_up():
    """A link that goes down while frames wait in the TX ring: they are lost (counted), the
    socket's pending error is read once (poll stops reporting it, else an engine spins), and
    once the link is back the port sends again: the ring's head went back to where the
    kernel's stopped."""
    import select

    from testbed.datapath.io import RingPort

    frames = _frames(40)
    tx_buf, lens = _rows(frames)
    with _veth("tbio2", "tbio3") as ports:
        rx_buf = np.zeros((256, 2048), np.uint8)
        rx_len = np.zeros(256, np.int32)
        receiver = RingPort("tbio3", rx_buf, rx_frames=256, tx_frames=32)
        sender = RingPort("tbio2", tx_buf, rx_frames=32, tx_frames=64)
        ports += [receiver, sender]
        subprocess.run(["ip", "link", "set", "tbio2", "down"], check=True)
        poller = select.poll()
        poller.register(sender.fileno(), select.POLLIN)
        assert any(ev & select.POLLERR for _, ev in poller.poll(100))
        assert sender.clear_error() > 0 and sender.down_events >= 1
        assert not any(ev & select.POLLERR for _, ev in poller.poll(0))
        sender.send_rows(np.arange(20), lens)  # the kernel refuses: lost, counted
        assert sender.tx_errors == 20
        subprocess.run(["ip", "link", "set", "tbio2", "up"], check=True)
        for _ in range(50):  # the veth's carrier comes back a moment later
            if open("/sys/class/net/tbio2/operstate").read().strip() == "up":
                break
            __import__("time").sleep(0.02)
        assert sender.send_rows(np.arange(20, 40), lens) == 20
        got = []
        for _ in range(200):
            n = receiver.recv_burst(0, 256, rx_len)
            got += [bytes(rx_buf[i, :rx_len[i]]) for i in range(n)]
            if sum(g[12:14] == b"\x08\x00" for g in got) >= 20:
                break
            __import__("time").sleep(0.01)
        assert [g for g in got if g[12:14] == b"\x08\x00"] == frames[20:]
