"""In-network aggregation client (SwitchML protocol, docs/architecture.md) for one worker.

Fixed point: ``testbed.kernels.fixedpoint`` (per-packet block exponent, scale
``floor(INT32_MAX/n) / 2**e``). Exponent agreement is SwitchML's "one packet ahead", done per
slot: every slot is an independent chain of packets ``j, j+W, j+2W, ...`` (W = window = slot
pool of the job). Packet ``j`` carries

* in its ``exponent`` field the worker's local exponent of data chunk ``j`` (the switch
  max-combines it, so the RESULT of packet ``j`` returns the agreed exponent of chunk j);
* as payload data chunk ``j - W`` quantised with its agreed exponent, which arrived with the
  RESULT of packet ``j - W`` - the previous packet on the same slot, which had to complete
  before the slot could be reused anyway. Packets ``0..W-1`` are a bootstrap round carrying a
  single zero element (the switch rejects empty payloads).

So the exponent costs one extra round of W tiny packets per collective, not one per chunk.
The set bit of a slot alternates with every use of the slot (per-slot use counter, kept
across repetitions so a new repetition never hits the previous one's completed set).

Reliability: a packet unanswered for its timeout is sent again as ``RETRANSMIT``; the timeout
of that slot doubles on each retry (capped at 320 ms) and resets when it completes; no
progress for ``timeout_s`` fails the run with :class:`CollectiveTimeout`. The base timeout is
SwitchML's 10 ms, raised TCP-style (``srtt + 4 rttvar`` from samples of packets sent once,
Karn's rule) when the measured round trip is longer: in emulation the round trip includes
the host's shaped egress queue (W packets at 100 Mb/s ~ 11 ms for W=128) and a userspace
switch on a shared CPU, where a fixed 10 ms would retransmit nearly every window. Results are written
by chunk offset. ``loss`` drops outgoing contributions and incoming results with that
probability (seeded), to exercise recovery when the switch has no impair stage.
"""

from __future__ import annotations

import select
import socket
import struct
import time

import numpy as np

from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.kernels import fixedpoint as fp
from testbed.kernels.wire import HEADER_LEN, MAGIC, TESTBED_UDP_PORT, VERSION, Codec, MsgType

HDR = struct.Struct("<HBBHHHBBBBhHHIf")
assert HDR.size == HEADER_LEN
ELEMS = 256
T0 = 0.010  # SwitchML's initial retransmission timeout
T_MAX = 0.320
_DATA, _RETX, _RESULT = int(MsgType.DATA), int(MsgType.RETRANSMIT), int(MsgType.RESULT)
_INT32 = int(Codec.INT32)


class InaClient:
    """One worker of an INA job; sockets live in the namespace the process is in."""

    def __init__(self, job: dict, spec: CollectiveSpec, rank: int):
        self.n = job["n"]
        self.rank = rank
        self.host = job["ranks"][rank]["host"]
        agg = job["aggregator"]
        self.agg = (agg["ip"], int(agg.get("port", TESTBED_UDP_PORT)))
        self.job_id = spec.job_id
        self.W = spec.window
        self.timeout_s = spec.timeout_s
        self.loss = float(spec.loss)
        self.rng = np.random.default_rng([spec.seed, 7919, rank])
        self.ip = job["ranks"][rank]["ip"]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.sock.bind((self.ip, 0))
        self.sock.setblocking(False)
        self.uses = np.zeros(self.W, dtype=np.int64)  # per-slot use counter -> set bit
        self.pkts = np.zeros((self.W, HEADER_LEN + 4 * ELEMS), dtype=np.uint8)
        self.rbuf = bytearray(2048)
        self.srtt = 0.0
        self.stats = {"sent": 0, "retransmitted": 0, "results": 0, "ignored": 0,
                      "lost_tx": 0, "lost_rx": 0}

    def _lost(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss

    def _build(self, slot: int, j: int, x: np.ndarray, K: int, local_e: np.ndarray,
               agreed: np.ndarray) -> int:
        """Fill the packet of index ``j`` into row ``slot``; return its length."""
        row = self.pkts[slot]
        W = self.W
        if j < K:
            lo = j * ELEMS
            local_e[j] = fp.block_exponent(x[lo:lo + ELEMS])
            e_next = int(local_e[j])
        else:
            e_next = fp.EXP_MIN
        if j >= W:
            k = j - W
            lo = k * ELEMS
            cnt = min(ELEMS, x.size - lo)
            payload = row[HEADER_LEN:HEADER_LEN + 4 * cnt].view(np.int32)
            fp.quantize_into(x[lo:lo + cnt], fp.scale_for(int(agreed[k]), self.n), payload)
            off = lo
        else:
            cnt = 1
            row[HEADER_LEN:HEADER_LEN + 4] = 0
            off = 0
        HDR.pack_into(row, 0, MAGIC, VERSION, _DATA, self.job_id, self.rank, slot,
                      int(self.uses[slot] & 1), 0, _INT32, self.n, e_next, cnt, 0, off, 0.0)
        return HEADER_LEN + 4 * cnt

    def _send(self, slot: int, length: int, retransmit: bool) -> None:
        row = self.pkts[slot]
        row[3] = _RETX if retransmit else _DATA
        self.stats["retransmitted" if retransmit else "sent"] += 1
        if self._lost():
            self.stats["lost_tx"] += 1
            return
        try:
            self.sock.sendto(memoryview(row)[:length], self.agg)
        except BlockingIOError:
            pass  # socket buffer full: the retransmission timer sends it again

    def allreduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """Sum ``x`` over the job's workers through the switch; float32 result into ``out``."""
        W = self.W
        count = x.size
        K = -(-count // ELEMS)  # data chunks
        total = K + W  # packets: W bootstrap + K data
        local_e = np.full(max(K, 1), fp.EXP_MIN, dtype=np.int16)
        agreed = np.full(max(K, 1), fp.EXP_MIN, dtype=np.int16)
        qsum = np.zeros(count, dtype=np.int32)
        cur = np.full(W, -1, dtype=np.int64)  # packet index outstanding on each slot
        lens = np.zeros(W, dtype=np.int64)
        deadline = np.full(W, np.inf)
        rto = np.full(W, T0)
        sent_at = np.zeros(W)
        retx = np.zeros(W, dtype=np.bool_)
        srtt, rttvar, base = 0.0, 0.0, T0
        last_progress = time.monotonic()
        for s in range(min(W, total)):
            lens[s] = self._build(s, s, x, K, local_e, agreed)
            cur[s] = s
            sent_at[s] = time.monotonic()
            deadline[s] = sent_at[s] + T0
            self._send(s, int(lens[s]), False)
        done = 0
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        rbuf = self.rbuf
        mv = memoryview(rbuf)
        q_view = np.frombuffer(rbuf, dtype=np.int32, offset=HEADER_LEN,
                               count=(len(rbuf) - HEADER_LEN) // 4)
        next_check = time.monotonic() + T0
        while done < total:
            try:
                nb = self.sock.recv_into(mv)
            except BlockingIOError:
                nb = -1
            now = time.monotonic()
            if nb >= HEADER_LEN:
                (magic, _v, mt, job, _w, slot, sset, _f, _c, _n, e, ne, _h, off,
                 _s) = HDR.unpack_from(rbuf, 0)
                j = cur[slot] if slot < W else -1
                if (magic != MAGIC or mt != _RESULT or job != self.job_id or j < 0
                        or sset != (self.uses[slot] & 1) or nb < HEADER_LEN + 4 * ne):
                    self.stats["ignored"] += 1
                    continue
                if self._lost():
                    self.stats["lost_rx"] += 1
                    continue
                if j < K:
                    agreed[j] = e
                if j >= W:
                    lo = (j - W) * ELEMS
                    if off != lo:
                        raise CollectiveError(f"rank {self.rank} ({self.host}): RESULT for slot "
                                              f"{slot} has chunk offset {off}, expected {lo}")
                    qsum[lo:lo + ne] = q_view[:ne]
                self.stats["results"] += 1
                done += 1
                last_progress = now
                self.uses[slot] += 1
                if not retx[slot]:  # Karn: only unambiguous samples
                    sample = now - sent_at[slot]
                    if srtt == 0.0:
                        srtt, rttvar = sample, sample / 2
                    else:
                        rttvar = 0.75 * rttvar + 0.25 * abs(srtt - sample)
                        srtt = 0.875 * srtt + 0.125 * sample
                    base = min(max(T0, srtt + 4 * rttvar), T_MAX)
                rto[slot] = base
                retx[slot] = False
                nj = j + W
                if nj < total:
                    lens[slot] = self._build(slot, nj, x, K, local_e, agreed)
                    cur[slot] = nj
                    sent_at[slot] = now
                    deadline[slot] = now + base
                    self._send(slot, int(lens[slot]), False)
                else:
                    cur[slot] = -1
                    deadline[slot] = np.inf
                if now < next_check:
                    continue
            elif nb < 0:
                wait = max(0.0, min(next_check, float(deadline.min())) - now)
                if wait > 0:
                    poller.poll(wait * 1000.0)
                now = time.monotonic()
            # retransmissions
            next_check = now + T0 / 2
            late = np.nonzero(deadline <= now)[0]
            for s in late:
                self._send(int(s), int(lens[s]), True)
                retx[s] = True
                rto[s] = min(rto[s] * 2, T_MAX)
                deadline[s] = now + rto[s]
            if now - last_progress > self.timeout_s:
                pending = [int(s) for s in np.nonzero(cur >= 0)[0][:8]]
                raise CollectiveTimeout(
                    f"rank {self.rank} ({self.host}): no RESULT from the aggregator "
                    f"{self.agg[0]} for {self.timeout_s} s ({done}/{total} packets done, "
                    f"slots {pending} pending; a worker died or the switch lost the job?)")
        # dequantise: chunk k was quantised with scale_for(agreed[k], n)
        for k in range(K):
            lo = k * ELEMS
            hi = min(lo + ELEMS, count)
            fp.dequantize_into(qsum[lo:hi], fp.scale_for(int(agreed[k]), self.n), out[lo:hi])

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()
