"""The ``aggregate`` program: SwitchML-style in-network aggregation (docs/architecture.md).

State lives in numpy arrays walked by one ``@njit`` call per burst:

* a pool of ``pool_slots`` slots, each with two *sets* (the shadow copy); per (slot, set) a
  32-bit worker bitmap, a counter, the element count, the max exponent, the chunk offset and
  ``max_elems`` int32 values;
* jobs (added through ``configure(jobs=...)``) own a contiguous partition of the pool; a packet's
  ``slot`` is job-relative. A job that cannot get its slots is refused (the caller falls back to
  a host-side reduction);
* per (job, worker) the address learned from that worker's own DATA packets (MAC, IP, UDP port,
  ingress port): results go back exactly where the contribution came from.

Protocol per contribution (worker ``w``, set ``s``): if ``w``'s bit is already set in ``s`` it is
a retransmission: answered from ``s`` (unicast RESULT) when ``s`` is complete, else dropped
``STALE``. Otherwise the bit is cleared from set ``1-s`` and OR-ed into ``s``; the first
contributor (empty bitmap) overwrites the values and sets counter = n-1, later ones add (int32,
wrapping like the switch ALU) and decrement; exponent = max. Counter 0 -> one RESULT per worker.
An absorbed contribution is marked ``PORT_HELD`` (the switch keeps it in its registers; it is
neither sent nor a drop).

A worker that dies mid-aggregation only wedges its own job's partition; ``reset_job(job_id)``
(control command ``reset_job``) clears that partition's bitmaps/counters and learned addresses
so the job can start again, and removing the job frees its slots for others.

The aggregator also answers ARP requests for its IP, so workers need no static ARP entry.
Packets that are not to the aggregator's MAC/IP fall through (``PORT_UNSET``) to later stages.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.datapath.batch import (
    PORT_DROP,
    PORT_HELD,
    PORT_UNSET,
    Batch,
    DropReason,
    Stage,
)
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.kernels.packets import (
    rd_i16le,
    rd_u16be,
    rd_u16le,
    rd_u32le,
    set_ipv4_checksum,
    wr_u16be,
    wr_u16le,
    wr_u32le,
)
from testbed.kernels.wire import (
    FIELD_OFFSETS,
    HEADER_LEN,
    HEADER_OFFSET,
    MAGIC,
    PAYLOAD_OFFSET,
    TESTBED_UDP_PORT,
    VERSION,
    Codec,
    Flags,
    MsgType,
)

DEFAULT_AGG_IP = "10.0.0.254"
DEFAULT_AGG_MAC = "02:54:42:00:00:fe"
MAX_WORKERS = 32
MAX_JOBS = 64
#: Payload bytes that fit a 1500-byte MTU: 1500 - 20 - 8 - 28.
MTU_PAYLOAD = 1500 - 20 - 8 - HEADER_LEN
#: Largest int32 payload that fits a 1500-byte MTU: (1500 - 20 - 8 - 28) / 4.
MAX_ELEMS_MTU = MTU_PAYLOAD // 4
#: Most int8 lanes per ``Codec.THC`` packet: 1024 x 1 B = the bytes of SwitchML's 256 int32,
#: so the same bytes need a quarter of the packets. Registers stay int32 (per slot and set).
THC_MAX_ELEMS = 1024

#: Summable codecs an aggregate stage accepts unless configured otherwise.
DEFAULT_CODECS = ("INT32", "THC")

COUNTER_NAMES = (
    "contributions",  # absorbed into a slot
    "completed",  # slot sets that reached counter 0
    "results_sent",  # RESULT packets emitted (multicast copies + retransmission answers)
    "retransmissions_seen",  # contribution whose bit was already set
    "retransmissions_answered",  # ... answered from a complete set (shadow copy)
    "stale",  # ... dropped because the set was incomplete
    "arp_replies",
    "result_overflow",  # results not emitted because the batch was full (workers retransmit)
    "dropped",  # malformed / unknown job / bad slot etc. (reason in the engine's counters)
)
(C_CONTRIB, C_COMPLETED, C_RESULTS, C_RETX, C_RETX_ANS, C_STALE, C_ARP, C_OVERFLOW,
 C_DROPPED) = range(len(COUNTER_NAMES))

_O_MAGIC = HEADER_OFFSET + FIELD_OFFSETS["magic"]
_O_VERSION = HEADER_OFFSET + FIELD_OFFSETS["version"]
_O_TYPE = HEADER_OFFSET + FIELD_OFFSETS["msg_type"]
_O_JOB = HEADER_OFFSET + FIELD_OFFSETS["job_id"]
_O_WORKER = HEADER_OFFSET + FIELD_OFFSETS["worker_id"]
_O_SLOT = HEADER_OFFSET + FIELD_OFFSETS["slot"]
_O_SET = HEADER_OFFSET + FIELD_OFFSETS["slot_set"]
_O_FLAGS = HEADER_OFFSET + FIELD_OFFSETS["flags"]
_O_CODEC = HEADER_OFFSET + FIELD_OFFSETS["codec"]
_O_NW = HEADER_OFFSET + FIELD_OFFSETS["n_workers"]
_O_EXP = HEADER_OFFSET + FIELD_OFFSETS["exponent"]
_O_ELEMS = HEADER_OFFSET + FIELD_OFFSETS["elem_count"]
_O_HEAD = HEADER_OFFSET + FIELD_OFFSETS["head_bytes"]
_O_CHUNK = HEADER_OFFSET + FIELD_OFFSETS["chunk_offset"]
_O_SCALE = HEADER_OFFSET + FIELD_OFFSETS["scale"]

_T_DATA = int(MsgType.DATA)
_T_RESULT = int(MsgType.RESULT)
_T_RETX = int(MsgType.RETRANSMIT)
_R_TOO_SHORT = int(DropReason.TOO_SHORT)
_R_NOT_IPV4 = int(DropReason.NOT_IPV4)
_R_IP_OPTIONS = int(DropReason.IP_OPTIONS)
_R_NOT_UDP = int(DropReason.NOT_UDP)
_R_BAD_MAGIC = int(DropReason.BAD_MAGIC)
_R_BAD_VERSION = int(DropReason.BAD_VERSION)
_R_BAD_LENGTH = int(DropReason.BAD_LENGTH)
_R_UNKNOWN_TYPE = int(DropReason.UNKNOWN_TYPE)
_R_UNKNOWN_JOB = int(DropReason.UNKNOWN_JOB)
_R_BAD_SLOT = int(DropReason.BAD_SLOT)
_R_BAD_WORKER = int(DropReason.BAD_WORKER)
_R_BAD_CODEC = int(DropReason.BAD_CODEC)
_R_ELEM_MISMATCH = int(DropReason.ELEM_MISMATCH)
_R_STALE = int(DropReason.STALE)
_R_OTHER = int(DropReason.OTHER)
_PORT = TESTBED_UDP_PORT
_C_THC = int(Codec.THC)
_F_OVERFLOW = int(Flags.OVERFLOW)


@njit(cache=True)
def _csum(f, start, end, acc):
    """One's-complement 16-bit sum of f[start:end] added to ``acc`` (not folded)."""
    j = start
    while j + 1 < end:
        acc += (np.int64(f[j]) << 8) | np.int64(f[j + 1])
        j += 2
    if j < end:
        acc += np.int64(f[j]) << 8
    return acc


@njit(cache=True)
def _fold(acc):
    while acc >> 16:
        acc = (acc & 0xFFFF) + (acc >> 16)
    return (~acc) & 0xFFFF


@njit(cache=True)
def _drop(out_port, reason, counters, i, r):
    out_port[i] = PORT_DROP
    reason[i] = r
    counters[C_DROPPED] += 1


@njit(cache=True)
def result_lane(codec, values, elems):
    """(lane bytes, flags) of a RESULT: 4 (int32) unless ``codec`` is THC, whose sums go out
    in the narrowest of int8/int16/int32 that holds every sum of the slot and fits the MTU;
    none -> (0, OVERFLOW) and an empty payload (never a silently wrapped sum)."""
    if codec != _C_THC:
        return 4, 0
    lo = np.int64(0)
    hi = np.int64(0)
    for k in range(elems):
        v = np.int64(values[k])
        if v < lo:
            lo = v
        elif v > hi:
            hi = v
    if lo >= -128 and hi <= 127 and elems <= MTU_PAYLOAD:
        return 1, 0
    if lo >= -32768 and hi <= 32767 and 2 * elems <= MTU_PAYLOAD:
        return 2, 0
    if 4 * elems <= MTU_PAYLOAD:
        return 4, 0
    return 0, _F_OVERFLOW


@njit(cache=True)
def _build_result(row, agg_mac, agg_ip, w_mac, w_ip, w_udp, job_id, worker, slot, sset, codec,
                  n_workers, exponent, elems, chunk, values):
    """Write a RESULT frame into ``row``; return its length. UDP checksum is computed.

    The payload lane width comes from :func:`result_lane` (always int32 for INT32)."""
    lane, flags = result_lane(codec, values, elems)
    for j in range(6):
        row[j] = w_mac[j]
        row[6 + j] = agg_mac[j]
    row[12] = 0x08
    row[13] = 0x00
    payload = elems * lane
    tot = 20 + 8 + HEADER_LEN + payload
    row[14] = 0x45
    row[15] = 0
    wr_u16be(row, 16, tot)
    row[18] = 0
    row[19] = 0
    row[20] = 0x40  # DF
    row[21] = 0
    row[22] = 64
    row[23] = 17
    row[24] = 0
    row[25] = 0
    for j in range(4):
        row[26 + j] = agg_ip[j]
        row[30 + j] = w_ip[j]
    set_ipv4_checksum(row)
    wr_u16be(row, 34, _PORT)
    wr_u16be(row, 36, w_udp)
    wr_u16be(row, 38, tot - 20)
    row[40] = 0
    row[41] = 0
    wr_u16le(row, _O_MAGIC, MAGIC)
    row[_O_VERSION] = VERSION
    row[_O_TYPE] = _T_RESULT
    wr_u16le(row, _O_JOB, job_id)
    wr_u16le(row, _O_WORKER, worker)
    wr_u16le(row, _O_SLOT, slot)
    row[_O_SET] = sset
    row[_O_FLAGS] = flags
    row[_O_CODEC] = codec
    row[_O_NW] = n_workers
    wr_u16le(row, _O_EXP, exponent & 0xFFFF)
    wr_u16le(row, _O_ELEMS, elems)
    wr_u16le(row, _O_HEAD, 0)
    wr_u32le(row, _O_CHUNK, chunk)
    wr_u32le(row, _O_SCALE, 0)
    o = PAYLOAD_OFFSET
    if lane == 4:
        for k in range(elems):
            wr_u32le(row, o, values[k])
            o += 4
    elif lane == 2:
        for k in range(elems):
            wr_u16le(row, o, values[k] & 0xFFFF)
            o += 2
    elif lane == 1:
        for k in range(elems):
            row[o] = np.uint8(values[k] & 0xFF)
            o += 1
    # UDP checksum over the pseudo header + UDP header + data
    acc = _csum(row, 26, 34, np.int64(0)) + 17 + (tot - 20)
    acc = _csum(row, 34, 14 + tot, acc)
    c = _fold(acc)
    if c == 0:
        c = 0xFFFF
    wr_u16be(row, 40, c)
    return 14 + tot


@njit(cache=True)
def aggregate_kernel(buf, length, in_port, out_port, reason, n, agg_mac, agg_ip, job_map,
                     job_base, job_slots, job_n, codec_ok, via_ingress, w_mac, w_ip, w_udp,
                     w_port,
                     bitmap, counter, nelems, exponent, chunk, codec_of, values, counters,
                     max_elems):
    """Run the aggregation protocol over ``batch[0:n]``; return the new batch size.

    RESULT packets are appended after row ``n`` (up to ``buf.shape[0]``). ``max_elems``:
    int32 lanes per packet; ``Codec.THC`` packets carry up to ``min(THC_MAX_ELEMS,
    values.shape[2])`` int8 lanes, summed into the same int32 registers.
    """
    cap = buf.shape[0]
    n_out = n
    thc_max = min(THC_MAX_ELEMS, values.shape[2])
    for i in range(n):
        if out_port[i] != PORT_UNSET:
            continue
        ln = length[i]
        if ln < 14:
            continue
        f = buf[i]
        to_mac = True
        for j in range(6):
            if f[j] != agg_mac[j]:
                to_mac = False
                break
        is_ip = f[12] == 0x08 and f[13] == 0x00
        to_ip = False
        if is_ip and ln >= 34:
            to_ip = f[30] == agg_ip[0] and f[31] == agg_ip[1] and f[32] == agg_ip[2] and \
                f[33] == agg_ip[3]
        if f[12] == 0x08 and f[13] == 0x06 and ln >= 42:
            # ARP request for the aggregator's IP -> reply in place
            if rd_u16be(f, 20) == 1 and f[38] == agg_ip[0] and f[39] == agg_ip[1] and \
                    f[40] == agg_ip[2] and f[41] == agg_ip[3] and in_port[i] >= 0:
                for j in range(6):
                    f[j] = f[22 + j]  # eth dst = sender hw
                    f[32 + j] = f[22 + j]  # target hw = sender hw
                    f[6 + j] = agg_mac[j]
                    f[22 + j] = agg_mac[j]
                for j in range(4):
                    f[38 + j] = f[28 + j]  # target ip = sender ip
                    f[28 + j] = agg_ip[j]
                wr_u16be(f, 20, 2)
                out_port[i] = in_port[i]
                counters[C_ARP] += 1
                continue
        if not (to_mac or to_ip):
            continue
        # --- addressed to the aggregator: validate every layer, drop with a reason ---
        if not is_ip:
            _drop(out_port, reason, counters, i, _R_NOT_IPV4)
            continue
        if ln < 34:
            _drop(out_port, reason, counters, i, _R_TOO_SHORT)
            continue
        if (f[14] >> 4) != 4:
            _drop(out_port, reason, counters, i, _R_NOT_IPV4)
            continue
        ihl = f[14] & 0x0F
        if ihl > 5:
            _drop(out_port, reason, counters, i, _R_IP_OPTIONS)
            continue
        if ihl < 5:
            _drop(out_port, reason, counters, i, _R_BAD_LENGTH)
            continue
        if f[23] != 17:
            _drop(out_port, reason, counters, i, _R_NOT_UDP)
            continue
        tot = rd_u16be(f, 16)
        if tot > ln - 14 or tot < 28:
            _drop(out_port, reason, counters, i, _R_BAD_LENGTH)
            continue
        if rd_u16be(f, 36) != _PORT:
            _drop(out_port, reason, counters, i, _R_OTHER)
            continue
        if rd_u16be(f, 38) != tot - 20:
            _drop(out_port, reason, counters, i, _R_BAD_LENGTH)
            continue
        if tot < 28 + HEADER_LEN:
            _drop(out_port, reason, counters, i, _R_TOO_SHORT)
            continue
        if rd_u16le(f, _O_MAGIC) != MAGIC:
            _drop(out_port, reason, counters, i, _R_BAD_MAGIC)
            continue
        if f[_O_VERSION] != VERSION:
            _drop(out_port, reason, counters, i, _R_BAD_VERSION)
            continue
        mt = f[_O_TYPE]
        if mt != _T_DATA and mt != _T_RETX:
            _drop(out_port, reason, counters, i, _R_UNKNOWN_TYPE)
            continue
        cdc = f[_O_CODEC]
        if not codec_ok[cdc]:
            _drop(out_port, reason, counters, i, _R_BAD_CODEC)
            continue
        ne = rd_u16le(f, _O_ELEMS)
        narrow = cdc == _C_THC
        lim = thc_max if narrow else max_elems
        lane = 1 if narrow else 4
        if ne == 0 or ne > lim or ne * lane != tot - 28 - HEADER_LEN:
            _drop(out_port, reason, counters, i, _R_BAD_LENGTH)
            continue
        jid = rd_u16le(f, _O_JOB)
        jx = job_map[jid]
        if jx < 0:
            _drop(out_port, reason, counters, i, _R_UNKNOWN_JOB)
            continue
        w = rd_u16le(f, _O_WORKER)
        nw = job_n[jx]
        if w >= nw:
            _drop(out_port, reason, counters, i, _R_BAD_WORKER)
            continue
        sl = rd_u16le(f, _O_SLOT)
        s = np.int64(f[_O_SET])
        if sl >= job_slots[jx] or s > 1:
            _drop(out_port, reason, counters, i, _R_BAD_SLOT)
            continue
        g = job_base[jx] + sl
        bit = np.uint32(1) << np.uint32(w)
        # learn where this worker lives (results go back the way its data came)
        for j in range(6):
            w_mac[jx, w, j] = f[6 + j]
        for j in range(4):
            w_ip[jx, w, j] = f[26 + j]
        w_udp[jx, w] = rd_u16be(f, 34)
        w_port[jx, w] = in_port[i]
        if bitmap[g, s] & bit:
            counters[C_RETX] += 1
            if counter[g, s] == 0:
                if n_out < cap:
                    length[n_out] = _build_result(
                        buf[n_out], agg_mac, agg_ip, w_mac[jx, w], w_ip[jx, w], w_udp[jx, w],
                        jid, w, sl, s, codec_of[g, s], nw, exponent[g, s], nelems[g, s],
                        chunk[g, s], values[g, s])
                    out_port[n_out] = w_port[jx, w] if via_ingress else PORT_UNSET
                    in_port[n_out] = -1
                    reason[n_out] = 0
                    n_out += 1
                    counters[C_RESULTS] += 1
                    counters[C_RETX_ANS] += 1
                else:
                    counters[C_OVERFLOW] += 1
                out_port[i] = PORT_HELD
            else:
                out_port[i] = PORT_DROP
                reason[i] = _R_STALE
                counters[C_STALE] += 1
            continue
        exp = rd_i16le(f, _O_EXP)
        o = PAYLOAD_OFFSET
        if bitmap[g, s] == 0:
            vals = values[g, s]
            if narrow:
                for k in range(ne):
                    vals[k] = np.int32(np.int8(f[o + k]))
            else:
                for k in range(ne):
                    vals[k] = np.int32(np.uint32(rd_u32le(f, o)))
                    o += 4
            nelems[g, s] = ne
            exponent[g, s] = exp
            chunk[g, s] = rd_u32le(f, _O_CHUNK)
            codec_of[g, s] = cdc
            counter[g, s] = nw - 1
            bitmap[g, s] = bit
        else:
            if nelems[g, s] != ne:
                _drop(out_port, reason, counters, i, _R_ELEM_MISMATCH)
                continue
            if codec_of[g, s] != cdc:  # lanes of another meaning: never add them
                _drop(out_port, reason, counters, i, _R_BAD_CODEC)
                continue
            vals = values[g, s]
            if narrow:
                for k in range(ne):
                    vals[k] += np.int32(np.int8(f[o + k]))
            else:
                for k in range(ne):
                    vals[k] += np.int32(np.uint32(rd_u32le(f, o)))
                    o += 4
            if exp > exponent[g, s]:
                exponent[g, s] = exp
            counter[g, s] -= 1
            bitmap[g, s] |= bit
        bitmap[g, 1 - s] &= ~bit
        counters[C_CONTRIB] += 1
        out_port[i] = PORT_HELD
        if counter[g, s] == 0:
            counters[C_COMPLETED] += 1
            for v in range(nw):
                if n_out >= cap:
                    counters[C_OVERFLOW] += 1
                    continue
                length[n_out] = _build_result(
                    buf[n_out], agg_mac, agg_ip, w_mac[jx, v], w_ip[jx, v], w_udp[jx, v], jid,
                    v, sl, s, codec_of[g, s], nw, exponent[g, s], ne, chunk[g, s],
                    values[g, s])
                out_port[n_out] = w_port[jx, v] if via_ingress else PORT_UNSET
                in_port[n_out] = -1
                reason[n_out] = 0
                n_out += 1
                counters[C_RESULTS] += 1
    return n_out


class AggregateStage(Stage):
    """In-network aggregation (program name ``aggregate``); see the module docstring.

    Settings: ``agg_ip``, ``agg_mac``, ``pool_slots`` (default 4096), ``max_elems`` (per
    packet, default and max 361 = a full 1500-byte MTU), ``jobs`` ``{job_id: {"n_workers": n,
    "slots": k}}``, ``codecs`` (names or numbers of summable payload codecs, default INT32 and
    THC: int8 lanes, up to ``THC_MAX_ELEMS`` per packet, results in the narrowest lane that
    holds the sums, see :func:`result_lane`),
    ``results_via``: ``"ingress"`` (default: a RESULT leaves by the port its worker's data came
    in on) or ``"forward"`` (left undecided for a later ``forward`` stage to route by the
    worker's MAC/IP).
    """

    name = "aggregate"
    #: results emitted per received packet at most (the engine sizes the batch with it)
    max_expansion = 1 + MAX_WORKERS

    def __init__(self, ports: list[str] | None = None, agg_ip: str = DEFAULT_AGG_IP,
                 agg_mac: str = DEFAULT_AGG_MAC, pool_slots: int = 4096,
                 max_elems: int = MAX_ELEMS_MTU, jobs: dict | None = None,
                 codecs: list | None = None, results_via: str = "ingress"):
        pool_slots = int(pool_slots)
        max_elems = int(max_elems)
        if not 1 <= pool_slots <= 1 << 20:
            raise ValueError(f"aggregate: pool_slots must be 1..{1 << 20}, got {pool_slots}")
        if not 1 <= max_elems <= MAX_ELEMS_MTU:
            raise ValueError(f"aggregate: max_elems must be 1..{MAX_ELEMS_MTU}, got {max_elems}")
        self.pool_slots = pool_slots
        self.max_elems = max_elems
        self.agg_mac = np.zeros(6, np.uint8)
        self.agg_ip = np.zeros(4, np.uint8)
        self.codec_ok = np.zeros(256, np.bool_)
        self.job_map = np.full(1 << 16, -1, np.int32)
        self.job_base = np.zeros(MAX_JOBS, np.int64)
        self.job_slots = np.zeros(MAX_JOBS, np.int64)
        self.job_n = np.zeros(MAX_JOBS, np.int64)
        self.w_mac = np.zeros((MAX_JOBS, MAX_WORKERS, 6), np.uint8)
        self.w_ip = np.zeros((MAX_JOBS, MAX_WORKERS, 4), np.uint8)
        self.w_udp = np.zeros((MAX_JOBS, MAX_WORKERS), np.int64)
        self.w_port = np.zeros((MAX_JOBS, MAX_WORKERS), np.int16)
        self.bitmap = np.zeros((pool_slots, 2), np.uint32)
        self.counter = np.zeros((pool_slots, 2), np.int64)
        self.nelems = np.zeros((pool_slots, 2), np.int64)
        self.exponent = np.zeros((pool_slots, 2), np.int64)
        self.chunk = np.zeros((pool_slots, 2), np.int64)
        self.codec_of = np.zeros((pool_slots, 2), np.int64)
        # registers grow to THC_MAX_ELEMS lanes when the THC codec is enabled (configure)
        self.values = np.zeros((pool_slots, 2, max_elems), np.int32)
        self.counters_arr = np.zeros(len(COUNTER_NAMES), np.int64)
        self.jobs: dict[int, dict] = {}  # job_id -> {index, base, slots, n_workers}
        self.results_via = "ingress"
        self.configure(agg_ip=agg_ip, agg_mac=agg_mac, codecs=codecs or list(DEFAULT_CODECS),
                       jobs=jobs or {}, results_via=results_via)

    # --- control -----------------------------------------------------------------------------
    def configure(self, agg_ip: str | None = None, agg_mac: str | None = None,
                  jobs: dict | None = None, remove_jobs: list | None = None,
                  codecs: list | None = None, results_via: str | None = None,
                  **unknown) -> None:
        """Change the aggregator address, summable codecs, or add/remove jobs.

        ``jobs={job_id: {"n_workers": n, "slots": k}}`` adds (or re-sizes) jobs; a job gets a
        contiguous, exclusive partition of the pool or a ``ValueError`` saying how many slots
        are free. ``remove_jobs=[job_id, ...]`` frees partitions.
        """
        if unknown:
            raise ValueError(f"aggregate: unknown settings {sorted(unknown)}; use agg_ip, "
                             "agg_mac, jobs, remove_jobs, codecs, results_via")
        if results_via is not None:
            if results_via not in ("ingress", "forward"):
                raise ValueError(f"aggregate: results_via must be 'ingress' or 'forward', got "
                                 f"{results_via!r}")
            self.results_via = results_via
        if agg_ip is not None:
            self.agg_ip[:] = np.frombuffer(ip_to_int(agg_ip).to_bytes(4, "big"), np.uint8)
        if agg_mac is not None:
            self.agg_mac[:] = np.frombuffer(mac_to_int(agg_mac).to_bytes(6, "big"), np.uint8)
        if codecs is not None:
            self.codec_ok[:] = False
            for c in codecs:
                try:
                    self.codec_ok[int(Codec[c]) if isinstance(c, str) else int(Codec(c))] = True
                except (KeyError, ValueError):
                    raise ValueError(f"aggregate: unknown codec {c!r}; choose from "
                                     f"{[m.name for m in Codec]}") from None
            if self.codec_ok[_C_THC] and self.values.shape[2] < THC_MAX_ELEMS:
                grown = np.zeros((self.pool_slots, 2, THC_MAX_ELEMS), np.int32)
                grown[:, :, :self.values.shape[2]] = self.values
                self.values = grown
        for jid in remove_jobs or []:
            self.remove_job(int(jid))
        for jid, spec in (jobs or {}).items():
            if not isinstance(spec, dict):
                raise ValueError(f"aggregate: job {jid}: expected {{'n_workers': n, 'slots': k}}")
            self.add_job(int(jid), int(spec.get("n_workers", 0)), int(spec.get("slots", 0)))

    def _free_base(self, slots: int) -> int:
        used = sorted((j["base"], j["slots"]) for j in self.jobs.values())
        base = 0
        for b, s in used:
            if b - base >= slots:
                return base
            base = b + s
        if self.pool_slots - base >= slots:
            return base
        return -1

    def free_slots(self) -> int:
        """Slots not owned by any job."""
        return self.pool_slots - sum(j["slots"] for j in self.jobs.values())

    def add_job(self, job_id: int, n_workers: int, slots: int) -> None:
        """Give ``job_id`` an exclusive partition of ``slots`` slots for ``n_workers`` workers."""
        if not 0 <= job_id < 1 << 16:
            raise ValueError(f"aggregate: job_id must be 0..65535, got {job_id}")
        if not 1 <= n_workers <= MAX_WORKERS:
            raise ValueError(f"aggregate: job {job_id}: n_workers must be 1..{MAX_WORKERS}, "
                             f"got {n_workers}")
        if not 1 <= slots <= 1 << 16:
            raise ValueError(f"aggregate: job {job_id}: slots must be 1..65536, got {slots}")
        if job_id in self.jobs:
            self.remove_job(job_id)
        idx = next((k for k in range(MAX_JOBS)
                    if k not in {j["index"] for j in self.jobs.values()}), -1)
        if idx < 0:
            raise ValueError(f"aggregate: at most {MAX_JOBS} jobs at once; remove one first")
        base = self._free_base(slots)
        if base < 0:
            raise ValueError(f"aggregate: job {job_id} asks for {slots} slots but only "
                             f"{self.free_slots()} are free (contiguous) of {self.pool_slots}; "
                             "ask for fewer or remove a job (host-side fallback)")
        self.jobs[job_id] = {"index": idx, "base": base, "slots": slots, "n_workers": n_workers}
        self.job_base[idx] = base
        self.job_slots[idx] = slots
        self.job_n[idx] = n_workers
        self._clear(job_id)
        self.job_map[job_id] = idx

    def remove_job(self, job_id: int) -> None:
        """Forget ``job_id`` and free its slots (packets for it then drop ``UNKNOWN_JOB``)."""
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        self._clear(job_id)
        self.job_map[job_id] = -1
        del self.jobs[job_id]

    def _clear(self, job_id: int) -> None:
        j = self.jobs[job_id]
        sl = slice(j["base"], j["base"] + j["slots"])
        self.bitmap[sl] = 0
        self.counter[sl] = 0
        self.nelems[sl] = 0
        self.w_mac[j["index"]] = 0
        self.w_ip[j["index"]] = 0
        self.w_udp[j["index"]] = 0
        self.w_port[j["index"]] = 0

    def reset_job(self, job_id: int) -> None:
        """Free a wedged job: clear its slots' bitmaps/counters and learned worker addresses.

        Use after a worker of the job died mid-aggregation; the job keeps its partition and
        starts again from chunk 0. Other jobs are never affected (disjoint partitions).
        """
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        self._clear(job_id)

    # --- data path ---------------------------------------------------------------------------
    def process(self, batch: Batch, now_ns: int) -> None:
        """Aggregate the contributions in ``batch``; append RESULT packets to it."""
        batch.n = aggregate_kernel(
            batch.buf, batch.length, batch.in_port, batch.out_port, batch.reason, batch.n,
            self.agg_mac, self.agg_ip, self.job_map, self.job_base, self.job_slots, self.job_n,
            self.codec_ok, self.results_via == "ingress", self.w_mac, self.w_ip, self.w_udp,
            self.w_port, self.bitmap,
            self.counter, self.nelems, self.exponent, self.chunk, self.codec_of, self.values,
            self.counters_arr, self.max_elems)

    def counters(self) -> dict:
        """Protocol counters, plus jobs and free slots."""
        out = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr, strict=True)}
        out["jobs"] = {str(k): {"slots": v["slots"], "n_workers": v["n_workers"],
                                "base": v["base"]} for k, v in self.jobs.items()}
        out["free_slots"] = self.free_slots()
        return out


# ---------------------------------------------------------------------------------------------
# Plain-Python reference twin of aggregate_kernel (dict state, struct parsing, numpy sums).


def _inet_csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(int.from_bytes(data[k : k + 2], "big") for k in range(0, len(data), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def build_result_reference(agg_mac: bytes, agg_ip: bytes, w_mac: bytes, w_ip: bytes,
                           w_udp: int, job_id: int, worker: int, slot: int, sset: int,
                           codec: int, n_workers: int, exponent: int, chunk: int,
                           values: np.ndarray) -> bytes:
    """Reference RESULT frame (struct/numpy based; twin of the kernel's frame builder)."""
    import struct

    from testbed.kernels.wire import new_headers

    h = new_headers(1)
    h["msg_type"] = _T_RESULT
    h["job_id"], h["worker_id"], h["slot"], h["slot_set"] = job_id, worker, slot, sset
    h["codec"], h["n_workers"], h["exponent"] = codec, n_workers, exponent
    h["elem_count"], h["chunk_offset"] = len(values), chunk
    lane, flags = 4, 0
    if codec == _C_THC:
        lane = next((b for b, t in ((1, np.int8), (2, np.int16), (4, np.int32))
                     if b * len(values) <= MTU_PAYLOAD and (len(values) == 0 or (
                         values.min() >= np.iinfo(t).min and values.max() <= np.iinfo(t).max))),
                    0)
        flags = 0 if lane else _F_OVERFLOW
    h["flags"] = flags
    lanes = {1: "<i1", 2: "<i2", 4: "<i4"}
    data = h.tobytes() + (values.astype(lanes[lane]).tobytes() if lane else b"")
    tot = 28 + len(data)
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, tot, 0, 0x4000, 64, 17, 0, agg_ip,
                               w_ip))
    ip[10:12] = _inet_csum(bytes(ip)).to_bytes(2, "big")
    udp = bytearray(struct.pack("!HHHH", _PORT, w_udp, tot - 20, 0))
    c = _inet_csum(agg_ip + w_ip + struct.pack("!BBH", 0, 17, tot - 20) + bytes(udp) + data)
    udp[6:8] = (c or 0xFFFF).to_bytes(2, "big")
    return w_mac + agg_mac + b"\x08\x00" + bytes(ip) + bytes(udp) + data


class AggregateReference:
    """Per-packet model of :func:`aggregate_kernel` for tests (ARP handling not modelled).

    ``process(frame, in_port)`` returns ``(decision, reason, results)`` where decision is an
    out port / ``PORT_*`` and results is a list of ``(out_port, frame_bytes)``.
    """

    def __init__(self, agg_mac: str, agg_ip: str, jobs: dict[int, tuple[int, int, int]],
                 max_elems: int = MAX_ELEMS_MTU,
                 codecs=tuple(int(Codec[c]) for c in DEFAULT_CODECS)):
        self.mac = mac_to_int(agg_mac).to_bytes(6, "big")
        self.ip = ip_to_int(agg_ip).to_bytes(4, "big")
        self.jobs = dict(jobs)  # job_id -> (base, slots, n_workers)
        self.max_elems = max_elems
        self.codecs = set(codecs)
        self.sets: dict[tuple[int, int], dict] = {}
        self.addr: dict[tuple[int, int], tuple] = {}

    def process(self, f: bytes, in_port: int):
        """Apply one frame; see the class docstring."""
        import struct

        ln = len(f)
        if ln < 14:
            return PORT_UNSET, 0, []
        is_ip = f[12:14] == b"\x08\x00"
        if not (f[0:6] == self.mac or (is_ip and ln >= 34 and f[30:34] == self.ip)):
            return PORT_UNSET, 0, []
        checks = [
            (not is_ip, _R_NOT_IPV4), (ln < 34, _R_TOO_SHORT),
        ]
        for bad, r in checks:
            if bad:
                return PORT_DROP, r, []
        if f[14] >> 4 != 4:
            return PORT_DROP, _R_NOT_IPV4, []
        ihl = f[14] & 15
        if ihl != 5:
            return PORT_DROP, (_R_IP_OPTIONS if ihl > 5 else _R_BAD_LENGTH), []
        if f[23] != 17:
            return PORT_DROP, _R_NOT_UDP, []
        tot = int.from_bytes(f[16:18], "big")
        if tot > ln - 14 or tot < 28:
            return PORT_DROP, _R_BAD_LENGTH, []
        if int.from_bytes(f[36:38], "big") != _PORT:
            return PORT_DROP, _R_OTHER, []
        if int.from_bytes(f[38:40], "big") != tot - 20:
            return PORT_DROP, _R_BAD_LENGTH, []
        if tot < 28 + HEADER_LEN:
            return PORT_DROP, _R_TOO_SHORT, []
        (magic, ver, mt, jid, w, sl, s, _fl, cdc, _nw, exp, ne, _hb, chunk,
         _sc) = struct.unpack_from("<HBBHHHBBBBhHHIf", f, HEADER_OFFSET)
        if magic != MAGIC:
            return PORT_DROP, _R_BAD_MAGIC, []
        if ver != VERSION:
            return PORT_DROP, _R_BAD_VERSION, []
        if mt not in (_T_DATA, _T_RETX):
            return PORT_DROP, _R_UNKNOWN_TYPE, []
        if cdc not in self.codecs:
            return PORT_DROP, _R_BAD_CODEC, []
        narrow = cdc == _C_THC
        lim, lane = (THC_MAX_ELEMS, 1) if narrow else (self.max_elems, 4)
        if ne == 0 or ne > lim or ne * lane != tot - 28 - HEADER_LEN:
            return PORT_DROP, _R_BAD_LENGTH, []
        if jid not in self.jobs:
            return PORT_DROP, _R_UNKNOWN_JOB, []
        base, slots, nw = self.jobs[jid]
        if w >= nw:
            return PORT_DROP, _R_BAD_WORKER, []
        if sl >= slots or s > 1:
            return PORT_DROP, _R_BAD_SLOT, []
        self.addr[(jid, w)] = (f[6:12], f[26:30], int.from_bytes(f[34:36], "big"), in_port)
        vals = np.frombuffer(f, "<i1" if narrow else "<i4", ne, PAYLOAD_OFFSET).astype(np.int32)
        key = (base + sl, s)
        st = self.sets.setdefault(key, {"workers": set(), "left": 0})
        other = self.sets.setdefault((base + sl, 1 - s), {"workers": set(), "left": 0})

        def result(v):
            m, ip, port, p = self.addr[(jid, v)]
            return p, build_result_reference(self.mac, self.ip, m, ip, port, jid, v, sl, s,
                                             st["codec"], nw, st["exp"], st["chunk"],
                                             st["values"])

        if w in st["workers"]:
            if st["left"] == 0:
                return PORT_HELD, 0, [result(w)]
            return PORT_DROP, _R_STALE, []
        if not st["workers"]:
            st.update(values=vals.copy(), ne=ne, exp=exp, chunk=chunk, codec=cdc, left=nw - 1)
        else:
            if st["ne"] != ne:
                return PORT_DROP, _R_ELEM_MISMATCH, []
            if st["codec"] != cdc:
                return PORT_DROP, _R_BAD_CODEC, []
            with np.errstate(over="ignore"):
                st["values"] = (st["values"].astype(np.int64) + vals).astype(np.int32)
            st["exp"] = max(st["exp"], exp)
            st["left"] -= 1
        st["workers"].add(w)
        other["workers"].discard(w)
        if st["left"] == 0:
            return PORT_HELD, 0, [result(v) for v in range(nw)]
        return PORT_HELD, 0, []
