"""The ``trim`` program: an egress queue per port, drained at the port's rate, that trims.

A switch port that trims (NDP, Ultra Ethernet; the HotNets'24 trimming layout in
``testbed.kernels.trimming``) needs a queue it owns: the kernel's qdisc cannot cut payloads.
This stage is that queue. It runs after forwarding (an *egress* stage: it acts on packets whose
``out_port`` is a port index) and models each port as a link of ``rate_mbps``:

* a packet that finds its port idle and its queues empty leaves at once (it stays in the batch)
  and occupies the link for ``length * 8 / rate`` (the port's *drain clock* ``next_free``);
* otherwise it is copied into the port's **data queue** (a ring of frame slots owned by the
  stage), marked ``PORT_HELD`` and re-emitted (appended to a later batch) when the drain clock
  reaches it;
* when the data queue holds more than ``threshold_bytes`` (or ``threshold_pkts``) the packet is
  **trimmed** instead (``trim_frame``: cut at ``head_bytes``, ``Flags.TRIMMED`` set, IPv4/UDP
  lengths and checksum fixed) and the small frame goes to the port's **header queue**, which is
  served with strict priority (NDP); with ``header_priority=False`` trimmed frames join the data
  queue instead. A packet that cannot be trimmed (not a testbed frame, ``head_bytes == 0``,
  already trimmed) or does not fit is dropped (``DropReason.QUEUE_FULL``);
* ``mode="drop_tail"`` never trims: above the threshold it drops (the comparison baseline);
* ``mode="uet"`` trims as an Ultra Ethernet (UET 1.0) switch does (below);
* a row whose length no frame can have (< 0 or > ``FRAME_MAX``) is dropped ``BAD_LENGTH``;
* optional ECN: a testbed packet enqueued while the data queue holds at least
  ``ecn_threshold_bytes`` gets ``Flags.ECN`` (and a zero UDP checksum, legal in IPv4, since a
  header byte changed).

The drain clock is virtual (float ns since the stage's first call), so the long-run rate is the
configured one however late the engine wakes: a late wake-up sends the backlog that was due.
``burst_bytes`` (per port, default 0) lets a port run that far ahead of its clock, like a token
bucket of that depth (HTB's ``burst``): a frame leaves once the clock is within
``burst_bytes`` of link time of it. The stage asks to be woken when its head frame is due on
the exact clock (:meth:`TrimStage.next_deadline_ns`) and then sends a burst's worth, so the
engine wakes once per burst rather than once per frame, at the same long-run rate.
Packets leave in FIFO order per queue; nothing overtakes a held packet of the same queue.
Broadcast/flood copies are expanded by the engine after all stages, so they bypass the queue.

**UET mode** (``mode="uet"``). Each egress packet is classified by the DSCP of its IPv4 header
(not IPv4: best effort): ``dscp_control`` (default ``Dscp.CONTROL``, 46) goes to a per-port
**control queue** served with strict priority, never trimmed, dropped only when its
``control_slots`` are full; ``dscp_trimmed`` / ``dscp_trimmed_lasthop`` (26 / 28: trimmed
upstream) go to the **trimmed queue** (the header queue, ``header_slots`` frames, dropping
``QUEUE_FULL`` when full); valid testbed frames of ``dscp_trimmable`` (8) join the data queue
and above the threshold are cut (:func:`uet_trim_frame`) to ``trim_bytes`` (frame length after
the cut, default 128, at least ``PAYLOAD_OFFSET``) and go to the trimmed queue; anything else
joins the data queue and is dropped above the threshold (drop-tail). The cut keeps a
HotNets head that fits whole (trimming as compression still works), else the most whole
elements of the codec that fit (4 B for INT32/FLOAT32, 2 B for FLOAT16/BFLOAT16, bytes for
``Codec.BYTES``, nothing for a TRIM_LAYOUT whose head does not fit), sets ``head_bytes`` (and
``elem_count`` of element and BYTES codecs) to it, sets ``Flags.TRIMMED`` and re-marks the DSCP
``dscp_trimmed``, or on a ``last_hop`` port ``dscp_trimmed_lasthop`` plus ``Flags.LASTHOP``
(the receiver NACKs ``UET_TRIMMED`` / ``UET_TRIMMED_LASTHOP``). A frame already flagged TRIMMED
is only re-marked, never cut again. While both are backlogged the trimmed queue gets at most
``trimmed_share`` (default 0.5) of the port's bytes (a byte deficit counter); either alone takes
the whole port. The threshold is ``threshold_bytes`` or ``threshold_bdp`` times the port's
bandwidth-delay product ``rate_mbps * rtt_us / 8`` bytes, times ``lasthop_factor`` (1.5) on
``last_hop`` ports (UET's recommended one BDP, 1.5 at the last hop); it follows rate and RTT
changes. ``header_priority`` does not apply in this mode.

Counters per port: ``passed`` (left without queueing), ``enqueued`` (queued untrimmed, any
queue), ``trimmed`` (cut or re-marked here and queued), ``dropped`` (all drops), ``dequeued``,
``ecn_marked``, ``hwm_bytes`` / ``hwm_pkts`` (data queue high-water marks), ``hdr_hwm_pkts``,
the per-class ``trimmed_lasthop`` (of ``trimmed``, on last-hop ports), ``pretrimmed`` (of
``enqueued``, arrived trimmed), ``trimmed_dropped`` (trimmed-class frames lost to a full trimmed
queue), ``ctl_enqueued``, ``ctl_dropped``, ``ctl_hwm_pkts``, the bytes dequeued per queue
``ctl_bytes_sent`` / ``trimmed_bytes_sent`` / ``data_bytes_sent``, and the current
``depth_bytes`` / ``depth_pkts``. So ``passed + enqueued + trimmed + dropped`` counts every
packet and ``dequeued == enqueued + trimmed`` once the queues are empty.

Why one module of this length: the three queue disciplines are one kernel (one drain clock,
one admission path, one set of rings), and the ``shape`` stage is the same queue in drop-tail
mode; splitting them would duplicate the clock and the rings.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from testbed.datapath.batch import (
    FRAME_MAX,
    PORT_DROP,
    PORT_HELD,
    Batch,
    DropReason,
    PackedStage,
    sparse_zeros,
)
from testbed.kernels.checks import check_number
from testbed.kernels.packed import arrays_at
from testbed.kernels.packets import (
    ETHERTYPE_IPV4,
    OFF_ETHERTYPE,
    OFF_IP,
    OFF_UDP_CSUM,
    OFF_UDP_LEN,
    header,
    parse_frame,
    rd_u16be,
    set_payload_bytes,
    wr_u16be,
)
from testbed.kernels.trimming import trim_frame
from testbed.kernels.wire import (
    ETH_LEN,
    HEADER_LEN,
    IPV4_LEN,
    PAYLOAD_OFFSET,
    UDP_LEN,
    Codec,
    Dscp,
    Flags,
)

MODES = ("trim", "drop_tail", "uet")
MODE_TRIM = 0
MODE_DROP_TAIL = 1
MODE_UET = 2

# the queues of a port (the trimmed one is NDP's header queue), in the order of the rings
Q_DATA, Q_TRIMMED, Q_CONTROL = range(3)

# per-port counter columns (the bytes sent per queue in the order of the queues)
(C_PASSED, C_ENQUEUED, C_TRIMMED, C_DROPPED, C_DEQUEUED, C_ECN, C_HWM_BYTES, C_HWM_PKTS,
 C_HDR_HWM_PKTS, C_TRIMMED_LH, C_PRETRIMMED, C_TRIMMED_DROPPED, C_CTL_ENQUEUED, C_CTL_DROPPED,
 C_CTL_HWM_PKTS, C_DATA_BYTES, C_TRIMMED_BYTES, C_CTL_BYTES) = range(18)
COUNTER_NAMES = ("passed", "enqueued", "trimmed", "dropped", "dequeued", "ecn_marked",
                 "hwm_bytes", "hwm_pkts", "hdr_hwm_pkts", "trimmed_lasthop", "pretrimmed",
                 "trimmed_dropped", "ctl_enqueued", "ctl_dropped", "ctl_hwm_pkts",
                 "data_bytes_sent", "trimmed_bytes_sent", "ctl_bytes_sent")

# the UET DSCP settings, in the order of the kernel's ``dscp`` array
DSCP_SETTINGS = ("dscp_control", "dscp_trimmed", "dscp_trimmed_lasthop", "dscp_trimmable")
DSCP_DEFAULTS = (int(Dscp.CONTROL), int(Dscp.TRIMMED), int(Dscp.TRIMMED_LASTHOP),
                 int(Dscp.TRIMMABLE))
D_CONTROL, D_TRIMMED, D_TRIMMED_LH, D_TRIMMABLE = range(4)
#: default frame length after a UET cut: the headers (``PAYLOAD_OFFSET``, 74 B) and 54 B of
#: payload, room for the 1-bit HotNets head of a chunk of up to 352 elements
TRIM_BYTES = 128
#: UET's recommended threshold at the last hop, in thresholds of the other ports
LASTHOP_FACTOR = 1.5

_R_QUEUE_FULL = int(DropReason.QUEUE_FULL)
_R_BAD_LENGTH = int(DropReason.BAD_LENGTH)
_FLAG_ECN = int(Flags.ECN)
_FLAG_TRIMMED = int(Flags.TRIMMED)
_FLAG_LASTHOP = int(Flags.LASTHOP)
_CODEC_INT32 = int(Codec.INT32)
_CODEC_FLOAT32 = int(Codec.FLOAT32)
_CODEC_FLOAT16 = int(Codec.FLOAT16)
_CODEC_BFLOAT16 = int(Codec.BFLOAT16)
_CODEC_TRIM_LAYOUT = int(Codec.TRIM_LAYOUT)
_CODEC_BYTES = int(Codec.BYTES)
_OFF_TOS = OFF_IP + 1


# ---------------------------------------------------------------------------------------------
# helpers shared by the stages of this package (port lookup and per-port settings)


def port_index(ports: list[str], p, who: str) -> int:
    """Index of port ``p`` (a name from ``ports`` or an index) or a ValueError naming ``who``."""
    if isinstance(p, str):
        if p in ports:
            return ports.index(p)
        if p.isdigit():
            p = int(p)
        else:
            raise ValueError(f"{who}: unknown port {p!r}; ports are {ports}")
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 0 <= p < len(ports):
        raise ValueError(f"{who}: port {p!r} is not one of {ports} or an index 0..{len(ports) - 1}")
    return int(p)


def per_port(value, ports: list[str], who: str, check) -> dict[int, object]:
    """Expand a setting given for all ports (a scalar) or per port (``{port: v}`` or a list of
    ``len(ports)`` values) into ``{index: checked value}``."""
    if isinstance(value, dict):
        return {port_index(ports, k, who): check(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) != len(ports):
            raise ValueError(f"{who}: got {len(value)} values for {len(ports)} ports {ports}; "
                             "give one per port, a {port: value} dict, or one value for all")
        return {i: check(v) for i, v in enumerate(value)}
    v = check(value)
    return dict.fromkeys(range(len(ports)), v)


def resolve_ports(ports, n_ports, who: str) -> list[str]:
    """Port names from the engine's ``ports`` list, or ``port0..`` for ``n_ports`` ports."""
    if ports is not None:
        ports = [str(p) for p in ports]
        if not ports:
            raise ValueError(f"{who}: the node has no ports (pass ports=[...])")
        return ports
    if n_ports is None:
        raise ValueError(f"{who}: pass ports=[names] (the engine does) or n_ports=<count>")
    n = check_number("n_ports", 1, 1024, integer=True)(n_ports)
    return [f"port{i}" for i in range(n)]


def append_emitted(batch: Batch, k: int, ports: np.ndarray, column: np.ndarray) -> int:
    """Make the ``k`` rows a kernel wrote after ``batch.n`` part of the batch and set their
    ``column`` (``out_port`` or ``in_port``) from ``ports``; return the first row."""
    first = batch.alloc(k)
    column[first:first + k] = ports[:k]
    return first


# ---------------------------------------------------------------------------------------------
# kernels


@njit(cache=True, inline="always")
def frame_dscp(frame, length):
    """DSCP of an IPv4 frame's TOS byte, -1 for anything else (best effort in ``uet`` mode)."""
    if length < ETH_LEN + IPV4_LEN or rd_u16be(frame, OFF_ETHERTYPE) != ETHERTYPE_IPV4 \
            or (frame[OFF_IP] >> 4) != 4:
        return -1
    return np.int64(frame[_OFF_TOS]) >> 2


@njit(cache=True)
def uet_trim_frame(frame, trim_bytes, dscp, lasthop):
    """Cut a valid testbed frame (``parse_frame == 0``) as a UET switch does; return its new
    length (see the module docstring for what is kept).

    ``trim_bytes`` >= ``PAYLOAD_OFFSET`` is the longest result; ``dscp`` the class it is
    re-marked (the two ECN bits are kept); ``lasthop`` also sets ``Flags.LASTHOP``. IPv4 total
    length and checksum and the UDP length are fixed, the UDP checksum zeroed."""
    h = header(frame)
    payload = rd_u16be(frame, OFF_UDP_LEN) - UDP_LEN - HEADER_LEN
    room = trim_bytes - PAYLOAD_OFFSET
    codec = np.int64(h.codec)
    head = np.int64(h.head_bytes)
    if h.flags & _FLAG_TRIMMED:
        kept = payload  # cut upstream already: only re-marked here
    elif head > 0 and head <= room:
        kept = min(head, payload)
    elif codec == _CODEC_TRIM_LAYOUT:
        kept = 0  # part of a head decodes to nothing: keep the headers only
    else:
        kept = min(payload, room)
    esize = 0
    if codec == _CODEC_INT32 or codec == _CODEC_FLOAT32:
        esize = 4
    elif codec == _CODEC_FLOAT16 or codec == _CODEC_BFLOAT16:
        esize = 2
    if esize > 0:
        kept -= kept % esize  # parse_frame wants elem_count whole elements
        h.elem_count = kept // esize
    elif codec == _CODEC_BYTES:
        h.elem_count = kept
    h.head_bytes = kept  # a TRIMMED frame carries exactly head_bytes
    h.flags |= _FLAG_TRIMMED | (_FLAG_LASTHOP if lasthop else 0)
    frame[_OFF_TOS] = (dscp << 2) | (frame[_OFF_TOS] & 3)
    return set_payload_bytes(frame, kept)  # also the IPv4 checksum, after the TOS change


@njit(cache=True, inline="always")
def _due(p, now, ns_per_byte, burst_bytes, next_free, q_cnt):
    """Port ``p`` holds a frame whose departure time has come. Checked before calling
    :func:`_drain`, whose array arguments cost a reference count each per call."""
    return (q_cnt[Q_DATA, p] > 0 or q_cnt[Q_TRIMMED, p] > 0 or q_cnt[Q_CONTROL, p] > 0) and \
        next_free[p] <= now + burst_bytes[p] * ns_per_byte[p]


@njit(cache=True)
def _drain(p, now, modes, hdr_prio, share, deficit, ns_per_byte, burst_bytes, next_free, q_buf,
           q_len, q_ring, q_head, q_cnt, q_bytes, buf, length, base, room, k, emit_port, emitted,
           counters):
    """Emit port ``p``'s queued frames whose departure time has come (control first, then the
    trimmed and data queues by priority or byte share); return the new row count ``k``."""
    while k < room:
        has_c = q_cnt[Q_CONTROL, p] > 0
        has_h = q_cnt[Q_TRIMMED, p] > 0
        has_d = q_cnt[Q_DATA, p] > 0
        if not (has_c or has_h or has_d):
            break
        if next_free[p] > now + burst_bytes[p] * ns_per_byte[p]:
            break
        if has_c:
            c = Q_CONTROL
        elif not (has_h and has_d):
            deficit[p] = 0.0  # a queue that empties loses its credit (DRR)
            c = Q_TRIMMED if has_h else Q_DATA
        elif modes[p] == MODE_UET:
            c = Q_TRIMMED if deficit[p] >= 0.0 else Q_DATA
        else:
            c = Q_TRIMMED if hdr_prio else Q_DATA
        # pop written out here: an inlined helper taking the arrays cost a reference count
        # per array per frame
        h = q_head[c, p]
        s = q_ring[c, 0] + h
        ln = q_len[p, s]
        row = base + k
        buf[row, :ln] = q_buf[p, s, :ln]
        q_cnt[c, p] -= 1
        # an emptied ring starts over at its first slot: a port then touches only the slots
        # its deepest queue needed, not the whole ring its head would otherwise walk round
        # (each first touch of a page is a page fault, inside a collective; and the slots
        # in use stay in the caches)
        q_head[c, p] = (h + 1) % q_ring[c, 1] if q_cnt[c, p] else 0
        q_bytes[c, p] -= ln
        if c == Q_TRIMMED and has_d:
            deficit[p] -= (1.0 - share) * ln
        elif c == Q_DATA and has_h:
            deficit[p] += share * ln
        counters[p, C_DATA_BYTES + c] += ln
        length[row] = ln
        emit_port[k] = p
        k += 1
        next_free[p] += ln * ns_per_byte[p]
        counters[p, C_DEQUEUED] += 1
        emitted[p] = True
    return k


@njit(cache=True)
def _push(q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, c, p, frame, ln):
    """Append ``frame[:ln]`` to port ``p``'s ring of class ``c`` (caller checked there is a
    free slot)."""
    s = q_ring[c, 0] + (q_head[c, p] + q_cnt[c, p]) % q_ring[c, 1]
    q_buf[p, s, :ln] = frame[:ln]
    q_len[p, s] = ln
    q_cnt[c, p] += 1
    q_bytes[c, p] += ln


@njit(cache=True)
def earliest_departure(q_cnt, next_free):
    """The earliest ``next_free`` of the ports holding a frame in any class (``inf``: none);
    a loop where the numpy twin (``next_free[q_cnt.sum(axis=0) > 0].min()``) took four array
    operations, run at the end of every burst (:func:`trim_packed`) for ``next_deadline_ns``,
    which an engine group asks after every burst of its nodes."""
    best = np.inf
    for p in range(next_free.shape[0]):
        for c in range(q_cnt.shape[0]):
            if q_cnt[c, p] > 0:
                if next_free[p] < best:
                    best = next_free[p]
                break
    return best


@njit(cache=True)
def trim_kernel(buf, length, out_port, reason, n, base, room, now, modes, hdr_prio, thr_bytes,
                trim_thr, thr_pkts, ecn_bytes, ns_per_byte, burst_bytes, next_free, q_buf,
                q_len, q_ring, q_head, q_cnt, q_bytes, dscp, trim_bytes, last_hop, share,
                deficit, counters, emit_port, emitted):
    """One burst of the trim stage: drain what is due, admit/trim/drop the batch's egress
    packets, drain again. Emitted frames go to rows ``base..base+k-1`` (at most ``room``) with
    their port in ``emit_port[:k]``; returns ``k``.

    The queues of every port share ``q_buf`` / ``q_len``: class ``c`` (``Q_DATA``,
    ``Q_TRIMMED``, ``Q_CONTROL``) owns the ``q_ring[c, 1]`` slots from ``q_ring[c, 0]``, with
    ``q_head`` / ``q_cnt`` / ``q_bytes[c, port]``. ``modes`` is each port's mode; ``dscp``,
    ``trim_bytes``, ``trim_thr``, ``last_hop``, ``share`` and the control ring serve its
    ``MODE_UET`` ports only."""
    n_ports = next_free.shape[0]
    nq = q_ring[Q_DATA, 1]
    nc = q_ring[Q_CONTROL, 1]
    for p in range(n_ports):
        emitted[p] = False
    k = 0
    for p in range(n_ports):
        if _due(p, now, ns_per_byte, burst_bytes, next_free, q_cnt):
            k = _drain(p, now, modes, hdr_prio, share, deficit, ns_per_byte, burst_bytes,
                       next_free, q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, buf, length,
                       base, room, k, emit_port, emitted, counters)
    for i in range(n):
        p = out_port[i]
        if p < 0 or p >= n_ports:
            continue  # undecided/dropped/held, or a port this stage does not know
        ln = length[i]
        if ln < 0 or ln > FRAME_MAX:  # cannot be a frame: never copy it into a slot
            out_port[i] = PORT_DROP
            reason[i] = _R_BAD_LENGTH
            counters[p, C_DROPPED] += 1
            continue
        dq_cnt = q_cnt[Q_DATA, p]
        hq_cnt = q_cnt[Q_TRIMMED, p]
        if dq_cnt == 0 and hq_cnt == 0 and q_cnt[Q_CONTROL, p] == 0 and not emitted[p] and \
                next_free[p] <= now + burst_bytes[p] * ns_per_byte[p]:
            next_free[p] = max(next_free[p], now) + ln * ns_per_byte[p]
            counters[p, C_PASSED] += 1
            continue
        mode = modes[p]
        d = frame_dscp(buf[i], ln) if mode == MODE_UET else -1
        if d >= 0 and d == dscp[D_CONTROL]:
            if q_cnt[Q_CONTROL, p] < nc:
                _push(q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, Q_CONTROL, p, buf[i], ln)
                out_port[i] = PORT_HELD
                counters[p, C_ENQUEUED] += 1
                counters[p, C_CTL_ENQUEUED] += 1
                if q_cnt[Q_CONTROL, p] > counters[p, C_CTL_HWM_PKTS]:
                    counters[p, C_CTL_HWM_PKTS] = q_cnt[Q_CONTROL, p]
                continue
            out_port[i] = PORT_DROP
            reason[i] = _R_QUEUE_FULL
            counters[p, C_DROPPED] += 1
            counters[p, C_CTL_DROPPED] += 1
            continue
        # the trimmed class: cut upstream (arrives so marked) or here (below); a full ring drops
        trimmed = d >= 0 and (d == dscp[D_TRIMMED] or d == dscp[D_TRIMMED_LH])
        if not trimmed:
            # a trimmable frame meets the port's trim threshold where it has one; every other
            # class keeps the drop-tail limit (TCP beside a UET job is not cut short)
            thr = trim_thr[p] if trim_thr[p] > 0 and d >= 0 and d == dscp[D_TRIMMABLE] \
                else thr_bytes[p]
            full = q_bytes[Q_DATA, p] + ln > thr or dq_cnt >= nq
            if thr_pkts[p] > 0 and dq_cnt >= thr_pkts[p]:
                full = True
            if not full:
                if ecn_bytes[p] > 0 and q_bytes[Q_DATA, p] >= ecn_bytes[p] and \
                        parse_frame(buf[i], ln) == 0:
                    header(buf[i]).flags |= _FLAG_ECN
                    wr_u16be(buf[i], OFF_UDP_CSUM, 0)
                    counters[p, C_ECN] += 1
                _push(q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, Q_DATA, p, buf[i], ln)
                out_port[i] = PORT_HELD
                counters[p, C_ENQUEUED] += 1
                if q_bytes[Q_DATA, p] > counters[p, C_HWM_BYTES]:
                    counters[p, C_HWM_BYTES] = q_bytes[Q_DATA, p]
                if q_cnt[Q_DATA, p] > counters[p, C_HWM_PKTS]:
                    counters[p, C_HWM_PKTS] = q_cnt[Q_DATA, p]
                continue
        cut = False
        lh = False
        c = Q_TRIMMED
        if trimmed:
            pass
        elif mode == MODE_UET:
            if d < 0 or d != dscp[D_TRIMMABLE] or parse_frame(buf[i], ln) != 0:
                c = -1
            else:
                lh = last_hop[p]
                length[i] = uet_trim_frame(buf[i], trim_bytes[p],
                                           dscp[D_TRIMMED_LH] if lh else dscp[D_TRIMMED], lh)
                cut = True
        elif mode == MODE_TRIM:
            r = trim_frame(buf[i], ln)
            if r > 0 and r < ln:
                length[i] = r
                cut = True
                if not hdr_prio:
                    c = Q_DATA  # NDP without header priority: trimmed frames join the data
            else:
                c = -1
        else:
            c = -1
        if c >= 0:
            if q_cnt[c, p] < q_ring[c, 1]:
                _push(q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, c, p, buf[i], length[i])
                out_port[i] = PORT_HELD
                if cut:
                    counters[p, C_TRIMMED] += 1
                    if lh:
                        counters[p, C_TRIMMED_LH] += 1
                else:
                    counters[p, C_ENQUEUED] += 1
                    counters[p, C_PRETRIMMED] += 1
                if c == Q_TRIMMED and q_cnt[c, p] > counters[p, C_HDR_HWM_PKTS]:
                    counters[p, C_HDR_HWM_PKTS] = q_cnt[c, p]
                continue
            counters[p, C_TRIMMED_DROPPED] += 1
        out_port[i] = PORT_DROP
        reason[i] = _R_QUEUE_FULL
        counters[p, C_DROPPED] += 1
    for p in range(n_ports):
        if _due(p, now, ns_per_byte, burst_bytes, next_free, q_cnt):
            k = _drain(p, now, modes, hdr_prio, share, deficit, ns_per_byte, burst_bytes,
                       next_free, q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, buf, length,
                       base, room, k, emit_port, emitted, counters)
    return k


# ---------------------------------------------------------------------------------------------
# the stage


def _check_trim_bytes(v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) \
            or not PAYLOAD_OFFSET <= v <= FRAME_MAX:
        raise ValueError(f"trim_bytes: the frame length after a cut must be an integer from "
                         f"{PAYLOAD_OFFSET} (the minimum: Ethernet, IPv4, UDP and testbed "
                         f"headers) to {FRAME_MAX}, got {v!r}")
    return int(v)


def _check_mode(v):
    if v not in MODES:
        raise ValueError(f"trim: mode must be one of {MODES}, got {v!r}")
    return MODES.index(v)


def _check_bool(name: str):
    def check(v):
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{name}: must be True or False, got {v!r}")
        return bool(v)
    return check


#: the arrays :func:`trim_packed` takes in its table: the batch's four, then the stage's
BATCH_ARRAYS = ("buf", "length", "out_port", "reason")
STAGE_ARRAYS = ("modes", "thr_bytes", "trim_thr", "thr_pkts", "ecn_bytes", "ns_per_byte",
                "burst_bytes", "next_free", "q_buf", "q_len", "q_ring", "q_head", "q_cnt",
                "q_bytes", "dscp", "trim_bytes", "last_hop", "deficit", "counters_arr", "_emit",
                "_emitted", "_departure")
TRIM_SPEC = ("u1:2 i4:1 i2:1 u1:1 i8:1 i8:1 i8:1 i8:1 i8:1 f8:1 f8:1 f8:1 u1:3 i4:2 i8:2 i8:2 "
             "i8:2 i8:2 i8:1 i8:1 b1:1 f8:1 i8:2 i2:1 b1:1 f8:1")


@njit(cache=True)
def trim_packed(table, n, base, room, now, hdr_prio, share):
    """:func:`trim_kernel` with its arrays in one table (:mod:`testbed.kernels.packed`: one
    argument to unbox per burst instead of 25; ``BATCH_ARRAYS`` then ``STAGE_ARRAYS``), then
    the earliest departure of the frames left queued into ``departure[0]``
    (:func:`earliest_departure`; only this kernel changes the queues, so the stage's deadline
    reads it there instead of calling again after every burst)."""
    (buf, length, out_port, reason, modes, thr_bytes, trim_thr, thr_pkts, ecn_bytes,
     ns_per_byte, burst_bytes, next_free, q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, dscp,
     trim_bytes, last_hop, deficit, counters, emit_port, emitted,
     departure) = arrays_at(table, TRIM_SPEC)
    k = trim_kernel(buf, length, out_port, reason, n, base, room, now, modes, hdr_prio,
                    thr_bytes, trim_thr, thr_pkts, ecn_bytes, ns_per_byte, burst_bytes,
                    next_free, q_buf, q_len, q_ring, q_head, q_cnt, q_bytes, dscp, trim_bytes,
                    last_hop, share, deficit, counters, emit_port, emitted)
    departure[0] = earliest_departure(q_cnt, next_free)
    return k


class TrimStage(PackedStage):
    """Per-port egress queue drained at ``rate_mbps`` that trims above a threshold (``trim``).

    Settings (constructor and :meth:`configure`; per-port ones take one value for all ports, a
    ``{port: value}`` dict by name or index, or a list with one value per port):

    * ``rate_mbps`` (per port, > 0): drain rate of the port, Mb/s of frame bytes;
    * ``threshold_bytes`` (per port; alias ``threshold``): data-queue depth above which packets
      are trimmed (``mode="trim"``/``"uet"``) or dropped (``mode="drop_tail"``);
    * ``threshold_bdp`` (per port, > 0): the threshold as that many bandwidth-delay products
      ``rate_mbps * rtt_us / 8`` bytes (times ``lasthop_factor`` on ``last_hop`` ports),
      recomputed when the rate or RTT change; a port given ``threshold_bytes`` later leaves it;
    * ``rtt_us`` (per port, > 0): the plane's base RTT, for ``threshold_bdp``;
    * ``last_hop`` (per port, bool, default False): the port faces a host (UET's last hop);
    * ``lasthop_factor`` (> 0, default 1.5): the BDP threshold's multiple on last-hop ports;
    * ``threshold_pkts`` (per port, 0 = no packet limit): the same in packets;
    * ``ecn_threshold_bytes`` (per port, 0 = off): mark ``Flags.ECN`` from this depth on;
    * ``burst_bytes`` (per port, default 0): how far a port may run ahead of its drain clock;
    * ``mode`` (per port): ``"trim"``, ``"drop_tail"`` or ``"uet"``; ``header_priority``:
      serve trimmed headers first (``trim`` mode);
    * ``uet`` mode: ``trim_threshold_bytes`` (per port, 0 = off, the default): the data-queue
      depth above which a *trimmable* frame is cut, while every other class keeps
      ``threshold_bytes`` (a port trimming one job's UET packets at a BDP need not drop the
      TCP beside it at that depth); ``trim_bytes`` (per port, frame length after a cut,
      default 128), ``trimmed_share`` (in (0, 1], default 0.5), ``dscp_control`` (46),
      ``dscp_trimmable`` (8), ``dscp_trimmed`` (26), ``dscp_trimmed_lasthop`` (28) (values
      0..63).

    Construction only: ``queue_slots`` / ``header_slots`` (256) / ``control_slots`` (64):
    frames the data, header (trimmed) and control queues can hold per port.
    """

    name = "trim"
    max_expansion = 2

    batch_arrays, stage_arrays, spec = BATCH_ARRAYS, STAGE_ARRAYS, TRIM_SPEC  # trim_packed's

    def __init__(self, ports: list[str] | None = None, n_ports: int | None = None,
                 rate_mbps=100.0, threshold_bytes=None, threshold=None, threshold_pkts=0,
                 ecn_threshold_bytes=0, mode: str = "trim", header_priority: bool = True,
                 queue_slots: int = 256, header_slots: int = 256, burst_bytes=0,
                 control_slots: int = 64, threshold_bdp=None, rtt_us=None, last_hop=None,
                 lasthop_factor=None, trim_bytes=None, trimmed_share=None, dscp_control=None,
                 dscp_trimmable=None, dscp_trimmed=None, dscp_trimmed_lasthop=None,
                 trim_threshold_bytes=None):
        self.ports = resolve_ports(ports, n_ports, "trim")
        n = len(self.ports)
        q = check_number("queue_slots", 1, 65536, integer=True)(queue_slots)
        h = check_number("header_slots", 1, 65536, integer=True)(header_slots)
        c = check_number("control_slots", 1, 65536, integer=True)(control_slots)
        # one buffer for the three rings of every port: the kernel takes 6 arrays, not 15
        self.q_ring = np.array([[0, q], [q, h], [q + h, c]], np.int64)  # first slot, slots
        self.q_buf = sparse_zeros((n, q + h + c, FRAME_MAX), np.uint8)
        self.q_len = np.zeros((n, q + h + c), np.int32)
        self.q_head, self.q_cnt, self.q_bytes = (np.zeros((3, n), np.int64) for _ in range(3))
        # per-queue views (dq: data, hq: trimmed/header, cq: control)
        for name, k in (("dq", Q_DATA), ("hq", Q_TRIMMED), ("cq", Q_CONTROL)):
            for a in ("head", "cnt", "bytes"):
                setattr(self, f"{name}_{a}", getattr(self, f"q_{a}")[k])
        self.next_free = np.zeros(n, np.float64)  # ns since self._epoch
        self.rate_mbps = np.full(n, 100.0, np.float64)
        self.ns_per_byte = np.full(n, 8000.0 / 100.0, np.float64)  # 100 Mb/s unless given
        self.burst_bytes = np.zeros(n, np.float64)
        self.thr_bytes = np.full(n, 64 * 1024, np.int64)
        self.trim_thr = np.zeros(n, np.int64)  # 0: the trimmable class meets thr_bytes too
        self.thr_bdp = np.zeros(n, np.float64)  # 0: the port's threshold is thr_bytes as given
        self.rtt_us = np.zeros(n, np.float64)  # 0: not given
        self.last_hop = np.zeros(n, np.bool_)
        self.lasthop_factor = LASTHOP_FACTOR
        self.thr_pkts = np.zeros(n, np.int64)
        self.ecn_bytes = np.zeros(n, np.int64)
        self.trim_bytes = np.full(n, TRIM_BYTES, np.int64)
        self.dscp = np.array(DSCP_DEFAULTS, np.int64)
        self.trimmed_share = 0.5
        self.deficit = np.zeros(n, np.float64)  # bytes the trimmed queue may still send ahead
        self.counters_arr = np.zeros((n, len(COUNTER_NAMES)), np.int64)
        self._emit = np.zeros(0, np.int16)  # sized to the batch on first use
        self._emitted = np.zeros(n, np.bool_)
        self._departure = np.full(1, np.inf)  # the queues' earliest departure (trim_packed)
        self._epoch: int | None = None
        self.modes = np.full(n, MODE_TRIM, np.int64)
        self.header_priority = True
        if threshold_bytes is not None and threshold is not None:
            raise ValueError("trim: give threshold_bytes or its alias threshold, not both")
        self.configure(rate_mbps=rate_mbps,
                       threshold_bytes=threshold_bytes if threshold is None else threshold,
                       threshold_pkts=threshold_pkts, ecn_threshold_bytes=ecn_threshold_bytes,
                       mode=mode, header_priority=header_priority, burst_bytes=burst_bytes,
                       threshold_bdp=threshold_bdp, rtt_us=rtt_us, last_hop=last_hop,
                       lasthop_factor=lasthop_factor, trim_bytes=trim_bytes,
                       trimmed_share=trimmed_share, dscp_control=dscp_control,
                       dscp_trimmable=dscp_trimmable, dscp_trimmed=dscp_trimmed,
                       dscp_trimmed_lasthop=dscp_trimmed_lasthop,
                       trim_threshold_bytes=trim_threshold_bytes)

    @property
    def mode(self) -> int:
        """The ports' mode (an index of ``MODES``) where they all have one, else -1."""
        return int(self.modes[0]) if (self.modes == self.modes[0]).all() else -1

    def configure(self, rate_mbps=None, threshold_bytes=None, threshold=None,
                  threshold_pkts=None, ecn_threshold_bytes=None, mode=None,
                  header_priority=None, burst_bytes=None, threshold_bdp=None, rtt_us=None,
                  last_hop=None, lasthop_factor=None, trim_bytes=None, trimmed_share=None,
                  dscp_control=None, dscp_trimmable=None, dscp_trimmed=None,
                  dscp_trimmed_lasthop=None, trim_threshold_bytes=None, **unknown) -> None:
        """Change rates, thresholds, mode or the UET settings at run time (see the class doc).
        A setting that is refused changes nothing."""
        if unknown:
            raise ValueError(f"trim: unknown settings {sorted(unknown)}; use rate_mbps, "
                             "threshold_bytes (or threshold), threshold_bdp, rtt_us, last_hop, "
                             "lasthop_factor, threshold_pkts, ecn_threshold_bytes, burst_bytes, "
                             "mode, header_priority, trim_bytes, trim_threshold_bytes, "
                             "trimmed_share, "
                             f"{', '.join(DSCP_SETTINGS)}")
        if threshold is not None:
            if threshold_bytes is not None:
                raise ValueError("trim: give threshold_bytes or its alias threshold, not both")
            threshold_bytes = threshold
        # validate everything before changing anything: a bad setting changes nothing
        updates = []
        rates = self.rate_mbps.copy()
        if rate_mbps is not None:
            r = per_port(rate_mbps, self.ports, "trim: rate_mbps",
                         check_number("rate_mbps", 1e-3, 1e6))
            updates.append((self.ns_per_byte, {p: 8000.0 / v for p, v in r.items()}))
            for p, v in r.items():
                rates[p] = v
        bdp, rtt, lh = self.thr_bdp.copy(), self.rtt_us.copy(), self.last_hop.copy()
        by_bytes: dict[int, object] = {}
        if threshold_bytes is not None:
            by_bytes = per_port(threshold_bytes, self.ports, "trim: threshold_bytes",
                                check_number("threshold_bytes", 0, 2**40, integer=True))
            updates.append((self.thr_bytes, by_bytes))
            for p in by_bytes:
                bdp[p] = 0.0
        if threshold_bdp is not None:
            by_bdp = per_port(threshold_bdp, self.ports, "trim: threshold_bdp",
                              check_number("threshold_bdp", 0, 1e6, lo_open=True))
            both = sorted(self.ports[p] for p in set(by_bdp) & set(by_bytes))
            if both:
                raise ValueError(f"trim: ports {both} got both threshold_bytes and "
                                 "threshold_bdp; give each port one of them")
            for p, v in by_bdp.items():
                bdp[p] = v
        if rtt_us is not None:
            for p, v in per_port(rtt_us, self.ports, "trim: rtt_us",
                                 check_number("rtt_us", 0, 1e9, lo_open=True)).items():
                rtt[p] = v
        if last_hop is not None:
            for p, v in per_port(last_hop, self.ports, "trim: last_hop",
                                 _check_bool("last_hop")).items():
                lh[p] = v
        factor = self.lasthop_factor if lasthop_factor is None else \
            check_number("lasthop_factor", 0, 1000, lo_open=True)(lasthop_factor)
        unset = [self.ports[p] for p in range(len(self.ports)) if bdp[p] > 0 and rtt[p] <= 0]
        if unset:
            raise ValueError(f"trim: threshold_bdp needs rtt_us (the plane's base RTT, µs > 0) "
                             f"on ports {unset}")
        if threshold_pkts is not None:
            updates.append((self.thr_pkts, per_port(
                threshold_pkts, self.ports, "trim: threshold_pkts",
                check_number("threshold_pkts", 0, int(self.q_ring[Q_DATA, 1]), integer=True))))
        if ecn_threshold_bytes is not None:
            updates.append((self.ecn_bytes, per_port(
                ecn_threshold_bytes, self.ports, "trim: ecn_threshold_bytes",
                check_number("ecn_threshold_bytes", 0, 2**40, integer=True))))
        if burst_bytes is not None:
            updates.append((self.burst_bytes, per_port(
                burst_bytes, self.ports, "trim: burst_bytes",
                check_number("burst_bytes", 0, 2**30, integer=True))))
        if trim_threshold_bytes is not None:
            updates.append((self.trim_thr, per_port(
                trim_threshold_bytes, self.ports, "trim: trim_threshold_bytes",
                check_number("trim_threshold_bytes", 0, 2**40, integer=True))))
        if mode is not None:
            updates.append((self.modes, per_port(mode, self.ports, "trim: mode", _check_mode)))
        if trim_bytes is not None:
            updates.append((self.trim_bytes, per_port(trim_bytes, self.ports,
                                                      "trim: trim_bytes", _check_trim_bytes)))
        share = self.trimmed_share if trimmed_share is None else \
            check_number("trimmed_share", 0, 1, lo_open=True)(trimmed_share)
        dscp = self.dscp.copy()
        for j, (name, v) in enumerate(zip(DSCP_SETTINGS, (
                dscp_control, dscp_trimmed, dscp_trimmed_lasthop, dscp_trimmable), strict=True)):
            if v is not None:
                dscp[j] = check_number(name, 0, 63, integer=True)(v)
        # one class per value; a single TRIMMED class for both kinds of cut is allowed
        classes = {D_CONTROL: "dscp_control", D_TRIMMABLE: "dscp_trimmable"}
        for a, b in ((D_CONTROL, D_TRIMMABLE), (D_CONTROL, D_TRIMMED), (D_CONTROL, D_TRIMMED_LH),
                     (D_TRIMMABLE, D_TRIMMED), (D_TRIMMABLE, D_TRIMMED_LH)):
            if dscp[a] == dscp[b]:
                raise ValueError(f"trim: {classes[a]} and {DSCP_SETTINGS[b]} are both "
                                 f"{dscp[a]}; each class needs its own DSCP value (only "
                                 "dscp_trimmed and dscp_trimmed_lasthop may be equal)")
        for arr, vals in updates:
            for p, v in vals.items():
                arr[p] = v
        self.rate_mbps[:] = rates
        self.thr_bdp[:], self.rtt_us[:], self.last_hop[:] = bdp, rtt, lh
        self.lasthop_factor, self.trimmed_share = factor, share
        self.dscp[:] = dscp
        self._bdp_thresholds()
        if header_priority is not None:
            self.header_priority = bool(header_priority)

    def _bdp_thresholds(self) -> None:
        """Set the threshold of every ``threshold_bdp`` port from its rate and RTT."""
        for p in np.flatnonzero(self.thr_bdp > 0):
            lh = self.lasthop_factor if self.last_hop[p] else 1.0
            self.thr_bytes[p] = int(self.thr_bdp[p] * self.rate_mbps[p] * self.rtt_us[p] / 8.0
                                    * lh)

    def process(self, batch: Batch, now_ns: int) -> None:
        """Queue/trim/drop the batch's egress packets and append the frames now due."""
        if self._epoch is None:
            self._epoch = int(now_ns)
        now = float(now_ns - self._epoch)
        base = batch.n
        if self._emit.shape[0] < batch.capacity:
            self._emit = np.zeros(batch.capacity, np.int16)
        k = trim_packed(self.table(batch), batch.n, base, batch.capacity - base, now,
                        self.header_priority, self.trimmed_share)
        if k:
            append_emitted(batch, k, self._emit, batch.out_port)

    def next_deadline_ns(self) -> int | None:
        """When the earliest non-empty port's next queued frame is due on its exact clock."""
        if self._epoch is None:
            return None
        # the head frame's time on the exact clock, not the burst's head start: a port woken
        # then sends a burst's worth at once (never early by more than the burst), so the
        # engine wakes once per burst rather than once per frame
        t = float(self._departure[0])
        return None if t == math.inf else self._epoch + int(math.ceil(t))

    def queued(self) -> int:
        """Frames held in all queues now."""
        return int(self.q_cnt.sum())

    def counters(self) -> dict:
        """Per-port queue counters (see the module docstring) and their totals."""
        ports = {}
        for p, name in enumerate(self.ports):
            c = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr[p], strict=True)}
            c["mode"] = MODES[self.modes[p]]
            c["depth_bytes"] = int(self.q_bytes[:, p].sum())
            c["depth_pkts"] = int(self.q_cnt[:, p].sum())
            ports[name] = c
        totals = {k: int(self.counters_arr[:, j].sum()) for j, k in enumerate(COUNTER_NAMES)
                  if "hwm" not in k}
        # "mode": the ports' one mode, or "mixed" (each port's is in its counters)
        mode = MODES[self.mode] if self.mode >= 0 else "mixed"
        return {"mode": mode, "ports": ports, "totals": totals}


#: a kernel qdisc's default limit (``txqueuelen``), the ``shape`` stage's default queue
TXQUEUELEN = 1000
#: frames a ``shape`` port's trimmed and control queues hold (used once the port trims as UET
#: does; unused slots cost no resident memory)
SHAPE_TRIMMED_SLOTS = 128
SHAPE_CONTROL_SLOTS = 32
#: the ``shape`` stage's default burst: the one Mininet gives an HTB class (``burst 15k``)
HTB_BURST_BYTES = 15_000


class ShapeStage(TrimStage):
    """A port's egress link in the engine (``shape``): the ``trim`` stage's queue in
    ``drop_tail`` mode, drained at the link's rate. A programmable switch shapes its own ports
    with it instead of the kernel's HTB qdisc (see ``testbed.topologies.pipeline``).

    Settings: ``rate_mbps`` (per port; a port not named is not shaped), ``threshold_bytes``
    and ``threshold_pkts`` (drop above either; by default the kernel's ``txqueuelen`` of 1000
    frames), ``burst_bytes`` (by default HTB's 15 000 B as Mininet sets it: an engine woken
    for a queued frame sends up to that much ahead of the port's clock, not one frame per
    wake-up), ``ecn_threshold_bytes`` and, at construction only, ``queue_slots``.

    A port may trim as a UET switch does (``mode={port: "uet"}`` with a
    ``trim_threshold_bytes``, and the ``trim`` stage's UET settings): the provider turns the
    ports a UET job's traffic crosses into trimming ports while it runs
    (``testbed.provider.trimming``). Its trimmable packets are then cut above that threshold,
    its control packets overtake the data, and every other class keeps the drop-tail limits
    above. ``mode="trim"`` (NDP) is the ``trim`` stage's alone.
    """

    name = "shape"

    def __init__(self, ports: list[str] | None = None, n_ports: int | None = None,
                 rate_mbps=None, threshold_bytes=1 << 40, threshold_pkts=TXQUEUELEN,
                 queue_slots: int = TXQUEUELEN, burst_bytes=HTB_BURST_BYTES,
                 mode: str = "drop_tail"):
        super().__init__(ports, n_ports, threshold_bytes=threshold_bytes,
                         threshold_pkts=threshold_pkts, mode=mode, queue_slots=queue_slots,
                         header_slots=SHAPE_TRIMMED_SLOTS, control_slots=SHAPE_CONTROL_SLOTS,
                         burst_bytes=burst_bytes)
        self.ns_per_byte[:] = 0.0  # no drain time: the kernel passes every frame at once
        if rate_mbps is not None:
            self.configure(rate_mbps=rate_mbps)

    def configure(self, mode=None, **settings) -> None:
        """Change rates, thresholds or a port's mode at run time (see the class doc)."""
        if mode is not None:
            modes = mode.values() if isinstance(mode, dict) else \
                mode if isinstance(mode, (list, tuple)) else [mode]
            bad = [m for m in modes if m not in ("drop_tail", "uet")]
            if bad:
                raise ValueError(f"shape: mode={bad[0]!r}; a shaping port drops its tail or "
                                 "trims as UET does ('drop_tail' or 'uet'; NDP trimming is "
                                 "the 'trim' stage)")
        super().configure(mode=mode, **settings)
