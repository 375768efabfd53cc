"""TCP plumbing of the host-based collectives: connections between ranks and exact transfers.

A :class:`Comm` belongs to one rank (worker or server) inside its host's network namespace.
It holds one TCP connection per peer rank it talks to, a sender thread per peer (so a rank
can send and receive at once, as ring steps need) and the timeout after which a silent peer
fails the run with :class:`CollectiveTimeout`.

Every socket binds a deterministic port (:func:`testbed.collectives.ports.tcp_port`), so the
5-tuple of every flow, and with it the path an ECMP switch hashes it onto, is known before the
run. Sockets close with an RST (``SO_LINGER`` 0): no TIME_WAIT entry is left that would stop
the next run of the same job from binding the same ports (Linux refuses ``connect`` from a
bound port to a peer with a TIME_WAIT entry for that 4-tuple). A Comm closes only after every
rank finished (the pool's ``exit``) or when the run failed, so no data is in flight then.

Every socket runs the congestion control the Comm is given (``tcp_cc``, the collectives pass
:data:`DEFAULT_TCP_CC` unless a spec names another), not the host's default: that default is a
property of the machine (bbr on the development machines of this project, cubic on a stock
Debian kernel), every network namespace inherits it, and it changes the measured times by up
to 40 % (see :data:`DEFAULT_TCP_CC`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from testbed.collectives.ports import MAX_RANKS, TCP_JOB_SLOTS, tcp_port

#: Largest message a rank hands to the kernel itself (when nothing is queued for that peer and
#: its socket has room) instead of through the peer's sender thread. The thread's hand-off
#: dominates small messages: an 8-byte ring allreduce between two processes on loopback took
#: 373 us per call with every send through the thread, 122 us with this.
INLINE_SEND_BYTES = 64 << 10

#: Messages from this size up are received with a raised low-water mark (``_recv_into``); the
#: mark is at most the receive buffer over this share, so the window the peer is offered stays
#: open while the message gathers (the kernel also wakes the reader when it would close).
_LOWAT_MIN_BYTES = 16 << 10
_LOWAT_SHARE = 32


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, closed its connection, or sent garbage)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A peer stayed silent longer than ``spec.timeout_s``."""


_HELLO = struct.Struct("<I")
_LINGER_RST = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends an RST
_SIOCOUTQNSD = 0x894B  # a TCP socket's bytes not yet sent (linux/sockios.h)
_PROC_TCP = "/proc/sys/net/ipv4/"

#: The collectives' TCP congestion control (``CollectiveSpec.tcp_cc``'s default): Reno, whose
#: dynamics are counted in round trips and packets, so time dilation preserves them. Cubic's
#: HyStart leaves slow start when the RTT grows by 4-16 ms, an absolute threshold dilation does
#: not stretch: at factor f it fires at 1/f of the queue it would need on the undilated network,
#: and every step that restarts from idle under-fills its link (bbr's 10 s and 200 ms probing
#: periods are absolute too). Measured (4 MiB, 100 Mb/s, two runs each, fidelity = time /
#: flow model): ring on a star of 4 (f=6) 1.02-1.03 with reno, 1.15-1.19 cubic, 1.08-1.11 bbr,
#: and 1.03 with cubic once HyStart was switched off (a global module parameter, so not an
#: option for the testbed); star of 8 (f=16) 1.01-1.02 / 1.08-1.16 / 1.08-1.12; leaf-spine
#: 4:1 (f=6) 1.04-1.07 / 1.05-1.10 / 1.07-1.12. Halving-doubling 1.07-1.10 reno vs 1.39-1.51
#: cubic on the star of 4; on the others its spread (1.2-1.4) exceeds the differences.
#: Reno is built into every Linux kernel.
DEFAULT_TCP_CC = "reno"


def _proc_tcp(name: str) -> str:
    try:
        with open(_PROC_TCP + name) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_tcp_cc() -> str:
    """This network namespace's default TCP congestion control ('' where /proc hides it)."""
    return _proc_tcp("tcp_congestion_control")


def available_tcp_cc() -> list[str]:
    """The congestion controls this kernel has loaded (empty where /proc hides them)."""
    return _proc_tcp("tcp_available_congestion_control").split()


def set_tcp_cc(s: socket.socket, cc: str) -> None:
    """Run socket ``s`` with congestion control ``cc``; a clear ``CollectiveError`` when the
    kernel has no such algorithm or does not let this process use it."""
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    except OSError as e:
        have = " ".join(available_tcp_cc()) or "unknown"
        if e.errno == errno.ENOENT:
            why = (f"this kernel has no TCP congestion control {cc!r} (available: {have}); "
                   f"load it (modprobe tcp_{cc}) or name one of those in "
                   "CollectiveSpec.tcp_cc (None: the host's default)")
        elif e.errno == errno.EPERM:
            allowed = _proc_tcp("tcp_allowed_congestion_control") or "unknown"
            why = (f"TCP congestion control {cc!r} is not in "
                   f"net.ipv4.tcp_allowed_congestion_control ({allowed}) and this process "
                   "lacks CAP_NET_ADMIN; run as root, allow it with sysctl, or name an allowed "
                   "one in CollectiveSpec.tcp_cc")
        else:
            why = f"setting TCP congestion control {cc!r} failed: {e}"
        raise CollectiveError(why) from None


class Comm:
    """Connections of one rank to its peers, plus per-peer sender threads."""

    def __init__(self, rank: int, names: list[str], timeout_s: float, job_id: int = 0,
                 tcp_cc: str | None = DEFAULT_TCP_CC, window_clamp: int | None = None,
                 port_of=tcp_port):
        """``window_clamp``: the most bytes a connection's receiver offers its sender
        (``TCP_WINDOW_CLAMP``; None: the kernel's autotuned window); ``port_of``: the port
        map (``ports.tcp_port``, or ``ports.a2a_port`` for an all-to-all's connections)."""
        self.rank = rank
        self.port_of = port_of
        self.tcp_cc = tcp_cc  # None: the host's default
        self.window_clamp = window_clamp
        self.names = names  # host name of every rank, for error messages
        self.timeout_s = timeout_s
        self.job_id = job_id
        self.ip = ""
        self.socks: dict[int, socket.socket] = {}
        self._early: dict[int, socket.socket] = {}  # accepted before a connect() asked
        self._senders: dict[int, ThreadPoolExecutor] = {}
        self._queued: dict[int, int] = {}  # sends a peer's sender thread has not finished
        self._queue_lock = threading.Lock()
        self.listener: socket.socket | None = None

    def who(self, peer: int) -> str:
        """'rank 3 (tbh4)' for messages."""
        return f"rank {peer} ({self.names[peer]})"

    def listen(self, ip: str) -> int:
        """Open the listening socket on ``ip`` at the rank's own port; return the port."""
        self.ip = ip
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._bind(s, self.port_of(self.job_id, self.rank, self.rank))
        if self.tcp_cc:  # accepted connections start with the listener's algorithm
            self._set_cc(s)
        self._clamp(s)  # the window a SYN-ACK offers comes from the listener
        s.listen(256)
        s.settimeout(self.timeout_s)
        self.listener = s
        return s.getsockname()[1]

    def connect(self, peers: list[int], addrs: dict[int, tuple[str, int]]) -> None:
        """Connect to every peer with a higher rank, accept every one with a lower rank."""
        for p in sorted(peers):
            if p <= self.rank:
                continue
            deadline = time.monotonic() + self.timeout_s
            while True:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._tune(s)
                self._bind(s, self.port_of(self.job_id, self.rank, p))
                try:
                    s.connect(tuple(addrs[p]))
                    break
                except OSError as e:
                    s.close()
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout(f"{self.who(self.rank)}: cannot connect to "
                                                f"{self.who(p)} at {addrs[p]}: {e}") from None
                    time.sleep(0.05)
            s.sendall(_HELLO.pack(self.rank))
            self._add(p, s)
        lower = {p for p in peers if p < self.rank}
        for p in lower & set(self._early):
            self._add(p, self._early.pop(p))
        while lower - set(self.socks):
            assert self.listener is not None
            try:
                s, _ = self.listener.accept()
            except TimeoutError:
                missing = sorted(lower - set(self.socks))
                raise CollectiveTimeout(f"{self.who(self.rank)}: peers {missing} did not "
                                        f"connect within {self.timeout_s} s") from None
            self._tune(s)
            s.settimeout(self.timeout_s)
            buf = bytearray(_HELLO.size)
            self._recv_into(s, memoryview(buf), "hello")
            (p,) = _HELLO.unpack(buf)
            if p not in lower and 0 <= p < self.rank and p not in self.socks | self._early:
                # a peer already connecting for a later call (an all-to-all's missing pairs)
                # while this rank still waits for this call's: kept for that call
                self._early[p] = s
                continue
            if p not in lower:
                s.close()
                raise CollectiveError(f"{self.who(self.rank)}: unexpected hello from rank {p}")
            self._add(p, s)

    def _bind(self, s: socket.socket, port: int) -> None:
        """Bind ``s`` to ``(self.ip, port)``; a port held by someone else is a clear error."""
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.ip, port))
        except OSError as e:
            s.close()
            raise CollectiveError(
                f"{self.who(self.rank)}: cannot bind TCP port {port} on {self.ip}: {e}. Another "
                f"job whose job_id equals {self.job_id} modulo {TCP_JOB_SLOTS} runs on this "
                "host, or a process of an earlier run is still alive (testbed cleanup); give "
                "concurrent jobs different job_id values (a job of more than "
                f"{MAX_RANKS} ranks needs one rank per address)") from None

    def _set_cc(self, s: socket.socket) -> None:
        try:
            set_tcp_cc(s, self.tcp_cc)
        except CollectiveError as e:
            s.close()
            raise CollectiveError(f"{self.who(self.rank)}: {e}") from None

    def _clamp(self, s: socket.socket) -> None:
        if self.window_clamp:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, int(self.window_clamp))

    def _tune(self, s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._clamp(s)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        if self.tcp_cc:
            self._set_cc(s)
        # Buffers stay autotuned: fixed 4 MiB buffers (SO_*BUFFORCE) were tried for the
        # reduction server and changed nothing measurable (its fidelity gap was uneven TCP
        # sharing among a worker's flows, fixed by a credit window: see server.py).

    def _add(self, p: int, s: socket.socket) -> None:
        s.settimeout(self.timeout_s)
        self.socks[p] = s
        self._senders[p] = ThreadPoolExecutor(1, thread_name_prefix=f"send{p}")

    def send(self, peer: int, arr: np.ndarray) -> Future:
        """Send ``arr`` (contiguous) to ``peer``: handed to the kernel at once when it is small,
        nothing is queued for that peer and the socket has room, otherwise (the rest) queued
        for the peer's sender thread. Sends to one peer keep their order; the future is done
        once every byte is in the kernel."""
        mv = memoryview(np.ascontiguousarray(arr)).cast("B")
        if len(mv) <= INLINE_SEND_BYTES and not self._queued.get(peer):
            sent = self._send_now(peer, mv)
            if sent == len(mv):
                return _SENT
            mv = mv[sent:]
        with self._queue_lock:
            self._queued[peer] = self._queued.get(peer, 0) + 1
        fut = self._senders[peer].submit(self._sendall, peer, mv)
        fut.add_done_callback(lambda _f: self._unqueue(peer))
        return fut

    def _send_now(self, peer: int, mv: memoryview) -> int:
        """Bytes of ``mv`` the socket to ``peer`` took without waiting (0 when it has no room).
        ``os.write``: the socket is non-blocking (it has a timeout), and ``socket.send``
        would wait for room up to that timeout."""
        try:
            return os.write(self.socks[peer].fileno(), mv)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise CollectiveError(f"{self.who(self.rank)}: sending to {self.who(peer)} "
                                  f"failed: {e} (peer died?)") from None

    def _unqueue(self, peer: int) -> None:
        with self._queue_lock:
            self._queued[peer] -= 1

    def _sendall(self, peer: int, mv: memoryview) -> None:
        try:
            self.socks[peer].sendall(mv)
        except TimeoutError:
            raise CollectiveTimeout(f"{self.who(self.rank)}: sending to {self.who(peer)} "
                                    f"stalled for {self.timeout_s} s") from None
        except OSError as e:
            raise CollectiveError(f"{self.who(self.rank)}: sending to {self.who(peer)} "
                                  f"failed: {e} (peer died?)") from None

    def drain(self, peer: int) -> None:
        """Wait until the socket to ``peer`` sent every byte it was given (its unsent bytes,
        ``SIOCOUTQNSD``, are 0): what is left is in flight, at most a congestion window, and
        TCP small queues keep only about a millisecond of it in this host's own qdisc.

        ``sendall`` returns once data is in the socket's send buffer, which autotuning grows to
        megabytes: a rank that moves on would then send its next message while the previous
        one still waits in that buffer, the two share the uplink, and the previous message's
        receiver waits longer. Waiting for the peer's ACKs instead (``SIOCOUTQ``) was measured
        to cost more than it saves: the last ACK queues behind the peer's own next message on
        the peer's uplink. Polls with a sleep that grows from 0.2 ms to 2 ms; a socket that
        sends nothing for ``timeout_s`` fails the run."""
        s = self.socks[peer]
        nap, deadline, left = 2e-4, 0.0, -1
        while True:
            now = _ioctl_int(s, _SIOCOUTQNSD)
            if now <= 0:
                return
            if now != left:  # progress: restart the silence timer
                left, deadline = now, time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                raise CollectiveTimeout(f"{self.who(self.rank)}: {now} B for "
                                        f"{self.who(peer)} left unsent for "
                                        f"{self.timeout_s} s (peer not reading?)")
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)

    def recv(self, peer: int, arr: np.ndarray) -> None:
        """Fill ``arr`` (contiguous, writable) with exactly its size in bytes from ``peer``."""
        self._recv_into(self.socks[peer], memoryview(arr).cast("B"), self.who(peer))

    def _recv_into(self, s: socket.socket, mv: memoryview, who: str) -> None:
        """Fill ``mv`` from ``s``. A large message raises the socket's low-water mark
        (``SO_RCVLOWAT``) to what is still missing, up to a share of the receive buffer, so the
        kernel wakes this rank once per that many bytes rather than once per arriving segment.
        The rank cannot use a part of the message before all of it is there, so it waits no
        longer; the switch's engine, whose packet delivery runs each wake-up, saves the most."""
        got = 0
        total = len(mv)
        lowat = cap = 1
        if total >= _LOWAT_MIN_BYTES:
            with contextlib.suppress(OSError):  # a closed socket: its recv_into says why
                cap = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // _LOWAT_SHARE
        short = False  # the last wait timed out with bytes short of the mark: take them
        try:
            while got < total:
                want = 1 if short else max(1, min(total - got, cap))
                short = False
                if want != lowat:
                    lowat = _set_lowat(s, want)
                try:
                    k = s.recv_into(mv[got:], total - got)
                except TimeoutError:
                    # a peer on a thin link is slow, not silent: bytes came during the wait
                    if lowat > 1 and _unread(s) > 0:
                        short = True
                        continue
                    raise CollectiveTimeout(f"{self.who(self.rank)}: no data from {who} for "
                                            f"{self.timeout_s} s ({got}/{total} B received)"
                                            ) from None
                except OSError as e:
                    raise CollectiveError(f"{self.who(self.rank)}: receiving from {who} "
                                          f"failed: {e} (peer died?)") from None
                if k == 0:
                    raise CollectiveError(f"{self.who(self.rank)}: {who} closed the "
                                          f"connection ({got}/{total} B received; peer died?)")
                got += k
        finally:
            if lowat != 1:  # others poll this socket for any byte
                _set_lowat(s, 1)

    def close(self) -> None:
        """Close every connection and stop the sender threads."""
        for ex in self._senders.values():
            ex.shutdown(wait=False, cancel_futures=True)
        for s in [*self.socks.values(), *self._early.values()]:
            s.close()
        if self.listener is not None:
            self.listener.close()
        self.socks.clear()
        self._early.clear()


_SENT: Future = Future()  # what an inline send returns: done, no result
_SENT.set_result(None)


def _set_lowat(s: socket.socket, value: int) -> int:
    """Set ``s``'s receive low-water mark; the mark in force (1 where a closed socket refused
    it: its next ``recv_into`` says why, as for the buffer's size above)."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, value)
    except OSError:
        return 1
    return value


def _ioctl_int(s: socket.socket, request: int) -> int:
    """The count a socket ioctl reports (``FIONREAD``: bytes to read; ``SIOCOUTQNSD``: bytes
    not yet sent)."""
    buf = bytearray(4)
    fcntl.ioctl(s.fileno(), request, buf)
    return struct.unpack("i", buf)[0]


def _unread(s: socket.socket) -> int:
    """Bytes waiting in ``s``'s receive queue; 0 where that cannot be read."""
    try:
        return _ioctl_int(s, termios.FIONREAD)
    except OSError:
        return 0


def wait_all(futures: list[Future]) -> None:
    """Wait for queued sends; re-raise the first failure."""
    for f in futures:
        f.result()


def chunks(lo: int, hi: int, step: int):
    """(start, stop) pairs covering [lo, hi) in pieces of at most ``step``."""
    for s in range(lo, hi, step):
        yield s, min(s + step, hi)
