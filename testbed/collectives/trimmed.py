"""Gradient sum with trimmable packets: an incast to rank 0, then a broadcast of the sum.

The exchange of the trimming work (HotNets'24 "JIT gradient compression by packet trimming")
as a training job runs it: every worker but rank 0 encodes its float32 gradient in the
trimming layout (``testbed.kernels.trimming``: a coarse unbiased head of ``bits`` bits per
element at the front of each payload, the exact values behind it) and sends all its packets
at once to rank 0 (UDP to the testbed port, ``Codec.TRIM_LAYOUT`` with ``head_bytes`` set), an
incast on rank 0's switch port. A switch whose ``trim`` stage serves that port cuts packets to
their heads above its queue threshold (``drop_tail`` drops them). Rank 0 adds its own gradient
exactly and every packet as it decodes (a trimmed one to its head estimate), asks senders for
the chunks it misses after ``idle_s`` without traffic (NACK), and tells them when it has
everything (DONE); then the float32 sum goes back to every worker with the ring's pipelined
chain broadcast over TCP (``ring.broadcast``, set up by the caller).

With ``resend_trimmed`` (a training job's ``transport = "uet"``) the gather runs as Ultra
Ethernet would: rank 0 NACKs a trimmed packet as soon as it arrives and adds it only when it
comes whole, so the sum is exact and every cut costs a resend instead of accuracy.

Every packet carries the iteration in ``seq``: a late packet, NACK or DONE of an earlier
iteration is ignored. Error: each trimmed chunk's elements are off by at most one head step
``2 s / (2**bits - 1)`` (``s`` the chunk's max magnitude, in its payload), which rank 0 adds
up per element into ``bound`` (the check's tolerance, besides float32 rounding).
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np

from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.kernels.rng import stream_key
from testbed.kernels.trimming import (
    decode,
    encode,
    head_bytes_for,
    max_elements,
    total_bytes_for,
    trim,
)
from testbed.kernels.wire import (
    HEADER_DTYPE,
    HEADER_LEN,
    MAGIC,
    PAYLOAD_OFFSET,
    Codec,
    Dscp,
    Flags,
    MsgType,
    new_headers,
)

#: IPv4 TOS byte of the gradient packets: DSCP TRIMMABLE (Ultra Ethernet's trimmable class)
TRIMMABLE_TOS = int(Dscp.TRIMMABLE) << 2
#: UDP port of the testbed header: the data path recognises (and trims) frames sent to it.
DATA_PORT = 41000
#: Senders listen for NACK/DONE on ``CTL_PORT + job_id % 100``.
CTL_PORT = 41100
NACK, DONE = b"NACK", b"DONE"
_STEP = struct.Struct("<I")
#: Chunk indices per NACK datagram.
NACK_MAX = 300
BITS = (1, 2, 4, 8)


def chunk_elements(bits: int) -> int:
    """Elements per packet: what fits a 1400-byte payload in the layout, at most 256."""
    return min(max_elements(bits, 1400 - 28), 256)


def frame_sizes(count: int, bits: int) -> tuple[int, int, int]:
    """(packets, bytes of a full frame on the wire, bytes of a trimmed one) of a ``count``
    element gradient: what the incast model needs."""
    m = chunk_elements(bits)
    return (-(-count // m), PAYLOAD_OFFSET + int(total_bytes_for(m, bits)),
            PAYLOAD_OFFSET + int(head_bytes_for(m, bits)))


def encode_frames(x: np.ndarray, rank: int, n: int, bits: int, seed: int, job_id: int,
                  step: int) -> list[bytes]:
    """The testbed packets (header + trimming-layout payload) of gradient ``x`` of ``rank``;
    the random heads are drawn per (seed, step, rank) and chunk offset."""
    m = chunk_elements(bits)
    key = int(stream_key(seed, step, 0x7219 + rank))
    out = []
    for k, off in enumerate(range(0, x.size, m)):
        chunk = np.ascontiguousarray(x[off:off + m])
        h = new_headers(1)
        h["msg_type"] = int(MsgType.DATA)
        h["job_id"] = job_id
        h["worker_id"] = rank
        h["slot"] = k & 0xFFFF
        h["n_workers"] = n
        h["codec"] = int(Codec.TRIM_LAYOUT)
        h["elem_count"] = chunk.size
        h["head_bytes"] = int(head_bytes_for(chunk.size, bits))
        h["chunk_offset"] = off
        h["seq"] = step & 0xFFFFFFFF
        out.append(h.tobytes() + encode(chunk, bits, key, off).tobytes())
    return out


def warm() -> None:
    """Load (or compile once) the trimming kernels in this process: a pool calls it before
    forking its ranks, so no iteration pays for it."""
    for bits in BITS:
        m = min(chunk_elements(bits), 300)
        frame = encode_frames(np.linspace(-1, 1, m, dtype=np.float32), 1, 2, bits, 0, 0, 0)[0]
        payload = np.frombuffer(frame, dtype=np.uint8)[HEADER_LEN:].copy()
        decode(payload, m)
        decode(trim(payload), m)


class TrimmedGather:
    """One worker's side of the incast (see the module docstring); sockets live in the
    namespace the process is in. ``ranks``: ``[{"ip": ...}, ...]`` of the job in rank order."""

    def __init__(self, ranks: list[dict], rank: int, bits: int, job_id: int, seed: int,
                 timeout_s: float, idle_s: float = 0.02, resend_trimmed: bool = False):
        """``resend_trimmed``: Ultra Ethernet's mode instead of trimming as compression:
        rank 0 NACKs a trimmed packet as it arrives and waits for it whole (the sum is exact,
        the cut costs a resend) rather than adding its head."""
        self.resend_trimmed = resend_trimmed
        if bits not in BITS:
            raise ValueError(f"bits={bits!r}: head bits per element must be one of {BITS}")
        self.ranks, self.rank, self.n = ranks, rank, len(ranks)
        self.bits, self.job_id, self.seed = bits, job_id, seed
        self.timeout_s, self.idle_s = timeout_s, idle_s
        self.ctl_port = CTL_PORT + job_id % 100
        self.stats = {"packets": 0, "trimmed": 0, "nacks": 0, "resent": 0}
        self.data = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        me = ranks[rank]["ip"]
        try:
            if rank == 0:
                self.data.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
                self.data.bind((me, DATA_PORT))
            else:
                self.data.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                # trimmable in UET's terms too: a UET switch cuts it (to a head that fits its
                # trim size) instead of dropping it
                self.data.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, TRIMMABLE_TOS)
                self.data.connect((ranks[0]["ip"], DATA_PORT))
                self.ctl.bind((me, self.ctl_port))
        except OSError as e:
            self.close()
            raise CollectiveError(f"rank {rank}: cannot bind the trimmed exchange's UDP port on "
                                  f"{me} ({e}); another job using it on this host?") from None

    def reduce(self, x: np.ndarray, out: np.ndarray, step: int,
               bound: np.ndarray | None = None) -> None:
        """Rank 0: ``out`` = the sum of every worker's ``x`` as received (``bound``: the
        per-element error of the trimmed chunks); the others: deliver ``x`` to rank 0."""
        if self.rank == 0:
            self._receive(x, out, step, bound)
        else:
            self._send(x, step)

    def _send(self, x: np.ndarray, step: int) -> None:
        frames = encode_frames(x, self.rank, self.n, self.bits, self.seed, self.job_id, step)
        for f in frames:
            self.data.send(f)
        self.ctl.settimeout(min(self.timeout_s, 1.0))
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                msg = self.ctl.recv(65536)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"rank {self.rank}: no DONE from rank 0 for "
                                            f"{self.timeout_s} s (iteration {step})") from None
                continue
            if len(msg) < 8 or _STEP.unpack_from(msg, 4)[0] != step & 0xFFFFFFFF:
                continue  # another iteration's
            if msg.startswith(DONE):
                return
            if msg.startswith(NACK):
                for k in np.frombuffer(msg[8:], dtype="<u4"):
                    self.data.send(frames[int(k)])
                    self.stats["resent"] += 1
                deadline = time.monotonic() + self.timeout_s

    def _receive(self, x: np.ndarray, out: np.ndarray, step: int,
                 bound: np.ndarray | None) -> None:
        m = chunk_elements(self.bits)
        n_chunks = -(-x.size // m)
        missing = {r: set(range(n_chunks)) for r in range(1, self.n)}
        remaining = (self.n - 1) * n_chunks
        total = x.astype(np.float64)
        if bound is not None:
            bound[:] = 0.0
        levels = (1 << self.bits) - 1
        seq = step & 0xFFFFFFFF
        self.data.settimeout(self.idle_s)
        heard = False
        deadline = time.monotonic() + self.timeout_s
        while remaining:
            try:
                buf = self.data.recv(4096)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        f"rank 0: {remaining} chunks of iteration {step} still missing after "
                        f"{self.timeout_s} s without progress") from None
                if heard:  # traffic stopped with chunks missing: ask for them again
                    self._nack(missing, step)
                continue
            if len(buf) < HEADER_LEN:
                continue
            h = np.frombuffer(buf[:HEADER_LEN], dtype=HEADER_DTYPE)[0]
            r, off, cnt = int(h["worker_id"]), int(h["chunk_offset"]), int(h["elem_count"])
            if (int(h["magic"]) != MAGIC or int(h["job_id"]) != self.job_id
                    or int(h["seq"]) != seq or r not in missing or off % m):
                continue
            heard = True
            k = off // m
            if k not in missing[r]:
                continue  # a duplicate (a NACK crossed the original)
            if self.resend_trimmed and int(h["flags"]) & Flags.TRIMMED:
                self.stats["trimmed"] += 1
                self._nack({r: {k}}, step)  # UET: ask for it whole, now
                continue
            values, full = decode(np.frombuffer(buf[HEADER_LEN:], dtype=np.uint8), cnt)
            total[off:off + cnt] += values
            self.stats["packets"] += 1
            if not full or int(h["flags"]) & Flags.TRIMMED:
                self.stats["trimmed"] += 1
                if bound is not None:
                    s = float(np.frombuffer(buf[HEADER_LEN:HEADER_LEN + 4], dtype="<f4")[0])
                    bound[off:off + cnt] += 2.0 * s / levels
            missing[r].discard(k)
            remaining -= 1
            deadline = time.monotonic() + self.timeout_s
        out[:] = total
        done = DONE + _STEP.pack(seq)
        for r in range(1, self.n):
            for _ in range(3):  # a lost DONE only makes that sender wait for its timeout
                self.ctl.sendto(done, (self.ranks[r]["ip"], self.ctl_port))

    def _nack(self, missing: dict[int, set[int]], step: int) -> None:
        head = NACK + _STEP.pack(step & 0xFFFFFFFF)
        for r, miss in missing.items():
            if miss:
                idx = np.fromiter(sorted(miss), dtype="<u4")
                for i in range(0, idx.size, NACK_MAX):
                    self.ctl.sendto(head + idx[i:i + NACK_MAX].tobytes(),
                                    (self.ranks[r]["ip"], self.ctl_port))
                self.stats["nacks"] += 1

    def close(self) -> None:
        """Close the sockets."""
        self.data.close()
        self.ctl.close()
