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

INA + compression (``compressor="thc"``, THC NSDI'24, see ``kernels/compressors/thc.py``): the
worker rotates its vector once (blockwise randomized Hadamard transform, sign stream shared by
``(seed, step)``, step = this client's repetition counter), then runs the same slot protocol
with ``Codec.THC`` packets of up to 1024 int8 lanes (the bytes of 256 int32: a quarter of the
packets): the exponent chain agrees per chunk on ``e = max_w ceil(8 log2 ||chunk_w||)``, and a
chunk is stochastically rounded (per-worker random stream) to the levels -g/2..g/2 of the grid
``M / (g/2)``, ``M = clip * 2**(e/8) / sqrt(ne)``. The switch adds the lanes; the RESULT comes
back in int8/int16 lanes; the worker de-scales and applies the inverse transform. When
``n * g/2 > 127`` the sums need int16 lanes, so packets carry 512 lanes (a RESULT still fits
the MTU). Error: see :func:`thc_check`.

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
from testbed.collectives.spec import INA_COMPRESSORS, CollectiveSpec
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
        self.thc = None
        if spec.compressor is not None:
            if spec.compressor not in INA_COMPRESSORS or self.nic:
                raise CollectiveError(f"CollectiveSpec.compressor={spec.compressor!r} is not "
                                      f"implemented for algo {spec.algo!r}")
            from testbed.kernels.compressors import get_compressor

            self.thc = get_compressor("thc", **spec.compressor_params)
            self.half = self.thc.g // 2
            self.E = thc_elems(self.n, self.thc.g)
            self._warm_thc()
        self.step = 0  # repetition counter: the THC streams' step (same on every worker)

    def _warm_thc(self) -> None:
        """Load the THC kernels now (set-up), not inside the first timed collective."""
        y = np.ones(8, dtype=np.float32)
        pk = np.zeros((1, ik.ROW), dtype=np.uint8)
        agreed = np.zeros(1, dtype=np.int16)
        z = np.zeros(1, dtype=np.int64)
        k1 = np.uint64(1)
        ik.thc_build_packet(pk, 0, 1, y, 8, 8, 1, 1, 2, 0, 0, z[0], agreed, 4.0, 8.0, 8, k1, k1,
                            y.copy())
        ik.on_results_thc(self.rbuf, z, 0, np.zeros(1, np.bool_), pk, z.copy(), y, 8, 8,
                          np.zeros(8, np.int32), y.copy(), agreed, z - 1, z.copy(),
                          np.zeros(1), np.zeros(1, np.bool_), np.zeros(1), np.zeros(1),
                          np.zeros(4), 0.0, 1, 1, 1, 2, 0, 0, 4.0, 8.0, 8, k1, k1, z.copy(),
                          y.copy())

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
        step = self.step
        self.step += 1
        if self.thc is not None:
            self._allreduce_thc(x, out, step)
            return
        count = x.size
        K = -(-count // ELEMS)  # data chunks
        agreed = np.full(max(K, 1), fp.EXP_MIN, dtype=np.int16)
        qsum = np.zeros(1 if self.nic else count, dtype=np.int32)
        W, boot, n = self.W, self.boot, self.n

        def build(s: int, j: int) -> int:
            return ik.build_packet(self.pkts, self.pkts_i32, self.pkts_f32, s, j, x, K, boot,
                                   n, self.job_id, self.rank, self.uses[s] & 1, agreed,
                                   self.nic)

        def burst(got, rlen, drop, cur, sent_at, retx, deadline, rto, st, now, send_list):
            r = ik.on_results(
                self.rbuf, self.rbuf_i32, self.rbuf_f32, rlen, got, drop, self.pkts,
                self.pkts_i32, self.pkts_f32, self.lens, x, qsum, out, agreed, cur, self.uses,
                sent_at, retx, deadline, rto, st, now, K, boot, W, n, self.job_id, self.rank,
                self.nic, send_list)
            return (*r, 0)

        self._run(K, build, burst)
        if self.nic:
            return
        # dequantise: chunk k was quantised with scale_for(agreed[k], n)
        for k in range(K):
            lo = k * ELEMS
            hi = min(lo + ELEMS, count)
            fp.dequantize_into(qsum[lo:hi], fp.scale_for(int(agreed[k]), n), out[lo:hi])

    def _allreduce_thc(self, x: np.ndarray, out: np.ndarray, step: int) -> None:
        """INA + THC (see the module docstring)."""
        W, boot, n, E = self.W, self.boot, self.n, self.E
        comp = self.thc
        count = x.size
        d, blk, skey, qkey = thc_layout(comp, count, E, step, self.rank)
        K = -(-d // E)
        agreed = np.full(max(K, 1), ik.THC_EXP_ZERO, dtype=np.int16)
        qsum = np.zeros(d, dtype=np.int32)
        scratch = np.empty(E, dtype=np.float32)
        clip, half = float(comp.clip), float(self.half)

        def build(s: int, j: int) -> int:
            return ik.thc_build_packet(self.pkts, s, j, x, d, E, K, boot, n, self.job_id,
                                       self.rank, self.uses[s] & 1, agreed, clip, half, blk,
                                       skey, qkey, scratch)

        def burst(got, rlen, drop, cur, sent_at, retx, deadline, rto, st, now, send_list):
            return ik.on_results_thc(
                self.rbuf, rlen, got, drop, self.pkts, self.lens, x, d, E, qsum, out, agreed,
                cur, self.uses, sent_at, retx, deadline, rto, st, now, K, boot, W, n,
                self.job_id, self.rank, clip, half, blk, skey, qkey, send_list, scratch)

        # rotation and decoding happen per packet inside the loop (serial kernels: this runs
        # in a forked child, where Numba's parallel pool is unsafe)
        self._run(K, build, burst)

    def _run(self, K: int, build, burst) -> None:
        """The slot protocol loop (timers, retransmissions, bursts) for K data packets."""
        W, boot = self.W, self.boot
        total = K + boot  # packets: W bootstrap (exponents) + K data
        cur = np.full(W, -1, dtype=np.int64)  # packet index outstanding on each slot
        sent_at = np.zeros(W)
        retx = np.zeros(W, dtype=np.bool_)
        deadline = np.full(W, np.inf)
        rto = np.full(W, T0)
        lens = self.lens
        now = time.monotonic()
        st = np.array([0.0, 0.0, T0, now])  # srtt, rttvar, base timeout, last progress
        first = np.arange(min(W, total), dtype=np.int64)
        for s in first:
            lens[s] = build(int(s), int(s))
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
            d, ns, ign, lost, bad, ovf = burst(got, rlen, drop, cur, sent_at, retx, deadline,
                                               rto, st, time.monotonic(), send_list)
            self.stats["ignored"] += ign
            self.stats["lost_rx"] += lost
            if ovf:
                raise CollectiveError(
                    f"rank {self.rank} ({self.host}): the switch flagged OVERFLOW for slot "
                    f"{bad}: the THC sums do not fit a RESULT lane; lower granularity or the "
                    "number of workers")
            if bad >= 0:
                seen = [HDR.unpack_from(self.rbuf[i].tobytes(), 0) for i in range(got)]
                seen = [f"codec={h[8]} elems={h[11]} offset={h[13]}" for h in seen
                        if h[5] == bad][:1]
                raise CollectiveError(
                    f"rank {self.rank} ({self.host}): RESULT for slot {bad} ({seen}) does not "
                    f"match packet {int(cur[bad])} outstanding there (expected codec "
                    f"{'FLOAT32' if self.nic else 'THC' if self.thc else 'INT32'}; is the "
                    "SmartNIC in fixed32 mode / does the switch accept codec THC?)")
            done += d
            if ns:
                self._sendmmsg(send_list[:ns].copy())
            if got < B and coalesce:
                # interrupt coalescing: at 100 Mb/s a result arrives every ~90 us; waking per
                # packet costs more CPU than the packet. Sleeping a little lets a burst build
                # up (the window keeps the link busy meanwhile).
                time.sleep(coalesce)
        self.stats.update(results=done, srtt_ms=float(st[0]) * 1e3)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


# --------------------------------------------------------------------------- INA + THC helpers

_SALT_QUANT_RANK = 0x54484352  # "THCR": per-worker stochastic-rounding stream


def thc_elems(n: int, granularity: int) -> int:
    """int8 lanes per THC packet for ``n`` workers: 1024 when the n-way sum of levels
    (|sum| <= n * g/2) fits the int8 RESULT lane, else 512 (int16 RESULT lanes, still one MTU)."""
    return ik.THC_ELEMS if n * (granularity // 2) <= 127 else ik.THC_ELEMS // 2


def thc_layout(comp, count: int, E: int, step: int, rank: int) -> tuple:
    """(padded length d, rotation block, sign key (shared), rounding key (this rank's)).

    The rotation block is the compressor's ``block`` capped at the packet's E lanes, so every
    packet holds whole blocks; a vector shorter than a block uses one power-of-two block."""
    from testbed.kernels.compressors.thc import SALT_SIGN as _SALT_SIGN
    from testbed.kernels.compressors.thc import padded_length
    from testbed.kernels.rng import stream_key

    d, blk = padded_length(int(count), min(int(comp.block), E))
    skey = stream_key(comp.seed, step, _SALT_SIGN)
    qkey = stream_key(comp.seed, step, _SALT_QUANT_RANK + (rank << 16))
    return d, blk, skey, qkey


#: failure probability the per-element (Hoeffding) bound of :func:`thc_check` allows
THC_DELTA = 1e-9


def thc_check(spec: CollectiveSpec, inputs: list, outputs: list, n: int,
              step: int = 0) -> tuple[float, bool]:
    """(max_abs_err against the numpy sum of ``inputs``, correct) for INA + THC.

    THC's error: the rounding of worker w's rotated coordinate j is zero-mean and in
    (-s_k, s_k), s_k = M_k / (g/2) the grid step of its chunk k; workers round independently.
    Clamping to [-M_k, M_k] is the only bias: ``c`` = inverse transform of the summed clamp
    excess (recomputed here from the inputs, the shared rotation and the agreed scales).
    ``correct`` needs both, for every output:

    * per element: ``|out - sum + c| <= s_k sqrt(2 n ln(2 count / THC_DELTA))`` (Hoeffding:
      an output element is a +-1/sqrt(block) combination of n*block independent roundings)
      + float32 slack;
    * in L2 (the transform is orthonormal): ``||out - sum + c||^2 <= sum_j n s_j^2 / 4 +
      n^2 max s^2 sqrt(d ln(1/THC_DELTA) / 2)`` (mean + Hoeffding deviation), which a wrong
      decode (wrong signs, scale or lanes) far exceeds.
    """
    from testbed.kernels.compressors import get_compressor
    from testbed.kernels.compressors.thc import rht_forward, rht_inverse

    comp = get_compressor("thc", **spec.compressor_params)
    E = thc_elems(n, comp.g)
    half = comp.g // 2
    count = inputs[0].size
    d, blk, skey, _ = thc_layout(comp, count, E, step, 0)
    K = -(-d // E)
    ys = []
    for x in inputs:
        y = np.empty(d, dtype=np.float32)
        rht_forward.serial(np.ascontiguousarray(x, dtype=np.float32), blk, skey, y)
        ys.append(y.astype(np.float64))
    agreed = np.full(K, ik.THC_EXP_ZERO, dtype=np.int64)
    for x in inputs:  # the norm is taken before rotating (as the workers do)
        for k in range(K):
            agreed[k] = max(agreed[k], ik.thc_exponent(x, k * E, min(k * E + E, count)))
    M = np.empty(d)
    for k in range(K):
        lo, hi = k * E, min(k * E + E, d)
        M[lo:hi] = ik.thc_scale_ref(int(agreed[k]), hi - lo, float(comp.clip))
    excess = np.zeros(d)
    for y in ys:
        excess += y - np.clip(y, -M, M)
    c = np.zeros(count, dtype=np.float32)
    rht_inverse.serial(excess.astype(np.float32), blk, skey, count, c)
    total = np.zeros(count)
    for x in inputs:
        total += x
    expect = total - c.astype(np.float64)
    s = M / half
    per_block = s.reshape(-1, blk).max(axis=1).repeat(blk)[:count] if d else s
    eps = float(np.finfo(np.float32).eps)
    # float32 transforms (forward per worker, inverse of the sum): ~log2(block) roundings of
    # values up to the block's magnitude
    slack = 8 * (np.log2(blk) + 2) * eps * (n * per_block * half + np.abs(expect))
    bound = per_block * np.sqrt(2 * n * np.log(2 * max(count, 1) / THC_DELTA)) + slack
    l2_bound = float(np.sum(n * s * s / 4) + n * n * float(s.max(initial=0.0)) ** 2 *
                     np.sqrt(d * np.log(1 / THC_DELTA) / 2))
    l2_bound = np.sqrt(l2_bound) + float(np.sqrt(np.sum(slack * slack)))
    worst, ok = 0.0, True
    for out in outputs:
        o = np.asarray(out, dtype=np.float64)
        if o.shape != total.shape or not np.all(np.isfinite(o)):
            return float("inf"), False
        if o.size:
            worst = max(worst, float(np.max(np.abs(o - total))))
            dev = o - expect
            ok = ok and bool(np.all(np.abs(dev) <= bound))
            ok = ok and float(np.sqrt(np.sum(dev * dev))) <= l2_bound
    return worst, bool(ok)


def _enter_netns(pid: int) -> None:
    """Move this (forked, single-threaded) process into the network namespace of ``pid``."""
    import os

    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if _libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the netns of pid {pid}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_direct(net, spec: CollectiveSpec, n: int) -> tuple[list, list, float]:
    """Run ``n`` INA clients once, each forked into its host's namespace, without the
    collective pool: ``(inputs, outputs, seconds)``; inputs are ``report.rank_input``.

    For checks the pool does not do yet (INA + THC, :func:`thc_check`). Holds the switch job
    for the run only; children are killed on failure."""
    import mmap
    import os
    import signal

    from testbed.collectives.report import rank_input

    hosts = list(net.hosts)[:n]
    agg = net.aggregator
    if agg is None:
        raise ValueError("run_direct needs a net with a programmable switch (aggregator)")
    job = {"n": n, "ranks": [{"host": h.name, "pid": int(h.pid), "ip": h.IP()} for h in hosts],
           "aggregator": {"ip": agg["ip"], "port": int(agg.get("port", TESTBED_UDP_PORT))}}
    count = spec.count
    xs = [rank_input(spec, r, count) for r in range(n)]
    shm = mmap.mmap(-1, 4 * count * n)
    outs = [np.frombuffer(shm, np.float32, count, 4 * count * r) for r in range(n)]
    for o in outs:
        o.fill(np.nan)
    client = net.switch_client(agg["switch"])
    client.configure("aggregate", jobs={spec.job_id: {"n_workers": n, "slots": spec.window}})
    pids: list[int] = []
    t0 = time.monotonic()
    try:
        for r in range(n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _enter_netns(int(hosts[r].pid))
                    c = InaClient(job, spec, r)
                    c.allreduce(xs[r], outs[r])
                    c.close()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        pids = []
        if codes != [0] * n:
            raise CollectiveError(f"run_direct: worker exit codes {codes}")
        return xs, [o.copy() for o in outs], time.monotonic() - t0
    finally:
        for p in pids:  # only our own children, on failure
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        client.configure("aggregate", remove_jobs=[spec.job_id])


def thc_model_s(net, spec: CollectiveSpec, n: int) -> float:
    """alpha-beta model of INA + THC: plain INA's model for the bytes on the wire (1 B per
    padded element, the same 1024 B payload per frame as int32 INA when E = 1024)."""
    from testbed.collectives import model
    from testbed.collectives.runner import net_alpha, net_bandwidth

    comp = _thc_comp(spec)
    E = thc_elems(n, comp.g)
    d = thc_layout(comp, spec.count, E, 0, 0)[0]
    hosts = list(net.hosts)[:n]
    wire = d * (model.INA_PAYLOAD / E)  # as many frames as int32 INA moving `wire` bytes
    return model.predict("allreduce", "ina", n, int(wire), net_bandwidth(net, hosts, "ina"),
                         net_alpha(net))


def _thc_comp(spec: CollectiveSpec):
    from testbed.kernels.compressors import get_compressor

    return get_compressor("thc", **spec.compressor_params)


def main(argv: list[str] | None = None) -> int:
    """``python -m testbed.collectives.ina``: ring vs INA vs INA+THC on a 4-host programmable
    star (100 Mb/s), 8 MB allreduce; prints times, model, ratios against ring (same run)."""
    import argparse

    from testbed.collectives.runner import run_collective

    ap = argparse.ArgumentParser(prog="python -m testbed.collectives.ina")
    ap.add_argument("--nbytes", type=int, default=8 << 20)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bw", type=float, default=100.0, help="link Mb/s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--window", type=int, default=64)
    a = ap.parse_args(argv)
    from testbed.topologies import Star, TestbedNet

    topo = Star(a.hosts, bw_mbps=a.bw, switch="programmable",
                programs={"switch": ["aggregate", "forward"]})
    n = a.hosts
    rows = {}
    with TestbedNet(topo) as net:
        for name, kw in (("ring", {"algo": "ring"}), ("ina", {"algo": "ina"}),
                         ("ina+thc", {"algo": "ina", "compressor": "thc"})):
            spec = CollectiveSpec(nbytes=a.nbytes, repetitions=a.reps, window=a.window,
                                  timeout_s=60, **kw)
            rs = run_collective(net, spec)
            t = sorted(r["time_s"] for r in rs)[len(rs) // 2]
            m = thc_model_s(net, spec, n) if name == "ina+thc" else rs[0]["model_s"]
            ok = all(r["correct"] for r in rs)
            if name == "ina+thc":  # the pool checks compressed runs as ring allgathers: check
                # THC's bound here on a direct run of the same spec instead
                one = CollectiveSpec(nbytes=a.nbytes, window=a.window, timeout_s=60, **kw)
                xs, outs, _ = run_direct(net, one, n)
                err, ok = thc_check(one, xs, outs, n)
            else:
                err = max(r["max_abs_err"] for r in rs)
            rows[name] = (t, m, ok, err, any(r["cpu_bound"] for r in rs))
    ring_t = rows["ring"][0]
    print(f"allreduce {a.nbytes} B, n={n}, Star {a.bw:g} Mb/s, median of {a.reps}")
    print(f"{'algo':8} {'time_s':>8} {'model_s':>8} {'fidelity':>8} {'vs ring':>8} "
          f"{'correct':>7} {'max_abs_err':>11} cpu_bound")
    for name, (t, m, ok, err, cb) in rows.items():
        print(f"{name:8} {t:8.3f} {m:8.3f} {t / m:8.2f} {ring_t / t:7.2f}x {ok!s:>7} "
              f"{err:11.3g} {cb}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
