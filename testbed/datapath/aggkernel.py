"""The aggregate program's data path: its registers, job table and the ``@njit`` steps that
apply a burst of packets to them (one call per burst). The protocol and its invariants are in
``docs/protocol.md``; :mod:`testbed.datapath.aggregate` is the stage (control plane side) and
:mod:`testbed.datapath.reference.aggregate` the plain-Python twin.

State, grouped in small typed records:

* :class:`Registers` - a pool of slots, each with two register *sets*; per (slot, set) the
  round ``seq`` it holds, a worker bitmap, the number of contributions still missing, element
  count, max exponent, chunk offset, codec and the int32 values;
* :class:`Jobs` - per job its contiguous partition of the pool and its members: per worker id
  the MAC, IPv4 address, UDP port and switch ingress port the control plane registered;
* :class:`Aggregator` - the aggregator's own MAC/IP, the summable codecs, where results leave.

Steps, in the order :func:`aggregate_kernel` runs them per packet: :func:`answer_arp`,
:func:`addressed_to_aggregator`, :func:`check_contribution`, :func:`find_member`, the slot
check, :func:`apply_contribution`, then :func:`build_result` for each RESULT it emits.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET
from testbed.kernels.packets import (
    OFF_ETH_SRC,
    OFF_IP_DST,
    OFF_IP_SRC,
    OFF_UDP_SPORT,
    header,
    header_at,
    parse_frame,
    rd_u16be,
    rd_u32be,
    wr_u16be,
    write_eth_ip_udp,
)
from testbed.kernels.wire import (
    HEADER_LEN,
    HEADER_OFFSET,
    MAGIC,
    MTU_PAYLOAD,
    PAYLOAD_OFFSET,
    TESTBED_UDP_PORT,
    VERSION,
    Codec,
    DropReason,
    Flags,
    MsgType,
)

MAX_WORKERS = 32
MAX_JOBS = 64
#: Largest int32 payload that fits a 1500-byte MTU.
MAX_ELEMS_MTU = MTU_PAYLOAD // 4
#: Most int8 lanes per ``Codec.THC`` packet: 1024 x 1 B = the bytes of SwitchML's 256 int32,
#: so the same bytes need a quarter of the packets. Registers stay int32 (per slot and set).
THC_MAX_ELEMS = 1024

COUNTER_NAMES = (
    "contributions",  # absorbed into a round
    "completed",  # rounds completed (each multicast once)
    "results_sent",  # RESULT packets emitted (multicast copies + answers)
    "retransmissions_answered",  # a counted member asked again for a complete round
    "duplicates",  # a counted member's contribution again while the round is open
    "stale",  # a packet of a round already left behind
    "not_member",  # DATA from an unregistered address/port/ingress
    "bad_seq",  # a round the protocol cannot have reached
    "arp_replies",
    "result_overflow",  # results not emitted because the batch was full (workers retransmit)
    "dropped",  # every drop, whatever its reason (reasons in the engine's counters)
)
(C_CONTRIB, C_COMPLETED, C_RESULTS, C_ANSWERED, C_DUPLICATES, C_STALE, C_NOT_MEMBER, C_BAD_SEQ,
 C_ARP, C_OVERFLOW, C_DROPPED) = range(len(COUNTER_NAMES))

SEQ_MOD = 1 << 32
_F_OVERFLOW = int(Flags.OVERFLOW)  # Numba has IntEnum constants, not IntFlag ones


class Registers(NamedTuple):
    """The switch's aggregation registers: index ``[pool slot, set]`` (values add ``[, lane]``)."""

    seq: np.ndarray  # int64: the round the set holds (a 32-bit serial number)
    bitmap: np.ndarray  # uint32: members counted in that round
    missing: np.ndarray  # int64: contributions the round still needs (0 = complete)
    nelems: np.ndarray  # int64
    exponent: np.ndarray  # int64: max of the contributions' exponents
    chunk: np.ndarray  # int64: chunk offset of the round's data
    codec: np.ndarray  # int64
    values: np.ndarray  # int32[..., lanes]


class Jobs(NamedTuple):
    """Jobs the control plane registered: ``row[job_id]`` indexes the other arrays (-1: none)."""

    row: np.ndarray  # int32[65536]
    base: np.ndarray  # int64[J]: first pool slot of the job's partition
    slots: np.ndarray  # int64[J]
    n_workers: np.ndarray  # int64[J]
    mac: np.ndarray  # uint8[J, W, 6]: per member
    ip: np.ndarray  # int64[J, W] (host order)
    port: np.ndarray  # int64[J, W]: UDP port
    ingress: np.ndarray  # int64[J, W]: switch port its packets arrive on


class Aggregator(NamedTuple):
    """The aggregator's own address and policy."""

    mac: np.ndarray  # uint8[6]
    ip: int  # host order
    codec_ok: np.ndarray  # bool[256]
    via_ingress: bool  # results leave by the member's ingress port (else: forward stage)
    max_elems: int  # int32 lanes per packet at most
    thc_max: int  # int8 lanes per THC packet at most


def new_registers(pool_slots: int, lanes: int) -> Registers:
    """Zeroed registers for ``pool_slots`` slots of ``lanes`` int32 values per set."""
    z = (pool_slots, 2)
    return Registers(np.zeros(z, np.int64), np.zeros(z, np.uint32), np.zeros(z, np.int64),
                     np.zeros(z, np.int64), np.zeros(z, np.int64), np.zeros(z, np.int64),
                     np.zeros(z, np.int64), np.zeros((pool_slots, 2, lanes), np.int32))


def new_jobs() -> Jobs:
    """An empty job table."""
    j, w = MAX_JOBS, MAX_WORKERS
    return Jobs(np.full(1 << 16, -1, np.int32), np.zeros(j, np.int64), np.zeros(j, np.int64),
                np.zeros(j, np.int64), np.zeros((j, w, 6), np.uint8), np.zeros((j, w), np.int64),
                np.zeros((j, w), np.int64), np.full((j, w), -1, np.int64))


def init_rounds(regs: Registers, lo: int, hi: int, seq0: int) -> None:
    """Put pool slots ``lo..hi-1`` before round ``seq0``: the set of ``seq0`` holds round
    ``seq0 - 2`` and the other set ``seq0 - 1``, both complete with no member counted, so the
    first contribution of round ``seq0`` starts a round and nothing older can."""
    s0 = seq0 & 1
    regs.seq[lo:hi, s0] = (seq0 - 2) % SEQ_MOD
    regs.seq[lo:hi, 1 - s0] = (seq0 - 1) % SEQ_MOD
    for a in (regs.bitmap, regs.missing, regs.nelems, regs.exponent, regs.chunk, regs.codec):
        a[lo:hi] = 0


@njit(cache=True, inline="always")
def serial_diff(a, b):
    """``a - b`` for 32-bit serial numbers (RFC 1982), in -2**31 .. 2**31 - 1."""
    d = (np.int64(a) - np.int64(b)) & 0xFFFFFFFF
    return d - (np.int64(1) << 32) if d >= (np.int64(1) << 31) else d


@njit(cache=True)
def result_lane(codec, values, elems):
    """(lane bytes, flags) of a RESULT: 4 (int32) unless ``codec`` is THC, whose sums go out
    in the narrowest of int8/int16/int32 that holds every sum of the slot and fits the MTU;
    none -> (0, OVERFLOW) and an empty payload (never a silently wrapped sum)."""
    if codec != Codec.THC:
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


# ------------------------------------------------------------------------------- the steps


@njit(cache=True)
def answer_arp(f, ln, port, agg):
    """Turn an ARP request for the aggregator's IP into the reply, in place; True if it was."""
    if ln < 42 or port < 0 or rd_u16be(f, 12) != 0x0806 or rd_u16be(f, 20) != 1:
        return False
    if rd_u32be(f, 38) != agg.ip:
        return False
    for j in range(6):
        f[j] = f[22 + j]  # eth dst = sender hw
        f[32 + j] = f[22 + j]  # target hw = sender hw
        f[6 + j] = agg.mac[j]
        f[22 + j] = agg.mac[j]
    for j in range(4):
        f[38 + j] = f[28 + j]  # target ip = sender ip
    wr_u16be(f, 28, agg.ip >> 16)
    wr_u16be(f, 30, agg.ip & 0xFFFF)
    wr_u16be(f, 20, 2)
    return True


@njit(cache=True)
def addressed_to_aggregator(f, ln, agg):
    """Whether the frame's destination MAC or IPv4 address is the aggregator's."""
    to_mac = True
    for j in range(6):
        if f[j] != agg.mac[j]:
            to_mac = False
            break
    if to_mac:
        return True
    return ln >= 34 and rd_u16be(f, 12) == 0x0800 and rd_u32be(f, OFF_IP_DST) == agg.ip


@njit(cache=True)
def check_contribution(f, ln, agg):
    """DropReason.NONE when ``f`` is a well-formed DATA/RETRANSMIT the aggregator can sum."""
    st = parse_frame(f, ln)
    if st != DropReason.NONE:
        return st
    h = header(f)
    if h.msg_type != MsgType.DATA and h.msg_type != MsgType.RETRANSMIT:
        return DropReason.UNKNOWN_TYPE
    if not agg.codec_ok[h.codec]:
        return DropReason.BAD_CODEC
    ne = np.int64(h.elem_count)
    narrow = h.codec == Codec.THC
    lim = agg.thc_max if narrow else agg.max_elems
    lane = 1 if narrow else 4
    if ne == 0 or ne > lim or ne * lane != rd_u16be(f, 38) - 8 - HEADER_LEN:
        return DropReason.BAD_LENGTH
    return DropReason.NONE


@njit(cache=True)
def find_member(f, in_port, jobs):
    """``(job row, reason)``: the job row of a registered member sending ``f``, or -1 and why
    not (unknown job, worker id out of range, or not the registered address/port/ingress)."""
    h = header(f)
    jx = jobs.row[h.job_id]
    if jx < 0:
        return -1, DropReason.UNKNOWN_JOB
    w = np.int64(h.worker_id)
    if w >= jobs.n_workers[jx]:
        return -1, DropReason.BAD_WORKER
    if (in_port != jobs.ingress[jx, w] or rd_u32be(f, OFF_IP_SRC) != jobs.ip[jx, w]
            or rd_u16be(f, OFF_UDP_SPORT) != jobs.port[jx, w]):
        return -1, DropReason.NOT_MEMBER
    for j in range(6):
        if f[OFF_ETH_SRC + j] != jobs.mac[jx, w, j]:
            return -1, DropReason.NOT_MEMBER
    return jx, DropReason.NONE


# outcomes of apply_contribution (besides drop reasons, which are > 0)
ADDED = -1  # counted; the round still misses contributions
COMPLETED = -2  # counted, and it was the last one: multicast the result
ANSWER = -3  # a counted member asked again for a complete round: unicast the result


@njit(cache=True)
def apply_contribution(f, g, bit, nw, regs):
    """Apply the contribution in ``f`` to pool slot ``g``; return ADDED, COMPLETED, ANSWER or
    a DropReason (see the module docstring for the rules)."""
    h = header(f)
    r = np.int64(h.seq)
    s = r & 1
    d = serial_diff(r, regs.seq[g, s])
    if d == 0:
        if regs.bitmap[g, s] & bit:
            return ANSWER if regs.missing[g, s] == 0 else DropReason.DUPLICATE
        if regs.missing[g, s] == 0:
            return DropReason.STALE  # a finished round this member never took part in
    elif d == 2:
        if (regs.missing[g, s] != 0 or regs.missing[g, 1 - s] != 0
                or serial_diff(r - 1, regs.seq[g, 1 - s]) != 0):
            return DropReason.BAD_SEQ
    elif d < 0:
        return DropReason.STALE
    else:
        return DropReason.BAD_SEQ
    ne = np.int64(h.elem_count)
    narrow = h.codec == Codec.THC
    vals = regs.values[g, s]
    o = PAYLOAD_OFFSET
    if d == 2:  # first contribution of a new round: overwrite
        regs.seq[g, s] = r
        regs.nelems[g, s] = ne
        regs.exponent[g, s] = h.exponent
        regs.chunk[g, s] = h.chunk_offset
        regs.codec[g, s] = h.codec
        regs.missing[g, s] = nw - 1
        regs.bitmap[g, s] = bit
        if narrow:
            for k in range(ne):
                vals[k] = np.int32(np.int8(f[o + k]))
        else:
            vals[:ne] = f[o:o + 4 * ne].view(np.int32)
    else:
        if regs.nelems[g, s] != ne or regs.chunk[g, s] != h.chunk_offset:
            return DropReason.ELEM_MISMATCH
        if regs.codec[g, s] != h.codec:  # lanes of another meaning: never add them
            return DropReason.BAD_CODEC
        if narrow:
            for k in range(ne):
                vals[k] += np.int32(np.int8(f[o + k]))
        else:
            vals[:ne] += f[o:o + 4 * ne].view(np.int32)
        if h.exponent > regs.exponent[g, s]:
            regs.exponent[g, s] = h.exponent
        regs.missing[g, s] -= 1
        regs.bitmap[g, s] |= bit
    return COMPLETED if regs.missing[g, s] == 0 else ADDED


@njit(cache=True)
def build_result(row, g, s, jx, w, job_id, slot, regs, jobs, agg):
    """Write the RESULT of pool slot ``g``, set ``s`` for member ``w`` of job row ``jx`` into
    ``row``; return its length."""
    ne = regs.nelems[g, s]
    vals = regs.values[g, s]
    lane, flags = result_lane(regs.codec[g, s], vals, ne)
    n = write_eth_ip_udp(row, agg.mac, jobs.mac[jx, w], agg.ip, jobs.ip[jx, w],
                         TESTBED_UDP_PORT, jobs.port[jx, w], ne * lane)
    h = header_at(row, HEADER_OFFSET)
    h.magic = MAGIC
    h.version = VERSION
    h.msg_type = MsgType.RESULT
    h.job_id = job_id
    h.worker_id = w
    h.slot = slot
    h.slot_set = s
    h.flags = flags
    h.codec = regs.codec[g, s]
    h.n_workers = jobs.n_workers[jx]
    h.exponent = regs.exponent[g, s]
    h.elem_count = ne
    h.head_bytes = 0
    h.chunk_offset = regs.chunk[g, s]
    h.scale = 0.0
    h.seq = regs.seq[g, s]
    o = PAYLOAD_OFFSET
    if lane == 4:
        row[o:o + 4 * ne].view(np.int32)[:] = vals[:ne]
    elif lane == 2:
        out16 = row[o:o + 2 * ne].view(np.int16)
        for k in range(ne):
            out16[k] = np.int16(vals[k])
    elif lane == 1:
        for k in range(ne):
            row[o + k] = np.uint8(vals[k] & 0xFF)
    return n


@njit(cache=True)
def _emit(buf, length, in_port, out_port, reason, n_out, g, s, jx, w, job_id, slot, regs, jobs,
          agg, counters):
    """Append the RESULT for member ``w`` at row ``n_out``; return the new batch size."""
    if n_out >= buf.shape[0]:
        counters[C_OVERFLOW] += 1
        return n_out
    length[n_out] = build_result(buf[n_out], g, s, jx, w, job_id, slot, regs, jobs, agg)
    out_port[n_out] = jobs.ingress[jx, w] if agg.via_ingress else PORT_UNSET
    in_port[n_out] = -1
    reason[n_out] = 0
    counters[C_RESULTS] += 1
    return n_out + 1


_R_DUPLICATE = int(DropReason.DUPLICATE)
_R_STALE = int(DropReason.STALE)
_R_NOT_MEMBER = int(DropReason.NOT_MEMBER)
_R_BAD_SEQ = int(DropReason.BAD_SEQ)


@njit(cache=True)
def _drop(out_port, reason, counters, i, r):
    out_port[i] = PORT_DROP
    reason[i] = r
    counters[C_DROPPED] += 1
    if r == _R_DUPLICATE:
        counters[C_DUPLICATES] += 1
    elif r == _R_STALE:
        counters[C_STALE] += 1
    elif r == _R_NOT_MEMBER:
        counters[C_NOT_MEMBER] += 1
    elif r == _R_BAD_SEQ:
        counters[C_BAD_SEQ] += 1


@njit(cache=True)
def aggregate_kernel(buf, length, in_port, out_port, reason, n, regs, jobs, agg, counters):
    """Run the aggregation protocol over ``batch[0:n]``; return the new batch size (RESULT
    packets are appended after row ``n``, up to ``buf.shape[0]``)."""
    n_out = n
    for i in range(n):
        if out_port[i] != PORT_UNSET:
            continue
        f = buf[i]
        ln = length[i]
        if ln < 14:
            continue
        if answer_arp(f, ln, in_port[i], agg):
            out_port[i] = in_port[i]
            counters[C_ARP] += 1
            continue
        if not addressed_to_aggregator(f, ln, agg):
            continue
        r = check_contribution(f, ln, agg)
        if r != DropReason.NONE:
            _drop(out_port, reason, counters, i, r)
            continue
        jx, r = find_member(f, in_port[i], jobs)
        if r != DropReason.NONE:
            _drop(out_port, reason, counters, i, r)
            continue
        h = header(f)
        if h.slot >= jobs.slots[jx] or h.slot_set != (h.seq & 1):
            _drop(out_port, reason, counters, i, DropReason.BAD_SLOT)
            continue
        w = np.int64(h.worker_id)
        g = jobs.base[jx] + h.slot
        s = np.int64(h.seq & 1)
        nw = jobs.n_workers[jx]
        outcome = apply_contribution(f, g, np.uint32(1) << np.uint32(w), nw, regs)
        if outcome > 0:
            _drop(out_port, reason, counters, i, outcome)
            continue
        out_port[i] = PORT_HELD
        if outcome == ANSWER:
            counters[C_ANSWERED] += 1
            n_out = _emit(buf, length, in_port, out_port, reason, n_out, g, s, jx, w, h.job_id,
                          h.slot, regs, jobs, agg, counters)
            continue
        counters[C_CONTRIB] += 1
        if outcome == COMPLETED:
            counters[C_COMPLETED] += 1
            for v in range(nw):
                n_out = _emit(buf, length, in_port, out_port, reason, n_out, g, s, jx, v,
                              h.job_id, h.slot, regs, jobs, agg, counters)
    return n_out
