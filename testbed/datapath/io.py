"""Batched packet I/O on AF_PACKET sockets: ``recvmmsg``/``sendmmsg`` into numpy buffers.

One system call moves a whole burst between a port and the rows of a 2-D ``uint8`` buffer
(``Batch.buf``): the ``mmsghdr``/``iovec`` arrays that point into the buffer are built once as
numpy structured arrays, so Python does a handful of operations per burst and never one per
packet. Measured on the 2-core development machine (veth, 128-byte frames): one ``recvmmsg``
of 64 frames costs about as much as two single ``recv`` calls (see ``testbed bench datapath``).

Sockets are bound to one interface with ``ETH_P_ALL``, put in promiscuous mode, and set to
ignore their own transmissions (``PACKET_IGNORE_OUTGOING``), so a forwarding loop never sees
the frames it sent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import struct
import subprocess

import numpy as np

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
            try:
                self.sock.bind((ifname, ETH_P_ALL))
            except OSError as e:
                raise ValueError(
                    f"cannot bind a packet socket to interface {ifname!r} ({e.strerror}); "
                    "check the port name exists in this network namespace"
                ) from None
            self.ifindex = socket.if_nametoindex(ifname)
            if promisc:
                mreq = struct.pack("iHH8s", self.ifindex, PACKET_MR_PROMISC, 0, b"")
                self.sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
            self.sock.setblocking(False)
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
        # tx: rewritten per burst (which rows go out of this port)
        self._tx_iov = np.zeros(n, dtype=IOVEC_DTYPE)
        self._tx_msg = np.zeros(n, dtype=MMSGHDR_DTYPE)
        self._tx_msg["iov"] = self._tx_iov.ctypes.data + np.arange(n, dtype=np.uint64) * 16
        self._tx_msg["iovlen"] = 1
        self._rx_msg_addr = self._rx_msg.ctypes.data
        self._tx_msg_addr = self._tx_msg.ctypes.data
        self.tx_errors = 0
        self.down_events = 0

    def fileno(self) -> int:
        """The socket's file descriptor (for ``poll``)."""
        return self.fd

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
        count = len(rows)
        if count == 0:
            return 0
        self._tx_iov["base"][:count] = self.buf.ctypes.data + rows.astype(np.uint64) * np.uint64(
            self.row_bytes
        )
        self._tx_iov["len"][:count] = lengths[rows]
        done = 0
        tries = 0
        while done < count:
            sent = _sendmmsg(self.fd, self._tx_msg_addr + done * 64, count - done, 0)
            if sent < 0:
                err = ctypes.get_errno()
                if err not in (errno.EAGAIN, errno.ENOBUFS, errno.EINTR) or tries >= 8:
                    break
                tries += 1
                continue
            done += sent
        self.tx_errors += count - done
        return done

    def send_one(self, frame: bytes) -> None:
        """Send one frame (slow path: tests, control, generated single packets)."""
        self.sock.send(frame)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()
