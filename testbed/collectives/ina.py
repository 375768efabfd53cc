"""In-network aggregation client for one worker (protocol: ``docs/protocol.md``).

The control plane (``runner.py``) registers the job's members with the aggregating switch before
the workers start: each worker binds exactly the UDP port it was given (``job["ranks"][r]
["port"]``), sends to the tree switch it was given (``job["ranks"][r]["aggregator"]``) as member
``job["ranks"][r]["member"]``, and starts its slots at the job's first round ``job["seq0"]``.

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

Reliability (:mod:`testbed.collectives.inakernel`): fast retransmission when later packets are
answered first, a timeout that adapts to the measured round trip (the round trip includes the
host's shaped egress queue: W packets at 100 Mb/s ~ 11 ms for W=128, and a userspace switch on a
shared CPU), and ``CollectiveTimeout`` after ``timeout_s`` without progress. ``loss`` drops
outgoing contributions and incoming results with that probability (seeded), to exercise recovery
when the switch has no impair stage.

Congestion response (``CollectiveSpec.ina_cc="delay"``, off by default): at most ``cwnd <= W``
packets outstanding, sent in packet order (so each slot still carries ``j, j+W, ...``), the
window driven by the round trips the loop samples (``inakernel.cc_sample``); without it a job
keeps all W slots busy and its UDP queues in front of TCP jobs sharing a link starve them.
The window carries over from one collective of a client to its next.

``algo="nic"``: the worker sends raw FLOAT32 payloads; its SmartNIC (``nic_codec`` program,
``fixed32``) quantises them with ATP's fixed factor on the way out and turns the INT32 RESULT
back into FLOAT32 on the way in, so the host does no fixed-point work and needs no exponent
round. Error of an n-way sum: n * 0.5 / factor + float32 rounding.

INA + compression (``compressor="thc"``, THC NSDI'24, ``kernels/compressors/thc.py``): the
worker rotates its vector (blockwise randomized Hadamard transform, sign stream shared by
``(seed, step)``, step = this client's repetition counter) and runs the same slot protocol
with ``Codec.THC`` packets of up to 1024 int8 lanes (the bytes of 256 int32: a quarter of the
packets): the exponent chain agrees per chunk on ``e = max_w ceil(8 log2 ||chunk_w||)``, and a
chunk is stochastically rounded (per-worker random stream) to the levels -g/2..g/2 of the grid
``M / (g/2)``, ``M = clip * 2**(e/8) / sqrt(ne)``. The switch adds the lanes; the RESULT comes
back in int8/int16 lanes; the worker de-scales and applies the inverse transform. When
``n * g/2 > 127`` the sums need int16 lanes, so packets carry 512 lanes (a RESULT still fits
the MTU). Error: see :func:`thc_check`.

Hot loop: ``recvmmsg`` a burst of RESULTs straight into a numpy buffer, one ``@njit`` call
(:func:`~testbed.collectives.inakernel.on_burst`, its arrays as one table) applies them,
builds the next packets in place with their ``iovec`` rows and GSO groups, and says the next
timer deadline; one ``sendmmsg`` sends them (in UDP GSO runs, see :data:`GSO_BURST_BYTES`);
Python only loops over bursts and timers. After a partial
burst the worker sleeps up to 1.5 ms (interrupt coalescing; capped at a quarter of the window)
so bursts are several packets long: at 100 Mb/s a result arrives every ~90 us, and waking per
packet costs more CPU than the packet.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import socket
import struct
import time

import numpy as np

from testbed.collectives import inakernel as ik
from testbed.collectives.ports import INA_PORT_SPAN, ina_worker_port
from testbed.collectives.spec import INA_COMPRESSORS, CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout
from testbed.kernels import fixedpoint as fp
from testbed.kernels.compressors import get_compressor
from testbed.kernels.compressors.thc import SALT_SIGN, padded_length, rht_forward, rht_inverse
from testbed.kernels.packed import array_table
from testbed.kernels.rng import stream_key
from testbed.kernels.wire import TESTBED_UDP_PORT, describe_header, unpack_header

#: Factor of the SmartNIC's fixed-point codec for ``algo="nic"`` (ATP's).
NIC_FACTOR = fp.ATP_FACTOR

RX_BURST = 64
#: pause after a partial burst (see the module docstring); only with a window of >= 16 packets
COALESCE_S = 0.0015
RB = 2048  # receive row: any datagram up to a jumbo-free MTU fits
MSG_DONTWAIT = 0x40
_libc = ctypes.CDLL(None, use_errno=True)
_libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                           ctypes.c_void_p]
_libc.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
#: UDP generic segmentation offload (``UDP_SEGMENT``, Linux >= 4.18): one ``sendmmsg`` entry
#: carries a run of equal-length packets as one buffer, the kernel cuts it into datagrams
#: after the host's qdisc, so the socket, IP and shaper work is paid once per run, not per
#: packet. A run is at most :data:`GSO_BURST_BYTES` on the wire: the depth of the host link's
#: HTB token bucket (Mininet's ``burst 15k``), so a batch leaves the host no burstier than its
#: shaper already lets single packets leave. ``TESTBED_INA_GSO=0`` turns it off (comparisons).
GSO_BURST_BYTES = 15000
UDP_MAX_SEGMENTS = 64
#: A run is also at most this share of the byte limit of a ``bfifo`` on the host's interfaces
#: (the queue a topology's ``queue_ms`` sets under the HTB class; :func:`gso_run_bytes`). The
#: qdisc sees a run as one packet and drops it whole where single packets would fill the
#: queue; a run above the limit never fits, so a window's retransmissions expiring together
#: were dropped every time: a 64-packet window at 20 Mb/s with ``queue_ms=2`` (5000 B) never
#: finished. At half the limit (runs of 2 in that queue) a 3 MiB ``nic`` job there took 13 s
#: against 7.6-9.4 s without GSO; at a quarter it sends one by one, and runs of 2 in a
#: 12 500 B queue ran as fast as single packets.
GSO_QUEUE_SHARE = 0.25
#: Ethernet + IPv4 + UDP header bytes of a frame (what the shaper counts besides the payload)
FRAME_OVERHEAD = 42
#: a full INA packet on the wire: its row (header + 256 int32) in a frame
FRAME_BYTES = ik.ROW + FRAME_OVERHEAD
_SOL_UDP, _UDP_SEGMENT = 17, 103
_SIOCETHTOOL, _ETHTOOL_GTXCSUM = 0x8946, 0x16
#: per-worker stochastic-rounding stream of THC ("THCR")
SALT_QUANT_RANK = 0x54484352


def _ip_u32(ip: str) -> int:
    return int.from_bytes(socket.inet_aton(ip), "big")


def _sockaddr_in(ip: str, port: int) -> np.ndarray:
    """A ``struct sockaddr_in`` (16 bytes) for ``sendmmsg``'s ``msg_name``."""
    a = np.zeros(16, np.uint8)
    a[0:2] = np.frombuffer(socket.AF_INET.to_bytes(2, "little"), np.uint8)
    a[2:4] = np.frombuffer(port.to_bytes(2, "big"), np.uint8)
    a[4:8] = np.frombuffer(socket.inet_aton(ip), np.uint8)
    return a


def ina_lanes(spec: CollectiveSpec, n: int) -> int:
    """Elements per packet of an INA job (the switch's registers per slot set)."""
    if spec.compressor is not None:
        return thc_elems(n, get_compressor("thc", **spec.compressor_params).g)
    return ik.ELEMS


#: Pool entries per slot of a shared job's window in the fair share: a slot holds up to two
#: (a round, and the previous one until every member has moved on, P1), and four hash probes
#: find a free entry for most rounds only while the pool is at most about half full.
POOL_ENTRIES_PER_SLOT = 4
#: Jobs the fair share divides the pool among at least: a shared pool is there to be shared,
#: and jobs that start together register at the same moment, before they can see each other.
POOL_MIN_SHARERS = 2


def fair_share_slots(asked: int, pool_entries: int, shared_jobs: int) -> int:
    """The window (slots) of a shared-mode job that asked for ``asked`` slots on a switch whose
    pool has ``pool_entries`` entries and ``shared_jobs`` other shared jobs registered: at most
    ``pool_entries / (POOL_ENTRIES_PER_SLOT x jobs)`` with this one counted and at least
    :data:`POOL_MIN_SHARERS` jobs, never below 1 (ATP gives a job a window of aggregators too).
    A larger window holds more entries than the pool can give every job, and the rounds that
    find none go to the host fallback: measured on two 4-worker tenants and a 96-entry pool,
    windows of 32, 24, 16 and 12 summed 69-72 %, 82-85 %, 92 % and 98 % of the rounds in the
    network."""
    if asked < 1 or pool_entries < 0 or shared_jobs < 0:
        raise ValueError(f"fair_share_slots: asked={asked} must be >= 1, pool_entries="
                         f"{pool_entries} and shared_jobs={shared_jobs} >= 0")
    jobs = max(POOL_MIN_SHARERS, shared_jobs + 1)
    return max(1, min(asked, pool_entries // (POOL_ENTRIES_PER_SLOT * jobs)))


def rounds(spec: CollectiveSpec, n: int) -> int:
    """Rounds (packets per worker) of one INA allreduce of ``spec``: the exponent bootstrap
    round of ``slots`` packets, then one per chunk."""
    if spec.compressor is not None:
        comp = get_compressor("thc", **spec.compressor_params)
        E = thc_elems(n, comp.g)
        return -(-thc_layout(comp, spec.count, E, 0, 0)[0] // E) + spec.slots
    K = -(-spec.count // ik.ELEMS)
    return K if spec.algo == "nic" else K + spec.slots


def udp_gso_usable(fd: int) -> bool:
    """Whether UDP GSO sends from this network namespace leave it as ordinary datagrams: every
    interface but ``lo`` must have transmit checksum offload off (as the testbed's hosts do),
    for the kernel only lets a device segment UDP itself with checksum offload on; then the
    kernel segments before the device, else a userspace switch on the other end could get one
    large frame it cannot parse. Asked with ``SIOCETHTOOL`` on the socket ``fd`` (a rank must
    not fork helpers: their names would be the rank's). False when unsure or when
    ``TESTBED_INA_GSO=0``."""
    if os.environ.get("TESTBED_INA_GSO", "1") == "0":
        return False
    try:
        names = [name for _, name in socket.if_nameindex() if name != "lo"]
    except OSError:
        return False
    for name in names:
        value = ctypes.create_string_buffer(struct.pack("II", _ETHTOOL_GTXCSUM, 0), 8)
        ifreq = struct.pack("16sP", name.encode()[:15], ctypes.addressof(value)).ljust(40, b"\0")
        try:
            fcntl.ioctl(fd, _SIOCETHTOOL, ifreq)
        except OSError:
            return False
        if struct.unpack("II", value.raw)[1]:
            return False
    return bool(names)


_RTM_NEWQDISC, _RTM_GETQDISC, _NLMSG_ERROR, _NLMSG_DONE = 36, 38, 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_TCA_KIND, _TCA_OPTIONS = 1, 2
_NLMSGHDR, _TCMSG, _RTATTR = struct.Struct("=IHHII"), struct.Struct("=BBHiIII"), \
    struct.Struct("=HH")


def byte_fifo_limits() -> dict[int, int]:
    """Interface index -> the smallest ``limit`` (bytes) of the ``bfifo`` qdiscs on it, for
    every interface of this network namespace that has one: one ``RTM_GETQDISC`` dump over
    rtnetlink (what ``tc qdisc show`` asks; a rank forks no helper)."""
    limits: dict[int, int] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        nl.send(_NLMSGHDR.pack(_NLMSGHDR.size + _TCMSG.size, _RTM_GETQDISC,
                               _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
                + _TCMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0, 0, 0))
        while True:
            data = nl.recv(1 << 16)
            off = 0
            while off + _NLMSGHDR.size <= len(data):
                length, kind_, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
                if kind_ == _NLMSG_DONE or length < _NLMSGHDR.size:
                    return limits
                if kind_ == _NLMSG_ERROR:
                    raise OSError("rtnetlink refused the qdisc dump")
                if kind_ == _RTM_NEWQDISC:
                    ifindex = _TCMSG.unpack_from(data, off + _NLMSGHDR.size)[3]
                    qdisc, options = _qdisc_attrs(data, off + _NLMSGHDR.size + _TCMSG.size,
                                                  off + length)
                    if qdisc == b"bfifo" and len(options) >= 4:
                        limit = struct.unpack_from("=I", options)[0]
                        limits[ifindex] = min(limit, limits.get(ifindex, limit))
                off += (length + 3) & ~3


def _qdisc_attrs(data: bytes, at: int, end: int) -> tuple[bytes, bytes]:
    """(``TCA_KIND``, ``TCA_OPTIONS``) of one qdisc message's attributes in ``data[at:end]``."""
    kind, options = b"", b""
    while at + _RTATTR.size <= end:
        length, what = _RTATTR.unpack_from(data, at)
        if length < _RTATTR.size:
            break
        value = data[at + _RTATTR.size:at + length]
        if what == _TCA_KIND:
            kind = value.rstrip(b"\0")
        elif what == _TCA_OPTIONS:
            options = value
        at += (length + 3) & ~3
    return kind, options


def egress_queue_bytes() -> int | None:
    """The smallest ``bfifo`` limit (bytes) on this namespace's interfaces: the host link's
    queue where a topology sets ``queue_ms``; None where there is none (the kernel's default
    queue counts packets) or the dump failed."""
    try:
        limits = byte_fifo_limits()
    except OSError:
        return None
    return min(limits.values()) if limits else None


def gso_run_bytes(fd: int, frame_bytes: int, queue_bytes: int | None) -> int:
    """The largest UDP GSO run (wire bytes) this namespace's sends may use, 0 for none: none
    where :func:`udp_gso_usable` says no, else :data:`GSO_BURST_BYTES`, at most
    :data:`GSO_QUEUE_SHARE` of a byte-limited host queue of ``queue_bytes``
    (:func:`egress_queue_bytes`), and none where that leaves room for fewer than two frames of
    ``frame_bytes``."""
    if not udp_gso_usable(fd):
        return 0
    run = GSO_BURST_BYTES
    if queue_bytes is not None:
        run = min(run, int(queue_bytes * GSO_QUEUE_SHARE))
    return run if run >= 2 * frame_bytes else 0


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


def timeout_floor(window: int, bw_bps: float | None) -> float:
    """The floor of a worker's timeout (undilated s): SwitchML's ``T0``, or twice the time its
    window of full packets takes to leave at ``bw_bps``, the job's bottleneck share per
    worker, whichever is longer. Below that, a window queued at a thin link times out behind
    itself. The flow model prices timeouts with the same floor (``flowmodel.ina_extra_s``)."""
    if not bw_bps or bw_bps <= 0:
        return ik.T0
    return max(ik.T0, 2.0 * window * FRAME_BYTES * 8 / bw_bps)


class InaClient:
    """One worker of an INA job; its socket lives in the namespace the process is in."""

    def __init__(self, job: dict, spec: CollectiveSpec, rank: int):
        self.n = job["n"]
        self.rank = rank
        me = job["ranks"][rank]
        self.host = me["host"]
        agg = me["aggregator"]  # the tree switch this worker sends to
        self.agg = (agg["ip"], int(agg.get("port", TESTBED_UDP_PORT)))
        self.member = int(me.get("member", rank))  # its member id there (worker_id on the wire)
        fallbacks = agg.get("fallback_ips") or []
        self.job_id = spec.job_id
        self.mode = ik.MODE_NIC if spec.algo == "nic" else (
            ik.MODE_THC if spec.compressor is not None else ik.MODE_INT32)
        self.W = spec.slots
        # congestion response (ik.cc_sample); the window carries over to the next collective
        self.cc = ik.CC_DELAY if spec.ina_cc == "delay" else ik.CC_OFF
        self.cwnd = 0.0
        # and so does the round-trip estimator (ik.new_loop says why)
        self.rtt = (0.0, 0.0)
        self.timeout_s = spec.timeout_s
        # on a dilated network (runner.py) every timer of the loop runs that much slower
        self.dilation = float(job.get("time_dilation", 1.0))
        # a delay-based window keeps its queue short: its timer needs no room for a whole one
        self.t0 = timeout_floor(self.W, job.get("bw_bps")) if self.cc == ik.CC_OFF else ik.T0
        self.loss = float(spec.loss)
        self.rng = np.random.default_rng([spec.seed, 7919, rank])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        port = int(me.get("port") or ina_worker_port(spec.job_id))
        try:
            self.sock.bind((me["ip"], port))
        except OSError as e:
            self.sock.close()
            raise CollectiveError(f"rank {rank} ({self.host}): cannot bind UDP {me['ip']}:{port} "
                                  f"({e}); another INA job with the same port on this host? "
                                  "give the jobs job ids that differ modulo "
                                  f"{INA_PORT_SPAN}") from None
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.slots = ik.new_slots(self.W, int(job.get("seq0", 0)))
        self.pkts_addr = np.uint64(self.slots.pkts.ctypes.data)
        self.send_list = np.zeros(self.W, dtype=np.int64)
        self.siov, self.shdr = _mmsg(self.W)
        self.shdr_addr = self.shdr.ctypes.data
        # GSO sends: one mmsghdr per run of packets, each with its UDP_SEGMENT cmsg
        # (cmsg_len = CMSG_LEN(2), level, type, the uint16 segment length; CMSG_SPACE(2) = 24)
        queue = egress_queue_bytes()
        self.gso_bytes = gso_run_bytes(self.sock.fileno(), FRAME_BYTES, queue)
        self.gso = self.gso_bytes > 0
        # a delay-based window starts no larger than the host's own queue holds (_run)
        self.queue_frames = None if queue is None else max(1, queue // FRAME_BYTES)
        self.gctl = np.zeros((self.W, 3), dtype=np.uint64)
        self.gctl[:, 0] = 18
        self.gctl[:, 1] = _SOL_UDP | (_UDP_SEGMENT << 32)
        self.ghdr = np.zeros((self.W, 8), dtype=np.uint64)
        self.ghdr[:, 4] = np.uint64(self.gctl.ctypes.data) + \
            np.arange(self.W, dtype=np.uint64) * np.uint64(24)
        self.ghdr[:, 5] = 24
        self.ghdr_addr = self.ghdr.ctypes.data
        self.siov_addr = np.uint64(self.siov.ctypes.data)
        self.rbuf = np.zeros((RX_BURST, RB), dtype=np.uint8)
        self.riov, self.rhdr = _mmsg(RX_BURST)
        self.sources = None
        if not fallbacks:
            self.sock.connect(self.agg)  # the kernel then drops datagrams from anyone else
        else:
            # shared mode: RESULTs come from the switch or from the job's host fallbacks; the
            # socket stays unconnected, packets go to the switch by address, and datagrams
            # from anyone else are ignored by their source address
            self.sources = np.array([_ip_u32(self.agg[0])] + [_ip_u32(f) for f in fallbacks],
                                    np.uint32)
            self.dst = _sockaddr_in(*self.agg)
            self.shdr[:, 0] = self.ghdr[:, 0] = np.uint64(self.dst.ctypes.data)
            self.shdr[:, 1] = self.ghdr[:, 1] = 16
            self.names = np.zeros((RX_BURST, 16), np.uint8)
            self.rhdr[:, 0] = np.uint64(self.names.ctypes.data) + \
                np.arange(RX_BURST, dtype=np.uint64) * np.uint64(16)
        self.riov[:, 0] = np.uint64(self.rbuf.ctypes.data) + \
            np.arange(RX_BURST, dtype=np.uint64) * np.uint64(RB)
        self.riov[:, 1] = RB
        self.rhdr_addr = self.rhdr.ctypes.data
        self.stats = {"sent": 0, "retransmitted": 0, "results": 0, "ignored": 0,
                      "lost_tx": 0, "lost_rx": 0, "gso_sends": 0}
        self.thc = None
        if spec.compressor is not None:
            if spec.compressor not in INA_COMPRESSORS or self.mode == ik.MODE_NIC:
                raise CollectiveError(f"CollectiveSpec.compressor={spec.compressor!r} is not "
                                      f"implemented for algo {spec.algo!r}")
            self.thc = get_compressor("thc", **spec.compressor_params)
            self.E = thc_elems(self.n, self.thc.g)
        self.step = 0  # repetition counter: the THC streams' step (same on every worker)
        self._qbuf = np.empty(0, np.int32)
        self._qsum(self._qsum_size(spec.count))  # page faults now, not in the timed loop
        warm_up()

    # --- one collective ----------------------------------------------------------------------
    def allreduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """Sum ``x`` over the job's workers through the switch; float32 result into ``out``."""
        p = self._payload(x, out, self.step)
        self.step += 1
        self._run(p)
        if self.mode == ik.MODE_INT32:
            ik.dequantize_int32(p)  # chunk k was quantised with scale_for(agreed[k], n)

    def _qsum_size(self, count: int) -> int:
        if self.mode == ik.MODE_THC:
            return thc_layout(self.thc, count, self.E, 0, self.rank)[0]
        return 1 if self.mode == ik.MODE_NIC else count

    def _qsum(self, size: int) -> np.ndarray:
        """The summed-lanes buffer of a collective, reused by the next ones (every lane is
        written by its RESULT before it is read). A fresh array of that size (numpy asks for
        huge pages from 4 MiB on) would be zeroed page by page by the kernel as the RESULTs
        first touch it, inside the timed loop and on the CPU the emulation is short of:
        measured at 8 workers, 64 MiB, that page clearing was a fifth of the machine's CPU,
        and reusing the buffer cut the workers' CPU per packet by 14-17 % at 32 MiB."""
        if self._qbuf.size < size:
            self._qbuf = np.empty(size, np.int32)
            self._qbuf.fill(0)  # touch every page here
        return self._qbuf[:size]

    def _payload(self, x: np.ndarray, out: np.ndarray, step: int) -> ik.Payload:
        count = x.size
        W, n, member = self.W, self.n, self.member
        scratch = np.empty(ik.THC_ELEMS, dtype=np.float32)
        zero = np.uint64(0)
        if self.mode == ik.MODE_THC:
            comp = self.thc
            d, blk, skey, qkey = thc_layout(comp, count, self.E, step, self.rank)
            K = -(-d // self.E)
            return ik.Payload(ik.MODE_THC, x, out, self._qsum(d),
                              np.full(max(K, 1), ik.THC_EXP_ZERO, np.int16), K, W, self.E, d, n,
                              self.job_id, member, float(comp.clip), float(comp.g // 2), blk,
                              skey, qkey, scratch)
        K = -(-count // ik.ELEMS)
        nic = self.mode == ik.MODE_NIC
        return ik.Payload(self.mode, x, out, self._qsum(1 if nic else count),
                          np.full(max(K, 1), fp.EXP_MIN, np.int16), K, 0 if nic else W,
                          ik.ELEMS, count, n, self.job_id, member, 0.0, 1.0, 1, zero, zero,
                          scratch)

    def _send(self, k: int) -> None:
        """Send the packet rows listed in ``send_list[:k]`` (seeded loss first): in UDP GSO
        runs where this namespace allows them (:func:`udp_gso_usable`), else one ``sendmmsg``
        entry each."""
        slots = self.send_list[:k]
        if self.loss:
            keep = self.rng.random(k) >= self.loss
            self.stats["lost_tx"] += int(k - keep.sum())
            slots = slots[keep]
            k = slots.size
        if k == 0:
            return
        self.siov[:k, 0] = self.pkts_addr + slots.astype(np.uint64) * np.uint64(ik.ROW)
        self.siov[:k, 1] = self.slots.lens[slots].astype(np.uint64)
        g = ik.gso_batches(slots, k, self.slots.lens, self.siov_addr, self.ghdr, self.gctl,
                           self.gso_bytes, UDP_MAX_SEGMENTS, FRAME_OVERHEAD) if self.gso else 0
        self._transmit(k, g)

    def _transmit(self, k: int, g: int) -> None:
        """Send the ``k`` packets whose ``iovec`` rows are ready: as the ``g`` GSO groups
        built over them when this namespace allows GSO, else one ``sendmmsg`` entry each."""
        first = 0
        if self.gso:
            sent = 0
            while sent < g:
                r = _libc.sendmmsg(self.fd, self.ghdr_addr + sent * 64, g - sent, 0)
                if r > 0:
                    sent += r
                    continue
                if ctypes.get_errno() in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT,
                                          errno.EOPNOTSUPP):
                    # a kernel or route without UDP GSO: one datagram per entry from now on
                    self.gso = False
                    first = int(self.ghdr[sent, 2] - self.siov_addr) // 16
                    break
                return  # socket buffer full (EAGAIN): the retransmission timer resends
            else:
                self.stats["gso_sends"] += g
                return
        sent = first
        while sent < k:
            r = _libc.sendmmsg(self.fd, self.shdr_addr + sent * 64, k - sent, 0)
            if r <= 0:
                break  # socket buffer full (EAGAIN): the retransmission timer resends
            sent += r

    def start_window(self) -> float:
        """The delay-based window a collective starts with (0: all W slots): the last
        collective's, or W for the first, but no more packets than the host's own queue holds
        (:func:`egress_queue_bytes`). More leave the socket at once than that queue takes, and
        the rest are dropped before they leave the host, then resent together when their timers
        expire together: a first window of W=64 into a 5-frame queue (50 Mb/s, ``queue_ms=1``)
        took 2.1-3.0 s where the next took 0.11 s. Without a congestion response the window is
        the protocol's W slots (SwitchML's pool)."""
        if self.cc == ik.CC_OFF or self.queue_frames is None:
            return self.cwnd
        return float(min(self.cwnd if self.cwnd > 0 else self.W, self.queue_frames))

    def _run(self, p: ik.Payload) -> None:
        """The slot protocol loop (bursts, timers, retransmissions) for one collective."""
        total = p.K + p.boot
        now = time.monotonic()
        loop = ik.new_loop(now, self.dilation, self.cc, self.start_window(), rtt=self.rtt,
                           t0=self.t0)
        st = loop[0]
        k = ik.start(self.slots, loop, p, now, self.send_list)
        self._send(k)
        # the timer kernel takes the slots as a plain tuple, the burst kernel its arrays as
        # one table (ik.on_burst says why)
        slots_t = tuple(self.slots)
        B = self.rbuf.shape[0]
        drop = np.zeros(B, dtype=np.bool_)
        # the table borrows these arrays: they stay referenced here while it is used
        burst = ik.burst_arrays(self.rbuf, self.rhdr, np.zeros(B, np.int64), drop, self.slots,
                                p, self.send_list, self.siov, self.ghdr, self.gctl)
        table = array_table(burst, ik.BURST_SPEC)
        scalars = ik.payload_scalars(p)
        done = 0
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        # at most a quarter of the window's worth of 100 Mb/s packet times (~90 us each),
        # which a dilated network stretches
        coalesce = min(COALESCE_S, self.W * 90e-6 / 4) * self.dilation if self.W >= 16 else 0.0
        first_dl = float(self.slots.deadline.min())  # the burst kernel says it after each burst
        while done < total:
            got = _libc.recvmmsg(self.fd, self.rhdr_addr, B, MSG_DONTWAIT, None)
            if got <= 0:
                # drained: only now look at timers (a descheduled worker must not retransmit
                # what is already waiting in its socket)
                now = time.monotonic()
                if first_dl > now:
                    if poller.poll(min(first_dl - now, 0.05) * 1000.0):
                        continue
                    now = time.monotonic()
                k = ik.expire_flat(slots_t, loop, now, self.send_list)
                self._send(k)
                first_dl = float(self.slots.deadline.min())
                if now - float(st["progress"]) > self.timeout_s:
                    pending = [int(s) for s in np.nonzero(self.slots.cur >= 0)[0][:8]]
                    raise CollectiveTimeout(
                        f"rank {self.rank} ({self.host}): no RESULT from the aggregator "
                        f"{self.agg[0]} for {self.timeout_s} s ({done}/{total} packets done, "
                        f"slots {pending} pending; a worker died or the switch lost the job?)")
                continue
            if self.loss:  # seeded client-side loss of what arrived
                drop[:got] = self.rng.random(got) < self.loss
            if self.sources is not None:  # shared mode: only the switch and the fallbacks
                src = self.names[:got, 4:8].astype(np.uint32)
                src = (src[:, 0] << 24) | (src[:, 1] << 16) | (src[:, 2] << 8) | src[:, 3]
                foreign = ~np.isin(src, self.sources)
                if foreign.any():
                    self.stats["foreign"] = self.stats.get("foreign", 0) + int(foreign.sum())
                drop[:got] = foreign | (drop[:got] if self.loss else False)
                self.rhdr[:, 1] = 16  # the kernel wrote the names' lengths
            # seeded loss filters the send list first (_send), so the kernel builds no sends
            how = ik.SEND_NONE if self.loss else (ik.SEND_GSO if self.gso else ik.SEND_EACH)
            d, ns, g, ign, lost, bad, code, first_dl = ik.on_burst(
                table, loop, scalars, got, time.monotonic(), how, self.gso_bytes,
                UDP_MAX_SEGMENTS, FRAME_OVERHEAD)
            self.stats["ignored"] += ign
            self.stats["lost_rx"] += lost
            if bad >= 0:
                self._protocol_error(bad, code, got)
            done += d
            if ns:
                if self.loss:
                    self._send(ns)
                else:
                    self._transmit(ns, g)
            if got < B and coalesce:
                time.sleep(coalesce)
        self.stats["sent"] += int(st["sends"])
        self.stats["retransmitted"] += int(st["sends"]) - total
        self.stats.update(results=done, srtt_ms=float(st["srtt"]) * 1e3)
        self.rtt = (float(st["srtt"]), float(st["rttvar"]))
        if self.cc != ik.CC_OFF:
            self.cwnd = float(st["cwnd"])
            self.stats.update(cwnd=self.cwnd, cwnd_min=float(st["cwnd_min"]),
                              base_rtt_ms=float(st["base_rtt"]) * 1e3)

    def _protocol_error(self, slot: int, code: int, got: int) -> None:
        if code == 2:
            raise CollectiveError(
                f"rank {self.rank} ({self.host}): the switch flagged OVERFLOW for slot {slot}: "
                "the THC sums do not fit a RESULT lane; lower granularity or the number of "
                "workers")
        seen = [describe_header(unpack_header(self.rbuf[i])) for i in range(got)]
        seen = [{k: h[k] for k in ("codec", "elem_count", "chunk_offset", "seq")}
                for h in seen if h["slot"] == slot][:1]
        want = {ik.MODE_NIC: "FLOAT32", ik.MODE_THC: "THC"}.get(self.mode, "INT32")
        raise CollectiveError(
            f"rank {self.rank} ({self.host}): RESULT for slot {slot} ({seen}) does not match "
            f"packet {int(self.slots.cur[slot])} outstanding there (expected codec {want}; is "
            "the SmartNIC in fixed32 mode / does the switch accept codec THC?)")

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


_warm = False


def warm_up() -> None:
    """Load (or compile once) the INA kernels now, with the argument types the client uses,
    so no timed collective pays for it."""
    global _warm
    if _warm:
        return
    W = 2
    slots = ik.new_slots(W, 0)
    loop = ik.new_loop(0.0)
    rbuf = np.zeros((1, RB), np.uint8)
    send_list = np.zeros(W, np.int64)
    x = np.ones(300, np.float32)
    q = np.zeros(300, np.int32)
    for mode, cc in ((ik.MODE_INT32, ik.CC_OFF), (ik.MODE_NIC, ik.CC_OFF),
                     (ik.MODE_THC, ik.CC_DELAY)):  # every kernel, with the loop's one type
        loop[0]["cc"] = cc
        p = ik.Payload(mode, x, x.copy(), q, np.zeros(2, np.int16), 2, W, 256, 300, 2, 1, 0,
                       4.0, 8.0, 8, np.uint64(1), np.uint64(2), np.zeros(1024, np.float32))
        ik.start(slots, loop, p, 0.0, send_list)
        arrays = ik.burst_arrays(rbuf, np.zeros((1, 8), np.uint64), np.zeros(1, np.int64),
                                 np.zeros(1, np.bool_), slots, p, send_list,
                                 np.zeros((W, 2), np.uint64), np.zeros((W, 8), np.uint64),
                                 np.zeros((W, 3), np.uint64))
        ik.on_burst(array_table(arrays, ik.BURST_SPEC), loop, ik.payload_scalars(p), 1, 0.0,
                    ik.SEND_GSO, GSO_BURST_BYTES, UDP_MAX_SEGMENTS, FRAME_OVERHEAD)
        ik.expire_flat(tuple(slots), loop, 0.0, send_list)
        if mode == ik.MODE_INT32:
            ik.dequantize_int32(p._replace(out=x.copy()))
        slots.cur[:] = -1
    ik.gso_batches(send_list, W, slots.lens, np.uint64(0), np.zeros((W, 8), np.uint64),
                   np.zeros((W, 3), np.uint64), GSO_BURST_BYTES, UDP_MAX_SEGMENTS,
                   FRAME_OVERHEAD)
    _warm = True


# --------------------------------------------------------------------------- INA + THC helpers


def thc_elems(n: int, granularity: int) -> int:
    """int8 lanes per THC packet for ``n`` workers: 1024 when the n-way sum of levels
    (|sum| <= n * g/2) fits the int8 RESULT lane, else 512 (int16 RESULT lanes, still one MTU)."""
    return ik.THC_ELEMS if n * (granularity // 2) <= 127 else ik.THC_ELEMS // 2


def thc_layout(comp, count: int, E: int, step: int, rank: int) -> tuple:
    """(padded length d, rotation block, sign key (shared), rounding key (this rank's)).

    The rotation block is the compressor's ``block`` capped at the packet's E lanes, so every
    packet holds whole blocks; a vector shorter than a block uses one power-of-two block."""
    d, blk = padded_length(int(count), min(int(comp.block), E))
    skey = stream_key(comp.seed, step, SALT_SIGN)
    qkey = stream_key(comp.seed, step, SALT_QUANT_RANK + (rank << 16))
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
        M[lo:hi] = ik.thc_scale(int(agreed[k]), hi - lo, float(comp.clip))
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
