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
Packets leave in FIFO order per queue; nothing overtakes a held packet of the same port.
Broadcast/flood copies are expanded by the engine after all stages, so they bypass the queue.

Counters per port: ``passed`` (left without queueing), ``enqueued``, ``trimmed``, ``dropped``,
``dequeued``, ``ecn_marked``, ``hwm_bytes`` / ``hwm_pkts`` (data queue high-water marks),
``hdr_hwm_pkts``, and the current ``depth_bytes`` / ``depth_pkts``.
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
    Stage,
)
from testbed.kernels.checks import check_number
from testbed.kernels.packets import OFF_UDP_CSUM, header, parse_frame, wr_u16be
from testbed.kernels.trimming import trim_frame
from testbed.kernels.wire import Flags

MODES = ("trim", "drop_tail")
MODE_TRIM = 0
MODE_DROP_TAIL = 1

# per-port counter columns
(C_PASSED, C_ENQUEUED, C_TRIMMED, C_DROPPED, C_DEQUEUED, C_ECN, C_HWM_BYTES, C_HWM_PKTS,
 C_HDR_HWM_PKTS) = range(9)
COUNTER_NAMES = ("passed", "enqueued", "trimmed", "dropped", "dequeued", "ecn_marked",
                 "hwm_bytes", "hwm_pkts", "hdr_hwm_pkts")

_R_QUEUE_FULL = int(DropReason.QUEUE_FULL)
_R_BAD_LENGTH = int(DropReason.BAD_LENGTH)
_FLAG_ECN = int(Flags.ECN)


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


@njit(cache=True)
def _drain(p, now, hdr_prio, ns_per_byte, burst_bytes, next_free, dq_buf, dq_len, dq_head,
           dq_cnt, dq_bytes, hq_buf, hq_len, hq_head, hq_cnt, hq_bytes, buf, length, base, room,
           k, emit_port, emitted, counters):
    """Emit port ``p``'s queued frames whose departure time has come (header queue first);
    return the new number of emitted rows ``k``."""
    nq = dq_len.shape[1]
    nh = hq_len.shape[1]
    while k < room:
        use_h = hq_cnt[p] > 0 and (hdr_prio or dq_cnt[p] == 0)
        if not use_h and dq_cnt[p] == 0:
            break
        if next_free[p] > now + burst_bytes[p] * ns_per_byte[p]:
            break
        row = base + k
        if use_h:
            s = hq_head[p]
            ln = hq_len[p, s]
            buf[row, :ln] = hq_buf[p, s, :ln]
            hq_head[p] = (s + 1) % nh
            hq_cnt[p] -= 1
            hq_bytes[p] -= ln
        else:
            s = dq_head[p]
            ln = dq_len[p, s]
            buf[row, :ln] = dq_buf[p, s, :ln]
            dq_head[p] = (s + 1) % nq
            dq_cnt[p] -= 1
            dq_bytes[p] -= ln
        length[row] = ln
        emit_port[k] = p
        k += 1
        next_free[p] += ln * ns_per_byte[p]
        counters[p, C_DEQUEUED] += 1
        emitted[p] = True
    return k


@njit(cache=True)
def _push(qbuf, qlen, head, cnt, qbytes, p, frame, ln):
    """Append ``frame[:ln]`` to port ``p``'s ring (caller checked there is a free slot)."""
    s = (head[p] + cnt[p]) % qlen.shape[1]
    qbuf[p, s, :ln] = frame[:ln]
    qlen[p, s] = ln
    cnt[p] += 1
    qbytes[p] += ln


@njit(cache=True)
def trim_kernel(buf, length, out_port, reason, n, base, room, now, mode, hdr_prio, thr_bytes,
                thr_pkts, ecn_bytes, ns_per_byte, burst_bytes, next_free, dq_buf, dq_len,
                dq_head, dq_cnt, dq_bytes, hq_buf, hq_len, hq_head, hq_cnt, hq_bytes, counters,
                emit_port, emitted):
    """One burst of the trim stage: drain what is due, admit/trim/drop the batch's egress
    packets, drain again. Emitted frames go to rows ``base..base+k-1`` (at most ``room``) with
    their port in ``emit_port[:k]``; returns ``k``."""
    n_ports = next_free.shape[0]
    nq = dq_len.shape[1]
    nh = hq_len.shape[1]
    for p in range(n_ports):
        emitted[p] = False
    k = 0
    for p in range(n_ports):
        if dq_cnt[p] > 0 or hq_cnt[p] > 0:
            k = _drain(p, now, hdr_prio, ns_per_byte, burst_bytes, next_free, dq_buf, dq_len,
                       dq_head, dq_cnt, dq_bytes, hq_buf, hq_len, hq_head, hq_cnt, hq_bytes, buf,
                       length, base, room, k, emit_port, emitted, counters)
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
        if dq_cnt[p] == 0 and hq_cnt[p] == 0 and not emitted[p] and \
                next_free[p] <= now + burst_bytes[p] * ns_per_byte[p]:
            next_free[p] = max(next_free[p], now) + ln * ns_per_byte[p]
            counters[p, C_PASSED] += 1
            continue
        full = dq_bytes[p] + ln > thr_bytes[p] or dq_cnt[p] >= nq
        if thr_pkts[p] > 0 and dq_cnt[p] >= thr_pkts[p]:
            full = True
        if not full:
            if ecn_bytes[p] > 0 and dq_bytes[p] >= ecn_bytes[p] and parse_frame(buf[i], ln) == 0:
                header(buf[i]).flags |= _FLAG_ECN
                wr_u16be(buf[i], OFF_UDP_CSUM, 0)
                counters[p, C_ECN] += 1
            _push(dq_buf, dq_len, dq_head, dq_cnt, dq_bytes, p, buf[i], ln)
            out_port[i] = PORT_HELD
            counters[p, C_ENQUEUED] += 1
            if dq_bytes[p] > counters[p, C_HWM_BYTES]:
                counters[p, C_HWM_BYTES] = dq_bytes[p]
            if dq_cnt[p] > counters[p, C_HWM_PKTS]:
                counters[p, C_HWM_PKTS] = dq_cnt[p]
            continue
        if mode == MODE_TRIM:
            r = trim_frame(buf[i], ln)
            if r > 0 and r < ln:
                length[i] = r
                if hdr_prio:
                    if hq_cnt[p] < nh:
                        _push(hq_buf, hq_len, hq_head, hq_cnt, hq_bytes, p, buf[i], r)
                        out_port[i] = PORT_HELD
                        counters[p, C_TRIMMED] += 1
                        if hq_cnt[p] > counters[p, C_HDR_HWM_PKTS]:
                            counters[p, C_HDR_HWM_PKTS] = hq_cnt[p]
                        continue
                elif dq_cnt[p] < nq:
                    _push(dq_buf, dq_len, dq_head, dq_cnt, dq_bytes, p, buf[i], r)
                    out_port[i] = PORT_HELD
                    counters[p, C_TRIMMED] += 1
                    continue
        out_port[i] = PORT_DROP
        reason[i] = _R_QUEUE_FULL
        counters[p, C_DROPPED] += 1
    for p in range(n_ports):
        if dq_cnt[p] > 0 or hq_cnt[p] > 0:
            k = _drain(p, now, hdr_prio, ns_per_byte, burst_bytes, next_free, dq_buf, dq_len,
                       dq_head, dq_cnt, dq_bytes, hq_buf, hq_len, hq_head, hq_cnt, hq_bytes, buf,
                       length, base, room, k, emit_port, emitted, counters)
    return k


# ---------------------------------------------------------------------------------------------
# the stage


class TrimStage(Stage):
    """Per-port egress queue drained at ``rate_mbps`` that trims above a threshold (``trim``).

    Settings (constructor and :meth:`configure`; per-port ones take one value for all ports, a
    ``{port: value}`` dict by name or index, or a list with one value per port):

    * ``rate_mbps`` (per port, > 0): drain rate of the port, Mb/s of frame bytes;
    * ``threshold_bytes`` (per port; alias ``threshold``): data-queue depth above which packets
      are trimmed (``mode="trim"``) or dropped (``mode="drop_tail"``);
    * ``threshold_pkts`` (per port, 0 = no packet limit): the same in packets;
    * ``ecn_threshold_bytes`` (per port, 0 = off): mark ``Flags.ECN`` from this depth on;
    * ``burst_bytes`` (per port, default 0): how far a port may run ahead of its drain clock;
    * ``mode``: ``"trim"`` or ``"drop_tail"``; ``header_priority``: serve trimmed headers first.

    Construction only: ``queue_slots`` / ``header_slots`` (frames each queue can hold per port).
    """

    name = "trim"
    max_expansion = 2

    def __init__(self, ports: list[str] | None = None, n_ports: int | None = None,
                 rate_mbps=100.0, threshold_bytes=None, threshold=None, threshold_pkts=0,
                 ecn_threshold_bytes=0, mode: str = "trim", header_priority: bool = True,
                 queue_slots: int = 256, header_slots: int = 256, burst_bytes=0):
        self.ports = resolve_ports(ports, n_ports, "trim")
        n = len(self.ports)
        q = check_number("queue_slots", 1, 65536, integer=True)(queue_slots)
        h = check_number("header_slots", 1, 65536, integer=True)(header_slots)
        self.dq_buf = np.zeros((n, q, FRAME_MAX), np.uint8)
        self.dq_len = np.zeros((n, q), np.int32)
        self.hq_buf = np.zeros((n, h, FRAME_MAX), np.uint8)
        self.hq_len = np.zeros((n, h), np.int32)
        for a in ("dq_head", "dq_cnt", "dq_bytes", "hq_head", "hq_cnt", "hq_bytes"):
            setattr(self, a, np.zeros(n, np.int64))
        self.next_free = np.zeros(n, np.float64)  # ns since self._epoch
        self.ns_per_byte = np.full(n, 8000.0 / 100.0, np.float64)  # 100 Mb/s unless given
        self.burst_bytes = np.zeros(n, np.float64)
        self.thr_bytes = np.full(n, 64 * 1024, np.int64)
        self.thr_pkts = np.zeros(n, np.int64)
        self.ecn_bytes = np.zeros(n, np.int64)
        self.counters_arr = np.zeros((n, len(COUNTER_NAMES)), np.int64)
        self._emit = np.zeros(0, np.int16)  # sized to the batch on first use
        self._emitted = np.zeros(n, np.bool_)
        self._epoch: int | None = None
        self.mode = MODE_TRIM
        self.header_priority = True
        if threshold_bytes is not None and threshold is not None:
            raise ValueError("trim: give threshold_bytes or its alias threshold, not both")
        self.configure(rate_mbps=rate_mbps,
                       threshold_bytes=threshold_bytes if threshold is None else threshold,
                       threshold_pkts=threshold_pkts, ecn_threshold_bytes=ecn_threshold_bytes,
                       mode=mode, header_priority=header_priority, burst_bytes=burst_bytes)

    def configure(self, rate_mbps=None, threshold_bytes=None, threshold=None,
                  threshold_pkts=None, ecn_threshold_bytes=None, mode=None,
                  header_priority=None, burst_bytes=None, **unknown) -> None:
        """Change rates, thresholds, mode or header priority at run time (see the class doc)."""
        if unknown:
            raise ValueError(f"trim: unknown settings {sorted(unknown)}; use rate_mbps, "
                             "threshold_bytes (or threshold), threshold_pkts, "
                             "ecn_threshold_bytes, burst_bytes, mode, header_priority")
        if threshold is not None:
            if threshold_bytes is not None:
                raise ValueError("trim: give threshold_bytes or its alias threshold, not both")
            threshold_bytes = threshold
        # validate everything before changing anything: a bad setting changes nothing
        updates = []
        if rate_mbps is not None:
            r = per_port(rate_mbps, self.ports, "trim: rate_mbps",
                         check_number("rate_mbps", 1e-3, 1e6))
            updates.append((self.ns_per_byte, {p: 8000.0 / v for p, v in r.items()}))
        if threshold_bytes is not None:
            updates.append((self.thr_bytes, per_port(
                threshold_bytes, self.ports, "trim: threshold_bytes",
                check_number("threshold_bytes", 0, 2**40, integer=True))))
        if threshold_pkts is not None:
            updates.append((self.thr_pkts, per_port(
                threshold_pkts, self.ports, "trim: threshold_pkts",
                check_number("threshold_pkts", 0, self.dq_len.shape[1], integer=True))))
        if ecn_threshold_bytes is not None:
            updates.append((self.ecn_bytes, per_port(
                ecn_threshold_bytes, self.ports, "trim: ecn_threshold_bytes",
                check_number("ecn_threshold_bytes", 0, 2**40, integer=True))))
        if burst_bytes is not None:
            updates.append((self.burst_bytes, per_port(
                burst_bytes, self.ports, "trim: burst_bytes",
                check_number("burst_bytes", 0, 2**30, integer=True))))
        if mode is not None and mode not in MODES:
            raise ValueError(f"trim: mode must be one of {MODES}, got {mode!r}")
        for arr, vals in updates:
            for p, v in vals.items():
                arr[p] = v
        if mode is not None:
            self.mode = MODES.index(mode)
        if header_priority is not None:
            self.header_priority = bool(header_priority)

    def process(self, batch: Batch, now_ns: int) -> None:
        """Queue/trim/drop the batch's egress packets and append the frames now due."""
        if self._epoch is None:
            self._epoch = int(now_ns)
        now = float(now_ns - self._epoch)
        base = batch.n
        if self._emit.shape[0] < batch.capacity:
            self._emit = np.zeros(batch.capacity, np.int16)
        k = trim_kernel(batch.buf, batch.length, batch.out_port, batch.reason, batch.n, base,
                        batch.capacity - base, now, self.mode, self.header_priority,
                        self.thr_bytes, self.thr_pkts, self.ecn_bytes, self.ns_per_byte,
                        self.burst_bytes, self.next_free, self.dq_buf, self.dq_len,
                        self.dq_head, self.dq_cnt, self.dq_bytes, self.hq_buf, self.hq_len,
                        self.hq_head, self.hq_cnt, self.hq_bytes, self.counters_arr, self._emit,
                        self._emitted)
        if k:
            append_emitted(batch, k, self._emit, batch.out_port)

    def next_deadline_ns(self) -> int | None:
        """When the earliest non-empty port's next queued frame is due on its exact clock."""
        busy = (self.dq_cnt + self.hq_cnt) > 0
        if self._epoch is None or not busy.any():
            return None
        # the head frame's time on the exact clock, not the burst's head start: a port woken
        # then sends a burst's worth at once (never early by more than the burst), so the
        # engine wakes once per burst rather than once per frame
        return self._epoch + int(math.ceil(float(self.next_free[busy].min())))

    def queued(self) -> int:
        """Frames held in all queues now."""
        return int(self.dq_cnt.sum() + self.hq_cnt.sum())

    def counters(self) -> dict:
        """Per-port queue counters (see the module docstring) and their totals."""
        ports = {}
        for p, name in enumerate(self.ports):
            c = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr[p], strict=True)}
            c["depth_bytes"] = int(self.dq_bytes[p] + self.hq_bytes[p])
            c["depth_pkts"] = int(self.dq_cnt[p] + self.hq_cnt[p])
            ports[name] = c
        totals = {k: int(self.counters_arr[:, j].sum()) for j, k in enumerate(COUNTER_NAMES)
                  if "hwm" not in k}
        return {"mode": MODES[self.mode], "ports": ports, "totals": totals}


#: a kernel qdisc's default limit (``txqueuelen``), the ``shape`` stage's default queue
TXQUEUELEN = 1000
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
    wake-up), ``ecn_threshold_bytes`` and, at construction only, ``queue_slots``. It never
    trims: ``mode`` can only be ``"drop_tail"``.
    """

    name = "shape"

    def __init__(self, ports: list[str] | None = None, n_ports: int | None = None,
                 rate_mbps=None, threshold_bytes=1 << 40, threshold_pkts=TXQUEUELEN,
                 queue_slots: int = TXQUEUELEN, burst_bytes=HTB_BURST_BYTES,
                 mode: str = "drop_tail"):
        super().__init__(ports, n_ports, threshold_bytes=threshold_bytes,
                         threshold_pkts=threshold_pkts, mode=mode, queue_slots=queue_slots,
                         header_slots=1, burst_bytes=burst_bytes)
        self.ns_per_byte[:] = 0.0  # no drain time: the kernel passes every frame at once
        if rate_mbps is not None:
            self.configure(rate_mbps=rate_mbps)

    def configure(self, mode=None, **settings) -> None:
        """Change rates or thresholds at run time (see the class doc)."""
        if mode not in (None, "drop_tail"):
            raise ValueError(f"shape: mode={mode!r}; a shaping queue only drops its tail "
                             "(a trimming queue is the 'trim' stage)")
        super().configure(mode=mode, **settings)
