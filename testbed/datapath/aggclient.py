"""A minimal SwitchML worker over a real UDP socket, plus frame builders for tests.

Run inside a Mininet host::

    python -m testbed.datapath.aggclient --job 1 --worker 0 --n 4 --slots 8 --length 4096 \\
        --seed 7 --out /tmp/w0.npy

The worker's input is :func:`worker_input` (seeded, so a test can compute the expected sum).
Protocol (docs/architecture.md): chunk ``k`` uses slot ``k mod W`` and set ``(k div W) mod 2``;
at most ``W`` chunks are outstanding; a chunk unanswered after ``timeout`` is sent again as
``RETRANSMIT``. ``--loss p`` drops each outgoing contribution *and* each incoming result with
probability ``p`` (seeded) to exercise recovery from both directions. ``--die-after k`` makes the
worker exit after sending ``k`` chunks (a dead worker, for the pool-wedging test).

Imports only numpy (no numba): a worker process starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

import numpy as np

from testbed.kernels.wire import (
    HEADER_LEN,
    TESTBED_UDP_PORT,
    Codec,
    MsgType,
    new_headers,
)

DEFAULT_AGG_IP = "10.0.0.254"


def worker_input(seed: int, job: int, worker: int, length: int, n_workers: int) -> np.ndarray:
    """The int32 vector worker ``worker`` of ``job`` contributes (no overflow for n workers)."""
    rng = np.random.default_rng([seed, job, worker])
    lim = (2**31 - 1) // max(1, n_workers)
    return rng.integers(-lim, lim, size=length, dtype=np.int64).astype(np.int32)


def header_bytes(msg_type: int, job: int, worker: int, slot: int, sset: int, n_workers: int,
                 elem_count: int, chunk_offset: int, exponent: int = 0,
                 codec: int = int(Codec.INT32), flags: int = 0) -> bytes:
    """The 28-byte testbed header (built with the numpy dtype from ``wire``)."""
    h = new_headers(1)
    h["msg_type"], h["job_id"], h["worker_id"] = msg_type, job, worker
    h["slot"], h["slot_set"], h["n_workers"] = slot, sset, n_workers
    h["elem_count"], h["chunk_offset"], h["exponent"] = elem_count, chunk_offset, exponent
    h["codec"], h["flags"] = codec, flags
    return h.tobytes()


def udp_frame(src_mac: bytes, dst_mac: bytes, src_ip: bytes, dst_ip: bytes, sport: int,
              dport: int, data: bytes) -> bytes:
    """Ethernet/IPv4/UDP frame with correct IP and UDP checksums."""
    def csum(b: bytes) -> int:
        if len(b) % 2:
            b += b"\0"
        s = sum(struct.unpack(f"!{len(b) // 2}H", b))
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        return ~s & 0xFFFF

    tot = 28 + len(data)
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, tot, 0, 0x4000, 64, 17, 0, src_ip,
                               dst_ip))
    ip[10:12] = csum(bytes(ip)).to_bytes(2, "big")
    udp = bytearray(struct.pack("!HHHH", sport, dport, 8 + len(data), 0))
    c = csum(src_ip + dst_ip + struct.pack("!BBH", 0, 17, 8 + len(data)) + bytes(udp) + data)
    udp[6:8] = (c or 0xFFFF).to_bytes(2, "big")
    return dst_mac + src_mac + b"\x08\x00" + bytes(ip) + bytes(udp) + data


class Worker:
    """One worker of one job, aggregating an int32 vector through the switch."""

    def __init__(self, job: int, worker: int, n_workers: int, slots: int, values: np.ndarray,
                 elems: int = 256, agg_ip: str = DEFAULT_AGG_IP, timeout: float = 0.02,
                 loss: float = 0.0, seed: int = 0, die_after: int = -1):
        if not 0 <= worker < n_workers <= 32:
            raise ValueError(f"worker {worker} / n_workers {n_workers}: need 0 <= worker < n <= 32")
        if slots < 1 or elems < 1:
            raise ValueError("slots and elems must be >= 1")
        self.job, self.worker, self.n, self.slots, self.elems = job, worker, n_workers, slots, elems
        self.values = np.ascontiguousarray(values, dtype=np.int32)
        self.chunks = -(-len(self.values) // elems)
        self.agg = (agg_ip, TESTBED_UDP_PORT)
        self.timeout = timeout
        self.loss = loss
        self.rng = np.random.default_rng([seed, job, worker, 99])
        self.die_after = die_after
        self.result = np.zeros(len(self.values), np.int32)
        self.stats = {"sent": 0, "retransmitted": 0, "lost_tx": 0, "lost_rx": 0,
                      "results": 0, "duplicate_results": 0}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.settimeout(0.002)

    def _send(self, k: int, retransmit: bool) -> None:
        lo = k * self.elems
        chunk = self.values[lo : lo + self.elems]
        mt = MsgType.RETRANSMIT if retransmit else MsgType.DATA
        data = header_bytes(int(mt), self.job, self.worker, k % self.slots,
                            (k // self.slots) % 2, self.n, len(chunk), lo) + chunk.tobytes()
        self.stats["retransmitted" if retransmit else "sent"] += 1
        if self.loss and self.rng.random() < self.loss:
            self.stats["lost_tx"] += 1
            return
        self.sock.sendto(data, self.agg)

    def run(self, deadline_s: float = 60.0) -> np.ndarray:
        """Aggregate all chunks; return the element-wise sum over the job's workers."""
        outstanding: dict[int, float] = {}  # chunk -> last send time
        done = np.zeros(self.chunks, np.bool_)
        nxt = 0
        t_end = time.monotonic() + deadline_s
        while not done.all():
            now = time.monotonic()
            if now > t_end:
                raise TimeoutError(f"worker {self.worker}: {int(done.sum())}/{self.chunks} "
                                   f"chunks after {deadline_s} s")
            while nxt < self.chunks and len(outstanding) < self.slots:
                if self.die_after >= 0 and nxt >= self.die_after:
                    self.sock.close()
                    raise SystemExit(3)
                # chunk nxt reuses slot nxt % W: only after chunk nxt - W completed
                if nxt >= self.slots and not done[nxt - self.slots]:
                    break
                self._send(nxt, False)
                outstanding[nxt] = time.monotonic()
                nxt += 1
            try:
                pkt = self.sock.recv(2048)
            except TimeoutError:
                pkt = None
            if pkt is not None and len(pkt) >= HEADER_LEN:
                self._on_result(pkt, outstanding, done)
            now = time.monotonic()
            for k, t in list(outstanding.items()):
                if now - t > self.timeout:
                    self._send(k, True)
                    outstanding[k] = now
        self.sock.close()
        return self.result

    def _on_result(self, pkt: bytes, outstanding: dict, done: np.ndarray) -> None:
        (_m, _v, mt, job, _w, slot, sset, _f, _c, _n, _e, ne, _h, off,
         _s) = struct.unpack_from("<HBBHHHBBBBhHHIf", pkt, 0)
        if mt != MsgType.RESULT or job != self.job or off % self.elems:
            return
        if self.loss and self.rng.random() < self.loss:
            self.stats["lost_rx"] += 1
            return
        k = off // self.elems
        if k >= self.chunks or slot != k % self.slots or sset != (k // self.slots) % 2:
            return
        if done[k]:
            self.stats["duplicate_results"] += 1
            return
        if len(pkt) < HEADER_LEN + 4 * ne:
            return
        self.result[off : off + ne] = np.frombuffer(pkt, "<i4", ne, HEADER_LEN)
        done[k] = True
        outstanding.pop(k, None)
        self.stats["results"] += 1


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: run one worker, write its result (.npy) and stats (.json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--n", type=int, required=True, help="workers in the job")
    ap.add_argument("--slots", type=int, required=True, help="the job's slots (window)")
    ap.add_argument("--length", type=int, required=True, help="int32 elements to aggregate")
    ap.add_argument("--elems", type=int, default=256, help="elements per packet")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=0.02)
    ap.add_argument("--agg-ip", default=DEFAULT_AGG_IP)
    ap.add_argument("--die-after", type=int, default=-1)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--out", required=True, help="path of the result .npy (stats go to .json)")
    a = ap.parse_args(argv)
    vals = worker_input(a.seed, a.job, a.worker, a.length, a.n)
    w = Worker(a.job, a.worker, a.n, a.slots, vals, a.elems, a.agg_ip, a.timeout, a.loss,
               a.seed, a.die_after)
    res = w.run(a.deadline)
    np.save(a.out, res)
    with open(a.out.removesuffix(".npy") + ".json", "w") as fh:
        json.dump(w.stats, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
