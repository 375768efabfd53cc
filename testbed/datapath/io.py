"""Batched packet I/O on AF_PACKET sockets, moving whole bursts between a port and the rows of
a 2-D ``uint8`` buffer (``Batch.buf``). Two implementations with one interface
(``recv_burst``, ``send_rows``, ``send_one``, ``fileno``, ``close``, ``tx_errors``):

* :class:`RingPort` (the engine's default, ``io="ring"``): PACKET_MMAP rings (TPACKET_V2) shared
  with the kernel. Receiving costs no system call at all: the kernel writes each frame into
  the next slot of the mapped RX ring and flips its status word; one ``@njit`` call copies the
  ready frames into the batch rows and hands the slots back. Sending: one ``@njit`` call copies
  the burst's rows into TX ring slots and marks them, then one ``send()`` asks the kernel to
  transmit every marked slot (it builds the socket buffers from the ring's pages). Why V2 and
  not V3 for RX: a TPACKET_V3 block is handed to user space only when it is full or its
  retire timer (whole milliseconds) fires, which at the tens of kpps of a 100 Mb/s link adds
  up to that timer to every hop; a V2 slot is visible as soon as its frame is written.
* :class:`PacketPort` (``io="mmsg"``): ``recvmmsg``/``sendmmsg`` with ``mmsghdr``/``iovec``
  arrays built once as numpy structured arrays: one system call per burst and direction.

Sockets are bound to one interface with ``ETH_P_ALL``, put in promiscuous mode, and set to
ignore their own transmissions (``PACKET_IGNORE_OUTGOING``), so a forwarding loop never sees
the frames it sent.

Why one module this long: both packet I/O back-ends (``sendmmsg``/``recvmmsg`` and PACKET_MMAP
rings) with their ``@njit`` copy loops, which the engine calls per burst; their twins are in
``testbed/datapath/reference/io.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import socket
import struct
import subprocess

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from testbed.datapath.batch import PORT_UNSET
from testbed.kernels.packed import array_at

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
PACKET_IGNORE_OUTGOING = 23
PACKET_QDISC_BYPASS = 20
MSG_DONTWAIT = 0x40

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int
_sendmmsg = _libc.sendmmsg
_sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int
_send = _libc.send
_send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_send.restype = ctypes.c_ssize_t

# PACKET_MMAP (linux/if_packet.h)
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_VERSION = 10
PACKET_TX_RING = 13
PACKET_LOSS = 14
TPACKET_V2 = 1
TPACKET_V3 = 2
TP_STATUS_KERNEL = 0  # RX slot owned by the kernel
TP_STATUS_USER = 1  # RX slot holds a frame for us
TP_STATUS_AVAILABLE = 0  # TX slot free
TP_STATUS_SEND_REQUEST = 1  # TX slot filled, to be sent by the next send()
TP_STATUS_SENDING = 2  # TX slot being sent (its pages are in a socket buffer)
TP_STATUS_WRONG_FORMAT = 4
#: struct tpacket2_hdr (status, len, snaplen, mac, net, sec, nsec, vlan tci/tpid, padding)
TPACKET2_HDR = 32
#: where a TX slot's data starts: TPACKET2_HDRLEN - sizeof(struct sockaddr_ll)
TX_DATA_OFFSET = 32
#: struct virtio_net_hdr before each frame in a TX slot (PACKET_VNET_HDR): its hdr_len is the
#: whole frame, so the kernel copies the frame into one linear socket buffer. Without it the
#: buffer points at the ring's page, which a veth must then copy into a freshly allocated page
#: per frame to hand it to another namespace (skb_copy_ubufs), costing more than the copy.
PACKET_VNET_HDR = 15
VNET_HDR_LEN = 10
#: bytes per ring slot (a 1514-byte frame plus the headers fits) and per ring block
RING_FRAME = 2048
RING_BLOCK = 1 << 16
#: slots per port: RX absorbs a burst of this many frames while the engine is descheduled
RX_RING_FRAMES = 4096
TX_RING_FRAMES = 1024

# struct iovec / struct mmsghdr on 64-bit Linux (x86_64 and aarch64 share the layout).
IOVEC_DTYPE = np.dtype([("base", "<u8"), ("len", "<u8")])
MMSGHDR_DTYPE = np.dtype(
    [
        ("name", "<u8"),
        ("namelen", "<u4"),
        ("_pad0", "<u4"),
        ("iov", "<u8"),
        ("iovlen", "<u8"),
        ("control", "<u8"),
        ("controllen", "<u8"),
        ("flags", "<i4"),
        ("_pad1", "<u4"),
        ("msg_len", "<u4"),
        ("_pad2", "<u4"),
    ]
)
assert MMSGHDR_DTYPE.itemsize == 64 and ctypes.sizeof(ctypes.c_void_p) == 8


def disable_offloads(ifname: str) -> None:
    """Turn off checksum/segmentation offloads on ``ifname`` (in the caller's namespace).

    Why: with tx checksum offload a veth hands us frames whose UDP checksum is not filled in;
    forwarded unchanged, the receiving host would discard them. With GSO/GRO frames could
    exceed the MTU. Missing features are ignored (ethtool exits non-zero for them).
    """
    subprocess.run(
        ["ethtool", "-K", ifname, "tx", "off", "rx", "off", "gso", "off", "tso", "off",
         "gro", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
    )


def _bind(sock: socket.socket, ifname: str, proto: int, promisc: bool) -> int:
    """Bind a packet socket to ``ifname`` (promiscuous if asked), non-blocking; its ifindex."""
    try:
        sock.bind((ifname, proto))
    except OSError as e:
        raise ValueError(
            f"cannot bind a packet socket to interface {ifname!r} ({e.strerror}); "
            "check the port name exists in this network namespace"
        ) from None
    ifindex = socket.if_nametoindex(ifname)
    if promisc:
        mreq = struct.pack("iHH8s", ifindex, PACKET_MR_PROMISC, 0, b"")
        sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
    sock.setblocking(False)
    return ifindex


class MmsgSender:
    """``sendmmsg`` of buffer rows on socket ``fd``: the ``mmsghdr``/``iovec`` arrays are built
    once; per burst only the rows' addresses and lengths are written."""

    def __init__(self, fd: int, buf: np.ndarray):
        n = buf.shape[0]
        self.fd = fd
        self.buf = buf
        self.row_bytes = buf.shape[1]
        self._iov = np.zeros(n, dtype=IOVEC_DTYPE)
        self._msg = np.zeros(n, dtype=MMSGHDR_DTYPE)
        self._msg["iov"] = self._iov.ctypes.data + np.arange(n, dtype=np.uint64) * 16
        self._msg["iovlen"] = 1
        self._msg_addr = self._msg.ctypes.data
        self.errors = 0

    def send_rows(self, rows: np.ndarray, lengths: np.ndarray) -> int:
        """Send the frames in buffer ``rows``; return the count sent.

        Retries a short ``sendmmsg`` (kernel buffer full) a few times; what is still unsent
        is counted in ``errors`` and lost, like a full NIC ring.
        """
        count = len(rows)
        if count == 0:
            return 0
        self._iov["base"][:count] = self.buf.ctypes.data + rows.astype(np.uint64) * np.uint64(
            self.row_bytes
        )
        self._iov["len"][:count] = lengths[rows]
        done = 0
        tries = 0
        while done < count:
            sent = _sendmmsg(self.fd, self._msg_addr + done * 64, count - done, 0)
            if sent < 0:
                err = ctypes.get_errno()
                if err not in (errno.EAGAIN, errno.ENOBUFS, errno.EINTR) or tries >= 8:
                    break
                tries += 1
                continue
            done += sent
        self.errors += count - done
        return done


def clear_socket_error(port) -> int:
    """Read (and so clear) a port's pending socket error: the kernel sets ENETDOWN when the
    link goes down, and ``poll`` reports POLLERR until it is read (an engine would spin).
    Counts it in ``port.down_events``; returns the errno (0: none)."""
    err = port.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        port.down_events += 1
    return err


class PacketPort:
    """One AF_PACKET socket bound to ``ifname`` that moves bursts of frames.

    ``buf`` is the 2-D ``uint8`` frame buffer (rows of ``FRAME_MAX`` bytes) this port receives
    into and sends from; pass the same ``Batch.buf`` to every port of a node.
    """

    def __init__(self, ifname: str, buf: np.ndarray, promisc: bool = True,
                 rcvbuf: int = 8 << 20, sndbuf: int = 8 << 20, qdisc_bypass: bool = False):
        if buf.dtype != np.uint8 or buf.ndim != 2 or not buf.flags.c_contiguous:
            raise ValueError("buf must be a C-contiguous 2-D uint8 array (e.g. Batch.buf)")
        if buf.shape[1] < 64:
            raise ValueError(f"buf rows are {buf.shape[1]} bytes; need at least 64")
        self.ifname = ifname
        self.buf = buf
        self.row_bytes = buf.shape[1]
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            # Root may exceed net.core.rmem_max with the FORCE variants.
            for opt, val in ((33, rcvbuf), (32, sndbuf)):  # SO_RCVBUFFORCE, SO_SNDBUFFORCE
                try:
                    self.sock.setsockopt(socket.SOL_SOCKET, opt, val)
                except OSError:
                    pass
            self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            if qdisc_bypass:
                self.sock.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
            self.ifindex = _bind(self.sock, ifname, ETH_P_ALL, promisc)
        except BaseException:
            self.sock.close()
            raise
        self.fd = self.sock.fileno()
        n = buf.shape[0]
        base = buf.ctypes.data
        # rx: one iovec per buffer row, fixed for the life of the port
        self._rx_iov = np.zeros(n, dtype=IOVEC_DTYPE)
        self._rx_iov["base"] = base + np.arange(n, dtype=np.uint64) * self.row_bytes
        self._rx_iov["len"] = self.row_bytes
        self._rx_msg = np.zeros(n, dtype=MMSGHDR_DTYPE)
        self._rx_msg["iov"] = self._rx_iov.ctypes.data + np.arange(n, dtype=np.uint64) * 16
        self._rx_msg["iovlen"] = 1
        self._rx_msg_addr = self._rx_msg.ctypes.data
        self._tx = MmsgSender(self.fd, buf)
        self.down_events = 0

    @property
    def tx_errors(self) -> int:
        """Frames ``send_rows`` could not send (kernel buffer full), lost like on a full NIC."""
        return self._tx.errors

    def fileno(self) -> int:
        """The socket's file descriptor (for ``poll``)."""
        return self.fd

    def clear_error(self) -> int:
        """Read (and so clear) the socket's pending error (see :func:`clear_socket_error`)."""
        return clear_socket_error(self)

    def recv_burst(self, first_row: int, max_count: int, lengths: np.ndarray) -> int:
        """Receive up to ``max_count`` frames into rows ``first_row..``; never blocks.

        Writes each frame's length to ``lengths[first_row + i]`` and returns the count (0 when
        nothing is waiting).
        """
        if max_count <= 0:
            return 0
        if first_row < 0 or first_row + max_count > self.buf.shape[0]:
            raise ValueError(f"rows {first_row}..{first_row + max_count} outside the buffer")
        got = _recvmmsg(self.fd, self._rx_msg_addr + first_row * 64, max_count, MSG_DONTWAIT,
                        None)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EINTR):
                return 0
            if err in (errno.ENETDOWN, errno.ENODEV, errno.ENXIO):
                # link went down (or was deleted at teardown): the error is reported once
                self.down_events += 1
                return 0
            raise OSError(err, f"recvmmsg on {self.ifname}: {os.strerror(err)}")
        if got:
            lengths[first_row : first_row + got] = self._rx_msg["msg_len"][
                first_row : first_row + got
            ]
        return got

    def send_rows(self, rows: np.ndarray, lengths: np.ndarray) -> int:
        """Send the frames in buffer ``rows`` (lengths from ``lengths[rows]``); return count sent.

        Retries a short ``sendmmsg`` (kernel buffer full) a few times; what is still unsent
        is counted in ``tx_errors`` and lost, like a full NIC ring.
        """
        return self._tx.send_rows(rows, lengths)

    def send_one(self, frame: bytes) -> None:
        """Send one frame (slow path: tests, control, generated single packets)."""
        self.sock.send(frame)

    #: sendmmsg leaves nothing queued in user space (see :attr:`RingPort.tx_pending`)
    tx_pending = False

    def kick(self, filled: int = 0) -> None:
        """Nothing to do: every frame ``send_rows`` accepted is already sent."""

    def stats(self) -> dict:
        """The kernel's counters since the last call: frames delivered to the socket and frames
        dropped because its receive buffer was full (``PACKET_STATISTICS``, reset by reading)."""
        return _packet_stats(self.sock)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


# --- PACKET_MMAP rings ------------------------------------------------------------------------
# Slot layout (TPACKET_V2): the slot of frame h starts at h * frame_size (RX ring) or at
# tx_base + h * frame_size (TX ring, mapped right after the RX ring). ``ring`` is the mapping as
# bytes and ``ring32`` the same memory as little-endian uint32 words (slots are 16-aligned):
# word 0 the status, 1 tp_len, 2 tp_snaplen, 3 (low half) tp_mac.


@intrinsic
def copy_bytes(typingctx, dst, dst_off, src, src_off, n):
    """``memcpy`` of ``n`` bytes from ``src`` (flat byte offset ``src_off``) to ``dst`` (offset
    ``dst_off``), both C-contiguous ``uint8`` arrays of any shape; no bounds checks.

    Why: Numba compiles a byte loop between a ring slot and a batch row into a loop it does not
    vectorise (about 1 byte/ns, a microsecond per MTU frame); LLVM's memcpy is 10x faster.
    """
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
            and dst.dtype == types.uint8 and src.dtype == types.uint8
            and dst.layout == "C" and src.layout == "C"):
        return None
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, doff, s, soff, nbytes = args
        da = context.make_array(signature.args[0])(context, builder, d)
        sa = context.make_array(signature.args[2])(context, builder, s)
        cgutils.raw_memcpy(builder, builder.gep(da.data, [doff]), builder.gep(sa.data, [soff]),
                           nbytes, 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def ring_rx(ring, ring32, frame_size, nframes, head, buf, first_row, max_count, lengths):
    """Copy up to ``max_count`` frames the kernel handed over (from slot ``head`` on) into
    ``buf`` rows ``first_row..``, their lengths into ``lengths``; give the slots back.

    Returns ``(frames copied, next head)``. A frame longer than a row is cut to the row (the
    kernel already cut it to the slot). Slots go back to the kernel only after every copy:
    the kernel may write into a slot the moment its status says so.
    """
    row_bytes = buf.shape[1]
    h = head
    got = 0
    # at most one lap: the slots go back only after the walk, so a full ring would
    # otherwise be read twice
    limit = min(max_count, nframes)
    while got < limit:
        w = (h * frame_size) >> 2
        if (ring32[w] & TP_STATUS_USER) == 0:
            break
        n = min(np.int64(ring32[w + 2]), row_bytes)
        r = first_row + got
        copy_bytes(buf, r * row_bytes, ring, h * frame_size + np.int64(ring32[w + 3] & 0xFFFF), n)
        lengths[r] = n
        got += 1
        h += 1
        if h == nframes:
            h = 0
    h = head
    for _ in range(got):
        ring32[(h * frame_size) >> 2] = TP_STATUS_KERNEL
        h += 1
        if h == nframes:
            h = 0
    return got, h


@njit(cache=True)
def ring_tx(ring, ring32, base, frame_size, nframes, head, buf, rows, lengths, count):
    """Copy the frames of ``buf[rows[:count]]`` into free TX slots from ``head`` on and mark
    them for sending.

    Returns ``(slots filled, next head, frames refused)``: filling stops at the first slot the
    kernel still holds (ring full: the rest of the burst is not sent); a frame that does not
    fit a slot (or is empty) is refused and skipped.
    """
    room = min(frame_size - TX_DATA_OFFSET - VNET_HDR_LEN, buf.shape[1])
    row_bytes = buf.shape[1]
    h = head
    done = 0
    refused = 0
    for i in range(count):
        w = (base + h * frame_size) >> 2
        if ring32[w] != TP_STATUS_AVAILABLE:
            break
        r = rows[i]
        n = lengths[r]
        if n <= 0 or n > room:
            refused += 1
            continue
        vnet = base + h * frame_size + TX_DATA_OFFSET
        ring[vnet:vnet + VNET_HDR_LEN] = 0  # no checksum or segmentation offload asked
        ring[vnet + 2] = n & 0xFF  # hdr_len (little-endian): the whole frame is header
        ring[vnet + 3] = n >> 8
        copy_bytes(ring, vnet + VNET_HDR_LEN, buf, r * row_bytes, n)
        ring32[w + 1] = n + VNET_HDR_LEN
        # snaplen and mac as an RX slot has them (the kernel reads neither on TX): a TX ring
        # in plain memory is then the RX ring of a MemoryPort's peer, as it stands
        ring32[w + 2] = n
        ring32[w + 3] = TX_DATA_OFFSET + VNET_HDR_LEN
        ring32[w] = TP_STATUS_SEND_REQUEST
        done += 1
        h += 1
        if h == nframes:
            h = 0
    return done, h, refused


@njit(cache=True, inline="always")
def _port_ring(table, row0, n_ports, p):
    """Port ``p``'s ring (bytes, and the same memory as uint32 words) from a table whose rows
    ``row0..`` list the ``n_ports`` rings, then the same rings as words
    (:mod:`testbed.kernels.packed`)."""
    return array_at(table, row0 + p, "u1:1"), array_at(table, row0 + n_ports + p, "u4:1")


@njit(cache=True)
def rings_rx(table, row0, n_ports, heads, nframes, start, buf, lengths, in_port, out_port,
             reason, prev_n, max_count):
    """One burst from every port's RX ring into a batch (``testbed.datapath.batch.Batch``).

    Resets the batch's ``prev_n`` used rows first (``Batch.reset``), then takes up to
    ``max_count`` frames from the ports in turn, starting with port ``start`` (the engine
    rotates it, so no port starves the others); ``table`` holds the ports' mappings from row
    ``row0`` (:func:`_port_ring`), ``heads[p, 0]`` are their next RX slots (updated),
    ``nframes[p]`` their RX ring sizes. Returns the batch's new packet count.
    """
    for i in range(prev_n):
        out_port[i] = PORT_UNSET
        reason[i] = 0
        in_port[i] = -1
    n = 0
    for k in range(n_ports):
        if n >= max_count:
            break
        p = (start + k) % n_ports
        ring, ring32 = _port_ring(table, row0, n_ports, p)
        got, heads[p, 0] = ring_rx(ring, ring32, RING_FRAME, nframes[p], heads[p, 0], buf, n,
                                   max_count - n, lengths)
        for i in range(n, n + got):
            in_port[i] = p
        n += got
    return n


@njit(cache=True)
def rings_tx(table, row0, n_ports, heads, tx_base, nframes, buf, tx_rows, tx_count, lengths,
             tx_done):
    """Copy each port's rows ``tx_rows[p, :tx_count[p]]`` into its TX ring (``heads[p, 1]``
    updated; the rings from ``table``'s row ``row0`` on, as for :func:`rings_rx`);
    ``tx_done[p]`` = slots filled (to be sent by a ``send()`` on that port).
    Returns the number of frames that found no slot or did not fit one."""
    lost = 0
    for p in range(n_ports):
        c = tx_count[p]
        tx_done[p] = 0
        if c:
            ring, ring32 = _port_ring(table, row0, n_ports, p)
            done, heads[p, 1], _ = ring_tx(ring, ring32, tx_base[p], RING_FRAME, nframes[p],
                                           heads[p, 1], buf, tx_rows[p], lengths, c)
            tx_done[p] = done
            lost += c - done
    return lost


@njit(cache=True)
def ring_tx_pending(ring32, base, frame_size, nframes, head, count):
    """How many of the ``count`` slots before ``head`` still wait for a ``send()``."""
    pending = 0
    h = head
    for _ in range(min(count, nframes)):
        h = h - 1 if h > 0 else nframes - 1
        if ring32[(base + h * frame_size) >> 2] == TP_STATUS_SEND_REQUEST:
            pending += 1
    return pending


@njit(cache=True)
def ring_tx_cancel(ring32, base, frame_size, nframes, head):
    """Give back the slots still waiting for a ``send()`` (the link is down) and move the
    head back to the first of them, where the kernel's own head stopped: the kernel sends
    from its head on and stops at the first slot not marked, so a head left past freed slots
    would never send again once the link is back. Returns (slots freed, new head)."""
    n = 0
    h = head
    for _ in range(nframes):
        prev = h - 1 if h > 0 else nframes - 1
        w = (base + prev * frame_size) >> 2
        if ring32[w] != TP_STATUS_SEND_REQUEST:
            break
        ring32[w] = TP_STATUS_AVAILABLE
        n += 1
        h = prev
    return n, h


def _packet_stats(sock: socket.socket) -> dict:
    """``PACKET_STATISTICS`` of a packet socket (the kernel resets them when read)."""
    packets, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return {"packets": packets, "drops": drops}


def _ring_req(frames: int, frame_size: int = RING_FRAME, block: int = RING_BLOCK) -> bytes:
    """struct tpacket_req for ``frames`` slots (rounded up to whole blocks)."""
    per_block = block // frame_size
    blocks = -(-frames // per_block)
    return struct.pack("IIII", block, blocks, frame_size, blocks * per_block)


def load_port_kernels(ring: np.ndarray, buf: np.ndarray, rx_frames: int = 1, tx_base: int = 0,
                      tx_frames: int = 1) -> None:
    """Load (or compile) one port's ring kernels by calling them on nothing: at a port's
    opening, not with its first packet (``ring``: its mapping as uint8; a zeroed array of
    one frame stands in for it in the engines' fork server)."""
    ring32 = ring.view("<u4")
    one_len = np.zeros(1, np.int32)
    if rx_frames:
        ring_rx(ring, ring32, RING_FRAME, rx_frames, 0, buf, 0, 0, one_len)
    if tx_frames:
        ring_tx(ring, ring32, tx_base, RING_FRAME, tx_frames, 0,
                np.zeros((1, buf.shape[1]), np.uint8), np.zeros(1, np.int64), one_len, 0)
        ring_tx_pending(ring32, tx_base, RING_FRAME, tx_frames, 0, 0)


class RingPort:
    """One AF_PACKET socket bound to ``ifname`` with a mapped RX ring (TPACKET_V2) and either a
    mapped TX ring (``tx_frames`` > 0) or ``sendmmsg`` (``tx_frames=0``) to send.

    Same interface as :class:`PacketPort`; ``buf`` is the frame buffer the bursts are copied
    into and sent from. Ring sizes are rounded up to whole 64 KiB blocks. ``rx_frames=0``: a
    send-only port (a load generator), which the kernel delivers nothing to. Raises ``OSError``
    when the kernel refuses the rings (callers fall back to :class:`PacketPort`).
    """

    def __init__(self, ifname: str, buf: np.ndarray, promisc: bool = True,
                 rx_frames: int = RX_RING_FRAMES, tx_frames: int = TX_RING_FRAMES,
                 sndbuf: int = 32 << 20, qdisc_bypass: bool = False):
        if buf.dtype != np.uint8 or buf.ndim != 2 or not buf.flags.c_contiguous:
            raise ValueError("buf must be a C-contiguous 2-D uint8 array (e.g. Batch.buf)")
        if rx_frames < 0 or tx_frames < 0 or not (rx_frames or tx_frames):
            raise ValueError(f"ring sizes must be >= 0 frames and not both 0, got "
                             f"rx={rx_frames} tx={tx_frames}")
        self.ifname = ifname
        self.buf = buf
        self.frame_size = RING_FRAME
        self.mm = None
        self.ring = self.ring32 = None
        # protocol 0: nothing is queued before the rings exist and the socket is bound
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            s = self.sock
            s.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V2)
            s.setsockopt(SOL_PACKET, PACKET_LOSS, 1)  # a malformed TX slot is skipped, not stuck
            if tx_frames:
                s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)  # see VNET_HDR_LEN
            self.rx_frames, self.tx_base = 0, 0
            if rx_frames:
                rx_req = _ring_req(rx_frames)
                s.setsockopt(SOL_PACKET, PACKET_RX_RING, rx_req)
                block, blocks, _, self.rx_frames = struct.unpack("IIII", rx_req)
                self.tx_base = block * blocks
            self.tx_frames, tx_bytes = 0, 0
            if tx_frames:
                tx_req = _ring_req(tx_frames)
                s.setsockopt(SOL_PACKET, PACKET_TX_RING, tx_req)
                block, blocks, _, self.tx_frames = struct.unpack("IIII", tx_req)
                tx_bytes = block * blocks
            s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            if qdisc_bypass:
                s.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
            # frames in flight (e.g. queued by a shaped port's qdisc) count against the send
            # buffer; root may exceed net.core.wmem_max with the FORCE variant
            for opt in (socket.SO_SNDBUF, 32):  # SO_SNDBUFFORCE
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, sndbuf)
                except OSError:
                    pass
            self.mm = mmap.mmap(s.fileno(), self.tx_base + tx_bytes, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
            # protocol 0: a send-only port receives nothing
            self.ifindex = _bind(s, ifname, ETH_P_ALL if self.rx_frames else 0,
                                 promisc and bool(self.rx_frames))
        except BaseException:
            self.close()
            raise
        self.fd = self.sock.fileno()
        self.ring = np.frombuffer(self.mm, dtype=np.uint8)
        self.ring32 = self.ring.view("<u4")
        # one mapping both ways: TX from tx_base on (a MemoryPort's two rings are apart)
        self.tx_ring, self.tx_ring32 = self.ring, self.ring32
        #: [next RX slot, next TX slot]; an engine serving several ports in one Numba call
        #: replaces this by a row of its own (P, 2) array (see :func:`rings_rx`)
        self.heads = np.zeros(2, np.int64)
        #: filled TX slots still wait for a send() (the send buffer was full at the last kick)
        self.tx_pending = False
        self._tx_errors = 0
        self._mmsg = MmsgSender(self.fd, buf) if not self.tx_frames else None
        self.down_events = 0
        self._one = np.zeros((1, buf.shape[1]), np.uint8)
        self._one_len = np.zeros(1, np.int32)
        self._row0 = np.zeros(1, np.int64)
        load_port_kernels(self.ring, buf, self.rx_frames, self.tx_base, self.tx_frames)

    @property
    def tx_errors(self) -> int:
        """Frames not sent: no free TX slot, too long for a slot, or the link was down."""
        return self._tx_errors + (self._mmsg.errors if self._mmsg is not None else 0)

    def fileno(self) -> int:
        """The socket's file descriptor (``poll`` reports it readable when a frame waits)."""
        return self.fd

    def clear_error(self) -> int:
        """Read (and so clear) the socket's pending error (see :func:`clear_socket_error`)."""
        return clear_socket_error(self)

    def recv_burst(self, first_row: int, max_count: int, lengths: np.ndarray) -> int:
        """Copy up to ``max_count`` waiting frames into rows ``first_row..``; never blocks.

        Writes each frame's length to ``lengths[first_row + i]``; returns the count.
        """
        if max_count <= 0 or not self.rx_frames:
            return 0
        if first_row < 0 or first_row + max_count > self.buf.shape[0]:
            raise ValueError(f"rows {first_row}..{first_row + max_count} outside the buffer")
        got, self.heads[0] = ring_rx(self.ring, self.ring32, self.frame_size, self.rx_frames,
                                     self.heads[0], self.buf, first_row, max_count, lengths)
        return got

    def send_rows(self, rows: np.ndarray, lengths: np.ndarray) -> int:
        """Send the frames in buffer ``rows`` (lengths from ``lengths[rows]``); return count sent.

        What finds no free TX slot, or does not fit one, is counted in ``tx_errors`` and lost,
        like a full NIC ring.
        """
        if self._mmsg is not None:
            return self._mmsg.send_rows(rows, lengths)
        count = len(rows)
        if count == 0:
            return 0
        done, self.heads[1], _ = ring_tx(self.ring, self.ring32, self.tx_base, self.frame_size,
                                         self.tx_frames, self.heads[1], self.buf, rows, lengths,
                                         count)
        self._tx_errors += count - done
        if done:
            self.kick(done)
        return done

    def kick(self, filled: int = 0) -> None:
        """Ask the kernel to send every filled TX slot; retry while some of the last ``filled``
        still wait (the send buffer was full). A link that is down loses them."""
        if self._mmsg is not None:
            return
        self.tx_pending = False
        for _ in range(8):
            r = _send(self.fd, None, 0, MSG_DONTWAIT)
            if r < 0:
                err = ctypes.get_errno()
                if err in (errno.ENETDOWN, errno.ENODEV, errno.ENXIO):
                    self.down_events += 1
                    lost, self.heads[1] = ring_tx_cancel(self.ring32, self.tx_base,
                                                         self.frame_size, self.tx_frames,
                                                         self.heads[1])
                    self._tx_errors += lost
                    return
                if err not in (errno.EAGAIN, errno.ENOBUFS, errno.EINTR):
                    raise OSError(err, f"send on {self.ifname}: {os.strerror(err)}")
            if not filled or not ring_tx_pending(self.ring32, self.tx_base, self.frame_size,
                                                 self.tx_frames, self.heads[1], filled):
                return
        self.tx_pending = True  # the engine kicks again on its next round

    def send_one(self, frame: bytes) -> None:
        """Send one frame (slow path: tests, control, single packets)."""
        if len(frame) > min(self.buf.shape[1], self.frame_size - TX_DATA_OFFSET - VNET_HDR_LEN):
            raise ValueError(f"frame of {len(frame)} bytes does not fit a ring slot")
        self._one[0, : len(frame)] = np.frombuffer(frame, np.uint8)
        self._one_len[0] = len(frame)
        if self._mmsg is not None:
            self.sock.send(frame)
            return
        done, self.heads[1], _ = ring_tx(self.ring, self.ring32, self.tx_base, self.frame_size,
                                         self.tx_frames, self.heads[1], self._one, self._row0,
                                        self._one_len, 1)
        if done:
            self.kick(1)
        else:
            self._tx_errors += 1

    def stats(self) -> dict:
        """The kernel's counters since the last call: frames delivered and frames dropped for
        want of a free RX slot (``PACKET_STATISTICS``, reset by reading)."""
        return _packet_stats(self.sock)

    def close(self) -> None:
        """Unmap the rings and close the socket."""
        self.ring = self.ring32 = self.tx_ring = self.tx_ring32 = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view of the ring is still alive somewhere: leave it mapped
                pass
            self.mm = None
        self.sock.close()


class MemoryPort:
    """One end of a link between two nodes one engine process serves (an engine group,
    ``testbed.datapath.group.EngineGroup``): no socket and no kernel, two rings in plain
    memory laid out like the kernel's TPACKET_V2 rings. This end's TX ring is its peer's RX
    ring and the other way round: :func:`ring_tx` marks a slot ``TP_STATUS_SEND_REQUEST`` (1,
    the value of ``TP_STATUS_USER``) and writes it as an RX slot reads, and :func:`ring_rx`
    hands it back as ``TP_STATUS_KERNEL`` (0, that of ``TP_STATUS_AVAILABLE``), so the
    engine's ring kernels serve it unchanged. Built in pairs by an engine group.

    The link's rate, delay, queue and impairments are the sending node's egress stages, as on
    a veth; what the veth itself did (a copy, a softirq, a wake-up) is what this saves. A frame
    that finds its peer's ring full is lost and counted in the sender's ``tx_errors``.
    """

    io = "memory"
    tx_base = 0
    tx_pending = False
    tx_errors = 0

    def __init__(self, ifname: str, rx: np.ndarray, tx: np.ndarray):
        self.ifname = ifname
        self.ring, self.tx_ring = rx, tx
        self.ring32, self.tx_ring32 = rx.view("<u4"), tx.view("<u4")
        self.rx_frames, self.tx_frames = len(rx) // RING_FRAME, len(tx) // RING_FRAME
        self.heads = np.zeros(2, np.int64)

    def fileno(self) -> int:
        """-1: nothing to poll (its frames are put there by the process that reads them)."""
        return -1

    def kick(self, filled: int = 0) -> None:
        """Nothing to do: a filled slot is visible to the peer at once."""

    def stats(self) -> dict:
        """No kernel in between: nothing delivered or dropped by one."""
        return {"packets": 0, "drops": 0}

    def clear_error(self) -> int:
        return 0

    def close(self) -> None:
        self.ring = self.ring32 = self.tx_ring = self.tx_ring32 = None


def probe_rings() -> tuple[bool, str]:
    """Whether this kernel gives :class:`RingPort` its rings: (works, what was found).

    Sets up small TPACKET_V2 RX and TX rings (what the engine uses) and a TPACKET_V3 RX ring
    on unbound packet sockets; needs CAP_NET_RAW (root).
    """
    found = []
    for version, name, ring_opts in ((TPACKET_V2, "TPACKET_V2 RX+TX", (PACKET_RX_RING,
                                                                       PACKET_TX_RING)),
                                     (TPACKET_V3, "TPACKET_V3 RX", (PACKET_RX_RING,))):
        try:
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0) as s:
                s.setsockopt(SOL_PACKET, PACKET_VERSION, version)
                for opt in ring_opts:
                    req = _ring_req(32)
                    if version == TPACKET_V3:  # tpacket_req3: + retire timeout, priv, flags
                        req += struct.pack("III", 10, 0, 0)
                    s.setsockopt(SOL_PACKET, opt, req)
            found.append(f"{name} ok")
        except OSError as e:
            if version == TPACKET_V2:
                return False, f"{name} refused ({e.strerror})"
            found.append(f"{name} refused ({e.strerror})")
    return True, "; ".join(found)


def probe_af_xdp() -> tuple[bool, str]:
    """Whether AF_XDP sockets exist in this kernel (CONFIG_XDP_SOCKETS): (exists, detail)."""
    try:
        socket.socket(44, socket.SOCK_RAW, 0).close()  # AF_XDP
    except OSError as e:
        return False, f"AF_XDP socket refused ({e.strerror})"
    return True, "AF_XDP sockets exist (copy mode on veth needs an XDP program attached)"


def open_port(ifname: str, buf: np.ndarray, io: str = "ring", **kw):
    """A :class:`RingPort` (``io="ring"``) or :class:`PacketPort` (``io="mmsg"``) on ``ifname``.

    ``io="ring"`` falls back to :class:`PacketPort` when the kernel refuses PACKET_MMAP rings
    (the port's ``io`` attribute says which one it got).
    """
    if io not in ("ring", "mmsg"):
        raise ValueError(f"io must be 'ring' or 'mmsg', got {io!r}")
    if io == "ring":
        try:
            port = RingPort(ifname, buf, **kw)
            port.io = "ring"
            return port
        except OSError:
            pass
    kw.pop("rx_frames", None)
    kw.pop("tx_frames", None)
    port = PacketPort(ifname, buf, **kw)
    port.io = "mmsg"
    return port
