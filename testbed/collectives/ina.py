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

Hot loop: ``recvmmsg`` a burst of RESULTs straight into a numpy buffer, one ``@njit`` call
(``inakernel.on_results``) applies them and builds the next packets in place, one
``sendmmsg`` sends them; Python only loops over bursts and timers. After a partial burst the
worker sleeps up to 1.5 ms (interrupt coalescing; capped at a quarter of the window) so
bursts are several packets long. Measured on the loaded 2-core dev machine, 8 MB at n=4,
worker CPU per packet (send + result): 23-33 us per-packet Python, 22 us batched, 13-15 us
batched + coalescing (the wake-ups, not the Python, dominated); spurious retransmissions
fell from 26 % to 1 % once timers are checked only with an empty socket.
"""

from __future__ import annotations

import ctypes
import select
import socket
import struct
import time

import numpy as np

from testbed.collectives import inakernel as ik
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.kernels import fixedpoint as fp
from testbed.kernels.wire import HEADER_LEN, TESTBED_UDP_PORT, MsgType

#: ``algo="nic"``: the worker sends raw FLOAT32 payloads; its SmartNIC (``nic_codec`` program,
#: ``fixed32``) quantises them with ATP's fixed factor on the way out and turns the INT32
#: RESULT back into FLOAT32 on the way in, so the host does no fixed-point work and needs no
#: exponent round. Error of an n-way sum: n * 0.5 / factor + float32 rounding.
NIC_FACTOR = fp.ATP_FACTOR

HDR = struct.Struct("<HBBHHHBBBBhHHIf")
assert HDR.size == HEADER_LEN
RX_BURST = 64
#: pause after a partial burst (see allreduce); only with a window of >= 16 packets
COALESCE_S = 0.0015
RB = 2048  # receive row: any datagram up to a jumbo-free MTU fits
MSG_DONTWAIT = 0x40
_libc = ctypes.CDLL(None, use_errno=True)
_libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                           ctypes.c_void_p]
_libc.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]


def _mmsg(count: int) -> tuple[np.ndarray, np.ndarray]:
    """(iovecs uint64[count, 2] = base, len; struct mmsghdr uint64[count, 8]) for LP64 Linux:
    msghdr = name, namelen, iov, iovlen, control, controllen, flags (56 B) + msg_len."""
    if struct.calcsize("P") != 8:
        raise RuntimeError("the batched INA client needs a 64-bit Linux (mmsghdr layout)")
    iov = np.zeros((count, 2), dtype=np.uint64)
    hdr = np.zeros((count, 8), dtype=np.uint64)
    hdr[:, 2] = np.uint64(iov.ctypes.data) + np.arange(count, dtype=np.uint64) * np.uint64(16)
    hdr[:, 3] = 1
    return iov, hdr
ELEMS = 256
T0 = 0.010  # SwitchML's initial retransmission timeout
T_MAX = 0.320
_RETX = int(MsgType.RETRANSMIT)


class InaClient:
    """One worker of an INA job; sockets live in the namespace the process is in."""

    def __init__(self, job: dict, spec: CollectiveSpec, rank: int):
        self.n = job["n"]
        self.rank = rank
        self.host = job["ranks"][rank]["host"]
        agg = job["aggregator"]
        self.agg = (agg["ip"], int(agg.get("port", TESTBED_UDP_PORT)))
        self.job_id = spec.job_id
        self.nic = spec.algo == "nic"
        self.W = spec.window
        # packets before the first data packet: the exponent bootstrap round (none for nic)
        self.boot = 0 if self.nic else self.W
        self.timeout_s = spec.timeout_s
        self.loss = float(spec.loss)
        self.rng = np.random.default_rng([spec.seed, 7919, rank])
        self.ip = job["ranks"][rank]["ip"]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        # nic: the SmartNIC's codec only recognises testbed frames by UDP port 41000, and a
        # RESULT goes to the worker's own port, so the worker must use 41000 too (one NIC job
        # per host at a time)
        try:
            self.sock.bind((self.ip, TESTBED_UDP_PORT if self.nic else 0))
        except OSError as e:
            raise CollectiveError(f"rank {rank} ({self.host}): cannot bind UDP "
                                  f"{self.ip}:{TESTBED_UDP_PORT} for algo 'nic' ({e}); another "
                                  "NIC-offloaded job on this host?") from None
        self.sock.connect(self.agg)  # RESULTs come from the aggregator's address and port
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        W = self.W
        # per-slot use counter -> set bit (kept across repetitions)
        self.uses = np.zeros(W, dtype=np.int64)
        self.lens = np.zeros(W, dtype=np.int64)
        self.pkts = np.zeros((W, ik.ROW), dtype=np.uint8)
        self.pkts_i32 = self.pkts.view(np.int32)
        self.pkts_f32 = self.pkts.view(np.float32)
        self.pkts_addr = np.uint64(self.pkts.ctypes.data)
        self.row_mv = [memoryview(self.pkts[s]) for s in range(W)]
        # sendmmsg: one iovec per packet, filled per burst
        self.siov, self.shdr = _mmsg(W)
        self.shdr_addr = self.shdr.ctypes.data
        # recvmmsg: a burst of up to RX_BURST datagrams straight into rbuf rows
        self.rbuf = np.zeros((RX_BURST, RB), dtype=np.uint8)
        self.rbuf_i32 = self.rbuf.view(np.int32)
        self.rbuf_f32 = self.rbuf.view(np.float32)
        self.riov, self.rhdr = _mmsg(RX_BURST)
        self.riov[:, 0] = np.uint64(self.rbuf.ctypes.data) + \
            np.arange(RX_BURST, dtype=np.uint64) * np.uint64(RB)
        self.riov[:, 1] = RB
        self.rhdr_addr = self.rhdr.ctypes.data
        self.stats = {"sent": 0, "retransmitted": 0, "results": 0, "ignored": 0,
                      "lost_tx": 0, "lost_rx": 0}

    def _sendmmsg(self, slots: np.ndarray) -> None:
        """Send the packet rows of ``slots`` in one ``sendmmsg`` (seeded loss applied first)."""
        if self.loss:
            keep = self.rng.random(slots.size) >= self.loss
            self.stats["lost_tx"] += int(slots.size - keep.sum())
            slots = slots[keep]
        k = slots.size
        if k == 0:
            return
        self.siov[:k, 0] = self.pkts_addr + slots.astype(np.uint64) * np.uint64(ik.ROW)
        self.siov[:k, 1] = self.lens[slots].astype(np.uint64)
        sent = 0
        while sent < k:
            r = _libc.sendmmsg(self.fd, self.shdr_addr + sent * 64, k - sent, 0)
            if r <= 0:
                break  # socket buffer full (EAGAIN): the retransmission timer resends
            sent += r

    def _retransmit(self, s: int) -> None:
        self.pkts[s, 3] = _RETX
        self.stats["retransmitted"] += 1
        if self.loss and self.rng.random() < self.loss:
            self.stats["lost_tx"] += 1
            return
        try:
            self.sock.send(self.row_mv[s][: int(self.lens[s])])
        except BlockingIOError:
            pass

    def allreduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """Sum ``x`` over the job's workers through the switch; float32 result into ``out``."""
        W, boot, n = self.W, self.boot, self.n
        count = x.size
        K = -(-count // ELEMS)  # data chunks
        total = K + boot  # packets: W bootstrap (exponents) + K data
        agreed = np.full(max(K, 1), fp.EXP_MIN, dtype=np.int16)
        qsum = np.zeros(1 if self.nic else count, dtype=np.int32)
        cur = np.full(W, -1, dtype=np.int64)  # packet index outstanding on each slot
        uses = self.uses
        sent_at = np.zeros(W)
        retx = np.zeros(W, dtype=np.bool_)
        deadline = np.full(W, np.inf)
        rto = np.full(W, T0)
        lens = self.lens
        now = time.monotonic()
        st = np.array([0.0, 0.0, T0, now])  # srtt, rttvar, base timeout, last progress
        first = np.arange(min(W, total), dtype=np.int64)
        for s in first:
            lens[s] = ik.build_packet(self.pkts, self.pkts_i32, self.pkts_f32, s, s, x, K,
                                      boot, n, self.job_id, self.rank, uses[s] & 1, agreed,
                                      self.nic)
            cur[s] = s
        sent_at[first] = now
        deadline[first] = now + T0
        self._sendmmsg(first)
        self.stats["sent"] += total
        done = 0
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        B = self.rbuf.shape[0]
        no_drop = np.zeros(B, dtype=np.bool_)
        send_list = np.zeros(W, dtype=np.int64)
        # at most a quarter of the window's worth of 100 Mb/s packet times (~90 us each)
        coalesce = min(COALESCE_S, W * 90e-6 / 4) if W >= 16 else 0.0
        while done < total:
            got = _libc.recvmmsg(self.fd, self.rhdr_addr, B, MSG_DONTWAIT, None)
            if got <= 0:
                # drained: only now look at timers (a descheduled worker must not retransmit
                # what is already waiting in its socket)
                now = time.monotonic()
                first_dl = float(deadline.min())
                if first_dl > now:
                    if poller.poll(min(first_dl - now, 0.05) * 1000.0):
                        continue
                    now = time.monotonic()
                for s in np.nonzero(deadline <= now)[0]:
                    self._retransmit(int(s))
                    retx[s] = True
                    rto[s] = min(rto[s] * 2, T_MAX)
                    deadline[s] = now + rto[s]
                if now - st[3] > self.timeout_s:
                    pending = [int(s) for s in np.nonzero(cur >= 0)[0][:8]]
                    raise CollectiveTimeout(
                        f"rank {self.rank} ({self.host}): no RESULT from the aggregator "
                        f"{self.agg[0]} for {self.timeout_s} s ({done}/{total} packets done, "
                        f"slots {pending} pending; a worker died or the switch lost the job?)")
                continue
            rlen = (self.rhdr[:got, 7] & np.uint64(0xFFFFFFFF)).astype(np.int64)
            drop = (self.rng.random(got) < self.loss) if self.loss else no_drop
            d, ns, ign, lost, bad = ik.on_results(
                self.rbuf, self.rbuf_i32, self.rbuf_f32, rlen, got, drop, self.pkts,
                self.pkts_i32, self.pkts_f32, lens, x, qsum, out, agreed, cur, uses, sent_at,
                retx, deadline, rto, st, time.monotonic(), K, boot, W, n, self.job_id,
                self.rank, self.nic, send_list)
            self.stats["ignored"] += ign
            self.stats["lost_rx"] += lost
            if bad >= 0:
                seen = [HDR.unpack_from(self.rbuf[i].tobytes(), 0) for i in range(got)]
                seen = [f"codec={h[8]} elems={h[11]} offset={h[13]}" for h in seen
                        if h[5] == bad][:1]
                raise CollectiveError(
                    f"rank {self.rank} ({self.host}): RESULT for slot {bad} ({seen}) does not "
                    f"match packet {int(cur[bad])} outstanding there (expected codec "
                    f"{'FLOAT32' if self.nic else 'INT32'}; is the SmartNIC in fixed32 mode?)")
            done += d
            if ns:
                self._sendmmsg(send_list[:ns].copy())
            if got < B and coalesce:
                # interrupt coalescing: at 100 Mb/s a result arrives every ~90 us; waking per
                # packet costs more CPU than the packet. Sleeping a little lets a burst build
                # up (the window keeps the link busy meanwhile).
                time.sleep(coalesce)
        self.stats.update(results=done, srtt_ms=float(st[0]) * 1e3)
        if self.nic:
            return
        # dequantise: chunk k was quantised with scale_for(agreed[k], n)
        for k in range(K):
            lo = k * ELEMS
            hi = min(lo + ELEMS, count)
            fp.dequantize_into(qsum[lo:hi], fp.scale_for(int(agreed[k]), n), out[lo:hi])

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()
