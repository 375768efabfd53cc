"""The ``impair`` program: seeded per-port loss, duplication, reordering and delay.

The kernel here has no ``sch_netem``, so links get their impairments from this stage (the model
is SwitchML's P4 drop simulator, extended to netem's other effects). It runs either at
*ingress* (``direction="ingress"``: acts on undecided packets, keyed by ``in_port``; put it first)
or at *egress* (``direction="egress"``: acts on packets with ``out_port >= 0``, keyed by it; put
it after forwarding). Per packet of a port, in this order:

1. **loss** with probability ``loss``: dropped, ``DropReason.IMPAIR_LOSS``;
2. **duplication** with probability ``dup``: one extra copy is sent (it follows the original
   through the delay line, or leaves right after the burst when there is no delay);
3. **reordering** with probability ``reorder``: the packet is held back until ``reorder_k``
   later packets of the same port have left (or ``reorder_timeout_ms`` after its due time, so
   a packet is never stuck when traffic stops);
4. **delay**: ``delay_ms`` plus a uniform jitter in ``[-jitter_ms, +jitter_ms]`` through a
   per-port FIFO delay line (release times never decrease, so jitter does not reorder).

Held packets are marked ``PORT_HELD``, kept in a ring of frame slots owned by the stage and
appended to a later batch when due (``next_deadline_ns`` wakes the engine). Re-emitted ingress
packets keep their ``in_port``; egress ones their ``out_port``. A full ring drops the packet
(``DropReason.QUEUE_FULL``, counter ``overflow``).

Determinism: the decisions for the k-th packet seen on port p are a pure function of
``(seed, p, k)`` (a splitmix64 counter-based hash, ``testbed.kernels.trimming.uniform01``), so
the same seed and packet sequence give the same losses, copies and holds however the packets
are batched. ``filter="testbed"`` impairs only testbed frames (others pass untouched and do not
advance the sequence); ``filter="all"`` impairs every frame.

Counters per port: ``seen``, ``lost``, ``duplicated``, ``reordered``, ``delayed``,
``released``, ``overflow``, ``bypassed`` (frames the filter let through), ``malformed`` (a
length no frame can have: dropped ``BAD_LENGTH``), ``held`` (now).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from testbed.datapath.batch import (
    FRAME_MAX,
    PORT_DROP,
    PORT_HELD,
    PORT_UNSET,
    Batch,
    DropReason,
    Stage,
)
from testbed.datapath.trim import append_emitted, per_port, resolve_ports
from testbed.kernels.checks import check_number
from testbed.kernels.packets import parse_frame
from testbed.kernels.rng import uniform01

DIRECTIONS = ("ingress", "egress")
FILTERS = ("all", "testbed")

(C_SEEN, C_LOST, C_DUP, C_REORDER, C_DELAYED, C_RELEASED, C_OVERFLOW, C_BYPASS,
 C_MALFORMED) = range(9)
COUNTER_NAMES = ("seen", "lost", "duplicated", "reordered", "delayed", "released", "overflow",
                 "bypassed", "malformed")

# random streams per packet: one uniform per effect
E_LOSS, E_DUP, E_REORDER, E_JITTER = range(4)
N_EFFECTS = 4

# kinds of held entries
K_DELAY = 0  # FIFO delay line entry (release times non-decreasing per port)
K_REORDER = 1  # waits for reorder_k later packets (or its timeout)
K_EXTRA = 2  # a duplicate of a packet that was not delayed: leaves at its release time

_R_LOSS = int(DropReason.IMPAIR_LOSS)
_R_QUEUE_FULL = int(DropReason.QUEUE_FULL)
_R_BAD_LENGTH = int(DropReason.BAD_LENGTH)
_NEVER = np.iinfo(np.int64).max


def port_seed(seed: int, port: int) -> np.uint64:
    """Seed of port ``port``'s random stream (splitmix64 of the stage seed and the port)."""
    m64 = (1 << 64) - 1
    z = (int(seed) * 0x9E3779B97F4A7C15 + (port + 1) * 0xD1B54A32D192ED03) & m64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
    return np.uint64(z ^ (z >> 31))


@njit(cache=True, inline="always")
def draw(seeds, p, idx, effect):
    """Uniform [0, 1) for ``effect`` of the ``idx``-th packet of port ``p``."""
    return uniform01(seeds[p], idx * N_EFFECTS + effect)


@njit(cache=True)
def _hold(p, frame, ln, kind, rel, need, timeout, r_buf, r_len, r_kind, r_rel, r_need,
          r_timeout, r_used, r_head, r_tail, pend):
    """Put a copy of ``frame[:ln]`` into port ``p``'s ring; False when the ring is full."""
    size = r_len.shape[1]
    if r_tail[p] - r_head[p] >= size:
        return False
    s = r_tail[p] % size
    r_buf[p, s, :ln] = frame[:ln]
    r_len[p, s] = ln
    r_kind[p, s] = kind
    r_rel[p, s] = rel
    r_need[p, s] = need
    r_timeout[p, s] = timeout
    r_used[p, s] = True
    r_tail[p] += 1
    if kind == K_DELAY:
        pend[p] += 1
    return True


@njit(cache=True)
def _release(now, buf, length, base, room, k, emit_port, r_buf, r_len, r_kind, r_rel, r_need,
             r_timeout, r_used, r_head, r_tail, pend, passed, counters):
    """Append every held frame that is due (in ring order per port); return the new ``k``."""
    n_ports = r_head.shape[0]
    size = r_len.shape[1]
    for p in range(n_ports):
        for j in range(r_head[p], r_tail[p]):
            if k >= room:
                return k
            s = j % size
            if not r_used[p, s]:
                continue
            kind = r_kind[p, s]
            if kind == K_REORDER:
                due = now >= r_rel[p, s] and (passed[p] >= r_need[p, s] or now >= r_timeout[p, s])
            else:
                due = now >= r_rel[p, s]
            if not due:
                continue
            ln = r_len[p, s]
            buf[base + k, :ln] = r_buf[p, s, :ln]
            length[base + k] = ln
            emit_port[k] = p
            k += 1
            r_used[p, s] = False
            passed[p] += 1
            counters[p, C_RELEASED] += 1
            if kind == K_DELAY:
                pend[p] -= 1
        while r_head[p] < r_tail[p] and not r_used[p, r_head[p] % size]:
            r_head[p] += 1
    return k


@njit(cache=True)
def impair_kernel(buf, length, in_port, out_port, reason, n, base, room, now, egress,
                  only_testbed, seeds, loss, dup, reorder, reorder_k, delay_ns, jitter_ns,
                  reorder_timeout_ns, seq, passed, last_rel, pend, r_buf, r_len, r_kind, r_rel,
                  r_need, r_timeout, r_used, r_head, r_tail, counters, emit_port, deadline):
    """One burst of the impair stage (see the module docstring). Emitted frames go to rows
    ``base..base+k-1`` with their port in ``emit_port[:k]``; ``deadline[0]`` gets the next due
    time (int64 max when nothing is held). Returns ``k``."""
    n_ports = seq.shape[0]
    k = _release(now, buf, length, base, room, 0, emit_port, r_buf, r_len, r_kind, r_rel,
                 r_need, r_timeout, r_used, r_head, r_tail, pend, passed, counters)
    for i in range(n):
        if egress:
            p = out_port[i]
            if p < 0:
                continue
        else:
            if out_port[i] != PORT_UNSET:
                continue
            p = in_port[i]
            if p < 0:
                continue  # generated by an earlier stage: not from a link
        if p >= n_ports:
            continue
        ln = length[i]
        if ln < 0 or ln > FRAME_MAX:  # cannot be a frame: never copy it into a slot
            out_port[i] = PORT_DROP
            reason[i] = _R_BAD_LENGTH
            counters[p, C_MALFORMED] += 1
            continue
        if only_testbed and parse_frame(buf[i], ln) != 0:
            counters[p, C_BYPASS] += 1
            continue
        idx = seq[p]
        seq[p] += 1
        counters[p, C_SEEN] += 1
        if loss[p] > 0.0 and draw(seeds, p, idx, E_LOSS) < loss[p]:
            out_port[i] = PORT_DROP
            reason[i] = _R_LOSS
            counters[p, C_LOST] += 1
            continue
        copy = dup[p] > 0.0 and draw(seeds, p, idx, E_DUP) < dup[p]
        delayed = delay_ns[p] > 0 or jitter_ns[p] > 0
        rel = now
        if delayed:
            rel = now + delay_ns[p]
            if jitter_ns[p] > 0:
                rel += np.int64((2.0 * draw(seeds, p, idx, E_JITTER) - 1.0) * jitter_ns[p])
                rel = max(rel, now)
        kind = -1  # leaves now, in place
        if reorder[p] > 0.0 and draw(seeds, p, idx, E_REORDER) < reorder[p]:
            kind = K_REORDER
        elif delayed or pend[p] > 0:
            kind = K_DELAY  # also when delay was switched off while packets are still held
            rel = max(rel, last_rel[p])
            last_rel[p] = rel
        if kind < 0:
            passed[p] += 1
        else:
            ok = _hold(p, buf[i], ln, kind, rel, passed[p] + reorder_k[p],
                       rel + reorder_timeout_ns, r_buf, r_len, r_kind, r_rel, r_need,
                       r_timeout, r_used, r_head, r_tail, pend)
            if not ok:
                out_port[i] = PORT_DROP
                reason[i] = _R_QUEUE_FULL
                counters[p, C_OVERFLOW] += 1
                continue
            out_port[i] = PORT_HELD
            if kind == K_REORDER:
                counters[p, C_REORDER] += 1
            else:
                counters[p, C_DELAYED] += 1
        if copy:
            ck = K_DELAY if kind == K_DELAY else K_EXTRA
            if _hold(p, buf[i], ln, ck, rel if ck == K_DELAY else now, 0, 0, r_buf, r_len,
                     r_kind, r_rel, r_need, r_timeout, r_used, r_head, r_tail, pend):
                counters[p, C_DUP] += 1
            else:
                counters[p, C_OVERFLOW] += 1
    k = _release(now, buf, length, base, room, k, emit_port, r_buf, r_len, r_kind, r_rel,
                 r_need, r_timeout, r_used, r_head, r_tail, pend, passed, counters)
    # next due time over everything still held
    size = r_len.shape[1]
    d = _NEVER
    for p in range(n_ports):
        for j in range(r_head[p], r_tail[p]):
            s = j % size
            if r_used[p, s]:
                t = r_rel[p, s]
                if r_kind[p, s] == K_REORDER and passed[p] < r_need[p, s]:
                    t = r_timeout[p, s]
                if t < d:
                    d = t
    deadline[0] = d
    return k


class ImpairStage(Stage):
    """Seeded loss / duplication / reordering / delay per port (program name ``impair``).

    Settings (constructor and :meth:`configure`; the per-port ones take one value for all
    ports, a ``{port: value}`` dict by name or index, or a list with one value per port):

    * ``loss``, ``dup``, ``reorder`` (per port, probabilities in [0, 1]);
    * ``reorder_k`` (per port, >= 1): positions a reordered packet is held back;
    * ``delay_ms``, ``jitter_ms`` (per port, >= 0);
    * ``seed`` (int): changing it restarts every port's sequence;
    * ``filter``: ``"all"`` or ``"testbed"``; ``reorder_timeout_ms``.

    Construction only: ``direction`` (``"egress"`` or ``"ingress"``) and ``slots`` (frames
    the ring of each port can hold: size it to rate x delay).
    """

    name = "impair"
    max_expansion = 3

    def __init__(self, ports: list[str] | None = None, n_ports: int | None = None,
                 direction: str = "egress", seed: int = 0, loss=0.0, dup=0.0, reorder=0.0,
                 reorder_k=3, delay_ms=0.0, jitter_ms=0.0, filter: str = "all",
                 reorder_timeout_ms: float = 10.0, slots: int = 1024):
        self.ports = resolve_ports(ports, n_ports, "impair")
        if direction not in DIRECTIONS:
            raise ValueError(f"impair: direction must be one of {DIRECTIONS}, got {direction!r}")
        self.direction = direction
        n = len(self.ports)
        size = check_number("slots", 1, 1 << 20, integer=True)(slots)
        self.r_buf = np.zeros((n, size, FRAME_MAX), np.uint8)
        self.r_len = np.zeros((n, size), np.int32)
        self.r_kind = np.zeros((n, size), np.int8)
        self.r_rel = np.zeros((n, size), np.int64)
        self.r_need = np.zeros((n, size), np.int64)
        self.r_timeout = np.zeros((n, size), np.int64)
        self.r_used = np.zeros((n, size), np.bool_)
        for a in ("r_head", "r_tail", "seq", "passed", "last_rel", "pend", "reorder_k",
                  "delay_ns", "jitter_ns"):
            setattr(self, a, np.zeros(n, np.int64))
        self.loss = np.zeros(n, np.float64)
        self.dup = np.zeros(n, np.float64)
        self.reorder = np.zeros(n, np.float64)
        self.seeds = np.zeros(n, np.uint64)
        self.counters_arr = np.zeros((n, len(COUNTER_NAMES)), np.int64)
        self._emit = np.zeros(0, np.int16)
        self._deadline = np.full(1, _NEVER, np.int64)
        self.seed = 0
        self.only_testbed = False
        self.reorder_timeout_ns = 0
        self.configure(seed=seed, loss=loss, dup=dup, reorder=reorder, reorder_k=reorder_k,
                       delay_ms=delay_ms, jitter_ms=jitter_ms, filter=filter,
                       reorder_timeout_ms=reorder_timeout_ms)

    def configure(self, seed=None, loss=None, dup=None, reorder=None, reorder_k=None,
                  delay_ms=None, jitter_ms=None, filter=None, reorder_timeout_ms=None,
                  **unknown) -> None:
        """Change impairments at run time (see the class docstring); all-or-nothing."""
        if unknown:
            raise ValueError(f"impair: unknown settings {sorted(unknown)}; use seed, loss, dup, "
                             "reorder, reorder_k, delay_ms, jitter_ms, filter, "
                             "reorder_timeout_ms")
        prob = check_number
        updates = []
        for name, value, arr, check, conv in (
                ("loss", loss, self.loss, prob("loss", 0.0, 1.0), float),
                ("dup", dup, self.dup, prob("dup", 0.0, 1.0), float),
                ("reorder", reorder, self.reorder, prob("reorder", 0.0, 1.0), float),
                ("reorder_k", reorder_k, self.reorder_k,
                 check_number("reorder_k", 1, 1 << 20, integer=True), int),
                ("delay_ms", delay_ms, self.delay_ns, check_number("delay_ms", 0.0, 60_000.0),
                 lambda v: int(round(v * 1e6))),
                ("jitter_ms", jitter_ms, self.jitter_ns,
                 check_number("jitter_ms", 0.0, 60_000.0), lambda v: int(round(v * 1e6)))):
            if value is not None:
                vals = per_port(value, self.ports, f"impair: {name}", check)
                updates.append((arr, {p: conv(v) for p, v in vals.items()}))
        if seed is not None:
            seed = check_number("seed", 0, 2**63 - 1, integer=True)(seed)
        if filter is not None and filter not in FILTERS:
            raise ValueError(f"impair: filter must be one of {FILTERS}, got {filter!r}")
        if reorder_timeout_ms is not None:
            reorder_timeout_ms = check_number("reorder_timeout_ms", 0.0, 60_000.0)(
                reorder_timeout_ms)
        for arr, vals in updates:
            for p, v in vals.items():
                arr[p] = v
        if seed is not None:
            self.seed = seed
            for p in range(len(self.ports)):
                self.seeds[p] = port_seed(seed, p)
            self.seq[:] = 0
        if filter is not None:
            self.only_testbed = filter == "testbed"
        if reorder_timeout_ms is not None:
            self.reorder_timeout_ns = int(round(reorder_timeout_ms * 1e6))

    def process(self, batch: Batch, now_ns: int) -> None:
        """Impair the batch's packets of this stage's direction; append the held ones now due."""
        base = batch.n
        if self._emit.shape[0] < batch.capacity:
            self._emit = np.zeros(batch.capacity, np.int16)
        egress = self.direction == "egress"
        k = impair_kernel(batch.buf, batch.length, batch.in_port, batch.out_port, batch.reason,
                          batch.n, base, batch.capacity - base, int(now_ns), egress,
                          self.only_testbed, self.seeds, self.loss, self.dup, self.reorder,
                          self.reorder_k, self.delay_ns, self.jitter_ns,
                          self.reorder_timeout_ns, self.seq, self.passed, self.last_rel,
                          self.pend, self.r_buf, self.r_len, self.r_kind, self.r_rel,
                          self.r_need, self.r_timeout, self.r_used, self.r_head, self.r_tail,
                          self.counters_arr, self._emit, self._deadline)
        if k:
            append_emitted(batch, k, self._emit, batch.out_port if egress else batch.in_port)

    def next_deadline_ns(self) -> int | None:
        """When the earliest held packet is due (None when nothing is held)."""
        d = int(self._deadline[0])
        return None if d == _NEVER else d

    def held(self) -> int:
        """Frames held now (delay line, reorder holds and pending duplicates)."""
        return int(self.r_used.sum())

    def counters(self) -> dict:
        """Per-port effect counters (see the module docstring) and their totals."""
        ports = {}
        for p, name in enumerate(self.ports):
            c = {k: int(v) for k, v in zip(COUNTER_NAMES, self.counters_arr[p], strict=True)}
            c["held"] = int(self.r_used[p].sum())
            ports[name] = c
        totals = {k: int(self.counters_arr[:, j].sum()) for j, k in enumerate(COUNTER_NAMES)}
        # what the stage does now (configure changes it at run time): the models read it
        settings = {"filter": "testbed" if self.only_testbed else "all",
                    "reorder_timeout_ms": self.reorder_timeout_ns / 1e6,
                    "ports": {name: {"loss": float(self.loss[p]), "dup": float(self.dup[p]),
                                     "reorder": float(self.reorder[p])}
                              for p, name in enumerate(self.ports)}}
        return {"direction": self.direction, "seed": self.seed, "ports": ports,
                "totals": totals, "settings": settings}


class IngressImpairStage(ImpairStage):
    """:class:`ImpairStage` fixed to ``direction='ingress'`` (program name ``impair_ingress``).

    A node whose ports are impaired in both directions runs two impair stages; the engine
    addresses stages and their counters by name, so the ingress one needs its own.
    """

    name = "impair_ingress"

    def __init__(self, ports=None, **settings):
        settings.pop("direction", None)  # always ingress: that is the point of this class
        super().__init__(ports=ports, direction="ingress", **settings)
