"""Plain-Python twin of the PACKET_MMAP ring walks of :mod:`testbed.datapath.io`.

A ring is a ``bytearray`` laid out like the kernel's TPACKET_V2 rings: slot ``h`` starts at
``base + h * frame_size`` with a ``struct tpacket2_hdr`` (status, len, snaplen, mac, net, ...);
``struct`` reads and writes its fields, frames are ``bytes``.
"""

from __future__ import annotations

import struct

from testbed.datapath.io import (
    TP_STATUS_AVAILABLE,
    TP_STATUS_KERNEL,
    TP_STATUS_SEND_REQUEST,
    TP_STATUS_USER,
    TX_DATA_OFFSET,
    VNET_HDR_LEN,
)


def ring_rx(ring: bytearray, frame_size: int, nframes: int, head: int, max_count: int,
            row_bytes: int) -> tuple[list[bytes], int]:
    """Frames handed to user space from slot ``head`` on (at most ``max_count``, each cut to
    ``row_bytes``), with their slots given back to the kernel; returns (frames, next head)."""
    frames = []
    h = head
    while len(frames) < max_count:
        off = h * frame_size
        status, _length, snaplen, mac = struct.unpack_from("<IIIH", ring, off)
        if not status & TP_STATUS_USER:
            break
        frames.append(bytes(ring[off + mac: off + mac + min(snaplen, row_bytes)]))
        struct.pack_into("<I", ring, off, TP_STATUS_KERNEL)
        h = (h + 1) % nframes
    return frames, h


def ring_tx(ring: bytearray, base: int, frame_size: int, nframes: int, head: int,
            frames: list[bytes]) -> tuple[int, int, int]:
    """Put ``frames`` into free TX slots from ``head`` on (each behind a virtio_net_hdr that
    asks for no offload), marked for sending; stop at the first slot not free. Returns
    (frames placed, next head, frames refused: empty or too long)."""
    room = frame_size - TX_DATA_OFFSET - VNET_HDR_LEN
    h = head
    done = refused = 0
    for f in frames:
        off = base + h * frame_size
        if struct.unpack_from("<I", ring, off)[0] != TP_STATUS_AVAILABLE:
            break
        if not 0 < len(f) <= room:
            refused += 1
            continue
        # virtio_net_hdr: flags, gso_type, hdr_len = the whole frame, gso_size, csum start/off
        struct.pack_into("<BBHHHH", ring, off + TX_DATA_OFFSET, 0, 0, len(f), 0, 0, 0)
        data = off + TX_DATA_OFFSET + VNET_HDR_LEN
        ring[data: data + len(f)] = f
        # status, len, and snaplen and mac as an RX slot has them (see MemoryPort)
        struct.pack_into("<IIII", ring, off, TP_STATUS_SEND_REQUEST, VNET_HDR_LEN + len(f),
                         len(f), TX_DATA_OFFSET + VNET_HDR_LEN)
        done += 1
        h = (h + 1) % nframes
    return done, h, refused


def ring_tx_cancel(ring: bytearray, base: int, frame_size: int, nframes: int,
                   head: int) -> tuple[int, int]:
    """The slots before ``head`` still marked for sending, freed, walking back to where the
    kernel's head stopped; returns (slots freed, new head)."""
    n, h = 0, head
    while n < nframes:
        prev = (h - 1) % nframes
        off = base + prev * frame_size
        if struct.unpack_from("<I", ring, off)[0] != TP_STATUS_SEND_REQUEST:
            break
        struct.pack_into("<I", ring, off, TP_STATUS_AVAILABLE)
        n += 1
        h = prev
    return n, h
