"""A UET-like transport for the host collectives: sprayed UDP packets, NACKs for trimmed ones.

Ultra Ethernet's transport (UET 1.0) expects switches that *trim* a packet instead of dropping
it: the cut packet still reaches the receiver, which NACKs it at once, so the sender
retransmits within a round trip rather than after a timeout, and treats the trim as a
congestion signal. :class:`UetComm` is that transport for ring, halving-doubling and the
reduction server: the same calls as the TCP :class:`~testbed.collectives.transport.Comm`
(``listen``, ``connect``, ``send``, ``recv``, ``drain``, ``close``), chosen with
``CollectiveSpec.transport = "uet"``.

Wire (the testbed header, ``testbed.kernels.wire``): the messages to a peer form one byte
stream, cut into packets of at most ``MTU_PAYLOAD`` bytes, ``Codec.BYTES``, DSCP
``Dscp.TRIMMABLE``, sent to the peer's ``TESTBED_UDP_PORT`` from one of ``entropies`` source
ports (``uet_port``): the packets are **sprayed** round robin over the ECMP paths those ports
hash onto, and the receiver places them by stream offset, so reordering costs nothing (UET's
reliable unordered delivery); ``recv`` takes the stream's bytes in order, as TCP's would.
Fields: ``worker_id`` the sender's rank, ``slot`` and ``chunk_offset`` the high 16 and low 32
bits of the stream offset, ``elem_count`` the payload bytes, ``Flags.LAST`` on a message's last
packet, ``seq`` the packet sequence number (PSN) of the directed pair. The receiver answers
from its testbed port with DSCP ``Dscp.CONTROL``: an ``ACK`` every ``ACK_EVERY`` packets and
whenever its socket is drained (``seq`` the newest PSN, ``chunk_offset`` the cumulative one:
every PSN below it has arrived, and an 8-byte payload: which of the 64 PSNs from there on
arrived), and at once for a packet that arrived ``TRIMMED`` a ``NACK`` whose flags carry the
NACK code (``TRIMMED``, plus ``LASTHOP`` when the last hop cut it: UET_TRIMMED /
UET_TRIMMED_LASTHOP).

Sender: a congestion window of packets (slow start, then one packet per window per round
trip; a NACK, or a hole the selective ACKs show behind ``REORDER_PACKETS`` later packets,
halves it at most once per round trip), resending a NACKed or lost packet as soon as the
window has room, and a retransmission timeout (``max(rto_min_s, srtt + 4 rttvar)``) only for
what vanished: every packet in flight is then resent go-back-N from a window of
``min_window``, the timer backing off up to ``MAX_BACKOFF`` times until an ACK comes.
:meth:`UetComm.stats` counts each kind of retransmission and the timeouts.

One rank per address: the receive socket is the address's testbed port. Ranks of one job on
one host, or two UET jobs on one host at once, are refused with a clear error.
"""

from __future__ import annotations

import collections
import os
import random
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import Future

import numpy as np

from testbed.collectives.ports import uet_port
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.kernels.wire import (
    HEADER_DTYPE,
    HEADER_LEN,
    MAGIC,
    MTU_PAYLOAD,
    TESTBED_UDP_PORT,
    VERSION,
    Codec,
    Dscp,
    Flags,
    MsgType,
)

#: the testbed header as a struct (the order and types of ``HEADER_DTYPE``)
_HDR = struct.Struct("<HBBHHHBBBBhHHIfI")
assert _HDR.size == HEADER_LEN == HEADER_DTYPE.itemsize

_DATA, _ACK, _NACK = int(MsgType.DATA), int(MsgType.ACK), int(MsgType.NACK)
_BYTES = int(Codec.BYTES)
_LAST, _TRIMMED, _LASTHOP = int(Flags.LAST), int(Flags.TRIMMED), int(Flags.LASTHOP)
#: socket buffers: a window of sprayed packets from every peer must fit the receive buffer
#: (a datagram the kernel drops there is a loss no switch counted)
SOCK_BUF = 8 << 20

#: packets ACKed past a missing one that declare it lost (spraying over a few paths reorders
#: by less; a trimming switch's NACK comes before)
REORDER_PACKETS = 8
#: the retransmission timer doubles per timeout up to this many times its base value
MAX_BACKOFF = 8
#: a receiver ACKs every this many packets, and whatever is left when its socket is drained
ACK_EVERY = 4
#: source ports a message is sprayed over unless told otherwise
DEFAULT_ENTROPIES = 8
#: the largest congestion window (packets) unless told otherwise
MAX_WINDOW = 64
#: transports a CollectiveSpec can name
TRANSPORTS = ("tcp", "uet")

STAT_NAMES = ("packets_sent", "bytes_sent", "packets_received", "acks_sent", "nacks_sent",
              "nacks_received", "nack_retransmits", "fast_retransmits", "timeouts",
              "timeout_retransmits",
              "duplicates", "strangers", "trimmed_received", "lasthop_nacks")


class _Outbound:
    """Sender side of one directed pair: messages waiting, packets in flight, the window."""

    def __init__(self, init_window: float):
        self.messages: collections.deque = collections.deque()  # [msg, offset in it]
        self.stream = 0  # stream offset of the next message's first byte
        self.base: dict[int, int] = {}  # msg -> stream offset of its first byte
        self.next_msg = 0
        self.next_psn = 0
        # psn -> [msg, offset, length, last, sent_at, sends]; by (re)send time
        self.inflight: collections.OrderedDict = collections.OrderedDict()
        self.resend: collections.deque = collections.deque()  # NACKed PSNs
        self.unacked: dict[int, int] = {}  # msg -> its packets not yet ACKed
        self.cum = 0  # the highest cumulative ACK so far
        self.futures: dict[int, Future] = {}
        self.data: dict[int, memoryview] = {}
        self.cwnd = float(init_window)
        self.ssthresh = float("inf")
        self.recover_until = 0.0
        self.backoff = 1  # the retransmission timer's multiplier, doubled per timeout
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.last_progress = time.monotonic()

    def idle(self) -> bool:
        return not (self.messages or self.inflight or self.resend)


class _Inbound:
    """Receiver side of one directed pair: PSNs seen and the byte stream being assembled."""

    def __init__(self, lock: threading.Lock):
        # recv() of this peer waits here: one condition per peer, so a packet wakes only the
        # thread that reads this peer (a receiver of 16 peers would wake 16 threads each time)
        self.cond = threading.Condition(lock)
        self.cum = 0  # every PSN below it has arrived
        self.seen: set[int] = set()  # PSNs >= cum that arrived
        self.pieces: dict[int, bytes] = {}  # stream offset -> datagram (header + payload)
        self.ready = 0  # the stream's bytes below it have all arrived
        self.read = 0  # recv() consumed the bytes below it
        self.unacked = 0  # packets that arrived since the last ACK
        self.reply_to = None  # where the last packet came from
        self.last_psn = 0
        self.head = 0  # stream offset of the piece holding byte ``read``
        self.last_progress = time.monotonic()


class UetComm:
    """One rank's UET-like endpoint: the :class:`~testbed.collectives.transport.Comm` calls
    over sprayed, NACKed UDP (see the module docstring).

    ``entropies``: source ports a message is sprayed over; ``init_window`` / ``min_window`` /
    ``max_window``: the congestion window in packets; ``rto_min_s``: the shortest
    retransmission timeout (Linux TCP's 200 ms by default: the two transports then differ only
    in what a trim does; shorter ones fire on a busy machine's scheduling stalls);
    ``time_dilation``: the network's factor (the job's ``time_dilation``), which stretches that
    floor as the hosts' TCP floor is stretched (a dilated queue's round trip outgrows the
    undilated 200 ms: spurious timeouts); ``loss``: seeded drop probability applied on receive
    of data packets (a client-side impairment for tests where no switch drops)."""

    def __init__(self, rank: int, names: list[str], timeout_s: float, job_id: int = 0,
                 entropies: int = DEFAULT_ENTROPIES, init_window: int = 16, min_window: int = 1,
                 max_window: int = MAX_WINDOW, rto_min_s: float = 0.2, loss: float = 0.0,
                 seed: int = 0, time_dilation: float = 1.0):
        if not 1 <= entropies <= 64:
            raise ValueError(f"entropies={entropies!r}: spray over 1..64 source ports")
        if not 1 <= min_window <= init_window <= max_window:
            raise ValueError(f"windows: need 1 <= min_window ({min_window}) <= init_window "
                             f"({init_window}) <= max_window ({max_window})")
        self.rank = rank
        self.names = names
        self.timeout_s = timeout_s
        self.job_id = job_id
        self.entropies = entropies
        self.init_window = init_window
        self.min_window = min_window
        self.max_window = max_window
        if not time_dilation >= 1.0:
            raise ValueError(f"time_dilation={time_dilation!r}: need a factor >= 1")
        self.rto_min_s = rto_min_s * time_dilation
        #: the timeout before a round trip is measured (TCP's initial 200 ms floor)
        self.rto_initial_s = max(rto_min_s, 0.2) * time_dilation
        self.loss = float(loss)
        self._rng = random.Random(hash((seed, job_id, rank)))
        self.ip = ""
        self.addrs: dict[int, str] = {}
        self._out: dict[int, _Outbound] = {}
        self._in: dict[int, _Inbound] = {}
        self._rx: socket.socket | None = None
        self._tx: list[socket.socket] = []
        self._spray = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._stats = dict.fromkeys(STAT_NAMES, 0)

    def who(self, peer: int) -> str:
        """'rank 3 (tbh4)' for messages."""
        return f"rank {peer} ({self.names[peer]})"

    # ------------------------------------------------------------------ set-up

    def listen(self, ip: str) -> int:
        """Bind the receive socket (``ip``'s testbed port) and the spraying ports; return the
        testbed port."""
        self.ip = ip
        self._rx = self._udp(Dscp.CONTROL, TESTBED_UDP_PORT, (
            "for the UET transport. It takes one rank per address: another rank, another UET "
            "job, a trimmed gather or an incast receiver uses this host's testbed port; run "
            "one rank per host or use transport='tcp'"))
        try:
            for e in range(self.entropies):
                self._tx.append(self._udp(Dscp.TRIMMABLE, uet_port(self.job_id, e), (
                    f"(spraying port {e} of job {self.job_id}); another UET job with the same "
                    "job_id modulo the port span runs on this host")))
        except BaseException:
            self.close()
            raise
        return TESTBED_UDP_PORT

    def _udp(self, dscp: Dscp, port: int, why: str) -> socket.socket:
        """A non-blocking UDP socket of class ``dscp`` bound to ``port`` of this rank's
        address; a port in use is a CollectiveError saying ``why``."""
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((self.ip, port))
        except OSError as e:
            s.close()
            raise CollectiveError(f"{self.who(self.rank)}: cannot bind UDP {self.ip}:{port} "
                                  f"({e}) {why}") from None
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(dscp) << 2)  # DSCP, ECN bits 0
        for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):
            try:  # SO_RCVBUFFORCE / SO_SNDBUFFORCE: root may exceed net.core.*mem_max
                s.setsockopt(socket.SOL_SOCKET, force, SOCK_BUF)
            except OSError:
                s.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        s.setblocking(False)
        return s

    def connect(self, peers: list[int], addrs: dict[int, tuple[str, int]]) -> None:
        """Remember the peers' addresses and start the endpoint's I/O thread (there is no
        handshake: every rank bound its sockets before any address was handed out)."""
        if self._rx is None:
            raise CollectiveError(f"{self.who(self.rank)}: connect() before listen()")
        for p in peers:
            if p == self.rank:
                continue
            self.addrs[p] = str(addrs[p][0])
            self._out[p] = _Outbound(self.init_window)
            self._in[p] = _Inbound(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"uet{self.rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the Comm calls

    def send(self, peer: int, arr: np.ndarray) -> Future:
        """Queue ``arr`` for ``peer`` (copied now); the future is done once the peer ACKed
        every packet of it."""
        data = memoryview(np.ascontiguousarray(arr).tobytes())
        fut: Future = Future()
        with self._cond:
            self._raise_if_failed()
            out = self._out[peer]
            msg = out.next_msg
            out.next_msg += 1
            out.futures[msg] = fut
            out.data[msg] = data
            out.unacked[msg] = -(-len(data) // MTU_PAYLOAD)
            out.base[msg] = out.stream
            out.stream += len(data)
            if not len(data):  # nothing to carry: done at once, like an empty TCP send
                del out.unacked[msg], out.futures[msg], out.data[msg], out.base[msg]
                fut.set_result(None)
                return fut
            out.messages.append([msg, 0])
        self._wake()
        return fut

    def recv(self, peer: int, arr: np.ndarray) -> None:
        """Fill ``arr`` with the next ``arr.nbytes`` bytes of ``peer``'s stream (what it sent,
        in order, as TCP would deliver it)."""
        mv = memoryview(arr).cast("B")
        need = len(mv)
        inb = self._in[peer]
        with self._cond:
            while inb.ready - inb.read < need:
                self._raise_if_failed()
                if time.monotonic() - inb.last_progress > self.timeout_s:
                    raise CollectiveTimeout(
                        f"{self.who(self.rank)}: no data from {self.who(peer)} for "
                        f"{self.timeout_s} s ({inb.ready - inb.read}/{need} B received)")
                inb.cond.wait(0.05)
            o, key = 0, inb.head
            while o < need:
                d = inb.pieces[key]
                size = len(d) - HEADER_LEN
                skip = inb.read - key
                take = min(size - skip, need - o)
                mv[o:o + take] = memoryview(d)[HEADER_LEN + skip:HEADER_LEN + skip + take]
                o += take
                inb.read += take
                if skip + take == size:
                    del inb.pieces[key]
                    key += size
            inb.head = key

    def drain(self, peer: int) -> None:
        """Wait until ``peer`` ACKed everything sent to it."""
        out = self._out[peer]
        with self._cond:
            while not out.idle():
                self._raise_if_failed()
                err = self._silence(peer, out)
                if err is not None:
                    raise err
                self._cond.wait(0.05)

    def stats(self) -> dict[str, int]:
        """Counters of this endpoint (``STAT_NAMES``)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Stop the I/O thread and close every socket; queued sends fail."""
        self._stop = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        for s in [self._rx, *self._tx]:
            if s is not None:
                s.close()
        self._rx, self._tx = None, []
        with self._cond:
            for out in self._out.values():
                for f in out.futures.values():
                    if not f.done():
                        f.set_exception(CollectiveError(f"{self.who(self.rank)}: closed"))
                out.futures.clear()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ internals

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already woken (pipe full) or closed

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _silence(self, peer: int, out: _Outbound) -> CollectiveTimeout | None:
        """The error of a peer that ACKed nothing for ``timeout_s``, else None."""
        if time.monotonic() - out.last_progress <= self.timeout_s:
            return None
        return CollectiveTimeout(f"{self.who(self.rank)}: {self.who(peer)} acknowledged "
                                 f"nothing for {self.timeout_s} s ({len(out.inflight)} "
                                 "packets in flight; peer died?)")

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        sel.register(self._rx, selectors.EVENT_READ, "rx")
        for s in self._tx:
            sel.register(s, selectors.EVENT_READ, "tx")
        try:
            while not self._stop:
                with self._cond:
                    wait = self._pump(time.monotonic())
                for key, _ in sel.select(wait):
                    if key.data == "wake":
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                        continue
                    self._receive(key.fileobj, key.data == "rx")
        except BaseException as e:  # noqa: BLE001 - handed to the caller's next call
            if not self._stop:
                with self._cond:
                    self._error = CollectiveError(f"{self.who(self.rank)}: UET transport "
                                                  f"failed: {type(e).__name__}: {e}")
                    for out in self._out.values():
                        for f in out.futures.values():
                            if not f.done():
                                f.set_exception(self._error)
                    self._cond.notify_all()
                    for inb in self._in.values():
                        inb.cond.notify_all()
        finally:
            sel.close()

    def _receive(self, sock: socket.socket, is_rx: bool) -> None:
        """Drain ``sock`` (data on the receive socket, ACKs/NACKs on the spraying ports) and
        handle what came under one hold of the lock; then ACK what is still unACKed."""
        batch = []
        for _ in range(256):
            try:
                batch.append(sock.recvfrom(2048))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # e.g. an ICMP error queued on the socket; the timers recover
        if not batch:
            return
        with self._cond:
            for d, src in batch:
                if len(d) < HEADER_LEN:
                    self._stats["strangers"] += 1
                    continue
                h = _HDR.unpack_from(d)
                magic, version, mtype, job, who = h[0], h[1], h[2], h[3], h[4]
                if magic != MAGIC or version != VERSION or job != self.job_id:
                    self._stats["strangers"] += 1
                elif is_rx and mtype == _DATA and who in self._in:
                    self._on_data(who, h, d, src)
                elif not is_rx and mtype in (_ACK, _NACK) and who in self._out:
                    self._on_feedback(who, mtype, h, d)
                else:
                    self._stats["strangers"] += 1
            if is_rx:
                for inb in self._in.values():
                    if inb.unacked:
                        self._ack(inb)

    def _on_data(self, peer: int, h: tuple, d: bytes, src) -> None:
        flags, off, ln, psn = h[7], (h[5] << 32) | h[13], h[11], h[15]
        inb = self._in[peer]
        self._stats["packets_received"] += 1
        if flags & _TRIMMED:  # the payload was cut: ask for it again now
            self._stats["trimmed_received"] += 1
            if flags & _LASTHOP:
                self._stats["lasthop_nacks"] += 1
            self._control(src, _NACK, flags & (_TRIMMED | _LASTHOP), inb.cum, psn)
            return
        if self.loss and self._rng.random() < self.loss:
            return
        inb.last_progress = time.monotonic()
        inb.reply_to, inb.last_psn = src, psn
        if psn < inb.cum or psn in inb.seen:
            self._stats["duplicates"] += 1
            self._ack(inb)  # its ACK was lost, or it came twice: say so now
            return
        if len(d) - HEADER_LEN != ln or off < inb.read or ln == 0:
            self._stats["strangers"] += 1
            return
        inb.seen.add(psn)
        while inb.cum in inb.seen:
            inb.seen.discard(inb.cum)
            inb.cum += 1
        inb.pieces[off] = d
        if off == inb.ready:
            while inb.ready in inb.pieces:
                inb.ready += len(inb.pieces[inb.ready]) - HEADER_LEN
            inb.cond.notify()
        inb.unacked += 1
        if inb.unacked >= ACK_EVERY:
            self._ack(inb)

    def _ack(self, inb: _Inbound) -> None:
        """ACK ``inb``'s sender: the newest PSN, the cumulative one and, in an 8-byte payload,
        which of the 64 PSNs from the cumulative one on arrived (a selective ACK: sprayed
        packets arrive out of order, and the ones behind a hole need not wait for it)."""
        cum, bits = inb.cum, 0
        for p in inb.seen:
            if p - cum < 64:
                bits |= 1 << (p - cum)
        inb.unacked = 0
        self._control(inb.reply_to, _ACK, 0, cum, inb.last_psn, bits.to_bytes(8, "little"))

    def _control(self, dst, mtype: int, flags: int, cum: int, psn: int,
                 payload: bytes = b"") -> None:
        """Send an ACK or a NACK from the receive socket (class CONTROL)."""
        hdr = _HDR.pack(MAGIC, VERSION, mtype, self.job_id, self.rank, 0, 0, flags, _BYTES,
                        0, 0, len(payload), 0, cum & 0xFFFFFFFF, 0.0, psn)
        try:
            self._rx.sendto(hdr + payload, dst)
            self._stats["acks_sent" if mtype == _ACK else "nacks_sent"] += 1
        except OSError:
            pass  # a full socket buffer: the sender's timer recovers

    def _on_feedback(self, peer: int, mtype: int, h: tuple, d: bytes) -> None:
        psn, cum = h[15], h[13]
        out = self._out[peer]
        now = time.monotonic()
        if mtype == _NACK:
            self._stats["nacks_received"] += 1
            ent = out.inflight.pop(psn, None)
            if ent is not None:
                if ent[5] == 1:  # a cut packet's round trip is the path's too
                    self._rtt_sample(out, now - ent[4])
                out.resend.append((psn, ent))
                self._stats["nack_retransmits"] += 1
                out.last_progress = now
                self._congested(out, now)
        else:
            ent = out.inflight.pop(psn, None)
            if ent is not None:
                if ent[5] == 1:  # RTT samples from packets sent once only (Karn)
                    self._rtt_sample(out, now - ent[4])
                self._grow(out)
                self._acked(out, ent[0])
                out.last_progress = now
        if cum > out.cum:  # a cumulative ACK also covers packets whose own ACK was lost
            for p in range(out.cum, cum):
                ent = out.inflight.pop(p, None)
                if ent is not None:
                    self._grow(out)
                    self._acked(out, ent[0])
            if out.resend:
                for ent in [e for p, e in out.resend if p < cum]:
                    self._acked(out, ent[0])
                out.resend = collections.deque((p, e) for p, e in out.resend if p >= cum)
            out.cum = cum
            out.last_progress = now
        if mtype == _ACK and len(d) >= HEADER_LEN + 8:
            bits = int.from_bytes(d[HEADER_LEN:HEADER_LEN + 8], "little")
            hole = out.inflight.get(cum)
            if hole is not None and hole[5] == 1 and bits.bit_count() >= REORDER_PACKETS:
                # packets sent after the first missing one arrived, more than spraying
                # reorders: it was lost (a drop-tail queue), resend it without a timeout
                del out.inflight[cum]
                out.resend.append((cum, hole))
                self._stats["fast_retransmits"] += 1
                self._congested(out, now)
            while bits:
                low = bits & -bits
                ent = out.inflight.pop(cum + low.bit_length() - 1, None)
                bits ^= low
                if ent is not None:
                    self._grow(out)
                    self._acked(out, ent[0])
                    out.last_progress = now

    def _congested(self, out: _Outbound, now: float) -> None:
        """A trim or a loss: halve the window, at most once per round trip."""
        if now >= out.recover_until:
            out.cwnd = max(float(self.min_window), out.cwnd / 2)
            out.ssthresh = out.cwnd
            out.recover_until = now + (out.srtt or self.rto_min_s)

    def _grow(self, out: _Outbound) -> None:
        """One packet ACKed: slow start below ssthresh, else one packet per window."""
        out.backoff = 1
        out.cwnd += 1.0 if out.cwnd < out.ssthresh else 1.0 / out.cwnd
        out.cwnd = min(out.cwnd, float(self.max_window))

    def _acked(self, out: _Outbound, msg: int) -> None:
        left = out.unacked[msg] - 1
        if left:
            out.unacked[msg] = left
            return
        del out.unacked[msg]
        out.data.pop(msg, None)
        out.base.pop(msg, None)
        fut = out.futures.pop(msg, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._cond.notify_all()

    def _rtt_sample(self, out: _Outbound, rtt: float) -> None:
        if out.srtt is None:
            out.srtt, out.rttvar = rtt, rtt / 2
        else:
            out.rttvar = 0.75 * out.rttvar + 0.25 * abs(out.srtt - rtt)
            out.srtt = 0.875 * out.srtt + 0.125 * rtt

    def _rto(self, out: _Outbound) -> float:
        if out.srtt is None:
            return self.rto_initial_s
        return max(self.rto_min_s, out.srtt + 4 * out.rttvar)

    def _pump(self, now: float) -> float:
        """Send what the windows allow, retransmit what timed out; return how long the I/O
        thread may sleep."""
        wait = 0.05
        for peer, out in self._out.items():
            rto = self._rto(out)
            # a timeout (the oldest packet in flight, ACKed by nothing for an RTO): every
            # packet in flight is taken for lost and resent as the window of one packet
            # grows again (TCP's go-back-N); the timer backs off until an ACK comes
            if out.inflight:
                ent = next(iter(out.inflight.values()))
                due = ent[4] + rto * out.backoff
                if due > now:
                    wait = min(wait, due - now)
                else:
                    self._stats["timeouts"] += 1
                    self._stats["timeout_retransmits"] += len(out.inflight)
                    out.ssthresh = max(float(self.min_window), out.cwnd / 2)
                    out.cwnd = float(self.min_window)
                    out.recover_until = now + rto
                    out.backoff = min(out.backoff * 2, MAX_BACKOFF)
                    out.resend.extendleft(reversed(list(out.inflight.items())))
                    out.inflight.clear()
            while len(out.inflight) < int(out.cwnd):
                if out.resend:
                    psn, ent = out.resend.popleft()
                    self._transmit(peer, out, psn, ent, now)
                    continue
                if not out.messages:
                    break
                item = out.messages[0]
                msg, off = item
                data = out.data[msg]
                ln = min(MTU_PAYLOAD, len(data) - off)
                last = off + ln >= len(data)
                psn = out.next_psn
                out.next_psn += 1
                ent = [msg, off, ln, last, now, 0]  # ..., sent at, sends (_transmit counts)
                item[1] = off + ln
                if last:
                    out.messages.popleft()
                self._transmit(peer, out, psn, ent, now)
            if out.inflight and not self._stop:
                self._fail_silent_peer(peer, out)
        return max(wait, 0.0)

    def _fail_silent_peer(self, peer: int, out: _Outbound) -> None:
        """Fail the sends to a peer that ACKed nothing for ``timeout_s`` and drop its state."""
        err = self._silence(peer, out)
        if err is not None:
            for f in out.futures.values():
                if not f.done():
                    f.set_exception(err)
            out.futures.clear()
            out.inflight.clear()
            out.messages.clear()
            out.resend.clear()
            self._cond.notify_all()

    def _transmit(self, peer: int, out: _Outbound, psn: int, ent: list, now: float) -> None:
        msg, off, ln, last = ent[0], ent[1], ent[2], ent[3]
        at = out.base[msg] + off  # the stream offset: high 16 bits in slot, low 32 in offset
        hdr = _HDR.pack(MAGIC, VERSION, _DATA, self.job_id, self.rank, (at >> 32) & 0xFFFF, 0,
                        _LAST if last else 0, _BYTES, 0, 0, ln, 0, at & 0xFFFFFFFF, 0.0, psn)
        s = self._tx[self._spray]
        self._spray = (self._spray + 1) % len(self._tx)
        ent[4] = now
        ent[5] += 1
        out.inflight[psn] = ent
        out.inflight.move_to_end(psn)
        try:
            s.sendmsg([hdr, out.data[msg][off:off + ln]], (), 0,
                      (self.addrs[peer], TESTBED_UDP_PORT))
        except (BlockingIOError, InterruptedError):
            return  # the socket buffer is full: the timer sends it again
        self._stats["packets_sent"] += 1
        self._stats["bytes_sent"] += ln + HEADER_LEN
