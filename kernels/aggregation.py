"""In-network aggregation as a kernel: registers, a job table and the ``@njit`` steps that
apply a burst of frames to them (one call per burst), and :class:`Aggregation`, the state one
aggregator keeps. The data-path stage ``aggregate`` (:mod:`testbed.datapath.aggregate`) runs
it on a programmable switch; a job's host fallback aggregator
(:mod:`testbed.collectives.fallback`) runs it on a host. The protocol and its invariants are in
``docs/protocol.md``; :mod:`testbed.datapath.reference.aggregate` is the plain-Python twin.

State, grouped in small typed records:

* :class:`Registers` - per slot (a job's slot ``k`` is global slot ``base + k``) and register
  *set*: the round ``seq`` it holds, its state (``OPEN``, ``UP``: complete here and sent to the
  parent switch, ``DONE``, ``HOST``: aggregated by the job's host fallback), the members counted,
  the contributions still missing, element count, max exponent, chunk offset and codec; a
  set's values live in the switch's aggregator **memory** (flat int32 words) at ``val_off``:
  ``lanes`` words, in a static partition of the job or, for a job in shared mode, in a pool
  entry the round claimed when it started (``pool_owner``) and gives back once every member has
  its result: the pool is time-shared between jobs round by round, ATP style;
* :class:`Jobs` - per job: its slots, lanes and mode (static, shared, or the host fallback of a
  shared job); its members (workers or child switches of
  an aggregation tree: MAC, IPv4, UDP port and the ingress port the control plane registered);
  its parent switch in the tree (none at the root) and its host fallback aggregator;
* :class:`Aggregator` - this switch's aggregator identity (MAC/IP), summable codecs, where
  results leave, the shared pool's place in memory.

Per packet, :func:`aggregate_kernel` runs: :func:`answer_arp`, :func:`addressed_to_aggregator`,
then a contribution (:func:`check_contribution`, :func:`find_member`, the slot check,
:func:`apply_contribution`) or a parent's RESULT (:func:`apply_parent_result`), then emits what
the outcome asks for: RESULTs to members (:func:`build_result`), the partial sum to the parent
(:func:`build_upward`), or the contribution forwarded to the host fallback (:func:`to_fallback`).

Cost per packet: the records hold some 40 arrays, and Numba counts a reference for every array
of a record wherever one is passed or bound (an atomic increment and decrement per array, or at
least a call each), which made the named steps several times slower per packet than one function
on loose arrays. So the steps that take records are ``inline="always"``, and
:func:`aggregate_packed`, the per-burst entry point, is compiled without Numba's reference-counting
runtime (``_nrt=False``, inherited by everything it calls): nothing on this path allocates or
returns an array (an allocation would fail to compile there, loudly), so there is nothing to
count. ``bench ina-cost`` measures it.

Why one module this long: the burst step and every helper it calls are ``@njit`` functions
compiled together, and Numba's on-disk cache keys a function on its own file only, so a helper
moved to another file could leave a stale compiled caller behind; the sections below (state,
checks, rounds, emissions, the Python class) keep it navigable.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from testbed.kernels.packed import array_table, arrays_at
from testbed.kernels.packets import (
    OFF_ETH_DST,
    OFF_ETH_SRC,
    OFF_IP_DST,
    OFF_IP_SRC,
    OFF_UDP_CSUM,
    OFF_UDP_DPORT,
    OFF_UDP_SPORT,
    PORT_DROP,
    PORT_HELD,
    PORT_UNSET,
    header,
    header_at,
    parse_frame,
    rd_u16be,
    rd_u32be,
    set_ipv4_checksum,
    wr_u16be,
    wr_u32be,
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
#: so the same bytes need a quarter of the packets. Registers stay int32.
THC_MAX_ELEMS = 1024
SEQ_MOD = 1 << 32
_F_OVERFLOW = int(Flags.OVERFLOW)  # Numba has IntEnum constants, not IntFlag ones

#: States of a (slot, set) round.
OPEN, UP, DONE, HOST = 0, 1, 2, 3
#: Job modes: a static partition, the shared pool, or (on a host) the fallback of a shared job,
#: whose rounds are the ones its switch forwarded (the others were summed in the switch).
STATIC, SHARED, FALLBACK_HOST = 0, 1, 2
#: Pool entries a round may claim: ``POOL_PROBES`` hashes of (job, slot, round), as many
#: register arrays in successive pipeline stages; the first free one is taken.
POOL_PROBES = 4

COUNTER_NAMES = (
    "contributions",  # absorbed into a round in this switch's memory
    "completed",  # rounds completed here (root) or by the parent's RESULT (tree node)
    "results_sent",  # RESULT packets emitted (multicast copies + answers)
    "retransmissions_answered",  # a counted member asked again for a complete round
    "duplicates",  # a counted member's contribution again while the round is open
    "stale",  # a packet of a round already left behind
    "not_member",  # DATA from an unregistered address/port/ingress
    "bad_seq",  # a round the protocol cannot have reached
    "arp_replies",
    "result_overflow",  # emissions lost because the batch was full (workers retransmit)
    "dropped",  # every drop, whatever its reason (reasons in the engine's counters)
    "upward_sent",  # partial sums sent to the parent switch (first sends)
    "upward_resent",  # partial sums sent again (a child retransmitted meanwhile)
    "parent_results",  # RESULTs of the parent switch taken and multicast down
    "fallback_forwarded",  # contributions forwarded to the job's host aggregator
    "pool_claims",  # shared-pool entries a round claimed
    "pool_releases",  # shared-pool entries given back (every member had the round's result)
    "pool_collisions",  # rounds sent to the host fallback: every entry they hash to was held
    "upward_coalesced",  # members' requests to resend a partial sum that one resend covered
    "fallback_relayed",  # a host round's packets relayed between its host fallback and the tree
)
(C_CONTRIB, C_COMPLETED, C_RESULTS, C_ANSWERED, C_DUPLICATES, C_STALE, C_NOT_MEMBER, C_BAD_SEQ,
 C_ARP, C_OVERFLOW, C_DROPPED, C_UP_SENT, C_UP_RESENT, C_PARENT_RESULTS, C_FALLBACK,
 C_POOL_CLAIMS, C_POOL_RELEASES, C_POOL_COLLISIONS, C_UP_COALESCED,
 C_RELAYED) = range(len(COUNTER_NAMES))


class Registers(NamedTuple):
    """The switch's aggregation registers: ``[slot, set]`` metadata and the value memory."""

    seq: np.ndarray  # int64: the round the set holds (a 32-bit serial number)
    state: np.ndarray  # int64: OPEN, UP, DONE or HOST
    bitmap: np.ndarray  # uint32: members counted in that round
    asked: np.ndarray  # uint32: UP rounds: members that asked again since the last send up
    missing: np.ndarray  # int64: contributions the round still needs
    nelems: np.ndarray  # int64
    exponent: np.ndarray  # int64: max of the contributions' exponents
    chunk: np.ndarray  # int64: chunk offset of the round's data
    codec: np.ndarray  # int64
    overflow: np.ndarray  # bool: some partial sum fitted no lane (THC): the round says so
    val_off: np.ndarray  # int64[slot, set]: word offset of the set's values, -1: none
    values: np.ndarray  # int32[memory words]
    pool_owner: np.ndarray  # int64[pool entries]: 2 x slot + set of the round holding it, -1: free


class Jobs(NamedTuple):
    """Jobs the control plane registered: ``row[job_id]`` indexes the other arrays (-1: none)."""

    row: np.ndarray  # int32[65536]
    base: np.ndarray  # int64[J]: first global slot of the job's metadata partition
    slots: np.ndarray  # int64[J]
    n_workers: np.ndarray  # int64[J]: members (workers or child switches)
    lanes: np.ndarray  # int64[J]: int32 registers per set and slot (elements per packet)
    mode: np.ndarray  # int64[J]: STATIC, SHARED or FALLBACK_HOST
    mac: np.ndarray  # uint8[J, W, 6]: per member
    ip: np.ndarray  # int64[J, W] (host order)
    port: np.ndarray  # int64[J, W]: UDP port
    ingress: np.ndarray  # int64[J, W]: switch port its packets arrive on
    up_mac: np.ndarray  # uint8[J, 6]: the parent switch (tree)
    up_ip: np.ndarray  # int64[J]
    up_egress: np.ndarray  # int64[J]: port towards the parent, -1 at the root
    up_ingress: np.ndarray  # int64[J]: port the parent's RESULTs arrive on
    up_index: np.ndarray  # int64[J]: this switch's member id at its parent
    fb_n: np.ndarray  # int64[J]: host fallback aggregators (shared mode); slot s uses s % fb_n
    fb_mac: np.ndarray  # uint8[J, W, 6]
    fb_ip: np.ndarray  # int64[J, W]
    fb_port: np.ndarray  # int64[J, W]
    fb_egress: np.ndarray  # int64[J, W]: port towards it
    fb_ingress: np.ndarray  # int64[J, W]: port its packets arrive on


class AdmissionError(ValueError):
    """A job does not fit an aggregator (jobs, slots or memory): a refusal, not a bad setting;
    the control plane may run the job another way (``placement.refused``)."""


class Aggregator(NamedTuple):
    """This switch's aggregator identity and policy."""

    mac: np.ndarray  # uint8[6]
    ip: int  # host order
    codec_ok: np.ndarray  # bool[256]
    via_ingress: bool  # results leave by the member's ingress port (else: forward stage)
    max_elems: int  # int32 lanes per packet at most
    thc_max: int  # int8 lanes per THC packet at most
    pool_base: int  # word offset of the shared pool
    pool_lanes: int  # lanes of a pool entry (one register set)


def new_registers(max_slots: int, words: int, pool_entries: int) -> Registers:
    """Zeroed registers: ``max_slots`` slots of metadata, ``words`` int32 words of memory."""
    z = (max_slots, 2)
    return Registers(np.zeros(z, np.int64), np.full(z, DONE, np.int64), np.zeros(z, np.uint32),
                     np.zeros(z, np.uint32),
                     np.zeros(z, np.int64), np.zeros(z, np.int64), np.zeros(z, np.int64),
                     np.zeros(z, np.int64), np.zeros(z, np.int64), np.zeros(z, np.bool_),
                     np.full(z, -1, np.int64), np.zeros(max(words, 1), np.int32),
                     np.full(max(pool_entries, 1), -1, np.int64))


def new_jobs() -> Jobs:
    """An empty job table."""
    j, w = MAX_JOBS, MAX_WORKERS
    z = np.zeros(j, np.int64)
    return Jobs(np.full(1 << 16, -1, np.int32), z.copy(), z.copy(), z.copy(), z.copy(), z.copy(),
                np.zeros((j, w, 6), np.uint8), np.zeros((j, w), np.int64),
                np.zeros((j, w), np.int64), np.full((j, w), -1, np.int64),
                np.zeros((j, 6), np.uint8), z.copy(), np.full(j, -1, np.int64),
                np.full(j, -1, np.int64), z.copy(),
                z.copy(), np.zeros((j, w, 6), np.uint8), np.zeros((j, w), np.int64),
                np.zeros((j, w), np.int64), np.full((j, w), -1, np.int64),
                np.full((j, w), -1, np.int64))


def init_rounds(regs: Registers, lo: int, hi: int, seq0: int) -> None:
    """Put slots ``lo..hi-1`` before round ``seq0``: the set of ``seq0`` holds round
    ``seq0 - 2`` and the other set ``seq0 - 1``, both DONE with no member counted, so the first
    contribution of round ``seq0`` starts a round and nothing older can."""
    s0 = seq0 & 1
    regs.seq[lo:hi, s0] = (seq0 - 2) % SEQ_MOD
    regs.seq[lo:hi, 1 - s0] = (seq0 - 1) % SEQ_MOD
    regs.state[lo:hi] = DONE
    for a in (regs.bitmap, regs.asked, regs.missing, regs.nelems, regs.exponent, regs.chunk,
              regs.codec, regs.overflow):
        a[lo:hi] = 0


@njit(cache=True, inline="always")
def serial_diff(a, b):
    """``a - b`` for 32-bit serial numbers (RFC 1982), in -2**31 .. 2**31 - 1."""
    d = (np.int64(a) - np.int64(b)) & 0xFFFFFFFF
    return d - (np.int64(1) << 32) if d >= (np.int64(1) << 31) else d


@njit(cache=True)
def result_lane(codec, values, elems):
    """(lane bytes, flags) of a RESULT or an upward partial sum: 4 (int32) unless ``codec`` is
    THC, whose sums go out in the narrowest of int8/int16/int32 that holds every sum of the
    slot and fits the MTU; none -> (0, OVERFLOW) and an empty payload (never a silently
    wrapped sum)."""
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


@njit(cache=True, inline="always")
def set_values(regs, g, s, lanes):
    """The int32 registers of slot ``g``, set ``s`` (a view into the value memory)."""
    o = regs.val_off[g, s]
    return regs.values[o:o + lanes]


@njit(cache=True)
def read_lanes(f, o, ne, lane, out, add):
    """``out[:ne]`` = (or ``+=`` with ``add``) ``ne`` signed little-endian lanes of ``lane``
    bytes at ``f[o:]`` (int32 registers wrap like a switch ALU). Element loops: ``out[:ne] +=``
    would allocate a temporary array per packet."""
    if lane == 4:
        src = f[o:o + 4 * ne].view(np.int32)
        if add:
            for k in range(ne):
                out[k] += src[k]
        else:
            for k in range(ne):
                out[k] = src[k]
    elif lane == 2:
        src16 = f[o:o + 2 * ne].view(np.int16)
        for k in range(ne):
            out[k] = (out[k] if add else 0) + np.int32(src16[k])
    else:
        for k in range(ne):
            out[k] = (out[k] if add else 0) + np.int32(np.int8(f[o + k]))


# ------------------------------------------------------------------------------- the steps


@njit(cache=True, inline="always")
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
    wr_u32be(f, 28, agg.ip)
    wr_u16be(f, 20, 2)
    return True


@njit(cache=True, inline="always")
def addressed_to_aggregator(f, ln, agg):
    """Whether the frame's destination MAC or IPv4 address is this aggregator's."""
    to_mac = True
    for j in range(6):
        if f[j] != agg.mac[j]:
            to_mac = False
            break
    if to_mac:
        return True
    return ln >= 34 and rd_u16be(f, 12) == 0x0800 and rd_u32be(f, OFF_IP_DST) == agg.ip


@njit(cache=True, inline="always")
def payload_lane(f, ne):
    """Bytes per element of a testbed frame's payload (0 when it does not divide)."""
    pl = rd_u16be(f, 38) - 8 - HEADER_LEN
    return pl // ne if ne > 0 and pl % ne == 0 else 0


@njit(cache=True, inline="always")
def check_contribution(f, ln, agg):
    """DropReason.NONE when ``f`` is a well-formed DATA/RETRANSMIT the aggregator can sum.
    THC contributions carry int8 lanes from workers and int16/int32 lanes from child switches
    (their partial sums); INT32 carries int32."""
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
    lane = payload_lane(f, ne)
    if narrow and h.flags & _F_OVERFLOW and rd_u16be(f, 38) == 8 + HEADER_LEN:
        return DropReason.NONE if 0 < ne <= lim else DropReason.BAD_LENGTH  # a child's overflow
    if ne == 0 or ne > lim or (lane != 4 and not (narrow and (lane == 1 or lane == 2))):
        return DropReason.BAD_LENGTH
    return DropReason.NONE


@njit(cache=True, inline="always")
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


@njit(cache=True)
def pool_index(job_id, slot, seq, probe, entries):
    """The shared-pool entry that probe ``probe`` of round ``seq`` of a job slot hashes to
    (ATP: a hash of (job, index); the round is part of the key, so a collision lasts one round,
    not the job's lifetime)."""
    h = (np.uint64(job_id) << np.uint64(48)) ^ (np.uint64(slot) << np.uint64(32)) ^ \
        np.uint64(seq & 0xFFFFFFFF)
    h = h ^ (np.uint64(probe) * np.uint64(0x9E3779B97F4A7C15))
    h = (h ^ (h >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
    h = (h ^ (h >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
    h = h ^ (h >> np.uint64(33))
    return np.int64(h % np.uint64(entries))


@njit(cache=True, inline="always")
def claim(regs, g, s, job_id, slot, seq, agg):
    """Claim a free pool entry for round ``seq`` of a shared-mode job slot (global slot ``g``,
    set ``s``): the first free one of its ``POOL_PROBES`` hashes; False when all are held (the
    round goes to the host fallback)."""
    entries = regs.pool_owner.size
    for k in range(POOL_PROBES):
        e = pool_index(job_id, slot, seq, k, entries)
        if regs.pool_owner[e] < 0:
            regs.pool_owner[e] = 2 * g + s
            regs.val_off[g, s] = agg.pool_base + e * agg.pool_lanes
            return True
    return False


@njit(cache=True, inline="always")
def release(regs, g, s, agg):
    """Give set ``s`` of slot ``g``'s pool entry back (a shared-mode round every member has the
    result of); True if it held one."""
    o = regs.val_off[g, s]
    if o < 0:
        return False
    e = (o - agg.pool_base) // agg.pool_lanes
    if regs.pool_owner[e] == 2 * g + s:
        regs.pool_owner[e] = -1
    regs.val_off[g, s] = -1
    return True


@njit(cache=True, inline="always")
def release_previous(regs, g, s, agg):
    """Every member has the result of the round before set ``s``'s: give its entry back if the
    other set still holds that round; True if an entry was given back."""
    if serial_diff(regs.seq[g, 1 - s], regs.seq[g, s] - 1) != 0:
        return False
    return release(regs, g, 1 - s, agg)


@njit(cache=True)
def all_members(n):
    """The bitmap of members ``0..n-1``."""
    return np.uint32((np.uint64(1) << np.uint64(n)) - np.uint64(1))


# outcomes of apply_contribution (drop reasons are > 0)
ADDED = -1  # counted; the round still misses contributions
COMPLETED = -2  # counted, and it was the last one: multicast (root) or send upward
ANSWER = -3  # a counted member asked again for a complete round: unicast the result
RESEND_UP = -4  # a counted member asked again while the parent has not answered: resend up
FALLBACK = -5  # the round is the host fallback's: forward the contribution there
COALESCED = -6  # a counted member asked again, and the last resend up already answers it


@njit(cache=True, inline="always")
def ask_up(regs, g, s, bit):
    """Member ``bit`` asks again for the round in set ``s`` of slot ``g``, which is ``UP``:
    RESEND_UP or COALESCED (T2). The partial sum goes up again on the first request after a
    send up, and on a second request of a member that already asked since then; the other
    members' requests are covered by that resend. Members time out together when the parent
    is slow (one timer each, the same round trip), so without this a child of k members sends
    its partial sum up to k times for one late answer, and every level above multiplies it.
    Between two requests of any member at least one resend goes up, so a lost partial sum or
    parent RESULT is still recovered by the members' own retransmissions (W3)."""
    asked = regs.asked[g, s]
    if asked == 0 or asked & bit:
        regs.asked[g, s] = bit
        return RESEND_UP
    regs.asked[g, s] = asked | bit
    return COALESCED


@njit(cache=True, inline="always")
def seen(regs, g, s, bit, jx, jobs, agg, counters):
    """Member ``bit``'s contribution to the round in set ``s`` of shared-mode slot ``g`` passed
    this switch (counted here or forwarded to the host): it had the previous round's result
    (W1). Once every member has been seen, that result is needed no more: the other set's pool
    entry is given back."""
    full = all_members(jobs.n_workers[jx])
    if regs.bitmap[g, s] == full:
        return  # a duplicate: the previous round is released already (or moved on)
    regs.bitmap[g, s] |= bit
    if regs.bitmap[g, s] == full and release_previous(regs, g, s, agg):
        counters[C_POOL_RELEASES] += 1


@njit(cache=True, inline="always")
def apply_contribution(f, jx, g, bit, regs, jobs, agg, counters):
    """Apply the contribution in ``f`` (member bit ``bit`` of job row ``jx``) to global slot
    ``g``; return an outcome above or a DropReason (see docs/protocol.md)."""
    h = header(f)
    r = np.int64(h.seq)
    s = r & 1
    st = regs.state[g, s]
    d = serial_diff(r, regs.seq[g, s])
    mode = jobs.mode[jx]
    if d == 0:
        if st == HOST:
            seen(regs, g, s, bit, jx, jobs, agg, counters)
            return FALLBACK
        if regs.bitmap[g, s] & bit:
            if st == DONE:  # answered while its values are kept (every member may need them)
                return ANSWER if regs.val_off[g, s] >= 0 else DropReason.STALE
            return ask_up(regs, g, s, bit) if st == UP else DropReason.DUPLICATE
        if st != OPEN:
            return DropReason.STALE  # a finished round this member never took part in
    elif d == 2 and mode != FALLBACK_HOST:
        other = regs.state[g, 1 - s]
        if ((st != DONE and st != HOST) or (other != DONE and other != HOST)
                or serial_diff(r - 1, regs.seq[g, 1 - s]) != 0):
            return DropReason.BAD_SEQ
    elif d > 0 and mode == FALLBACK_HOST:
        # a host fallback sees only the rounds its switch sent it (the switch checked S3 and
        # summed the rounds between): a later round starts once this set's round completed
        if st != DONE:
            return DropReason.BAD_SEQ
    elif d < 0:
        return DropReason.STALE
    else:
        return DropReason.BAD_SEQ
    ne = np.int64(h.elem_count)
    lanes = jobs.lanes[jx]
    if ne > lanes:
        return DropReason.BAD_LENGTH
    ovf = (h.flags & _F_OVERFLOW) != 0 and rd_u16be(f, 38) == 8 + HEADER_LEN  # a child's
    lane = 0 if ovf else payload_lane(f, ne)
    if d != 0:  # the first contribution of a new round
        regs.seq[g, s] = r
        if mode == SHARED:
            # round r - 2's entry went back when r - 1 saw every member; should it not have,
            # r - 1 completed somewhere, so every member had r - 2's result (W1)
            if release(regs, g, s, agg):
                counters[C_POOL_RELEASES] += 1
            if not claim(regs, g, s, h.job_id, g - jobs.base[jx], r, agg):
                regs.state[g, s] = HOST
                regs.bitmap[g, s] = 0
                counters[C_POOL_COLLISIONS] += 1
                seen(regs, g, s, bit, jx, jobs, agg, counters)
                return FALLBACK
            counters[C_POOL_CLAIMS] += 1
        regs.state[g, s] = OPEN
        regs.nelems[g, s] = ne
        regs.exponent[g, s] = h.exponent
        regs.chunk[g, s] = h.chunk_offset
        regs.codec[g, s] = h.codec
        regs.missing[g, s] = jobs.n_workers[jx] - 1
        regs.bitmap[g, s] = bit
        regs.overflow[g, s] = ovf
        vals = set_values(regs, g, s, lanes)
        if ovf:
            vals[:ne] = 0
        else:
            read_lanes(f, PAYLOAD_OFFSET, ne, lane, vals, False)
    else:
        if regs.nelems[g, s] != ne or regs.chunk[g, s] != h.chunk_offset:
            return DropReason.ELEM_MISMATCH
        if regs.codec[g, s] != h.codec:  # lanes of another meaning: never add them
            return DropReason.BAD_CODEC
        if ovf:
            regs.overflow[g, s] = True
        else:
            read_lanes(f, PAYLOAD_OFFSET, ne, lane, set_values(regs, g, s, lanes), True)
        if h.exponent > regs.exponent[g, s]:
            regs.exponent[g, s] = h.exponent
        regs.missing[g, s] -= 1
        regs.bitmap[g, s] |= bit
    if regs.missing[g, s] != 0:
        return ADDED
    regs.state[g, s] = UP if jobs.up_egress[jx] >= 0 else DONE
    regs.asked[g, s] = 0
    if mode == SHARED and release_previous(regs, g, s, agg):  # every member had r - 1's result
        counters[C_POOL_RELEASES] += 1
    return COMPLETED


@njit(cache=True, inline="always")
def from_parent(f, in_port, jx, jobs):
    """Whether ``f`` comes from job row ``jx``'s registered parent switch, by its port."""
    if jobs.up_egress[jx] < 0 or in_port != jobs.up_ingress[jx]:
        return False
    if rd_u32be(f, OFF_IP_SRC) != jobs.up_ip[jx] or rd_u16be(f, OFF_UDP_SPORT) != \
            TESTBED_UDP_PORT:
        return False
    for j in range(6):
        if f[OFF_ETH_SRC + j] != jobs.up_mac[jx, j]:
            return False
    return True


# outcomes of apply_parent_result
TAKEN = -1  # the round is DONE with the parent's sum: multicast it down


@njit(cache=True, inline="always")
def apply_parent_result(f, jx, g, regs, jobs):
    """Take the parent's RESULT for slot ``g`` into the registers; TAKEN or a DropReason."""
    h = header(f)
    r = np.int64(h.seq)
    s = r & 1
    d = serial_diff(r, regs.seq[g, s])
    if d < 0 or (d == 0 and regs.state[g, s] == DONE):
        return DropReason.STALE if d < 0 else DropReason.DUPLICATE
    if d != 0 or regs.state[g, s] != UP:
        return DropReason.BAD_SEQ
    ne = np.int64(h.elem_count)
    if ne != regs.nelems[g, s] or np.int64(h.chunk_offset) != regs.chunk[g, s] or \
            h.codec != regs.codec[g, s]:
        return DropReason.ELEM_MISMATCH
    ovf = (h.flags & _F_OVERFLOW) != 0
    lane = payload_lane(f, ne)
    if not ovf and lane != 4 and not (h.codec == Codec.THC and (lane == 1 or lane == 2)):
        return DropReason.BAD_LENGTH
    regs.overflow[g, s] = ovf  # the sums fitted no lane up the tree: say so downward
    if not ovf:
        read_lanes(f, PAYLOAD_OFFSET, ne, lane, set_values(regs, g, s, jobs.lanes[jx]), False)
    regs.exponent[g, s] = h.exponent
    regs.state[g, s] = DONE
    return TAKEN


# ------------------------------------------------------------------------------- emissions


@njit(cache=True, inline="always")
def write_sum(row, g, s, jx, msg_type, dst_mac, dst_ip, dst_port, worker, job_id, slot, regs,
              jobs, agg):
    """Write slot ``g``, set ``s``'s sum as a testbed packet from this aggregator into ``row``
    (a RESULT to a member, or a DATA/RETRANSMIT to the parent); return its length."""
    ne = regs.nelems[g, s]
    vals = set_values(regs, g, s, jobs.lanes[jx])
    if regs.overflow[g, s]:
        lane, flags = 0, _F_OVERFLOW
    else:
        lane, flags = result_lane(regs.codec[g, s], vals, ne)
    n = write_eth_ip_udp(row, agg.mac, dst_mac, agg.ip, dst_ip, TESTBED_UDP_PORT, dst_port,
                         ne * lane)
    h = header_at(row, HEADER_OFFSET)
    h.magic = MAGIC
    h.version = VERSION
    h.msg_type = msg_type
    h.job_id = job_id
    h.worker_id = worker
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
        out32 = row[o:o + 4 * ne].view(np.int32)
        for k in range(ne):
            out32[k] = vals[k]
    elif lane == 2:
        out16 = row[o:o + 2 * ne].view(np.int16)
        for k in range(ne):
            out16[k] = np.int16(vals[k])
    elif lane == 1:
        for k in range(ne):
            row[o + k] = np.uint8(vals[k] & 0xFF)
    return n


@njit(cache=True, inline="always")
def build_result(row, g, s, jx, w, job_id, slot, regs, jobs, agg):
    """The RESULT of slot ``g``, set ``s`` for member ``w``; return its length."""
    return write_sum(row, g, s, jx, MsgType.RESULT, jobs.mac[jx, w], jobs.ip[jx, w],
                     jobs.port[jx, w], w, job_id, slot, regs, jobs, agg)


@njit(cache=True, inline="always")
def build_upward(row, g, s, jx, msg_type, job_id, slot, regs, jobs, agg):
    """This switch's partial sum of slot ``g``, set ``s`` to its parent; return its length."""
    return write_sum(row, g, s, jx, msg_type, jobs.up_mac[jx], jobs.up_ip[jx],
                     TESTBED_UDP_PORT, jobs.up_index[jx], job_id, slot, regs, jobs, agg)


@njit(cache=True, inline="always")
def to_fallback(f, jx, slot, jobs, agg):
    """Readdress contribution ``f`` (of job slot ``slot``) to the job's host fallback
    aggregator of that slot (``slot % fb_n``: the overflow is spread over the job's hosts, as
    ATP's parameter servers shard a job's model), from this switch's identity (the member
    checked here stays in the header's ``worker_id``; a host would drop a packet carrying its
    own address as source, and the fallback can trust its switch alone); return the egress
    port, -1 without a fallback."""
    if jobs.fb_n[jx] <= 0:
        return -1
    k = slot % jobs.fb_n[jx]
    readdress(f, agg, jobs.fb_mac[jx, k], jobs.fb_ip[jx, k], jobs.fb_port[jx, k])
    return jobs.fb_egress[jx, k]


@njit(cache=True, inline="always")
def from_fallback(f, in_port, jx, slot, jobs):
    """Whether ``f`` comes from job row ``jx``'s host fallback of slot ``slot`` (its address,
    UDP port and the port its packets arrive on)."""
    if jobs.fb_n[jx] <= 0:
        return False
    k = slot % jobs.fb_n[jx]
    if in_port != jobs.fb_ingress[jx, k] or rd_u32be(f, OFF_IP_SRC) != jobs.fb_ip[jx, k] or \
            rd_u16be(f, OFF_UDP_SPORT) != jobs.fb_port[jx, k]:
        return False
    for j in range(6):
        if f[OFF_ETH_SRC + j] != jobs.fb_mac[jx, k, j]:
            return False
    return True


@njit(cache=True, inline="always")
def readdress(f, agg, dst_mac, dst_ip, dst_port):
    """Make ``f`` a packet of this aggregator to ``dst_*`` (from the testbed port; no UDP
    checksum, legal on IPv4, rather than a stale one)."""
    for j in range(6):
        f[OFF_ETH_DST + j] = dst_mac[j]
        f[OFF_ETH_SRC + j] = agg.mac[j]
    wr_u32be(f, OFF_IP_SRC, agg.ip)
    wr_u32be(f, OFF_IP_DST, dst_ip)
    wr_u16be(f, OFF_UDP_SPORT, TESTBED_UDP_PORT)
    wr_u16be(f, OFF_UDP_DPORT, dst_port)
    wr_u16be(f, OFF_UDP_CSUM, 0)
    set_ipv4_checksum(f)


class Batch4(NamedTuple):
    """The batch columns the kernel writes (a small record instead of four arguments)."""

    buf: np.ndarray
    length: np.ndarray
    in_port: np.ndarray
    out_port: np.ndarray
    reason: np.ndarray


@njit(cache=True, inline="always")
def _emit_row(b, n_out, counters):
    """The next free row for an emission, or -1 (counted) when the batch is full."""
    if n_out >= b.buf.shape[0]:
        counters[C_OVERFLOW] += 1
        return -1
    b.in_port[n_out] = -1
    b.reason[n_out] = 0
    return n_out


@njit(cache=True, inline="always")
def emit_result(b, n_out, g, s, jx, w, job_id, slot, regs, jobs, agg, counters):
    """Append member ``w``'s RESULT; return the new batch size."""
    i = _emit_row(b, n_out, counters)
    if i < 0:
        return n_out
    b.length[i] = build_result(b.buf[i], g, s, jx, w, job_id, slot, regs, jobs, agg)
    b.out_port[i] = jobs.ingress[jx, w] if agg.via_ingress else PORT_UNSET
    counters[C_RESULTS] += 1
    return n_out + 1


@njit(cache=True, inline="always")
def emit_all(b, n_out, g, s, jx, job_id, slot, regs, jobs, agg, counters):
    """Append one RESULT per member; return the new batch size."""
    for v in range(jobs.n_workers[jx]):
        n_out = emit_result(b, n_out, g, s, jx, v, job_id, slot, regs, jobs, agg, counters)
    return n_out


@njit(cache=True, inline="always")
def emit_upward(b, n_out, g, s, jx, msg_type, job_id, slot, regs, jobs, agg, counters):
    """Append the partial sum to the parent; return the new batch size."""
    i = _emit_row(b, n_out, counters)
    if i < 0:
        return n_out
    b.length[i] = build_upward(b.buf[i], g, s, jx, msg_type, job_id, slot, regs, jobs, agg)
    b.out_port[i] = jobs.up_egress[jx]
    counters[C_UP_SENT if msg_type == MsgType.DATA else C_UP_RESENT] += 1
    return n_out + 1


_R_DUPLICATE = int(DropReason.DUPLICATE)
_R_STALE = int(DropReason.STALE)
_R_NOT_MEMBER = int(DropReason.NOT_MEMBER)
_R_BAD_SEQ = int(DropReason.BAD_SEQ)


@njit(cache=True, inline="always")
def _drop(b, counters, i, r):
    b.out_port[i] = PORT_DROP
    b.reason[i] = r
    counters[C_DROPPED] += 1
    if r == _R_DUPLICATE:
        counters[C_DUPLICATES] += 1
    elif r == _R_STALE:
        counters[C_STALE] += 1
    elif r == _R_NOT_MEMBER:
        counters[C_NOT_MEMBER] += 1
    elif r == _R_BAD_SEQ:
        counters[C_BAD_SEQ] += 1


@njit(cache=True, inline="always")
def _send_to_fallback(b, i, jx, slot, jobs, agg, counters, counter):
    """Readdress row ``i`` to the job's host fallback of ``slot``, counted under ``counter``
    (dropped NO_ROUTE where the job has none)."""
    port = to_fallback(b.buf[i], jx, slot, jobs, agg)
    if port < 0:
        _drop(b, counters, i, DropReason.NO_ROUTE)
    else:
        b.out_port[i] = port
        counters[counter] += 1


@njit(cache=True, inline="always")
def _host_round(h, jx, regs, jobs):
    """The global slot of the round in header ``h`` if this switch left that round to its host
    fallback (HOST, the same round), else -1."""
    g = jobs.base[jx] + h.slot
    s = np.int64(h.seq & 1)
    if regs.state[g, s] == HOST and serial_diff(np.int64(h.seq), regs.seq[g, s]) == 0:
        return g
    return -1


@njit(cache=True, inline="always")
def _from_host(b, i, jx, regs, jobs, agg, counters):
    """A packet of the host fallback that summed a round of this tree node (F3): its partial
    sum (DATA/RETRANSMIT) goes on to the parent, a RESULT for a member switch (the host
    fallback of a node whose members are switches) down to that member, both as this switch's
    own packets: the parent and the members check their peer's identity as ever."""
    f = b.buf[i]
    h = header(f)
    if h.slot >= jobs.slots[jx] or h.slot_set != (h.seq & 1):
        _drop(b, counters, i, DropReason.BAD_SLOT)
        return
    if _host_round(h, jx, regs, jobs) < 0:
        _drop(b, counters, i, DropReason.STALE)  # not a round this switch left to the host
        return
    if h.msg_type == MsgType.RESULT:
        w = np.int64(h.worker_id)
        if w >= jobs.n_workers[jx]:
            _drop(b, counters, i, DropReason.BAD_WORKER)
            return
        readdress(f, agg, jobs.mac[jx, w], jobs.ip[jx, w], jobs.port[jx, w])
        b.out_port[i] = jobs.ingress[jx, w] if agg.via_ingress else PORT_UNSET
    elif jobs.up_egress[jx] >= 0:
        h.worker_id = jobs.up_index[jx]
        readdress(f, agg, jobs.up_mac[jx], jobs.up_ip[jx], TESTBED_UDP_PORT)
        b.out_port[i] = jobs.up_egress[jx]
    else:
        _drop(b, counters, i, DropReason.NO_ROUTE)  # the root has no parent to send to
        return
    counters[C_RELAYED] += 1


@njit(cache=True, inline="always")
def _parent_result(b, i, n_out, jx, regs, jobs, agg, counters):
    """A RESULT addressed to this switch: its parent's sum, multicast down (a round this
    switch left to its host fallback: relayed there, F3); return n_out."""
    h = header(b.buf[i])
    if h.slot >= jobs.slots[jx] or h.slot_set != (h.seq & 1):
        _drop(b, counters, i, DropReason.BAD_SLOT)
        return n_out
    if _host_round(h, jx, regs, jobs) >= 0:
        _send_to_fallback(b, i, jx, np.int64(h.slot), jobs, agg, counters, C_RELAYED)
        return n_out
    g = jobs.base[jx] + h.slot
    outcome = apply_parent_result(b.buf[i], jx, g, regs, jobs)
    if outcome > 0:
        _drop(b, counters, i, outcome)
        return n_out
    b.out_port[i] = PORT_HELD
    counters[C_PARENT_RESULTS] += 1
    counters[C_COMPLETED] += 1
    return emit_all(b, n_out, g, np.int64(h.seq & 1), jx, h.job_id, h.slot, regs, jobs, agg,
                    counters)


@njit(cache=True, inline="always")
def _contribution(b, i, n_out, jx, regs, jobs, agg, counters):
    """A member's DATA/RETRANSMIT: apply it and emit what it completes; return n_out."""
    f = b.buf[i]
    h = header(f)
    if h.slot >= jobs.slots[jx] or h.slot_set != (h.seq & 1):
        _drop(b, counters, i, DropReason.BAD_SLOT)
        return n_out
    w = np.int64(h.worker_id)
    g = jobs.base[jx] + h.slot
    s = np.int64(h.seq & 1)
    outcome = apply_contribution(f, jx, g, np.uint32(1) << np.uint32(w), regs, jobs, agg,
                                 counters)
    if outcome == FALLBACK:
        _send_to_fallback(b, i, jx, np.int64(h.slot), jobs, agg, counters, C_FALLBACK)
        return n_out
    if outcome > 0:
        _drop(b, counters, i, outcome)
        return n_out
    if outcome == COALESCED:
        counters[C_UP_COALESCED] += 1
        _drop(b, counters, i, DropReason.DUPLICATE)
        return n_out
    b.out_port[i] = PORT_HELD
    if outcome == ANSWER:
        counters[C_ANSWERED] += 1
        return emit_result(b, n_out, g, s, jx, w, h.job_id, h.slot, regs, jobs, agg, counters)
    if outcome == RESEND_UP:
        counters[C_DUPLICATES] += 1
        return emit_upward(b, n_out, g, s, jx, MsgType.RETRANSMIT, h.job_id, h.slot, regs, jobs,
                           agg, counters)
    counters[C_CONTRIB] += 1
    if outcome != COMPLETED:
        return n_out
    if jobs.up_egress[jx] >= 0:
        return emit_upward(b, n_out, g, s, jx, MsgType.DATA, h.job_id, h.slot, regs, jobs, agg,
                           counters)
    counters[C_COMPLETED] += 1
    return emit_all(b, n_out, g, s, jx, h.job_id, h.slot, regs, jobs, agg, counters)


@njit(cache=True)
def aggregate_kernel(b, n, regs, jobs, agg, counters):
    """Run the aggregation protocol over ``batch[0:n]``; return the new batch size (emitted
    packets are appended after row ``n``, up to the batch's capacity)."""
    n_out = n
    for i in range(n):
        if b.out_port[i] != PORT_UNSET:
            continue
        f = b.buf[i]
        ln = b.length[i]
        if ln < 14:
            continue
        if answer_arp(f, ln, b.in_port[i], agg):
            b.out_port[i] = b.in_port[i]
            counters[C_ARP] += 1
            continue
        if not addressed_to_aggregator(f, ln, agg):
            continue
        st = parse_frame(f, ln)
        if st == DropReason.NONE:
            h = header(f)
            jx = jobs.row[h.job_id]
            if jx >= 0 and jobs.mode[jx] == SHARED and from_fallback(
                    f, b.in_port[i], jx, np.int64(h.slot), jobs):
                _from_host(b, i, jx, regs, jobs, agg, counters)
                continue
            if jx >= 0 and h.msg_type == MsgType.RESULT and from_parent(f, b.in_port[i], jx,
                                                                         jobs):
                n_out = _parent_result(b, i, n_out, jx, regs, jobs, agg, counters)
                continue
        r = check_contribution(f, ln, agg)
        if r != DropReason.NONE:
            _drop(b, counters, i, r)
            continue
        jx, r = find_member(f, b.in_port[i], jobs)
        if r != DropReason.NONE:
            _drop(b, counters, i, r)
            continue
        n_out = _contribution(b, i, n_out, jx, regs, jobs, agg, counters)
    return n_out


#: the spec (:mod:`testbed.kernels.packed`) of :func:`aggregate_packed`'s table: the batch's
#: five arrays, the registers', the job table's, the aggregator's MAC and codecs, the counters
AGG_SPEC = ("u1:2 i4:1 i2:1 i2:1 u1:1 "
            "i8:2 i8:2 u4:2 u4:2 i8:2 i8:2 i8:2 i8:2 i8:2 b1:2 i8:2 i4:1 i8:1 "
            "i4:1 i8:1 i8:1 i8:1 i8:1 i8:1 u1:3 i8:2 i8:2 i8:2 u1:2 i8:1 i8:1 i8:1 i8:1 i8:1 u1:3 "
            "i8:2 i8:2 i8:2 i8:2 "
            "u1:1 b1:1 i8:1")


@njit(cache=True, _nrt=False)
def aggregate_packed(table, n, ip, via_ingress, max_elems, thc_max, pool_base, pool_lanes):
    """:func:`aggregate_kernel` with every array in one table and the aggregator's scalars
    as arguments: the per-burst entry point. Numba unboxes each array argument at a call,
    about 50 ns each, and types a NamedTuple through Python element by element (about 12 us
    per call for these four records, several times the kernel's own work on a small burst);
    here it unboxes one table (``AGG_SPEC``, :mod:`testbed.kernels.packed`) and the records
    are rebuilt from borrowed arrays, which without the reference-counting runtime (see the
    module docstring) nothing counts references to: the caller holds the arrays."""
    a = arrays_at(table, AGG_SPEC)
    return aggregate_kernel(Batch4(*a[0:5]), n, Registers(*a[5:18]), Jobs(*a[18:39]),
                            Aggregator(a[39], ip, a[40], via_ingress, max_elems, thc_max,
                                       pool_base, pool_lanes), a[41])


# ------------------------------------------------------------------------------- the state

#: Slot metadata (round, state, bitmap, missing, ...) in bytes per slot, both sets.
SLOT_METADATA_BYTES = 2 * 8 * 8


class Member(NamedTuple):
    """A registered member: worker id, MAC (6 bytes), IPv4 (host order), UDP port, ingress."""

    worker: int
    mac: bytes
    ip: int
    port: int
    ingress: int


class Peer(NamedTuple):
    """A job's parent switch or host fallback: MAC, IPv4, the port towards it, the port its
    packets arrive on, and this aggregator's member id there (parent) or its UDP port
    (fallback)."""

    mac: bytes
    ip: int
    egress: int
    ingress: int
    index_or_port: int


def free_range(used: list[tuple[int, int]], lo: int, hi: int, size: int) -> int:
    """First offset in ``lo..hi`` where ``size`` units fit between the ``(start, size)`` ranges
    in ``used``, or -1."""
    base = lo
    for b, n in sorted(used):
        if b - base >= size:
            return base
        base = max(base, b + n)
    return base if hi - base >= size else -1


class Aggregation:
    """The state of one aggregator (a switch's or a host's): identity, memory, shared pool,
    jobs, counters; :meth:`process` applies a burst. Memory is the int32 value words the jobs'
    slots hold: a static job reserves ``slots x 2 x lanes`` words (or is refused saying what is
    free), the shared pool (``pool_entries`` entries of ``pool_lanes`` lanes: one register set
    each, claimed per round) serves the jobs in shared mode."""

    def __init__(self, memory_bytes: int, pool_entries: int, pool_lanes: int, max_slots: int,
                 max_elems: int):
        self.max_slots, self.max_elems = max_slots, max_elems
        self.memory_words = memory_bytes // 4
        self.pool_entries, self.pool_lanes = pool_entries, pool_lanes
        self.pool_words = pool_entries * pool_lanes
        if self.pool_words > self.memory_words:
            raise ValueError(f"aggregate: the shared pool ({4 * self.pool_words} B) exceeds the "
                             f"memory ({4 * self.memory_words} B)")
        self.static_words = self.memory_words - self.pool_words
        self.regs = new_registers(max_slots, self.memory_words, pool_entries)
        self.jobs_arr = new_jobs()
        self.counters_arr = np.zeros(len(COUNTER_NAMES), np.int64)
        self.jobs: dict[int, dict] = {}
        self._agg = {"mac": np.zeros(6, np.uint8), "ip": 0, "codec_ok": np.zeros(256, np.bool_),
                     "via_ingress": True, "max_elems": max_elems, "thc_max": THC_MAX_ELEMS,
                     "pool_base": self.static_words, "pool_lanes": pool_lanes}
        self._packed: np.ndarray | None = None  # aggregate_packed's table (process)
        self._packed_with: tuple | None = None  # the batch arrays it was built with
        self.set_identity()  # builds self.agg

    def set_identity(self, mac: bytes | None = None, ip: int | None = None,
                     codec_ok: np.ndarray | None = None, via_ingress: bool | None = None) -> None:
        """Change the aggregator's address, summable codecs or where results leave (nothing
        given: build the ``agg`` record, and its plain tuple, from the settings as they are)."""
        a = self._agg
        if mac is not None:
            a["mac"] = np.frombuffer(bytes(mac), np.uint8).copy()
        if ip is not None:
            a["ip"] = int(ip)
        if codec_ok is not None:
            a["codec_ok"] = codec_ok
        if via_ingress is not None:
            a["via_ingress"] = bool(via_ingress)
        self.agg = Aggregator(**a)
        self._packed_with = None  # aggregate_packed's table: built again with the new arrays
        g = self.agg
        self._agg_scalars = (g.ip, g.via_ingress, g.max_elems, g.thc_max, g.pool_base,
                             g.pool_lanes)

    def free_slots(self) -> int:
        """Slots of metadata no job holds."""
        return self.max_slots - sum(j["slots"] for j in self.jobs.values())

    def free_memory_bytes(self) -> int:
        """Bytes of static aggregator memory no job holds (outside the shared pool)."""
        return 4 * (self.static_words - sum(j["words"] for j in self.jobs.values()))

    def add_job(self, job_id: int, slots: int, members: list[Member], seq0: int = 0, *,
                lanes: int = 256, shared: bool = False, parent: Peer | None = None,
                fallback: Peer | list[Peer] | None = None, fallback_host: bool = False) -> None:
        """Register ``job_id`` (replacing it if present); ``ValueError`` when it does not fit
        or is malformed (the message says what is free or what is wrong). ``fallback``: the
        host aggregator, or several (slot ``s`` goes to ``fallback[s % len(fallback)]``).
        ``fallback_host``: this aggregator is such a host fallback of a shared-mode job (it sees
        only the rounds the switch could not hold, so a slot's rounds may skip ahead)."""
        who = f"aggregate: job {job_id}"
        if not 0 <= job_id < 1 << 16:
            raise ValueError(f"aggregate: job_id must be 0..65535, got {job_id}")
        if not 1 <= slots <= 1 << 16:
            raise ValueError(f"{who}: slots must be 1..65536, got {slots}")
        if not 0 <= seq0 < SEQ_MOD:
            raise ValueError(f"{who}: seq0 must be 0..2**32-1, got {seq0}")
        if not 1 <= lanes <= THC_MAX_ELEMS:
            raise ValueError(f"{who}: lanes must be 1..{THC_MAX_ELEMS}, got {lanes}")
        n = len(members)
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"{who}: needs 1..{MAX_WORKERS} members, got {n}")
        if sorted(m.worker for m in members) != list(range(n)):
            raise ValueError(f"{who}: member workers must be 0..{n - 1}, each once; got "
                             f"{sorted(m.worker for m in members)}")
        fallbacks = [] if fallback is None else (
            [fallback] if isinstance(fallback, Peer) else list(fallback))
        if len(fallbacks) > MAX_WORKERS:
            raise ValueError(f"{who}: at most {MAX_WORKERS} fallback aggregators, got "
                             f"{len(fallbacks)}")
        if shared and fallback_host:
            raise ValueError(f"{who}: a job is shared here or the host fallback of one, not both")
        if shared:
            if not fallbacks:
                raise ValueError(f"{who}: shared mode needs a 'fallback' host aggregator")
            if self.pool_entries == 0:
                raise ValueError(f"{who}: shared mode, but this aggregator has no shared pool "
                                 "(pool_bytes = 0)")
            if lanes > self.pool_lanes:
                raise ValueError(f"{who}: lanes {lanes} > the pool's {self.pool_lanes}")
        if job_id in self.jobs:
            self.remove_job(job_id)
        idx = next((k for k in range(MAX_JOBS)
                    if k not in {j["index"] for j in self.jobs.values()}), -1)
        if idx < 0:
            raise AdmissionError(f"aggregate: at most {MAX_JOBS} jobs at once; remove one first")
        base = free_range([(j["base"], j["slots"]) for j in self.jobs.values()], 0,
                          self.max_slots, slots)
        if base < 0:
            raise AdmissionError(f"{who} asks for {slots} slots but only {self.free_slots()} "
                                 f"are free (contiguous) of {self.max_slots}; ask for fewer or "
                                 "remove a job")
        words = 0 if shared else slots * 2 * lanes
        vbase = free_range([(j["vbase"], j["words"]) for j in self.jobs.values() if j["words"]],
                           0, self.static_words, words) if words else 0
        if vbase < 0:
            raise AdmissionError(f"{who} needs {4 * words} B of aggregator memory ({slots} slots "
                                 f"x 2 sets x {lanes} lanes x 4 B) but only "
                                 f"{self.free_memory_bytes()} B are free (contiguous) of "
                                 f"{4 * self.static_words} B static memory; ask for fewer "
                                 "slots, use shared mode, or fall back to the hosts")
        self.jobs[job_id] = {"index": idx, "base": base, "slots": slots, "n_workers": n,
                             "seq0": seq0, "lanes": lanes, "shared": shared, "vbase": vbase,
                             "words": words, "tree_child": parent is not None,
                             "mode": "shared" if shared else "fallback" if fallback_host
                             else "static"}
        J, R = self.jobs_arr, self.regs
        J.base[idx], J.slots[idx], J.n_workers[idx], J.lanes[idx] = base, slots, n, lanes
        J.mode[idx] = SHARED if shared else FALLBACK_HOST if fallback_host else STATIC
        J.ingress[idx] = -1
        for m in members:
            J.mac[idx, m.worker] = np.frombuffer(m.mac, np.uint8)
            J.ip[idx, m.worker], J.port[idx, m.worker] = m.ip, m.port
            J.ingress[idx, m.worker] = m.ingress
        J.up_egress[idx], J.up_ingress[idx], J.fb_egress[idx], J.fb_ingress[idx] = -1, -1, -1, -1
        J.fb_n[idx] = len(fallbacks)
        if parent is not None:
            J.up_mac[idx] = np.frombuffer(parent.mac, np.uint8)
            J.up_ip[idx], J.up_egress[idx] = parent.ip, parent.egress
            J.up_ingress[idx], J.up_index[idx] = parent.ingress, parent.index_or_port
        for k, fb in enumerate(fallbacks):
            J.fb_mac[idx, k] = np.frombuffer(fb.mac, np.uint8)
            J.fb_ip[idx, k], J.fb_egress[idx, k] = fb.ip, fb.egress
            J.fb_ingress[idx, k] = fb.ingress
            J.fb_port[idx, k] = fb.index_or_port
        R.val_off[base:base + slots] = -1
        if not shared:
            R.val_off[base:base + slots, 0] = vbase + np.arange(slots) * 2 * lanes
            R.val_off[base:base + slots, 1] = vbase + np.arange(slots) * 2 * lanes + lanes
        init_rounds(R, base, base + slots, seq0)
        J.row[job_id] = idx

    def remove_job(self, job_id: int) -> None:
        """Forget ``job_id``, free its slots, memory and shared-pool entries."""
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        j = self.jobs.pop(job_id)
        self.jobs_arr.row[job_id] = -1
        self._free_pool(j)
        self.regs.val_off[j["base"]:j["base"] + j["slots"]] = -1

    def _free_pool(self, j: dict) -> None:
        """Give back every pool entry a job's rounds hold."""
        if not j["shared"]:
            return
        lo, hi = j["base"], j["base"] + j["slots"]
        owner = self.regs.pool_owner
        owner[(owner >= 2 * lo) & (owner < 2 * hi)] = -1
        self.regs.val_off[lo:hi] = -1

    def reset_job(self, job_id: int, seq0: int | None = None) -> None:
        """Start ``job_id`` afresh at round ``seq0`` (default: its first round)."""
        if job_id not in self.jobs:
            raise ValueError(f"aggregate: no job {job_id}; jobs are {sorted(self.jobs)}")
        j = self.jobs[job_id]
        if seq0 is not None:
            j["seq0"] = int(seq0) % SEQ_MOD
        self._free_pool(j)
        init_rounds(self.regs, j["base"], j["base"] + j["slots"], j["seq0"])

    def process(self, b: Batch4 | tuple, n: int) -> int:
        """Apply ``n`` frames of a batch (a :class:`Batch4`, or its arrays as a plain tuple);
        return the new batch size."""
        held = self._packed_with
        if b is not held and (held is None or any(x is not y for x, y in
                                                  zip(b, held, strict=True))):
            held = b if isinstance(b, tuple) else tuple(b)  # held: the table points into it
            self._packed = array_table(held + tuple(self.regs) + tuple(self.jobs_arr) + (
                self.agg.mac, self.agg.codec_ok, self.counters_arr), AGG_SPEC)
            self._packed_with = held
        return aggregate_packed(self._packed, n, *self._agg_scalars)

    def counters(self) -> dict:
        """Protocol counters; per job its slots, memory, mode and where its slots' rounds are
        aggregated; the memory configured, allocated and in use."""
        out = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr, strict=True)}
        R = self.regs
        jobs, in_use = {}, 0
        for jid, j in self.jobs.items():
            lo, hi = j["base"], j["base"] + j["slots"]
            st = R.state[lo:hi]
            held = int(np.count_nonzero(R.val_off[lo:hi] >= 0))  # sets with values in memory
            open_sets = int(np.count_nonzero((st == OPEN) | (st == UP)))
            in_use += open_sets * j["lanes"] * 4
            jobs[str(jid)] = {
                "slots": j["slots"], "n_workers": j["n_workers"], "base": j["base"],
                "lanes": j["lanes"], "mode": j["mode"],
                "tree_child": j["tree_child"],
                "memory_bytes": 4 * (j["words"] if not j["shared"] else held * self.pool_lanes),
                "slots_in_memory": int(np.count_nonzero((R.val_off[lo:hi] >= 0).any(axis=1))),
                "slots_at_host": int(np.count_nonzero((st == HOST).any(axis=1))),
                "open_sets": open_sets, "up_sets": int(np.count_nonzero(st == UP))}
        out["jobs"] = jobs
        out["free_slots"] = self.free_slots()
        out["memory"] = {"configured_bytes": 4 * self.memory_words,
                         "pool_bytes": 4 * self.pool_words,
                         "pool_entries": self.pool_entries,
                         "pool_entries_held": int(np.count_nonzero(R.pool_owner[
                             :self.pool_entries] >= 0)),
                         "allocated_bytes": 4 * sum(j["words"] for j in self.jobs.values()),
                         "free_bytes": self.free_memory_bytes(), "in_use_bytes": in_use,
                         "slot_metadata_bytes": SLOT_METADATA_BYTES * self.max_slots}
        return out
