"""The INA worker's hot loop: one ``@njit`` call per received burst, one per timer check.

Worker side of the protocol in ``docs/protocol.md`` (the switch side is
:mod:`testbed.datapath.aggregate`). A worker keeps ``W`` slots busy; slot ``k`` carries packets
``k, k + W, k + 2W, ...`` in successive *rounds*: round ``seq`` (a 32-bit serial number that
starts at the job's ``seq0`` and continues across repetitions) uses register set ``seq & 1``.
A RESULT is accepted only for the slot's current round and chunk offset, so duplicates, late
answers and strangers' datagrams are ignored. Packets ``0..boot-1`` are the exponent bootstrap
round (see ``ina.py``), one element each.

The state is three small records:

* :class:`Slots` - per slot: packet index outstanding (-1: idle), round, send time, send order,
  retransmitted flag, deadline, timeout, packet length and the packet row itself;
* :data:`LOOP_DTYPE` - one record: RTT estimator (srtt, rttvar, timeout, and its floor and
  cap), last progress time, send counter, the highest send order answered and the round trip
  of that packet (for fast retransmission), and the congestion window's state (``cc``,
  ``cwnd``, next packet to send, packets outstanding, least round trip, margin, send order of
  the last decrease, least window);
* :class:`Payload` - what is being reduced: input, outputs, agreed exponents, sizes and the
  codec (``MODE_INT32`` SwitchML fixed point, ``MODE_NIC`` float32 that a SmartNIC quantises,
  ``MODE_THC`` THC int8 lanes).

Loss recovery: an unanswered packet is sent again as ``RETRANSMIT`` after its timeout (TCP's
``srtt + 4 rttvar`` and twice the slot's last round trip, at least a floor: SwitchML's 10 ms,
or twice the time the worker's window takes to leave at its bottleneck share; doubling per
retry up to 320 ms: :func:`expire`, and kept doubled for the slot's next packets until a
round trip without a resend gives a clean sample: :func:`advance`; floor and cap times the
network's time dilation, and the estimator kept from one collective to the next:
:func:`new_loop`) or, sooner, like TCP's RACK: once ``FAST_RETX`` packets sent after it were
answered (rounds of one worker complete in the order it sent them) and it has been outstanding
``REORDER_SLACK`` times the round trip of the latest-sent answered packet, a delay that follows
the queues of the moment (:func:`fast_retransmit` says why that matters).

Congestion response (``cc = CC_DELAY``, ``CollectiveSpec.ina_cc = "delay"``; off by default,
and then nothing above changes): at most ``cwnd <= W`` packets outstanding, sent in packet
order (:func:`pump`); a slot whose round completed waits until the window has room for its next
packet. The window follows the round trips the loop already samples (:func:`cc_sample`, Swift's
delay rule: additive increase below a target, multiplicative decrease above it, at most once
per round trip) and halves on a timeout. UDP INA then leaves room on a shared link to the TCP
jobs beside it instead of keeping W packets queued in front of theirs.

Cost per packet: the per-packet steps that take the records are ``inline="always"`` (a call
that is not inlined passes every array of ``Slots`` and ``Payload`` field by field), and the
client enters through :func:`on_burst`, which takes every array of a burst as one table
(:mod:`testbed.kernels.packed`), and :func:`expire_flat`, which takes the slots as a plain
tuple; both borrow the arrays and are compiled without Numba's reference-counting runtime
(``_nrt=False``, inherited by what they call): Numba would otherwise count a reference for each
array of a record wherever it is passed or bound. Nothing on this path allocates or returns an
array (payload copies are element loops for that reason; an allocation would fail to compile).

:mod:`testbed.collectives.reference.inakernel` is the plain-Python twin of every function here;
tests run both on the same inputs and compare every output.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from testbed.kernels import fixedpoint as fp
from testbed.kernels.compressors.thc import fwht_inplace
from testbed.kernels.packed import arrays_at
from testbed.kernels.packets import borrow_arrays, header_at
from testbed.kernels.rng import hash_u32, uniform
from testbed.kernels.wire import HEADER_LEN, MAGIC, VERSION, Codec, Flags, MsgType

#: int32 elements per INA packet (SwitchML's client default).
ELEMS = 256
#: Bytes of a packet row: header + 256 int32 (= 1024 THC int8 lanes).
ROW = HEADER_LEN + 4 * ELEMS
#: SwitchML's initial retransmission timeout, and the cap of its doubling.
T0 = 0.010
T_MAX = 0.320
#: Answered packets sent after an unanswered one that make it a loss (TCP's dupack threshold).
FAST_RETX = 3
#: a packet overtaken by FAST_RETX later ones is lost once outstanding this many times the round
#: trip of the latest-sent answered packet (or its slot's own last one, if longer)
REORDER_SLACK = 1.25
#: the delay target's margin over the scaled least round trip (:data:`CC_TARGET_FACTOR`):
#: a few packets of queue at the bottleneck, enough to keep it busy
CC_MARGIN_S = 0.002
#: chunk_offset of the exponent bootstrap packets: never a data offset.
BOOT_OFFSET = 0xFFFFFFFF

MODE_INT32, MODE_NIC, MODE_THC = 0, 1, 2

#: int8 lanes per THC packet: the bytes of 256 int32, so a quarter of the packets of plain INA.
THC_ELEMS = 1024
#: exponent units per octave: the agreed norm bound 2**(e/8) is at most 9 % above the norm
NORM_RES = 8
#: exponent of an all-zero chunk (scale 0: everything quantises to 0)
THC_EXP_ZERO = -32768
_OVERFLOW = int(Flags.OVERFLOW)  # Numba has IntEnum constants, not IntFlag ones

#: congestion response of the window (``CollectiveSpec.ina_cc``): none (every slot always busy)
#: or the delay-based window of :func:`cc_sample`
CC_OFF, CC_DELAY = 0, 1
#: the delay target: the least round trip seen in the collective times this, plus the margin
#: (:func:`new_loop`)
CC_TARGET_FACTOR = 1.5
#: Swift's multiplicative decrease: by BETA x (rtt - target) / rtt, at most MAX_MDF, at most once
#: per round trip
CC_BETA = 0.8
CC_MAX_MDF = 0.5

LOOP_DTYPE = np.dtype([("srtt", "f8"), ("rttvar", "f8"), ("rto", "f8"), ("progress", "f8"),
                       ("sends", "i8"), ("acked", "i8"), ("t0", "f8"), ("tmax", "f8"),
                       ("rack_rtt", "f8"), ("cc", "i8"), ("cwnd", "f8"), ("nxt", "i8"),
                       ("inflight", "i8"), ("base_rtt", "f8"), ("margin", "f8"),
                       ("dec_order", "i8"), ("cwnd_min", "f8")])


class Slots(NamedTuple):
    """Per-slot state of one worker (index: slot 0..W-1)."""

    cur: np.ndarray  # int64: packet index outstanding on the slot, -1 when idle
    seq: np.ndarray  # int64: the slot's current round (32-bit serial number)
    sent_at: np.ndarray  # float64: time of the last (re)send
    order: np.ndarray  # int64: send counter value of the last (re)send
    retx: np.ndarray  # bool: sent more than once (Karn: no RTT sample)
    deadline: np.ndarray  # float64: retransmission time (inf when idle)
    rto: np.ndarray  # float64: the slot's current timeout
    rtt: np.ndarray  # float64: the slot's last RTT sample (0: none yet)
    lens: np.ndarray  # int64: bytes of the packet row
    pkts: np.ndarray  # uint8[W, ROW]: the packets, header first


class Payload(NamedTuple):
    """What one worker reduces and how it is encoded."""

    mode: int  # MODE_INT32, MODE_NIC or MODE_THC
    x: np.ndarray  # float32 input
    out: np.ndarray  # float32 result
    qsum: np.ndarray  # int32 summed lanes (INT32: the whole vector; THC: padded length d)
    agreed: np.ndarray  # int16 agreed exponent per data chunk
    K: int  # data packets
    boot: int  # exponent bootstrap packets before the data (W, or 0 for MODE_NIC)
    E: int  # elements per data packet
    d: int  # padded length (THC) or x.size
    n: int  # workers
    job_id: int
    member: int  # this worker's member id at the switch it sends to (worker_id on the wire)
    clip: float  # THC: clamp factor
    half: float  # THC: g / 2, the largest level
    blk: int  # THC: rotation block
    skey: np.uint64  # THC: shared sign stream
    qkey: np.uint64  # THC: this rank's rounding stream
    scratch: np.ndarray  # float32[E]


def new_slots(W: int, seq0: int) -> Slots:
    """Idle slots whose first round is ``seq0``."""
    return Slots(np.full(W, -1, np.int64), np.full(W, seq0 % (1 << 32), np.int64), np.zeros(W),
                 np.zeros(W, np.int64), np.zeros(W, np.bool_), np.full(W, np.inf),
                 np.full(W, T0), np.zeros(W), np.zeros(W, np.int64),
                 np.zeros((W, ROW), np.uint8))


def new_loop(now: float, dilation: float = 1.0, cc: int = CC_OFF, cwnd: float = 0.0,
             margin_s: float = CC_MARGIN_S, rtt: tuple[float, float] = (0.0, 0.0),
             t0: float = T0) -> np.ndarray:
    """The loop record at the start of a collective; on a network dilated by ``dilation``
    the timeout's floor ``t0`` and cap (:data:`T_MAX`, at least ``t0``) and the delay
    target's margin are that many times longer. ``cc``: :data:`CC_OFF` or :data:`CC_DELAY`,
    whose window starts at ``cwnd`` packets (0: the whole window W; a client passes the last
    collective's). ``rtt``: the last collective's ``(srtt, rttvar)``, which the timeout starts
    from, as a TCP connection keeps its estimator ((0, 0): none yet).

    ``t0``: SwitchML's 10 ms (:data:`T0`), or what a client computes from its path
    (``ina.timeout_floor``). Both keep timers from firing behind the worker's own queue: on
    a path whose round trip is many floors long, every collective's first window timed out
    whole, and those resends held the answers behind them past the next timeout, and so on
    (a 3 + 2 dumbbell with a 30 Mb/s bottleneck ran 1.4-1.7x the model)."""
    tmax = max(T_MAX, t0) * dilation
    st = np.zeros(1, LOOP_DTYPE)
    st[0]["t0"] = t0 * dilation
    st[0]["tmax"] = tmax
    st[0]["rto"] = t0 * dilation
    if rtt[0] > 0.0:
        st[0]["srtt"], st[0]["rttvar"] = rtt
        st[0]["rto"] = min(max(t0 * dilation, rtt[0] + 4 * rtt[1]), tmax)
    st[0]["progress"] = now
    st[0]["acked"] = -1
    st[0]["cc"] = cc
    st[0]["cwnd"] = cwnd
    st[0]["margin"] = margin_s * dilation
    return st


# ------------------------------------------------------------------------------- packets


@njit(cache=True, inline="always")
def write_data_header(row, slot, seq, codec, e_next, cnt, off, p):
    """Fill the testbed header of a DATA packet of round ``seq`` in ``row``."""
    h = header_at(row, 0)
    h.magic = MAGIC
    h.version = VERSION
    h.msg_type = MsgType.DATA
    h.job_id = p.job_id
    h.worker_id = p.member
    h.slot = slot
    h.slot_set = seq & 1
    h.flags = 0
    h.codec = codec
    h.n_workers = p.n
    h.exponent = e_next
    h.elem_count = cnt
    h.head_bytes = 0
    h.chunk_offset = off
    h.scale = 0.0
    h.seq = seq


@njit(cache=True)
def thc_exponent(y, lo, hi):
    """ceil(NORM_RES * log2(||y[lo:hi]||_2)) (float64 accumulation), THC_EXP_ZERO for zeros."""
    s = 0.0
    for k in range(lo, hi):
        v = np.float64(y[k])
        s += v * v
    if s == 0.0:
        return THC_EXP_ZERO
    e = np.ceil(NORM_RES * 0.5 * np.log2(s))
    return np.int64(min(max(e, -32767.0), 32767.0))


@njit(cache=True)
def thc_scale(e, ne, clip):
    """The agreed clamp value M of a chunk of ``ne`` coordinates with agreed exponent ``e``."""
    if e == THC_EXP_ZERO or ne <= 0:
        return 0.0
    return clip * 2.0 ** (np.float64(e) / NORM_RES) / np.sqrt(np.float64(ne))


@njit(cache=True)
def rotate_chunk(x, lo, cnt, blk, key, buf):
    """buf[0:cnt] = the rotation (H D / sqrt(blk), blockwise) of x[lo:lo+cnt] zero-padded;
    signs by global index, so bit-identical to ``thc.rht_forward`` over the whole vector."""
    inv = np.float32(1.0 / np.sqrt(blk))
    for b in range(cnt // blk):
        seg = buf[b * blk:(b + 1) * blk]
        base = lo + b * blk
        for jj in range(blk):
            k = base + jj
            v = x[k] if k < x.size else np.float32(0.0)
            seg[jj] = -v if hash_u32(k, key) & np.uint64(1) else v
        fwht_inplace(seg)
        for jj in range(blk):
            seg[jj] *= inv


@njit(cache=True)
def unrotate_chunk(buf, lo, cnt, blk, key, out):
    """out[lo:lo+cnt] (clipped to out.size) = inverse rotation of buf[0:cnt] (buf is
    overwritten); bit-identical to ``thc.rht_inverse`` over the whole vector."""
    inv = np.float32(1.0 / np.sqrt(blk))
    for b in range(cnt // blk):
        seg = buf[b * blk:(b + 1) * blk]
        fwht_inplace(seg)
        base = lo + b * blk
        for jj in range(blk):
            k = base + jj
            if k < out.size:
                v = seg[jj] * inv
                out[k] = -v if hash_u32(k, key) & np.uint64(1) else v


@njit(cache=True)
def _thc_quantize(row, lo, cnt, sc, p):
    """Stochastically round the rotated chunk in ``p.scratch`` to int8 levels -half..half on the
    grid of scale ``sc`` into the payload of ``row``; coordinate ``i`` rounds up with
    probability frac(a) using ``uniform(i, qkey)`` (counter-based: the twin draws the same)."""
    f = p.half / sc if sc > 0.0 else 0.0
    lim = np.float64(p.half)
    for k in range(cnt):
        a = np.float64(p.scratch[k]) * f
        if a > lim:
            a = lim
        elif a < -lim:
            a = -lim
        lv = np.floor(a)
        if uniform(lo + k, p.qkey) < a - lv:
            lv += 1.0
        row[HEADER_LEN + k] = np.uint8(np.int64(lv) & 0xFF)


@njit(cache=True, inline="always")
def build_packet(slots, s, j, p):
    """Write packet ``j`` (bootstrap ``j < boot``, else data chunk ``j - boot``) of slot ``s``'s
    current round into its row; return its length.

    A packet carries the sender's local exponent of data chunk ``j`` (max-combined by the switch:
    its RESULT returns the agreed exponent) and the data of chunk ``j - boot`` quantised with its
    agreed exponent, which arrived one round earlier on the same slot."""
    row = slots.pkts[s]
    seq = slots.seq[s]
    if p.mode == MODE_NIC:  # raw float32; the SmartNIC quantises
        lo = j * p.E
        cnt = min(p.E, p.x.size - lo)
        dst = row[HEADER_LEN:HEADER_LEN + 4 * cnt].view(np.float32)
        for k in range(cnt):
            dst[k] = p.x[lo + k]
        write_data_header(row, s, seq, Codec.FLOAT32, 0, cnt, lo, p)
        return HEADER_LEN + 4 * cnt
    if p.mode == MODE_THC:
        e_next = thc_exponent(p.x, j * p.E, min(j * p.E + p.E, p.x.size)) if j < p.K \
            else THC_EXP_ZERO
    else:
        e_next = fp.block_exponent(p.x[j * p.E:min(j * p.E + p.E, p.x.size)]) if j < p.K \
            else fp.EXP_MIN
    codec = Codec.THC if p.mode == MODE_THC else Codec.INT32
    lane = 1 if p.mode == MODE_THC else 4
    if j < p.boot:
        for k in range(lane):
            row[HEADER_LEN + k] = 0
        write_data_header(row, s, seq, codec, e_next, 1, BOOT_OFFSET, p)
        return HEADER_LEN + lane
    c = j - p.boot
    lo = c * p.E
    cnt = min(p.E, p.d - lo)
    if p.mode == MODE_THC:
        rotate_chunk(p.x, lo, cnt, p.blk, p.skey, p.scratch)
        _thc_quantize(row, lo, cnt, thc_scale(np.int64(p.agreed[c]), cnt, p.clip), p)
    else:
        fp.quantize_into(p.x[lo:lo + cnt], fp.scale_for(np.int64(p.agreed[c]), p.n),
                         row[HEADER_LEN:HEADER_LEN + 4 * cnt].view(np.int32))
    write_data_header(row, s, seq, codec, e_next, cnt, lo, p)
    return HEADER_LEN + lane * cnt


# ------------------------------------------------------------------------------- results


@njit(cache=True, inline="always")
def match_result(rb, ln, slots, p):
    """The slot a received datagram ``rb`` answers, or -1 when it is not a RESULT of this job
    for a slot's current round and chunk (another job, a duplicate, a late answer, junk)."""
    if ln < HEADER_LEN:
        return -1
    h = header_at(rb, 0)
    s = np.int64(h.slot)
    if (h.magic != MAGIC or h.msg_type != MsgType.RESULT or h.job_id != p.job_id
            or s >= slots.cur.size):
        return -1
    j = slots.cur[s]
    if j < 0 or np.int64(h.seq) != slots.seq[s]:
        return -1
    want = (j - p.boot) * p.E if j >= p.boot else BOOT_OFFSET
    if np.int64(h.chunk_offset) != want:
        return -1
    return s


@njit(cache=True, inline="always")
def apply_result(rb, ln, s, slots, p):
    """Take the RESULT ``rb`` of slot ``s`` into the outputs; return 0, or 1 when it does not
    fit the packet outstanding there (codec, size: a protocol violation), or 2 when the switch
    flagged OVERFLOW (THC sums beyond an int32 lane)."""
    h = header_at(rb, 0)
    j = slots.cur[s]
    ne = np.int64(h.elem_count)
    if p.mode == MODE_THC and h.flags & _OVERFLOW:
        return 2
    if j < p.boot:
        want = 1
    else:
        want = min(p.E, p.d - (j - p.boot) * p.E)
    pl = ln - HEADER_LEN
    lane = pl // ne if ne > 0 else 0
    codec_ok = (h.codec == Codec.THC) if p.mode == MODE_THC else (
        h.codec == (Codec.FLOAT32 if p.mode == MODE_NIC else Codec.INT32))
    lanes_ok = (lane == 1 or lane == 2 or lane == 4) if p.mode == MODE_THC else lane == 4
    if ne != want or not codec_ok or not lanes_ok or lane * ne != pl:
        return 1
    if j < p.K and p.mode != MODE_NIC:
        p.agreed[j] = h.exponent
    if j < p.boot:
        return 0
    c = j - p.boot
    lo = c * p.E
    o = HEADER_LEN
    if p.mode == MODE_NIC:
        src = rb[o:o + 4 * ne].view(np.float32)
        for k in range(ne):
            p.out[lo + k] = src[k]
    elif p.mode == MODE_INT32:
        src32 = rb[o:o + 4 * ne].view(np.int32)
        for k in range(ne):
            p.qsum[lo + k] = src32[k]
    else:
        for k in range(ne):
            v = np.int64(rb[o])
            for b in range(1, lane):
                v |= np.int64(rb[o + b]) << (8 * b)
            top = np.int64(1) << (8 * lane - 1)
            if v >= top:
                v -= top << 1
            p.qsum[lo + k] = v
            o += lane
        sc = thc_scale(np.int64(p.agreed[c]), ne, p.clip) / p.half
        for k in range(ne):
            p.scratch[k] = np.float32(p.qsum[lo + k] * sc)
        unrotate_chunk(p.scratch, lo, ne, p.blk, p.skey, p.out)
    return 0


@njit(cache=True)
def rtt_sample(st, sample):
    """Jacobson/Karels: update srtt, rttvar and the base timeout of the loop record."""
    if st.srtt == 0.0:
        st.srtt = sample
        st.rttvar = sample / 2
    else:
        st.rttvar = 0.75 * st.rttvar + 0.25 * abs(st.srtt - sample)
        st.srtt = 0.875 * st.srtt + 0.125 * sample
    st.rto = min(max(st.t0, st.srtt + 4 * st.rttvar), st.tmax)


@njit(cache=True, inline="always")
def send(slots, s, st, now, msg_type):
    """Stamp slot ``s``'s packet as sent now (``msg_type`` DATA or RETRANSMIT)."""
    header_at(slots.pkts[s], 0).msg_type = msg_type
    slots.sent_at[s] = now
    slots.order[s] = st.sends
    st.sends += 1
    slots.deadline[s] = now + slots.rto[s]


@njit(cache=True, inline="always")
def cc_sample(st, rtt, order, W):
    """The delay-based window (``CC_DELAY``, Swift's rule) takes a clean round trip ``rtt`` of
    the packet of send order ``order``: below the target (the least round trip of the
    collective times :data:`CC_TARGET_FACTOR`, plus the margin) the window grows by 1/cwnd
    (one packet per round trip), up to ``W``; above it, it shrinks by ``CC_BETA x (rtt -
    target) / rtt`` (at most :data:`CC_MAX_MDF`), never below one packet, and only for a packet
    sent after the last decrease (once per round trip).

    The round trip includes the host's own egress queue and the wait for the job's slowest
    member: a worker whose packets wait at the switch for a slower one's backs off to the
    slower one's pace, which is the job's pace anyway."""
    if st.base_rtt == 0.0 or rtt < st.base_rtt:
        st.base_rtt = rtt
    target = st.base_rtt * CC_TARGET_FACTOR + st.margin
    if rtt <= target:
        st.cwnd = min(st.cwnd + 1.0 / st.cwnd, np.float64(W))
    elif order >= st.dec_order:
        cut = max(1.0 - CC_BETA * (rtt - target) / rtt, 1.0 - CC_MAX_MDF)
        st.cwnd = max(1.0, st.cwnd * cut)
        st.dec_order = st.sends
        st.cwnd_min = min(st.cwnd_min, st.cwnd)


@njit(cache=True, inline="always")
def pump(slots, st, now, p, send_list, nsend):
    """``CC_DELAY``: send the next packets in packet order while fewer than ``cwnd`` are
    outstanding; packet ``nxt`` goes on its slot ``nxt % W`` once that slot's previous packet
    (``nxt - W``) is answered. Returns the new ``nsend``.

    In packet order, not slot by slot: every member then sends the lowest packet no round has
    completed as soon as its window allows, so members with different windows never wait for
    each other's contributions in a circle (a slot sent out of turn could fill one member's
    window with packets another member cannot reach)."""
    W = slots.cur.size
    total = p.K + p.boot
    while st.nxt < total and st.inflight < np.int64(st.cwnd):
        s = st.nxt % W
        if slots.cur[s] >= 0:
            break
        slots.cur[s] = st.nxt
        slots.lens[s] = build_packet(slots, s, st.nxt, p)
        send(slots, s, st, now, MsgType.DATA)
        send_list[nsend] = s
        nsend += 1
        st.nxt += 1
        st.inflight += 1
    return nsend


@njit(cache=True, inline="always")
def advance(slots, s, st, now, W, p):
    """Slot ``s``'s round completed: sample the RTT, move to its next round and build the next
    packet (True) or leave the slot idle (False)."""
    clean = not slots.retx[s]
    if clean:  # Karn: only unambiguous samples
        slots.rtt[s] = now - slots.sent_at[s]
        rtt_sample(st, slots.rtt[s])
    # the worker's timeout, but never under twice the slot's own last round trip: slots differ
    # in path (host fallback) and a slot keeps its path; after a resend the round trip was
    # ambiguous and the slot keeps its backed-off timeout until a clean sample (Karn; RFC 6298
    # 5.7): else, when queues grow faster than clean samples come in, every round starts again
    # at the floor and every packet is resent several times, which fills the queues further
    rto = min(max(st.rto, 2.0 * slots.rtt[s]), st.tmax)
    slots.rto[s] = rto if clean else max(rto, slots.rto[s])
    slots.retx[s] = False
    if clean and slots.order[s] > st.acked:  # an answer to a resend may be the original's
        st.acked = slots.order[s]
        st.rack_rtt = slots.rtt[s]
    slots.seq[s] = (slots.seq[s] + 1) & 0xFFFFFFFF
    if st.cc != CC_OFF:  # the slot waits: :func:`pump` sends its next packet in turn
        if clean:
            cc_sample(st, slots.rtt[s], slots.order[s], W)
        st.inflight -= 1
        slots.cur[s] = -1
        slots.deadline[s] = np.inf
        return False
    nj = slots.cur[s] + W
    if nj >= p.K + p.boot:
        slots.cur[s] = -1
        slots.deadline[s] = np.inf
        return False
    slots.cur[s] = nj
    slots.lens[s] = build_packet(slots, s, nj, p)
    send(slots, s, st, now, MsgType.DATA)
    return True


@njit(cache=True, inline="always")
def resend(slots, s, st, now, send_list, nsend):
    """Stamp slot ``s``'s packet as a RETRANSMIT sent now and list it; return the new count."""
    slots.retx[s] = True
    send(slots, s, st, now, MsgType.RETRANSMIT)
    send_list[nsend] = s
    return nsend + 1


@njit(cache=True, inline="always")
def fast_retransmit(slots, st, now, send_list, nsend):
    """Resend every packet that ``FAST_RETX`` later-sent packets overtook and that has been
    outstanding ``REORDER_SLACK`` times the round trip of the latest-sent answered packet (or
    of its slot's own last round, if longer: slots differ in path, e.g. a shared-pool slot
    summed by a host fallback); its new send order waits for as many again before another
    resend. Returns the new ``nsend``.

    Why the time condition follows the latest answer (TCP RACK) rather than a mean: when an
    uplink's queue grows, every round trip grows with it; a mean RTT lags, every queued packet
    then looks lost, and the resends and their answers fill the queue further. That collapsed a
    4:1 leaf-spine to 6-8x its time. Overtaking alone is no proof of loss either: a round
    completes when the slowest member's contribution arrives."""
    for s in range(slots.cur.size):
        if slots.cur[s] >= 0 and slots.order[s] + FAST_RETX <= st.acked:
            ref = max(st.rack_rtt, slots.rtt[s])
            if ref <= 0.0:
                ref = st.srtt
            if now - slots.sent_at[s] > REORDER_SLACK * ref:
                nsend = resend(slots, s, st, now, send_list, nsend)
    return nsend


@njit(cache=True)
def on_results(rbuf, rlen, nrecv, drop, slots, loop, p, now, send_list):
    """Apply a burst of ``nrecv`` received datagrams (rows of ``rbuf``); ``drop[i]`` discards
    datagram ``i`` after matching (seeded client-side loss). Builds the next packet of every
    completed slot and lists the slots to send in ``send_list``. Returns ``(done, nsend,
    ignored, lost, bad_slot, code)``: ``bad_slot >= 0`` with ``code`` 1 (mismatch) or 2
    (OVERFLOW) stops at that datagram; the caller raises. ``loop`` is the 1-record array."""
    st = loop[0]
    W = slots.cur.size
    done = nsend = ignored = lost = 0
    for i in range(nrecv):
        s = match_result(rbuf[i], rlen[i], slots, p)
        if s < 0:
            ignored += 1
            continue
        if drop[i]:
            lost += 1
            continue
        code = apply_result(rbuf[i], rlen[i], s, slots, p)
        if code:
            return done, nsend, ignored, lost, s, code
        done += 1
        st.progress = now
        if advance(slots, s, st, now, W, p):
            send_list[nsend] = s
            nsend += 1
    if st.cc != CC_OFF:
        nsend = pump(slots, st, now, p, send_list, nsend)
    nsend = fast_retransmit(slots, st, now, send_list, nsend)
    return done, nsend, ignored, lost, -1, 0


#: the arrays of :func:`on_burst`'s table (:mod:`testbed.kernels.packed`), in
#: :func:`burst_arrays`' order: the receive rows, their ``mmsghdr`` rows and lengths and
#: drop marks; the :class:`Slots`; the :class:`Payload`'s arrays; the send list and the send
#: side's ``iovec``, GSO ``mmsghdr`` and ``cmsghdr`` rows
BURST_SPEC = ("u1:2 u8:2 i8:1 b1:1 "
              "i8:1 i8:1 f8:1 i8:1 b1:1 f8:1 f8:1 f8:1 i8:1 u1:2 "
              "f4:1 f4:1 i4:1 i2:1 f4:1 "
              "i8:1 u8:2 u8:2 u8:2")
#: the :class:`Payload` fields that are arrays, in the table's order
PAYLOAD_ARRAYS = ("x", "out", "qsum", "agreed", "scratch")
#: ``on_burst``'s ``gso``: GSO runs, one ``sendmmsg`` entry per packet, or nothing to build
#: (the caller filters the send list first: seeded client-side loss)
SEND_GSO, SEND_EACH, SEND_NONE = 1, 0, -1


def burst_arrays(rbuf, rhdr, rlen, drop, slots: Slots, p: Payload, send_list, siov, ghdr,
                 gctl) -> list:
    """The arrays of a worker's :func:`on_burst` table, in :data:`BURST_SPEC`'s order."""
    return [rbuf, rhdr, rlen, drop, *slots, *(getattr(p, f) for f in PAYLOAD_ARRAYS),
            send_list, siov, ghdr, gctl]


def payload_scalars(p: Payload) -> tuple:
    """The :class:`Payload`'s other fields, in its order: :func:`on_burst`'s ``scalars``,
    each of one type whatever the codec (one compiled specialisation)."""
    return (int(p.mode), int(p.K), int(p.boot), int(p.E), int(p.d), int(p.n), int(p.job_id),
            int(p.member), float(p.clip), float(p.half), int(p.blk), np.uint64(p.skey),
            np.uint64(p.qkey))


@njit(cache=True, _nrt=False)
def on_burst(table, loop, scalars, nrecv, now, gso, max_bytes, max_segs, overhead):
    """The client's per-burst entry point: the ``nrecv`` datagrams ``recvmmsg`` left in the
    table's receive rows (their lengths read from the ``mmsghdr`` rows) go through
    :func:`on_results`, and the packets it lists are made ready to send: an ``iovec`` each
    and, with ``gso`` = :data:`SEND_GSO`, their GSO groups (:func:`gso_batches`). Returns
    ``(done, nsend, groups, ignored, lost, bad_slot, code, earliest)``, ``earliest`` the
    slots' first retransmission deadline (the client's next timer check).

    Why one table (:mod:`testbed.kernels.packed`): the burst's 23 arrays, passed one by one
    or as tuples, cost about 50 ns each to unbox per call, and the numpy steps around the old
    entry point (the lengths, the ``iovec`` rows) about 4 us more: on an INA worker's small
    bursts, more than the protocol's own work. The records are rebuilt here from borrowed
    arrays, so every kernel below keeps its named fields."""
    (rbuf, rhdr, rlen, drop, cur, seq, sent_at, order, retx, deadline, rto, rtt, lens, pkts,
     x, out, qsum, agreed, scratch, send_list, siov, ghdr, gctl) = arrays_at(table, BURST_SPEC)
    mode, K, boot, E, d, n, job_id, member, clip, half, blk, skey, qkey = scalars
    slots = Slots(cur, seq, sent_at, order, retx, deadline, rto, rtt, lens, pkts)
    p = Payload(mode, x, out, qsum, agreed, K, boot, E, d, n, job_id, member, clip, half, blk,
                skey, qkey, scratch)
    for i in range(nrecv):
        rlen[i] = np.int64(rhdr[i, 7] & np.uint64(0xFFFFFFFF))  # msg_len
    done, nsend, ignored, lost, bad, code = on_results(rbuf, rlen, nrecv, drop, slots, loop, p,
                                                       now, send_list)
    groups = 0
    if nsend and gso != SEND_NONE:
        base = np.uint64(pkts.ctypes.data)
        for i in range(nsend):
            siov[i, 0] = base + np.uint64(send_list[i] * ROW)
            siov[i, 1] = np.uint64(lens[send_list[i]])
        if gso == SEND_GSO:
            groups = gso_batches(send_list, nsend, lens, np.uint64(siov.ctypes.data), ghdr,
                                 gctl, max_bytes, max_segs, overhead)
    earliest = np.inf
    for s in range(deadline.size):
        earliest = min(earliest, deadline[s])
    return done, nsend, groups, ignored, lost, bad, code, earliest


@njit(cache=True, _nrt=False)
def expire_flat(slots_t, loop, now, send_list):
    """:func:`expire` with the slots as a plain tuple: Numba types a plain tuple of arrays in
    C from its fingerprint but a NamedTuple through Python, element by element (about 2 us per
    record and call); the record is rebuilt here with borrowed arrays. The timer path runs
    once per drained socket, not per burst, so it keeps the tuple."""
    return expire(Slots(*borrow_arrays(slots_t)), loop, now, send_list)


@njit(cache=True)
def expire(slots, loop, now, send_list):
    """Resend every packet whose deadline passed, doubling its timeout up to the loop's cap
    (``T_MAX`` times the dilation); return how many are listed in ``send_list``. A delay-based
    window (``CC_DELAY``) halves for a packet sent after its last decrease."""
    st = loop[0]
    nsend = 0
    for s in range(slots.cur.size):
        if slots.cur[s] >= 0 and slots.deadline[s] <= now:
            if st.cc != CC_OFF and slots.order[s] >= st.dec_order:
                st.cwnd = max(1.0, st.cwnd * (1.0 - CC_MAX_MDF))
                st.dec_order = st.sends
                st.cwnd_min = min(st.cwnd_min, st.cwnd)
            slots.rto[s] = min(slots.rto[s] * 2, st.tmax)
            nsend = resend(slots, s, st, now, send_list, nsend)
    return nsend


@njit(cache=True)
def start(slots, loop, p, now, send_list):
    """Build and stamp the first packet of every slot (``CC_DELAY``: of the first ``cwnd``,
    a window of 0 meaning ``W``); return how many to send."""
    st = loop[0]
    W = slots.cur.size
    k = min(W, p.K + p.boot)
    if st.cc != CC_OFF:
        st.cwnd = np.float64(W) if st.cwnd <= 0.0 else min(max(st.cwnd, 1.0), np.float64(W))
        st.cwnd_min = st.cwnd
        st.dec_order = 0
        st.nxt = 0
        st.inflight = 0
        for s in range(k):
            slots.cur[s] = -1
            slots.deadline[s] = np.inf
            slots.retx[s] = False
            slots.rto[s] = st.rto
        return pump(slots, st, now, p, send_list, 0)
    for s in range(k):
        slots.cur[s] = s
        slots.retx[s] = False
        slots.rto[s] = st.rto
        slots.lens[s] = build_packet(slots, s, s, p)
        send(slots, s, st, now, MsgType.DATA)
        send_list[s] = s
    return k


@njit(cache=True)
def thc_descale(qsum, agreed, E, clip, half, ysum):
    """ysum = qsum * M_k / half per chunk k (M_k from the agreed exponent): the summed rotated
    coordinates, ready for the inverse transform."""
    d = qsum.size
    K = (d + E - 1) // E
    for c in range(K):
        lo = c * E
        hi = min(lo + E, d)
        s = thc_scale(np.int64(agreed[c]), hi - lo, clip) / half
        for k in range(lo, hi):
            ysum[k] = np.float32(qsum[k] * s)


@njit(cache=True)
def dequantize_int32(p):
    """MODE_INT32's last step: ``out`` from ``qsum``, each chunk with the scale of its agreed
    exponent (:func:`testbed.kernels.fixedpoint.scale_for`). One call for the whole vector: a
    Python loop of a kernel call per 256-element chunk was about 40 % of an INA rank's Python
    samples at 8 MiB (py-spy, fat-tree k=4), inside the timed collective."""
    for k in range(p.K):
        lo = k * p.E
        hi = min(lo + p.E, p.x.size)
        fp.dequantize_into(p.qsum[lo:hi], fp.scale_for(np.int64(p.agreed[k]), p.n),
                           p.out[lo:hi])


@njit(cache=True, _nrt=False)
def gso_batches(send_list, k, lens, iov_addr, hdr, ctrl, max_bytes, max_segs, overhead):
    """Group the packet rows ``send_list[:k]`` into UDP GSO sends (``UDP_SEGMENT``). The
    caller lists the rows' ``struct iovec`` (16 B each) in list order at ``iov_addr``; each
    ``struct mmsghdr`` row ``g`` of ``hdr`` (uint64[., 8]) gets a run of consecutive ones,
    every row but the last exactly as long as the first (the kernel cuts the concatenated
    payload at that length), at most ``max_segs`` rows and ``max_bytes`` on the wire
    (``overhead``: the Ethernet, IP and UDP header bytes of a frame), and ``ctrl[g, 2]``, the
    data word of its ``cmsghdr``, the segment length. Returns the number of groups."""
    g = 0
    i = 0
    while i < k:
        ln = lens[send_list[i]]
        cap = max(1, min(max_segs, max_bytes // (ln + overhead)))
        j = i + 1
        while j < k and j - i < cap:
            lj = lens[send_list[j]]
            if lj > ln:
                break
            j += 1
            if lj < ln:  # a shorter row can only be a group's last
                break
        hdr[g, 2] = iov_addr + np.uint64(i * 16)
        hdr[g, 3] = j - i
        ctrl[g, 2] = ln
        g += 1
        i = j
    return g
