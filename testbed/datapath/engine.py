"""The data-path engine: one process per node serving all its ports in batches.

Run inside the node's network namespace (``nodes.ProgrammableSwitch`` does this)::

    python -m testbed.datapath.engine --config tbs1.json --counters-out tbs1.counters.json \\
        testbed-node=tbs1

Config (JSON)::

    {"node": "tbs1", "ports": ["tbs1-eth1", "tbs1-eth2"],
     "programs": [{"name": "aggregate", "settings": {"jobs": {"1": {"n_workers": 4,
                                                                   "slots": 64}}}},
                  ["forward", {"learn": true}]],
     "flood_ports": null, "rx_burst": 256, "control_socket": "@/run/testbed/tbs1.sock",
     "control_fd": 3}

``control_socket`` is the control channel's address (``testbed.datapath.control``: an
abstract name ``@...`` or a path); ``control_fd``, when given, is a socket already listening
on it that the parent created in the root network namespace and passed down, so that the
channel is reachable from the provider's namespace only.

Loop: poll the ports (timeout bounded by the stages' ``next_deadline_ns``), receive up to
``rx_burst`` frames from all ports into one :class:`Batch` with ``recvmmsg``, run the stages in
order, then one Numba call tallies the batch and sorts rows per egress port (``PORT_FLOOD`` ->
``flood_ports`` but the ingress one) and one ``sendmmsg`` per port transmits them. While traffic
flows the loop does not poll at all. SIGTERM/SIGINT (or the control command ``stop``) end it
cleanly; final counters go to ``--counters-out``.

``python -m testbed.datapath.engine --fork-server FD --stages ...`` is the
engines' fork server instead (:mod:`testbed.datapath.forks`): a network's engines are forked
from it, with their kernels already loaded, and run :func:`main` as above.

Stages are looked up by name in :data:`testbed.datapath.programs.STAGES` (``"module:Class"``
strings, imported lazily) or given directly as ``"package.module:Class"``. A stage class is built with its settings as
keyword arguments, plus ``ports=[names]`` if its ``__init__`` accepts ``ports`` (or ``**kw``).

Why one module this long: it is the engine process (I/O loop, control socket, stage loading and
the ``@njit`` routing of bursts into the TX rings, which Numba's per-file cache must see
together with its callers).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import operator
import os
import select
import signal
import sys
import threading
import time
import traceback

import numpy as np
from numba import njit

from testbed.datapath.batch import (
    PORT_DROP,
    PORT_FLOOD,
    Batch,
    DropReason,
    Stage,
)
from testbed.datapath.control import ControlServer
from testbed.datapath.io import (
    RING_FRAME,
    MemoryPort,
    RingPort,
    disable_offloads,
    load_port_kernels,
    open_port,
    rings_rx,
    rings_tx,
)
from testbed.datapath.programs import normalize_programs, stage_class
from testbed.datapath.trace import Tracer
from testbed.kernels.packed import array_table, arrays_at
from testbed.lifeline import follow_owner
from testbed.warm import compile_lock

N_REASONS = 32
DEFAULT_RX_BURST = 256
DEFAULT_COALESCE_US = 50.0
#: scheduling of the engine's packet loop: ``fifo`` (real-time, priority
#: :data:`FIFO_PRIORITY`: a switch does not wait for the hosts' CPUs) or ``other`` (the
#: kernel's default time sharing)
SCHED_POLICIES = ("fifo", "other")
FIFO_PRIORITY = 1
#: the longest an idle engine waits before looking round (telemetry stays fresh)
IDLE_POLL_MS = 200
MAX_COALESCE_US = 10_000.0
DEFAULT_IO = "ring"
#: adaptive coalescing (see Engine): longest wait as a multiple of coalesce_us, and the CPU
#: fractions of a window above which the wait grows and below which it shrinks
COALESCE_MAX_FACTOR = 4
COALESCE_BUSY = 0.5
COALESCE_IDLE = 0.25
#: ring slots per port (x 2 KiB each): RX absorbs this many frames while the engine waits for
#: a CPU (4 ms at 500 kpps); TX holds a burst plus what a shaped port's qdisc still queues
RX_RING_FRAMES = 2048
TX_RING_FRAMES = 1024
#: sizing an RX ring by its port's rate (:func:`rx_ring_frames`): the smallest frame, the
#: CPU wait a ring absorbs (2048 slots of 64 B frames at 100 Mb/s: 10 ms) and the fewest slots
MIN_FRAME_BYTES = 64
RX_ABSORB_S = 0.010
MIN_RX_RING_FRAMES = 256


def rx_ring_frames(bw_mbps: float | None, time_dilation: float = 1.0,
                   coalesce_us: float = DEFAULT_COALESCE_US) -> int:
    """RX ring slots for ports of at most ``bw_mbps`` (None: unshaped) on a network dilated
    by ``time_dilation`` whose engines wait ``coalesce_us`` (already dilated): what arrives
    in smallest frames at the dilated rate while the engine waits out its longest coalescing
    wait and a CPU wait of :data:`RX_ABSORB_S`, in a power of two from
    :data:`MIN_RX_RING_FRAMES` to :data:`RX_RING_FRAMES`. A fat-tree k=8 switch at 100 Mb/s
    and dilation 64 needs 256 of the 2048 slots (3.5 MB of mapped ring a port less: 2.2 GB
    over its 80 switches)."""
    if bw_mbps is None:
        return RX_RING_FRAMES
    pps = bw_mbps * 1e6 / time_dilation / (8 * MIN_FRAME_BYTES)
    wait_s = COALESCE_MAX_FACTOR * coalesce_us * 1e-6 + RX_ABSORB_S
    need = max(MIN_RX_RING_FRAMES, int(pps * wait_s) + 1)
    return min(RX_RING_FRAMES, 1 << (need - 1).bit_length())


def at_once(fn, items: list) -> list:
    """``fn(item)`` for every item, each in a thread of its own, results (or the exception
    raised) in order. Opening and closing a packet socket's rings wait out a grace period
    of the kernel's (about 20 ms each): a node's ports done at once share them (a fat-tree
    k=8's 80 engines stopped in 3.7 s one port after the other, in 0.6 s at once)."""
    out: list = [None] * len(items)

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(items))]
    for t in threads:
        t.start()
    if items:
        run(0)
    for t in threads:
        t.join()
    return out


@contextlib.contextmanager
def signal_wakeup(poller):
    """A pipe registered with ``poller`` that a signal (SIGTERM: stop) makes readable, so an
    idle wait ends at once; without it the wait runs on after the handler (PEP 475), up to
    :data:`IDLE_POLL_MS` per engine at every teardown. Yields the pipe's read end."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        old_wake = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread (a test's engine): signals are not ours
        old_wake = None
    poller.register(wake_r, select.POLLIN)
    try:
        yield wake_r
    finally:
        if old_wake is not None:
            signal.set_wakeup_fd(old_wake)
        os.close(wake_r)
        os.close(wake_w)


def adapt_hold(hold_s: float, cpu_frac: float, base_s: float) -> float:
    """The coalescing wait for the next CPU window: doubled (up to ``COALESCE_MAX_FACTOR`` x
    ``base_s``) after a window in which the engine used more than ``COALESCE_BUSY`` of a CPU,
    halved (down to ``base_s``) after one below ``COALESCE_IDLE``, else unchanged."""
    if cpu_frac > COALESCE_BUSY:
        return min(hold_s * 2, base_s * COALESCE_MAX_FACTOR)
    if cpu_frac < COALESCE_IDLE:
        return max(hold_s / 2, base_s)
    return hold_s


def make_stage(name: str, settings: dict, ports: list[str]) -> Stage:
    """Instantiate program ``name`` with ``settings`` for a node with ``ports``."""
    cls = stage_class(name)
    params = inspect.signature(cls.__init__).parameters
    kw = dict(settings)
    if "ports" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kw.setdefault("ports", list(ports))
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"program {name!r}: bad settings {sorted(settings)} ({e})") from None


@njit(cache=True)
def tally_and_route(n, out_port, in_port, length, reason, n_ports, flood_mask, tx_rows,
                    tx_count, rx_pk, rx_by, tx_pk, tx_by, drops):
    """Count rx/drops of the batch and list, per egress port, the rows to send."""
    for p in range(n_ports):
        tx_count[p] = 0
    for i in range(n):
        ip_ = in_port[i]
        if ip_ >= 0:
            rx_pk[ip_] += 1
            rx_by[ip_] += length[i]
        op = out_port[i]
        if op >= 0:
            if op < n_ports:
                tx_rows[op, tx_count[op]] = i
                tx_count[op] += 1
                tx_pk[op] += 1
                tx_by[op] += length[i]
            else:
                drops[n_ports if ip_ < 0 else ip_, DropReason.OTHER] += 1  # a bad port from a stage
        elif op == PORT_FLOOD:
            for p in range(n_ports):
                if p != ip_ and flood_mask[p]:
                    tx_rows[p, tx_count[p]] = i
                    tx_count[p] += 1
                    tx_pk[p] += 1
                    tx_by[p] += length[i]
        elif op == PORT_DROP:
            drops[n_ports if ip_ < 0 else ip_, reason[i]] += 1
        elif op == -1:  # PORT_UNSET after all stages: nobody wanted it
            drops[n_ports if ip_ < 0 else ip_, DropReason.NO_ROUTE] += 1


#: the arrays of an engine's burst kernels (:func:`burst_rx`, :func:`burst_tx`), in the order
#: of their table (:mod:`testbed.kernels.packed`): the batch's, the ports' ring heads, sizes,
#: TX bases and slots filled, the flood mask, the TX lists and the counters; the ports' rings
#: follow them (``testbed.datapath.io.rings_rx``'s layout: RX bytes, RX words, then TX)
BURST_ARRAYS = ("batch.buf", "batch.length", "batch.in_port", "batch.out_port", "batch.reason",
                "_heads", "_rx_nframes", "_tx_nframes", "_tx_base", "_tx_done", "flood_mask",
                "tx_rows", "tx_count", "rx_pk", "rx_by", "tx_pk", "tx_by", "drops")
BURST_SPEC = "u1:2 i4:1 i2:1 i2:1 u1:1 i8:2 i8:1 i8:1 i8:1 i8:1 b1:1 i8:2 i8:1 i8:1 i8:1 i8:1 i8:1 i8:2"
#: the table's row of the first port's RX ring
RINGS_ROW = len(BURST_ARRAYS)


@njit(cache=True, _nrt=False)
def burst_rx(table, n_ports, start, prev_n, max_count):
    """One burst from every port's RX ring into the batch (:func:`testbed.datapath.io.
    rings_rx`), its arrays and the rings all in ``table`` (one argument to unbox per burst
    instead of about twenty: on the small bursts of an engine group that cost more than the
    copying). Returns the batch's new packet count."""
    (buf, length, in_port, out_port, reason, heads, rx_nframes, _, _, _, _, _, _, _, _, _, _,
     _) = arrays_at(table, BURST_SPEC)
    return rings_rx(table, RINGS_ROW, n_ports, heads, rx_nframes, start, buf, length, in_port,
                    out_port, reason, prev_n, max_count)


@njit(cache=True, _nrt=False)
def burst_tx(table, n, n_ports):
    """:func:`tally_and_route`, then every port's rows into its TX ring
    (:func:`testbed.datapath.io.rings_tx`), from the same table as :func:`burst_rx`: one
    call per burst. Returns the frames lost.

    Numba's on-disk cache of this function is keyed on this file alone: after a change to
    ``io.rings_tx``/``io.ring_tx`` only, the cached machine code still holds the old ones
    (delete ``testbed/datapath/__pycache__/engine.*.nb[ic]`` or touch this file)."""
    (buf, length, in_port, out_port, reason, heads, _, tx_nframes, tx_base, tx_done,
     flood_mask, tx_rows, tx_count, rx_pk, rx_by, tx_pk, tx_by, drops) = arrays_at(table,
                                                                                BURST_SPEC)
    tally_and_route(n, out_port, in_port, length, reason, n_ports, flood_mask, tx_rows,
                    tx_count, rx_pk, rx_by, tx_pk, tx_by, drops)
    return rings_tx(table, RINGS_ROW + 2 * n_ports, n_ports, heads, tx_base, tx_nframes, buf,
                    tx_rows, tx_count, length, tx_done)


def tally_reference(out_port: np.ndarray, in_port: np.ndarray, length: np.ndarray,
                    reason: np.ndarray, n_ports: int, flood_mask: np.ndarray) -> dict:
    """Numpy twin of :func:`tally_and_route` (vectorised; returns fresh arrays)."""
    op, ip_, ln = out_port.astype(np.int64), in_port.astype(np.int64), length.astype(np.int64)
    rows = {}
    tx_pk = np.zeros(n_ports, np.int64)
    tx_by = np.zeros(n_ports, np.int64)
    for p in range(n_ports):
        sel = (op == p) | ((op == PORT_FLOOD) & (ip_ != p) & bool(flood_mask[p]))
        rows[p] = np.flatnonzero(sel)
        tx_pk[p] = sel.sum()
        tx_by[p] = ln[sel].sum()
    rx = ip_ >= 0
    rx_pk = np.bincount(ip_[rx], minlength=n_ports)[:n_ports]
    rx_by = np.bincount(ip_[rx], weights=ln[rx], minlength=n_ports)[:n_ports].astype(np.int64)
    drops = np.zeros((n_ports + 1, N_REASONS), np.int64)
    row = np.where(ip_ < 0, n_ports, ip_)
    r = np.where(op == PORT_DROP, reason.astype(np.int64),
                 np.where(op == -1, int(DropReason.NO_ROUTE),
                          np.where(op >= n_ports, int(DropReason.OTHER), -1)))
    np.add.at(drops, (row[r >= 0], r[r >= 0]), 1)
    return {"rows": rows, "tx_pk": tx_pk, "tx_by": tx_by, "rx_pk": rx_pk, "rx_by": rx_by,
            "drops": drops}


class Engine:
    """The engine of one node (see the module docstring)."""

    def __init__(self, config: dict):
        self.config = dict(config)  # reported by the control command `config`
        self.node = str(config.get("node") or "tbnode")
        self.ports = list(config.get("ports") or [])
        if not self.ports:
            raise ValueError("config: 'ports' must list the node's interfaces")
        if len(set(self.ports)) != len(self.ports):
            raise ValueError(f"config: duplicate ports in {self.ports}")
        self.rx_burst = int(config.get("rx_burst", DEFAULT_RX_BURST))
        if not 1 <= self.rx_burst <= 1024:
            raise ValueError(f"config: rx_burst must be 1..1024, got {self.rx_burst}")
        # Interrupt coalescing (like NAPI): after a burst that was mostly empty, wait this long
        # before the next receive so that the per-burst Python cost is shared by more packets.
        # At tens of kpps it cuts the engine's CPU several-fold for a few tens of microseconds
        # of added latency; full bursts (saturation) never wait. 0 disables it. Adaptive (like
        # a NIC's adaptive interrupt moderation): while the engine keeps a CPU more than half
        # busy the wait doubles, up to COALESCE_MAX_FACTOR times this, and it comes back down
        # once the engine is mostly idle again; so latency is only traded for CPU when CPU is
        # what the emulation is short of. Stretched by a network's time dilation.
        self.set_coalesce(config.get("coalesce_us", DEFAULT_COALESCE_US))
        # Packet I/O: PACKET_MMAP rings ("ring", no system call to receive, one per port and
        # burst to send) or recvmmsg/sendmmsg ("mmsg"); see testbed.datapath.io.
        self.io_kind = str(config.get("io", DEFAULT_IO))
        if self.io_kind not in ("ring", "mmsg"):
            raise ValueError(f"config: io must be 'ring' or 'mmsg', got {self.io_kind!r}")
        self.ring_frames = {}
        for key, default in (("rx_ring_frames", RX_RING_FRAMES), ("tx_ring_frames",
                                                                  TX_RING_FRAMES)):
            v = int(config.get(key, default))
            if not (32 <= v <= 65536 or (v == 0 and key == "tx_ring_frames")):
                raise ValueError(f"config: {key} must be 32..65536 (tx_ring_frames: or 0, "
                                 f"to send with sendmmsg), got {v}")
            self.ring_frames[key] = v
        self.flood_mask = np.ones(len(self.ports), np.bool_)
        self.set_flood_ports(config.get("flood_ports"))
        self.stages: list[Stage] = [make_stage(n, s, self.ports)
                                    for n, s in normalize_programs(config.get("programs"))]
        expansion = max(int(getattr(s, "max_expansion", 1)) for s in self.stages)
        self.batch = Batch(self.rx_burst * max(2, expansion) + 64)
        self.tracer = Tracer(self.ports)  # armed by the control command `trace`
        self.control_path = config.get("control_socket")
        self.control_fd = config.get("control_fd")
        if self.control_fd is not None and not self.control_path:
            raise ValueError("config: control_fd needs control_socket (the address it listens on)")
        self.disable_offloads = bool(config.get("disable_offloads", True))
        self.sched = str(config.get("sched", "fifo"))
        if self.sched not in SCHED_POLICIES:
            raise ValueError(f"config: sched must be one of {SCHED_POLICIES}, got "
                             f"{self.sched!r}")
        self.config["sched"] = self.sched
        n = len(self.ports)
        self.rx_pk = np.zeros(n, np.int64)
        self.rx_by = np.zeros(n, np.int64)
        self.tx_pk = np.zeros(n, np.int64)
        self.tx_by = np.zeros(n, np.int64)
        self.drops = np.zeros((n + 1, N_REASONS), np.int64)  # row n: generated packets
        self.tx_rows = np.zeros((n, self.batch.capacity), np.int64)
        self.tx_count = np.zeros(n, np.int64)
        self.bursts = 0
        self.max_burst = 0
        self.stage_errors: dict[str, int] = {}
        self.running = False
        self.io = []
        self._rings = None
        self._table = self._table_heads = None  # the burst kernels' (_burst_table)
        self._kick_ports: list = []
        self.control = None
        self._t0 = time.monotonic()
        self._cpu0 = time.process_time()
        self._cpu_win = (self._t0, self._cpu0, 0.0)  # (wall, cpu, last fraction)
        self.cpu_max = 0.0  # highest 0.5 s CPU fraction seen while serving
        #: the engine group this node is served by (None: a process of its own), which
        #: tells its CPU share (:meth:`cpu_seconds`)
        self.group = None

    # --- lifecycle ---------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile/load every kernel on an empty batch so the first packets are not late."""
        self.batch.reset()
        for s in self.stages:
            s.process(self.batch, time.monotonic_ns())
            s.next_deadline_ns()
        self._route(self.batch.n)
        self.batch.reset()

    def schedule(self) -> None:
        """Run the packet loop (this thread) under the configured policy. ``fifo``: a
        real-time thread preempts the hosts' processes when its packets are due, as a switch
        would not wait for the hosts' CPUs (measured on 2 cores, ring of 8 at 100 Mb/s: the
        engine waited for a CPU 15-16 % of the run under time sharing, 4-7 % as real-time;
        the kernel's real-time throttling still leaves the others 5 % of each CPU). Where
        the kernel refuses (no CAP_SYS_NICE, a cgroup without real-time time), the engine
        stays time-shared and its ``config`` says why (``sched_note``)."""
        if self.sched != "fifo":
            return
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FIFO_PRIORITY))
        except OSError as e:
            self.config["sched"] = "other"
            self.config["sched_note"] = (f"real-time scheduling refused ({e.strerror}); "
                                         "the engine is time-shared")

    def open(self, memory: dict | None = None) -> None:
        """Open the ports (and the control socket last: its existence means 'ready').
        ``memory``: port name -> :class:`~testbed.datapath.io.MemoryPort` for the ports whose
        links an engine group carries in memory (:mod:`testbed.datapath.group`)."""
        memory = memory or {}

        def open_one(name: str):
            if name in memory:
                return memory[name]
            if self.disable_offloads:
                disable_offloads(name)
            return open_port(name, self.batch.buf, io=self.io_kind,
                             rx_frames=self.ring_frames["rx_ring_frames"],
                             tx_frames=self.ring_frames["tx_ring_frames"])

        opened = at_once(open_one, self.ports)
        self.io = [p for p in opened if not isinstance(p, BaseException)]
        failed = [p for p in opened if isinstance(p, BaseException)]
        if failed:
            raise failed[0]
        self.kernel_drops = np.zeros(len(self.ports), np.int64)
        self.tx_lost = np.zeros(len(self.ports), np.int64)
        self._setup_rings()
        if self.control_path:
            self.control = ControlServer(self.control_path, fd=self.control_fd)

    def _setup_rings(self) -> None:
        """When every port has an RX and a TX ring, serve them all with one Numba call per
        burst and direction (:func:`burst_rx`, :func:`burst_tx`): the ports' ring heads
        move into one (ports, 2) array those calls update."""
        self._rings = self._table = None
        if not self.io or not all(isinstance(p, RingPort | MemoryPort) and p.rx_frames
                                  and p.tx_frames for p in self.io):
            return
        n = len(self.io)
        self._heads = np.zeros((n, 2), np.int64)
        for p, port in enumerate(self.io):
            self._heads[p] = port.heads
            port.heads = self._heads[p]
        self._rings = (tuple(p.ring for p in self.io), tuple(p.ring32 for p in self.io))
        # TX slots: in the same mapping (from tx_base) but for a MemoryPort's
        self._tx_rings = (tuple(p.tx_ring for p in self.io),
                          tuple(p.tx_ring32 for p in self.io))
        self._rx_nframes = np.array([p.rx_frames for p in self.io], np.int64)
        self._tx_nframes = np.array([p.tx_frames for p in self.io], np.int64)
        self._tx_base = np.array([p.tx_base for p in self.io], np.int64)
        self._tx_done = np.zeros(n, np.int64)
        self._rx_start = 0
        #: the ports a send() hands frames to (a MemoryPort's peer sees them at once)
        self._kick_ports = [(p, port) for p, port in enumerate(self.io) if port.io != "memory"]
        self._load_ring_kernels()

    def _load_ring_kernels(self) -> None:
        """Compile (first time) or load the kernels of the rings set up, calling them on
        nothing; one engine at a time: engines starting at once would race Numba's cache."""
        n = len(self._rings[0])
        with compile_lock():
            table = self._burst_table()
            burst_rx(table, n, 0, 0, 0)
            self.tx_count[:] = 0
            burst_tx(table, 0, n)

    def _burst_table(self) -> np.ndarray:
        """The table of the burst kernels (:data:`BURST_ARRAYS`, then the ports' rings), built
        again when a group has moved the ring heads into its own array. The engine holds the
        arrays it lists (the rings through ``_rings``/``_tx_rings``)."""
        table = self._table
        if table is None or self._table_heads is not self._heads:
            rings = [*self._rings[0], *self._rings[1], *self._tx_rings[0], *self._tx_rings[1]]
            n = len(self._rings[0])
            spec = " ".join([BURST_SPEC] + ["u1:1"] * n + ["u4:1"] * n + ["u1:1"] * n
                            + ["u4:1"] * n)
            arrays = [*operator.attrgetter(*BURST_ARRAYS)(self), *rings]
            table = self._table = array_table(arrays, spec)
            self._table_heads = self._heads
        return table

    def close(self) -> None:
        """Close ports and the control socket."""
        # the ports' mappings can only close once nothing refers to them
        self._rings = self._tx_rings = self._table = None
        ports, self.io = self.io, []
        errors = [e for e in at_once(lambda p: p.close(), ports) if isinstance(e, BaseException)]
        if self.control is not None:
            self.control.close()
            self.control = None
        if errors:
            raise errors[0]

    # --- per burst -------------------------------------------------------------------------
    def _route(self, n: int) -> None:
        b = self.batch
        tally_and_route(n, b.out_port, b.in_port, b.length, b.reason, len(self.ports),
                        self.flood_mask, self.tx_rows, self.tx_count, self.rx_pk, self.rx_by,
                        self.tx_pk, self.tx_by, self.drops)

    def set_coalesce(self, us) -> float:
        """Set the coalescing wait's base (µs, 0..:data:`MAX_COALESCE_US`; 0 disables it) and
        restart the adaptation from it. A time-dilated network (``TestbedNet``) stretches it
        with every other time, so a dilated engine gathers as many packets per wake-up as an
        undilated one."""
        if isinstance(us, bool) or not isinstance(us, int | float) \
                or not 0 <= us <= MAX_COALESCE_US:
            raise ValueError(f"config: coalesce_us must be a number 0..{MAX_COALESCE_US:g} "
                             f"(µs), got {us!r}")
        us = float(us)
        self.coalesce_us = us
        self.config["coalesce_us"] = us
        self.hold_s = us * 1e-6  # the wait now (adapted every CPU window)
        return us

    def run_burst(self) -> int:
        """Receive one burst from all ports, run the stages, transmit; return frames received."""
        b = self.batch
        rings = self._rings
        if rings is not None:
            table = self._burst_table()
            b.n = burst_rx(table, len(self.io), self._rx_start, b.n, self.rx_burst)
            self._rx_start = (self._rx_start + 1) % len(self.io)
        else:
            b.reset()
            for p, port in enumerate(self.io):
                room = self.rx_burst - b.n
                if room <= 0:
                    break
                got = port.recv_burst(b.n, room, b.length)
                if got:
                    b.in_port[b.n : b.n + got] = p
                    b.n += got
        received = b.n
        now = time.monotonic_ns()
        for s in self.stages:
            try:
                s.process(b, now)
            except Exception:  # noqa: BLE001 - a buggy stage must not take the node down
                self._stage_failed(s, b)
                break
        if self.tracer.remaining:
            self.tracer.record(b, now)
        n = b.n
        if rings is not None:
            done = self._tx_done
            if burst_tx(table, n, len(self.ports)):
                self.tx_lost += self.tx_count - done
            for p, port in self._kick_ports:
                if done[p]:
                    port.kick(int(done[p]))
                elif port.tx_pending:
                    port.kick()
        else:
            self._route(n)
            for p, port in enumerate(self.io):
                c = self.tx_count[p]
                if c:
                    port.send_rows(self.tx_rows[p, :c], b.length)
                elif port.tx_pending:
                    port.kick()
        if received:
            self.bursts += 1
            if received > self.max_burst:
                self.max_burst = received
        return received

    def _stage_failed(self, stage: Stage, b: Batch) -> None:
        """Drop the whole burst (reason OTHER), count the error, log the first tracebacks."""
        self.stage_errors[stage.name] = self.stage_errors.get(stage.name, 0) + 1
        if self.stage_errors[stage.name] <= 5:
            print(f"{self.node}: stage {stage.name!r} failed; burst of {b.n} dropped:\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        b.n = min(b.n, b.capacity)
        b.out_port[: b.n] = PORT_DROP
        b.reason[: b.n] = int(DropReason.OTHER)

    def _deadline_wait_ns(self) -> int | None:
        """Nanoseconds until the earliest stage deadline (<= 0: due now); None when no stage
        holds anything."""
        now = time.monotonic_ns()
        wait = None
        for s in self.stages:
            d = s.next_deadline_ns()
            if d is not None and (wait is None or d - now < wait):
                wait = d - now
        return wait

    def _idle_wait(self, poller) -> list:
        """Wait for a port, the control channel or the next stage deadline; the ready fds.

        ``poll()`` counts whole milliseconds, so a held frame due in less than one (a link's
        departure clock, a delay line) is waited for with a sleep. Polling with a zero timeout
        until it was due spun a CPU whenever a stage held frames. Ring allreduce, star of 4,
        100 Mb/s, 8 MiB, machine CPU per packet (the engine's in brackets): with 1 ms of
        emulated delay on every link 13.1 (8.5) us spinning, 10.2 (3.7-3.9) us sleeping; with
        the switch's egress queued in the ``trim`` stage 24-25 (19.6) against 19-20 (15.1) us,
        and 16.6-17.9 (12.7-12.9) us with the coalescing wait added: the sleep lasts
        ``hold_s`` longer (as after a short burst), so the departures due within it share one
        wake-up, the receive side's latency-for-CPU trade. The stages' clocks are virtual, so
        a late wake-up sends what was due and keeps the rate."""
        wait = self._deadline_wait_ns()
        if wait is not None and 0 < wait < 1_000_000:
            time.sleep(wait / 1e9 + self.hold_s)
            return poller.poll(0)
        # wake regularly to refresh telemetry even when idle
        return poller.poll(IDLE_POLL_MS if wait is None else min(IDLE_POLL_MS,
                                                                 max(0, wait // 1_000_000)))

    def serve(self) -> None:
        """Main loop until stopped (signal or control ``stop``)."""
        poller = select.poll()
        port_fds = {p.fileno(): p for p in self.io}
        for fd in port_fds:
            poller.register(fd, select.POLLIN)
        if self.control is not None:
            for fd in self.control.fds():
                poller.register(fd, self.control.events(fd))
        with signal_wakeup(poller) as wake_r:
            self._serve(poller, port_fds, wake_r)

    def _serve(self, poller, port_fds: dict, wake_r: int) -> None:
        self.running = True
        busy = False
        while self.running:
            if busy:
                events = poller.poll(0) if self.control is not None and \
                    self.bursts % 64 == 0 else []
            else:
                events = self._idle_wait(poller)
            for fd, ev in events:
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                    continue
                if fd in port_fds:
                    if ev & select.POLLERR:  # a link that went down: else poll spins on it
                        port_fds[fd].clear_error()
                    continue
                for ch in self.control.handle(fd, self.dispatch):
                    if ch > 0:  # new, or waits for other events now (registering again sets them)
                        poller.register(ch, self.control.events(ch))
                    else:
                        try:
                            poller.unregister(-ch)
                        except KeyError:
                            pass
            got = self.run_burst()
            busy = got > 0
            wait = None if busy else self._deadline_wait_ns()
            if not busy and ((wait is not None and wait <= 0)
                             or any(p.tx_pending for p in self.io)):
                busy = True  # a held packet is due, or frames wait to be sent: go round
            elif 0 < got < self.rx_burst // 8 and self.hold_s:
                time.sleep(self.hold_s)
            self._sample_cpu()

    def _sample_cpu(self) -> None:
        wall0, cpu0, frac = self._cpu_win
        now = time.monotonic()
        if now - wall0 >= 0.5:
            cpu = time.process_time()
            frac = (cpu - cpu0) / (now - wall0)
            self._cpu_win = (now, cpu, frac)
            self.cpu_max = max(self.cpu_max, frac)
            self.hold_s = adapt_hold(self.hold_s, frac, self.coalesce_us * 1e-6)

    def set_flood_ports(self, ports: list[str] | None) -> list[str]:
        """The ports floods leave by (None: all); a looped fabric's flood tree, which changes
        when a link fails. Returns them; ``ValueError`` naming a port the node lacks."""
        mask = np.ones(len(self.ports), np.bool_)
        if ports is not None:
            if not isinstance(ports, list):
                raise ValueError("flood ports must be a list of port names")
            mask[:] = False
            for p in ports:
                if p not in self.ports:
                    raise ValueError(f"config: flood port {p!r} is not one of {self.ports}")
                mask[self.ports.index(p)] = True
        self.flood_mask[:] = mask  # in place: the packet loop holds this array
        self.config["flood_ports"] = ports
        return [p for p, m in zip(self.ports, self.flood_mask, strict=True) if m]

    # --- control -----------------------------------------------------------------------------
    def stage(self, name: str) -> Stage:
        """The stage called ``name``."""
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"no stage {name!r} on {self.node}; stages: "
                         f"{[s.name for s in self.stages]}")

    def dispatch(self, req: dict) -> object:
        """Run one control command (see ``testbed.datapath.control``)."""
        cmd = req.get("cmd")
        if cmd == "ping":
            return "pong"
        if cmd == "counters":
            return self.counters()
        if cmd == "configure":
            settings = req.get("settings") or {}
            if not isinstance(settings, dict):
                raise ValueError("configure: 'settings' must be an object")
            self.stage(str(req.get("stage"))).configure(**settings)
            return self.stage(str(req.get("stage"))).counters()
        if cmd == "coalesce":
            return self.set_coalesce(req.get("us"))
        if cmd == "flood":
            return self.set_flood_ports(req.get("ports"))
        if cmd == "reset_job":
            targets = [s for s in self.stages if hasattr(s, "reset_job")]
            if not targets:
                raise ValueError(f"reset_job: no aggregate stage on {self.node}")
            for s in targets:
                s.reset_job(int(req.get("job_id")))
            return True
        if cmd == "config":
            return {**self.config, "stages": [s.name for s in self.stages]}
        if cmd == "trace":
            return self.tracer.arm(req["count"]) if "count" in req else self.tracer.read()
        if cmd == "stop":
            self.running = False
            return True
        raise ValueError(f"unknown command {cmd!r}; use counters, config, configure, coalesce, "
                         "flood, reset_job, trace, stop")

    def cpu_seconds(self) -> float:
        """CPU-seconds this node's engine used: the process's, or in an engine group its
        share of the process's, by the time its bursts took (the shares add up to it)."""
        if self.group is not None:
            return self.group.cpu_share(self)
        return time.process_time() - self._cpu0

    def counters(self) -> dict:
        """Per-port rx/tx, drops by reason, stage counters and CPU figures (in an engine
        group, ``cpu``/``cpu_max`` are the shared process's, ``cpu_seconds`` this node's
        share, and ``engine_group`` names the group's nodes)."""
        names = {int(r): r.name for r in DropReason}
        ports = {}
        for p, port in enumerate(self.io):  # the kernel's counter resets when read
            self.kernel_drops[p] += port.stats()["drops"]
        for p, name in enumerate(self.ports):
            d = {names.get(r, str(r)): int(c) for r, c in enumerate(self.drops[p]) if c}
            ports[name] = {"rx_packets": int(self.rx_pk[p]), "rx_bytes": int(self.rx_by[p]),
                           "tx_packets": int(self.tx_pk[p]), "tx_bytes": int(self.tx_by[p]),
                           "tx_errors": int(self.io[p].tx_errors + self.tx_lost[p])
                           if self.io else 0,
                           # frames the kernel had no room for (full RX ring / socket buffer)
                           "rx_kernel_drops": int(self.kernel_drops[p]) if self.io else 0,
                           "io": self.io[p].io if self.io else None,
                           "drops": d}
        total = self.drops.sum(axis=0)
        gen = {names.get(r, str(r)): int(c) for r, c in enumerate(self.drops[-1]) if c}
        wall = time.monotonic() - self._t0
        cpu_s = self.cpu_seconds()
        return {
            "node": self.node,
            "pid": os.getpid(),  # which engine answered: a restarted one starts from zero
            "ports": ports,
            "drops": {names.get(r, str(r)): int(c) for r, c in enumerate(total) if c},
            "drops_generated": gen,
            "stages": {s.name: s.counters() for s in self.stages},
            "bursts": self.bursts,
            "stage_errors": dict(self.stage_errors),
            "max_burst": self.max_burst,
            "rx_burst": self.rx_burst,
            "uptime_s": round(wall, 3),
            "cpu_seconds": round(cpu_s, 3),
            "cpu": round(self._cpu_win[2], 3),  # CPU fraction over the last ~0.5 s
            "cpu_max": round(self.cpu_max, 3),  # >= 0.9: the engine was CPU-bound
            "cpu_avg": round(cpu_s / wall, 3) if wall > 0 else 0.0,
            # the adaptive wait now (in a group, the group's)
            "coalesce_us": round((self.group or self).hold_s * 1e6, 1),
            "io": self.io_kind,
        } | ({"engine_group": self.group.nodes} if self.group is not None else {})


#: the engine's log line before its kernels load (or compile, on a cold cache)
COMPILING = "loading (or compiling) the kernels of stages"


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def preload_kernels(stages: list[str]) -> None:
    """Load (or compile) the kernels an engine with each of ``stages`` calls, and its ring
    I/O kernels, on empty rings: what the engines' fork server
    (:mod:`testbed.datapath.forks`) holds for its children. The ring kernels read their
    ports from one table (:meth:`Engine._burst_table`), so one load serves every port
    count. A stage that fails is reported and left to the engines that run it (their logs
    then say why)."""
    for name in stages:
        try:
            Engine({"ports": ["p0", "p1"], "programs": [name]}).warm_up()
        except Exception:  # noqa: BLE001 - reported; the engines meet it again
            print(f"stage {name!r} did not load:\n{traceback.format_exc()}", flush=True)
    n = 2
    eng = Engine({"ports": [f"p{i}" for i in range(n)], "programs": ["forward"]})
    rings = tuple(np.zeros(RING_FRAME, np.uint8) for _ in range(n))
    eng._rings = eng._tx_rings = (rings, tuple(r.view("<u4") for r in rings))
    eng._heads = np.zeros((n, 2), np.int64)
    eng._rx_nframes = eng._tx_nframes = np.ones(n, np.int64)
    eng._tx_base = np.zeros(n, np.int64)
    eng._tx_done = np.zeros(n, np.int64)
    eng._load_ring_kernels()
    load_port_kernels(np.zeros(RING_FRAME, np.uint8), Batch(1).buf)


def main(argv: list[str] | None = None, control_fds: list[int] | None = None) -> int:
    """Process entry point (see the module docstring). ``control_fds``: the listening
    control sockets, one per config in order, when this engine was forked with them (the
    configs name the owner's descriptor numbers). Several ``--config`` (and ``--link``): one
    process serving several nodes (:mod:`testbed.datapath.group`)."""
    ap = argparse.ArgumentParser(description="testbed data-path engine")
    ap.add_argument("--config", action="append", default=[],
                    help="JSON config file; several: an engine group serving those nodes")
    ap.add_argument("--counters-out", action="append", default=[],
                    help="write final counters (JSON) here on exit (one per --config)")
    ap.add_argument("--link", action="append", default=[], metavar="PORT_A=PORT_B",
                    help="in an engine group: a link between two of its nodes, in memory")
    ap.add_argument("--fork-server", type=int, metavar="FD",
                    help="serve forked engines on socket FD (testbed.datapath.forks)")
    ap.add_argument("--stages", default="", help="with --fork-server: stages to load")
    ap.add_argument("marker", nargs="*", help="testbed-node=<name> (for cleanup)")
    a = ap.parse_args(argv)
    if a.fork_server is not None:
        # the module by its name, as every other module imports it (not this __main__ copy)
        from testbed.datapath import engine
        from testbed.datapath.forks import serve

        stages = [s for s in a.stages.split(",") if s]

        def preload() -> str:
            engine.preload_kernels(stages)
            return f"kernels of {stages} and the ring I/O"

        return serve(a.fork_server, preload,
                     lambda argv, fds: engine.main(argv, control_fds=fds))
    if not a.config:
        ap.error("--config is required")
    if a.counters_out and len(a.counters_out) != len(a.config):
        ap.error(f"{len(a.config)} --config but {len(a.counters_out)} --counters-out: give "
                 "one per config, or none")
    follow_owner()  # first: a run that dies while this engine compiles takes it along
    configs = []
    for path in a.config:
        with open(path) as fh:
            configs.append(json.load(fh))
    if control_fds is not None:
        if len(control_fds) != len(configs):
            raise ValueError(f"{len(control_fds)} control sockets for {len(configs)} configs")
        for config, fd in zip(configs, control_fds, strict=True):
            config["control_fd"] = fd
    if len(configs) == 1 and not a.link:
        unit = Engine(configs[0])
        members = [unit]
    else:
        from testbed.datapath.group import EngineGroup, parse_link

        unit = EngineGroup(configs, [parse_link(link) for link in a.link])
        members = unit.members

    stopped = []

    def stop(_sig, _frm):
        unit.running = False
        stopped.append(_sig)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.monotonic()
    print(f"{COMPILING} {sorted({s.name for m in members for s in m.stages})}", flush=True)
    unit.warm_up()
    print(f"kernels ready in {time.monotonic() - t0:.1f} s", flush=True)
    if stopped:  # told to stop while it compiled (its owner died): serve() would start anew
        return 0
    # Everything allocated so far (modules, Numba's dispatchers and types) is permanent: the
    # cyclic GC no longer walks it, which otherwise costs a full collection's worth of CPU now
    # and then in the packet loop.
    gc.collect()
    gc.freeze()
    unit.schedule()  # after the compilation above: that may take seconds of CPU
    try:
        unit.open()
        unit.serve()
    finally:
        for i, m in enumerate(members):
            result = m.counters()
            if a.counters_out:
                _write_json(a.counters_out[i], result)
        unit.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
