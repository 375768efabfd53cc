"""An engine group: one process serving several nodes, the links between them in memory.

A fabric of programmable switches runs one engine per switch, and a packet crossing it pays
at every switch-to-switch hop for a ``send()``, a veth, a softirq, a copy into the next
engine's ring and that engine's wake-up, and for a burst's worth of Python in an engine that
sees only a trickle (measured on a fat-tree k=4: 35 % of the machine in the kernel, 53 % in
the engines' per-burst Python, 6.5 packets a burst). A group serves several nodes in one
loop: each node keeps its :class:`~testbed.datapath.engine.Engine` (its ports, stages,
counters, control socket and CPU figures), but a link between two nodes of the group is a
pair of :class:`~testbed.datapath.io.MemoryPort` ends: the sender's TX ring *is* the
receiver's RX ring, served by the same ring kernels. The link's rate, queue, delay and
impairments are the sending node's egress stages, exactly as on a veth.

The loop (:meth:`EngineGroup.serve`) runs a node's burst only when it has work: frames in an
RX ring (kernel rings by ``poll``, memory rings by their next slot's status word), a stage
deadline that is due, or frames still to be sent; a round with nothing to do blocks in one
``poll`` on every kernel port, control channel and the signal pipe. Coalescing (the engine's
wait after a short burst) applies to frames from outside only: a packet crossing the group
hop by hop is never held for it.

What a group changes for the nodes in it: they live and die together (a SIGKILL takes them
all, and ``dead_engines`` names them all), a ``stop`` to one stops the group, and each node's
``cpu_seconds`` is the process's shared out by the time each node's bursts took.
``TestbedNet(engine_groups=N)`` builds them (``testbed.topologies``).
"""

from __future__ import annotations

import contextlib
import os
import select
import time

import numpy as np
from numba import njit

from testbed.datapath.batch import Stage
from testbed.datapath.engine import (
    COALESCE_MAX_FACTOR,
    IDLE_POLL_MS,
    Engine,
    adapt_hold,
    at_once,
    signal_wakeup,
)
from testbed.datapath.io import RING_FRAME, MemoryPort
from testbed.warm import compile_lock

#: the most nodes one group serves: each passes its control socket in one ``SCM_RIGHTS``
#: message of the fork server (the kernel's SCM_MAX_FD is 253, less the log and namespace)
MAX_GROUP_NODES = 250
_NEVER = np.iinfo(np.int64).max
_STATUS_WORDS = RING_FRAME // 4


def parse_link(text: str) -> tuple[str, str]:
    """``"PORT_A=PORT_B"`` -> ``(PORT_A, PORT_B)`` (``ValueError`` naming the form)."""
    a, sep, b = text.partition("=")
    if not sep or not a or not b:
        raise ValueError(f"link {text!r}: write it as PORT_A=PORT_B (two interface names)")
    return a, b


@njit(cache=True)
def mark_ready(ready, pending, deadline, now, mem32, mem_words, heads, mem_rows, mem_owner):
    """Which nodes have work now: ``ready[i]`` set for node ``i`` with frames left to send
    (``pending``), a stage deadline due (``deadline[i] <= now``) or a frame in the next slot
    of one of its memory rings (status word ``mem32[mem_words[k] + heads[mem_rows[k], 0] *
    RING_FRAME / 4]``, odd, for memory port ``k`` of node ``mem_owner[k]``); the count."""
    for i in range(ready.shape[0]):
        ready[i] = pending[i] or deadline[i] <= now
    for k in range(mem_rows.shape[0]):
        if mem32[mem_words[k] + heads[mem_rows[k], 0] * _STATUS_WORDS] & 1:
            ready[mem_owner[k]] = True
    count = 0
    for i in range(ready.shape[0]):
        if ready[i]:
            count += 1
    return count


def warm_up() -> None:
    """Load (or compile) :func:`mark_ready` as a group calls it (``testbed warm``)."""
    z = np.zeros(1, np.int64)
    mark_ready(np.zeros(1, np.bool_), np.zeros(1, np.bool_), z, 0, np.zeros(4, np.uint8)
               .view("<u4"), z[:0], np.zeros((1, 2), np.int64), z[:0], z[:0])


class EngineGroup:
    """The nodes of ``configs`` (engine configs, see :mod:`testbed.datapath.engine`) in one
    process, with the ``links`` (pairs of port names of two different nodes) in memory."""

    def __init__(self, configs: list[dict], links: list[tuple[str, str]]):
        if not configs:
            raise ValueError("an engine group needs at least one node's config")
        if len(configs) > MAX_GROUP_NODES:
            raise ValueError(f"an engine group serves at most {MAX_GROUP_NODES} nodes, got "
                             f"{len(configs)}")
        self.members = [Engine(c) for c in configs]
        self.nodes = [m.node for m in self.members]
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"engine group: a node appears twice in {self.nodes}")
        owner: dict[str, int] = {}
        for i, m in enumerate(self.members):
            if m.io_kind != "ring":
                raise ValueError(f"engine group: {m.node} has io={m.io_kind!r}; a group's "
                                 "nodes run PACKET_MMAP rings (io='ring')")
            for port in m.ports:
                if port in owner:
                    raise ValueError(f"engine group: port {port!r} belongs to "
                                     f"{self.nodes[owner[port]]} and {m.node}")
                owner[port] = i
        seen: set[str] = set()
        for a, b in links:
            for port in (a, b):
                if port not in owner:
                    raise ValueError(f"engine group: link {a}={b}: no node of the group has "
                                     f"port {port!r}")
                if port in seen:
                    raise ValueError(f"engine group: port {port!r} is in two links")
                seen.add(port)
            if owner[a] == owner[b]:
                raise ValueError(f"engine group: link {a}={b} joins {self.nodes[owner[a]]} "
                                 "to itself")
        self.links = [(a, b) for a, b in links]
        self._owner = owner
        for m in self.members:
            m.group = self
        self.running = False
        self.hold_s = min(m.hold_s for m in self.members)
        self._t0 = time.monotonic()
        self._cpu0 = time.process_time()
        self._cpu_win = (self._t0, self._cpu0)
        # seconds each node's bursts took (a clock read costs 50 ns, the CPU clock a system
        # call): the process's CPU is shared out in these proportions
        self._busy = np.zeros(len(self.members))
        #: per node, its stages that may hold frames until a deadline (the others' is None)
        self._timed = [[s for s in m.stages
                        if type(s).next_deadline_ns is not Stage.next_deadline_ns]
                       for m in self.members]

    # --- lifecycle -------------------------------------------------------------------------
    def warm_up(self) -> None:
        for m in self.members:
            m.warm_up()

    def schedule(self) -> None:
        """The first node's scheduling policy for the process (a group shares one)."""
        first = self.members[0]
        first.schedule()
        for m in self.members[1:]:
            m.config["sched"] = first.config["sched"]
            if "sched_note" in first.config:
                m.config["sched_note"] = first.config["sched_note"]

    def open(self) -> None:
        """Make the memory links, open every node's ports (all at once: each kernel ring
        waits out a grace period), then index every node's RX rings for the loop."""
        # Every memory ring is a slice of one array, so that one call (mark_ready) reads
        # their next slots' status words. Each is as long as the RX ring of the node that
        # reads it (sized by its port's dilated rate, engine.rx_ring_frames): what a veth
        # would have delivered into.
        def slots(port: str) -> int:
            return self.members[self._owner[port]].ring_frames["rx_ring_frames"] * RING_FRAME

        self._mem = np.zeros(sum(slots(a) + slots(b) for a, b in self.links), np.uint8)
        # Every page now, not on the first collective: a ring's reader polls its next slot's
        # status before the writer fills it, so each page was mapped from the shared zero
        # page, then copied on the writer's first frame there, inside the timed run (a
        # quarter of a fat-tree k=4 group's CPU over its first 8 MiB INA collective). A ring
        # is walked round its whole length within a collective or two, so the pages would
        # be resident soon in any case.
        self._mem.fill(0)
        memory: dict[str, MemoryPort] = {}
        ring_at: dict[str, int] = {}  # port -> byte offset of its RX ring in self._mem
        off = 0
        for a, b in self.links:
            to_a, to_b = self._mem[off:off + slots(a)], self._mem[off + slots(a):
                                                                   off + slots(a) + slots(b)]
            memory[a], memory[b] = MemoryPort(a, rx=to_a, tx=to_b), MemoryPort(b, rx=to_b,
                                                                               tx=to_a)
            ring_at[a], ring_at[b] = off, off + slots(a)
            off += slots(a) + slots(b)
        errors = [e for e in at_once(lambda m: m.open(memory), self.members)
                  if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
        bad = [m.node for m in self.members if m._rings is None]
        if bad:
            raise RuntimeError(f"engine group: the kernel refused PACKET_MMAP rings on "
                               f"{bad}; a group needs them (run without engine groups)")
        # every node's ring heads become rows of one array too
        self._heads = np.zeros((sum(len(m.ports) for m in self.members), 2), np.int64)
        mem_rows, mem_words, mem_owner = [], [], []
        self._kernel_fd: dict[int, int] = {}  # kernel port's fd -> member index
        row = 0
        for i, m in enumerate(self.members):
            k = len(m.ports)
            self._heads[row:row + k] = m._heads
            m._heads = self._heads[row:row + k]
            for p, port in enumerate(m.io):
                port.heads = m._heads[p]
                if port.io == "memory":
                    mem_rows.append(row + p)
                    mem_words.append(ring_at[m.ports[p]] // 4)
                    mem_owner.append(i)
                else:
                    self._kernel_fd[port.fileno()] = i
            row += k
        self._mem32 = self._mem.view("<u4")
        self._mem_rows = np.array(mem_rows, np.int64)
        self._mem_words = np.array(mem_words, np.int64)
        self._mem_owner = np.array(mem_owner, np.int64)
        with compile_lock():  # loaded (a cold cache: compiled) now, not with the first frame
            warm_up()

    def close(self) -> None:
        errors = [e for e in at_once(lambda m: m.close(), self.members)
                  if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    # --- CPU -------------------------------------------------------------------------------
    def cpu_share(self, member: Engine) -> float:
        """``member``'s CPU-seconds: the process's, shared out in proportion to the time
        each node's bursts took (equally before any burst)."""
        total = time.process_time() - self._cpu0
        busy = self._busy.sum()
        i = self.members.index(member)
        return float(total * (self._busy[i] / busy if busy else 1 / len(self.members)))

    def _sample_cpu(self) -> None:
        wall0, cpu0 = self._cpu_win
        now = time.monotonic()
        if now - wall0 < 0.5:
            return
        cpu = time.process_time()
        frac = (cpu - cpu0) / (now - wall0)
        self._cpu_win = (now, cpu)
        for m in self.members:  # the process's figures, which every node reports
            m._cpu_win = (now, cpu, frac)
            m.cpu_max = max(m.cpu_max, frac)
        base = min(m.coalesce_us for m in self.members) * 1e-6
        self.hold_s = adapt_hold(self.hold_s, frac, base)

    # --- the loop --------------------------------------------------------------------------
    def _deadline(self, i: int) -> int:
        """The earliest stage deadline of node ``i`` (ns, monotonic), or never."""
        d = _NEVER
        for s in self._timed[i]:
            t = s.next_deadline_ns()
            if t is not None and t < d:
                d = t
        return d

    def serve(self) -> None:
        """Serve every node until stopped (a signal, or ``stop`` to any node's channel)."""
        poller = select.poll()
        for fd in self._kernel_fd:
            poller.register(fd, select.POLLIN)
        control_of: dict[int, int] = {}  # control channel fd -> member index
        for i, m in enumerate(self.members):
            if m.control is not None:
                for fd in m.control.fds():
                    control_of[fd] = i
                    poller.register(fd, m.control.events(fd))
        with signal_wakeup(poller) as wake_r:
            self._serve(poller, control_of, wake_r)

    def _serve(self, poller, control_of: dict, wake_r: int) -> None:
        members = self.members
        n = len(members)
        deadline = np.array([self._deadline(i) for i in range(n)], np.int64)
        memory = (self._mem32, self._mem_words, self._heads, self._mem_rows, self._mem_owner)
        pending = np.zeros(n, np.bool_)  # frames left for a send() to take
        ready = np.zeros(n, np.bool_)
        short = False  # the last round took few frames
        self.running = True
        for m in members:
            m.running = True
        while self.running:
            now = time.monotonic_ns()
            due = mark_ready(ready, pending, deadline, now, *memory)
            if short and self.hold_s and not due:
                time.sleep(self.hold_s)  # coalescing: only frames from outside wait
                now = time.monotonic_ns()
                due = mark_ready(ready, pending, deadline, now, *memory)
            events = poller.poll(0)
            if not events and not due:
                wait = int(deadline.min()) - now if deadline.min() < _NEVER else None
                if wait is not None and wait < 1_000_000:
                    time.sleep(max(wait, 0) / 1e9 + self.hold_s)
                    events = poller.poll(0)
                    mark_ready(ready, pending, deadline, time.monotonic_ns(), *memory)
                else:
                    events = poller.poll(IDLE_POLL_MS if wait is None else
                                         min(IDLE_POLL_MS, wait // 1_000_000))
            for fd, ev in events:
                i = self._kernel_fd.get(fd)
                if i is not None:
                    if ev & select.POLLERR:
                        for port in members[i].io:
                            if port.fileno() == fd:
                                port.clear_error()
                    ready[i] = True
                elif fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                else:
                    i = control_of[fd]
                    m = members[i]
                    for ch in m.control.handle(fd, m.dispatch):
                        if ch > 0:
                            control_of[ch] = i
                            poller.register(ch, m.control.events(ch))
                        else:
                            control_of.pop(-ch, None)
                            with contextlib.suppress(KeyError):
                                poller.unregister(-ch)
                    if not m.running:  # `stop` to any node stops the group
                        self.running = False
                    # a command may have set a node's coalescing wait (a re-timed network)
                    base = min(x.coalesce_us for x in members) * 1e-6
                    self.hold_s = min(max(self.hold_s, base), base * COALESCE_MAX_FACTOR)
                    deadline[i] = self._deadline(i)  # a command may have re-timed a stage
                    ready[i] = True
            got = 0
            for i in ready.nonzero()[0].tolist():
                t = time.perf_counter()
                got += members[i].run_burst()
                self._busy[i] += time.perf_counter() - t
                deadline[i] = self._deadline(i)
                kernel = members[i]._kick_ports
                pending[i] = bool(kernel) and any(port.tx_pending for _, port in kernel)
            short = 0 < got < members[0].rx_burst // 8
            self._sample_cpu()
