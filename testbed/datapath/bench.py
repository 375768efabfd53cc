"""Load tools of the data-path benchmark and tests, run inside emulated hosts.

* :func:`build_ring` - frames a generator cycles through: UDP frames to the discard port, or
  aggregation contributions of ``N_AGG_WORKERS`` workers in protocol order;
* :func:`gen` - a batched sender of a pre-built ring of frames (through a PACKET_MMAP TX ring,
  or ``sendmmsg``), at full speed or paced; :func:`sink` - counts (and optionally saves) the
  matching frames arriving;
* :func:`naive_forwarder` - a per-packet Python AF_PACKET forwarder (the benchmark's floor);
* :func:`save_frames` / :func:`load_frames` - frame files (npz) to compare what was sent with
  what arrived.

::

    python -m testbed.datapath.bench gen --iface tbh1-eth0 ...
    python -m testbed.datapath.bench sink --iface tbh2-eth0 ...
    python -m testbed.datapath.bench naive --ports tbs1-eth1 tbs1-eth2

The benchmark that builds networks around them is ``testbed.bench.datapath``
(``testbed bench datapath``). Only numpy is imported at module level (the tools must start
fast inside hosts).
"""

from __future__ import annotations

import argparse
import gc
import json
import select
import signal
import socket
import time

import numpy as np

from testbed.datapath.aggclient import header_bytes, udp_frame
from testbed.datapath.io import PacketPort, open_port
from testbed.kernels.wire import FIELD_OFFSETS, HEADER_OFFSET, MsgType

BENCH_UDP_PORT = 9  # discard; the sink counts only frames to this port (or RESULTs)
N_AGG_WORKERS = 2
AGG_SLOTS = 64
#: UDP source port of the aggregation contributions the generator sends
AGG_SPORT = 41001
#: seconds a generator sends by default
DURATION_S = 2.0
#: frames per generator burst, and TX ring slots of the generator's port
GEN_BURST = 256
GEN_TX_FRAMES = 4096


def _mac(s: str) -> bytes:
    return bytes(int(x, 16) for x in s.split(":"))


def _ip(s: str) -> bytes:
    return bytes(int(x) for x in s.split("."))


def build_ring(mode: str, src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, elems: int,
               count: int, seed: int = 0) -> list[bytes]:
    """Frames the generator cycles through.

    ``udp``: ``count`` UDP frames to port 9 whose payload starts with a sequence number
    (``elems`` = 0: each frame a random size from 8 bytes to a full 1500-byte MTU).
    ``agg``: contributions of ``N_AGG_WORKERS`` workers for ``2*AGG_SLOTS`` chunks in protocol
    order (all workers' chunk k before chunk k+1), job 1; cycling it repeats the slot/set pattern.
    """
    rng = np.random.default_rng(seed)
    sm, dm, si, di = _mac(src_mac), _mac(dst_mac), _ip(src_ip), _ip(dst_ip)
    frames = []
    if mode == "udp":
        for k in range(count):
            plen = 28 + 4 * elems if elems > 0 else int(rng.integers(8, 1473))
            body = k.to_bytes(8, "little") + rng.bytes(plen - 8)
            frames.append(udp_frame(sm, dm, si, di, 40000 + k % 64, BENCH_UDP_PORT, body))
    elif mode == "agg":
        for k in range(2 * AGG_SLOTS):
            for w in range(N_AGG_WORKERS):
                vals = rng.integers(-1000, 1000, elems, dtype=np.int32)
                data = header_bytes(int(MsgType.DATA), 1, w, k % AGG_SLOTS,
                                    (k // AGG_SLOTS) % 2, N_AGG_WORKERS, elems, k * elems,
                                    seq=k // AGG_SLOTS)
                frames.append(udp_frame(sm, dm, si, di, AGG_SPORT, 41000, data + vals.tobytes()))
    else:
        raise ValueError(f"mode must be 'udp' or 'agg', got {mode!r}")
    return frames


def save_frames(path: str, frames: list[bytes]) -> None:
    """Write frames to ``path`` (npz: concatenated bytes + lengths)."""
    data = np.frombuffer(b"".join(frames), np.uint8) if frames else np.zeros(0, np.uint8)
    np.savez(path, data=data, lens=np.array([len(f) for f in frames], np.int64))


def load_frames(path: str) -> list[bytes]:
    """Frames written by :func:`save_frames`."""
    z = np.load(path)
    data, lens = z["data"].tobytes(), z["lens"]
    offs = np.concatenate([[0], np.cumsum(lens)])
    return [data[offs[i] : offs[i + 1]] for i in range(len(lens))]


def gen(iface: str, frames: list[bytes], duration: float, count: int = 0,
        burst: int = GEN_BURST, pps: float = 0.0, seq_step: int = 0, io: str = "ring") -> dict:
    """Send ``frames`` cyclically for ``duration`` s (or exactly ``count`` frames), batched.

    ``io="ring"``: each burst is copied into a PACKET_MMAP TX ring by one Numba call and sent by
    one ``send()`` (the kernel walks the ring); ``"mmsg"``: one ``sendmmsg`` per burst.
    ``pps`` > 0 paces the sender (for loss-free correctness runs); 0 = as fast as possible.
    ``seq_step`` (even) > 0: every pass over the ring advances the testbed header's round
    (``seq``) by that much, so aggregation contributions stay in protocol order forever.
    Returns ``{"sent", "seconds", "cpu_s", "refused", "io"}``; ``cpu_s`` is the sender's CPU
    time while sending, ``refused`` counts frames the kernel had no room for at the moment (they
    are sent again in the next burst, never skipped).
    """
    if seq_step % 2:
        raise ValueError(f"seq_step must be even (the register set is seq & 1), got {seq_step}")
    ring = len(frames)
    reps = max(1, -(-burst // ring)) + 1  # ring repeated so any burst is a contiguous slice
    buf = np.zeros((ring * reps, 2048), np.uint8)
    lens = np.zeros(ring * reps, np.int32)
    for r in range(reps):
        for i, f in enumerate(frames):
            buf[r * ring + i, : len(f)] = np.frombuffer(f, np.uint8)
            lens[r * ring + i] = len(f)
    port = open_port(iface, buf, io=io, promisc=False, rx_frames=0, tx_frames=GEN_TX_FRAMES)
    rows = np.arange(ring * reps, dtype=np.int64)
    off = HEADER_OFFSET + FIELD_OFFSETS["seq"]
    seq_col = buf[:, off:off + 4].view("<u4")
    # row r*ring+i carries pass r of the ring: its rounds are seq_step*r ahead of pass 0
    seq0 = seq_col.copy() + np.uint32(seq_step) * (np.arange(ring * reps, dtype=np.uint32)
                                                   // ring)[:, None]
    gc.collect()
    gc.freeze()  # the loop allocates little; nothing old for the collector to walk
    passes = 0
    sent = 0
    refused = 0
    pos = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    t_end = t0 + duration
    while True:
        now = time.perf_counter()
        if now >= t_end or (count and sent >= count):
            break
        n = burst if not count else min(burst, count - sent)
        if pps > 0:
            due = (sent + n) / pps - (now - t0)
            if due > 0:
                time.sleep(min(due, 0.01))
                continue
        done = port.send_rows(rows[pos:pos + n], lens)
        refused += n - done
        sent += done
        if seq_step and pos + done >= ring:  # passes over the ring ended: next rounds
            passes += (pos + done) // ring
            seq_col[:] = seq0 + np.uint32(seq_step * passes)
        pos = (pos + done) % ring
    el = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    io_used = port.io
    port.close()
    return {"sent": sent, "seconds": el, "cpu_s": round(cpu, 4), "refused": refused,
            "io": io_used}


def sink(iface: str, duration: float, count: int = 0, save: str | None = None,
         results: bool = False, ready_file: str | None = None) -> dict:
    """Count frames to UDP port 9 (or testbed RESULTs with ``results``) arriving on ``iface``.

    Stops after ``duration`` s, 1 s after the last frame once frames flowed, or when ``count``
    frames arrived. ``save`` writes the matching frames (see :func:`save_frames`).
    """
    buf = np.zeros((256, 2048), np.uint8)
    lens = np.zeros(256, np.int32)
    port = PacketPort(iface, buf, promisc=False)
    if ready_file:
        open(ready_file, "w").close()
    got = 0
    nbytes = 0
    first = last = None
    saved: list[bytes] = []
    poller = select.poll()
    poller.register(port.fileno(), select.POLLIN)
    t_end = time.monotonic() + duration
    while time.monotonic() < t_end and not (count and got >= count):
        if first is not None and time.monotonic() - last > 1.0:
            break
        if not poller.poll(50):
            continue
        n = port.recv_burst(0, 256, lens)
        if not n:
            continue
        now = time.monotonic()
        fr = buf[:n]
        is_udp = (fr[:, 12] == 8) & (fr[:, 13] == 0) & (fr[:, 23] == 17)
        dport = (fr[:, 36].astype(np.int32) << 8) | fr[:, 37]
        if results:
            match = is_udp & (fr[:, HEADER_OFFSET + 3] == int(MsgType.RESULT)) & (
                ((fr[:, 34].astype(np.int32) << 8) | fr[:, 35]) == 41000)
        else:
            match = is_udp & (dport == BENCH_UDP_PORT)
        m = int(match.sum())
        if m:
            if first is None:
                first = now
            last = now
            got += m
            nbytes += int(lens[:n][match].sum())
            if save is not None:
                saved.extend(bytes(buf[i, : lens[i]]) for i in np.flatnonzero(match))
    port.close()
    span = (last - first) if first is not None and last > first else 0.0
    if save is not None:
        save_frames(save, saved)
    return {"received": got, "bytes": nbytes, "span_s": span,
            "kpps": got / span / 1e3 if span else 0.0}


def naive_forwarder(ports: list[str]) -> None:
    """Per-packet Python forwarder between ``ports`` (the benchmark's floor): recv, send."""
    socks = []
    for p in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        s.setsockopt(263, 23, 1)  # PACKET_IGNORE_OUTGOING
        s.bind((p, 3))
        s.setblocking(False)
        socks.append(s)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    by_fd = {s.fileno(): s for s in socks}
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    while not stop:
        for fd, _ in poller.poll(200):
            s = by_fd[fd]
            while True:
                try:
                    frame = s.recv(2048)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                for o in socks:
                    if o is not s:
                        try:
                            o.send(frame)
                        except OSError:
                            pass


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="data-path benchmark and its load tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("--iface", required=True)
    g.add_argument("--mode", default="udp", choices=["udp", "agg"])
    g.add_argument("--src-mac", required=True)
    g.add_argument("--dst-mac", required=True)
    g.add_argument("--src-ip", required=True)
    g.add_argument("--dst-ip", required=True)
    g.add_argument("--elems", type=int, default=256)
    g.add_argument("--ring", type=int, default=256)
    g.add_argument("--duration", type=float, default=DURATION_S)
    g.add_argument("--count", type=int, default=0)
    g.add_argument("--pps", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save", help="write the frames sent (npz) for comparison")
    g.add_argument("--load", help="send the frames of this npz (save_frames) instead")
    g.add_argument("--seq-step", type=int, default=0,
                   help="advance the rounds (seq) by this much per pass over the ring")
    g.add_argument("--burst", type=int, default=GEN_BURST, help="frames per burst")
    g.add_argument("--io", default="ring", choices=["ring", "mmsg"],
                   help="PACKET_MMAP TX ring or sendmmsg")
    s = sub.add_parser("sink")
    s.add_argument("--iface", required=True)
    s.add_argument("--duration", type=float, default=DURATION_S + 4)
    s.add_argument("--count", type=int, default=0)
    s.add_argument("--save")
    s.add_argument("--results", action="store_true")
    s.add_argument("--ready-file")
    n = sub.add_parser("naive")
    n.add_argument("marker", nargs="?", help="testbed-node=<name>")
    n.add_argument("--ports", nargs="+", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "gen":
        if a.load:
            frames = load_frames(a.load)
        else:
            frames = build_ring(a.mode, a.src_mac, a.dst_mac, a.src_ip, a.dst_ip, a.elems,
                                a.count or a.ring, a.seed)
        if a.save:
            save_frames(a.save, frames)
        print(json.dumps(gen(a.iface, frames, a.duration if not a.count else 3600, a.count,
                             burst=a.burst, pps=a.pps, seq_step=a.seq_step, io=a.io)))
    elif a.cmd == "sink":
        print(json.dumps(sink(a.iface, a.duration, a.count, a.save, a.results, a.ready_file)))
    else:
        naive_forwarder(a.ports)
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())
