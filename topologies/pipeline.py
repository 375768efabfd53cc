"""Which data-path stages each programmable node runs, in which order, with which settings.

:func:`compose` is the one place that decides a pipeline. It is a pure function of a topology
and a :class:`DatapathOptions` record (the conditions an experiment adds on top of the
topology: seeded impairments, trimming queues, a SmartNIC codec), so a notebook or a test can
ask for a network's pipelines without building it. :class:`~testbed.topologies.net.TestbedNet`
starts every engine with the result, and the experiment runner hands its options to
``TestbedNet`` rather than composing anything itself.

Order of the stages::

    switch:   [ingress impair] [aggregate] forward          [egress impair] [trim | shape]
    SmartNIC: [ingress impair]             wire | nic_codec [egress impair] [trim | shape]

How the parts are chosen:

* **Core.** A ``programs`` override of the topology (by node name, or ``'switch'`` /
  ``'smartnic'`` for every node of that kind) replaces the default core: ``forward`` on a
  switch, ``wire`` on a SmartNIC, ``nic_codec`` on a SmartNIC when the options ask for a codec
  (then an override must contain ``nic_codec``; its settings are merged with the codec's).
* **Aggregate.** Every programmable switch (SmartNICs excepted) aggregates: an ``aggregate``
  stage is put in front of ``forward`` when the core lacks it, with the switch's aggregator
  identity (:func:`~testbed.topologies.base.switch_identity`: the aggregator switch answers
  the well-known address) and the options' ``aggregate`` settings (memory, shared pool).
* **Forwarding table.** A ``forward`` stage gets the routing's table (``l2``: destination MAC
  -> ECMP group of ports) and ``learn=False`` unless the override sets them.
* **Link impairments.** Without netem, the topology's ``delay_ms`` / ``loss_pct`` are applied
  by the programmable end of each link: an egress stage on every port, and an ingress stage on
  the ports whose peer runs no data path (nobody else impairs peer -> node). Seeds are derived
  per node and direction from the topology's seed.
* **Options.** Each :class:`Impairment` adds a stage in its direction; each :class:`Trimming`
  adds a ``trim`` stage last (the egress queue must see every packet after the other stages);
  in ``uet`` mode its ``last_hop`` ports are those whose link ends at a host (or its SmartNIC).
* **Link shaping.** A node's shaped links (``bw_mbps``) are shaped, on its side, by its own
  engine: a ``shape`` stage last, a drop-tail queue per port drained at the link's rate and as
  deep as the kernel's queue would be (``queue_ms`` of the topology, else ``txqueuelen``, 1000
  frames), so the network does not shape those ports again with an HTB qdisc
  (:func:`engine_shaped_ports`). Like Mininet's HTB class it may send 15 000 B ahead of its
  clock, and the engine wakes once per such burst. A packet then costs the machine no
  shaper timer per packet (0.1 timer interrupts per packet instead of 0.7 for a ring of 4):
  ``testbed bench capacity`` on 2 cores, 8 MiB at 100 Mb/s, machine CPU per packet of a ring
  of 8 10-11 us instead of 17-18, of INA of 4 20-22 instead of 25-30 (``--shaping qdisc`` and
  ``DatapathOptions(shape_in_engine=False)`` keep the qdiscs, for such comparisons). A node
  with a ``trim`` stage (its queue drains at the link rates already) or a ``shape`` stage of
  its own gets none.

A node runs one stage per name (the engine addresses stages and their counters by name). The
impairments of one direction (the topology's delay_ms/loss_pct in the data path, every
:class:`Impairment` entry) are one ``impair`` stage: per port, probabilities combine as
independent draws in sequence, delays add, jitters add in quadrature; entries that filter
different traffic are refused. When a node is impaired in both directions, its ingress stage
is ``impair_ingress``; a lone ingress stage keeps the name ``impair``.

**Time dilation.** :func:`compose` describes the emulated network (rates and delays as the
user gave them). :func:`dilate` turns a plan into what the engines of a network dilated by a
factor f run: every delay, jitter and reordering timeout of an ``impair`` stage multiplied by
f, every drain rate of a ``trim`` or ``shape`` stage (a link rate) divided by f and a ``trim``
stage's ``rtt_us`` multiplied by f. Queue thresholds and bursts stay in bytes (a BDP threshold,
rate x RTT, too) and probabilities stay as they are: a dilated network carries the same
packets, f times slower.

``DatapathOptions(explicit_programs=True)`` uses the topology's overrides exactly as given
(no aggregate or shape stage added, no table filled in: a ``forward`` stage then learns):
for tests and benchmarks that exercise a stage on its own.

Bad input raises :class:`~testbed.topologies.base.TopologyError` naming the node and the
field: an unknown program name, options for a node that runs no data path, a port that is
not the node's, two sources of the same stage.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

from testbed.datapath.programs import normalize_programs

from . import routing
from .base import (
    IMPAIR_STAGES,
    TestbedTopo,
    TopologyError,
    aggregating_switches,
    switch_identity,
)

#: trim threshold of the ports a trimming entry does not name: only a full queue drops
NO_TRIM_BYTES = 1 << 40
#: stages that are egress queues drained at link rates (time dilation divides their rates)
QUEUE_STAGES = ("trim", "shape")
#: A full-size Ethernet frame (1500 B MTU + 14 B header): the unit of queue limits counted in
#: packets, and the smallest byte limit a shaping queue gets.
FULL_FRAME_BYTES = 1514
#: frame slots of a ``shape`` queue per byte of its limit: frames down to 512 B fill the limit
#: before the slots run out (smaller ones meet the slot count first)
SHAPE_SLOT_BYTES = 512


@dataclass(frozen=True)
class Impairment:
    """Seeded loss / duplication / reordering / delay on ports of one programmable node.

    Probabilities are fractions in [0, 1]. ``ports``: indices (engine order, 0 = the node's
    first port) or interface names; None = every port.
    """

    node: str
    direction: str = "ingress"
    ports: tuple[int | str, ...] | None = None
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    filter: str = "all"
    seed: int = 0


#: a :class:`Trimming` entry for every programmable switch (not SmartNICs) without its own:
#: trimming anywhere in a fabric (every port of a leaf-spine or fat-tree)
EVERY_SWITCH = "*"
#: modes of a :class:`Trimming` queue (those of the ``trim`` stage)
TRIM_MODES = ("trim", "drop_tail", "uet")


@dataclass(frozen=True)
class Trimming:
    """An egress queue per port of one node, drained at ``rate_mbps``, trimming (or dropping,
    ``mode='drop_tail'``; trimming as Ultra Ethernet does, ``mode='uet'``) above
    ``threshold_bytes``, or above ``threshold_bdp`` bandwidth-delay products of ``rtt_us``
    (the plane's base RTT) when given.

    ``node`` ``"*"``: every programmable switch that has no entry of its own.
    ``rate_mbps`` None: the topology's ``bw_mbps``. ``ports`` (indices or names): only these
    get the rate and threshold; the node's other ports drain at their own link rate and never
    trim below a full queue. None = every port. ``trim_bytes``: frame length after a UET cut
    (None: the stage's default). In ``uet`` mode the node's host-facing ports are its last hop
    (``last_hop``: a 1.5x threshold, cuts re-marked TRIMMED_LASTHOP).
    """

    node: str
    mode: str = "trim"
    rate_mbps: float | None = None
    threshold_bytes: int = 30_000
    queue_slots: int = 256
    ports: tuple[int | str, ...] | None = None
    trim_bytes: int | None = None
    threshold_bdp: float | None = None
    rtt_us: float | None = None


@dataclass(frozen=True)
class DatapathOptions:
    """What an experiment adds to the topology's own pipelines (see the module docstring).

    ``nic_codec``: settings of a ``nic_codec`` stage every SmartNIC runs (e.g.
    ``{"codec": "fixed32"}``), None for none. ``aggregate``: settings of every switch's
    ``aggregate`` stage (e.g. ``{"memory_bytes": 1 << 20, "pool_bytes": 1 << 19}``).
    ``shape_in_engine``: programmable nodes shape their links in their engines (a ``shape``
    stage) rather than with the kernel's HTB; False keeps HTB (for comparing the two).
    """

    impairments: tuple[Impairment, ...] = ()
    trimming: tuple[Trimming, ...] = ()
    nic_codec: dict[str, Any] | None = None
    explicit_programs: bool = False
    aggregate: dict[str, Any] | None = None
    shape_in_engine: bool = True

    def is_empty(self) -> bool:
        """True when the options add nothing to the topology's pipelines."""
        return not (self.impairments or self.trimming or self.nic_codec is not None
                    or self.explicit_programs or self.aggregate)


def node_seed(seed: int, node: str, what: str) -> int:
    """A per-node, per-stage seed derived from the topology's: independent loss patterns on
    different nodes, yet the same run again for the same ``seed``."""
    return zlib.crc32(f"{seed}:{node}:{what}".encode()) & 0x7FFFFFFF


def node_ports(topo: TestbedTopo, node: str) -> list[str]:
    """Interface names of ``node`` in engine order (index 0 = Mininet port 1)."""
    adj = routing.adjacency(topo).get(node, {})
    return [f"{node}-eth{port}" for port, _bw in sorted(adj.values())]


def compose(topo: TestbedTopo, options: DatapathOptions | None = None,
            tables: dict[str, dict[str, list[int]]] | None = None) -> dict[str, list]:
    """Node -> ``[(program, settings), ...]`` for every programmable node of ``topo``.

    ``tables``: the routing's forwarding tables when the caller has them already
    (:func:`testbed.topologies.routing.forwarding_tables`). Raises :class:`TopologyError`.
    """
    options = options or DatapathOptions()
    _check_option_nodes(topo, options)
    if tables is None and not options.explicit_programs:
        tables = routing.forwarding_tables(topo)
    return {name: _node_pipeline(topo, options, tables, name)
            for name in sorted(topo.programmable)}


#: settings that are times (multiplied by the dilation factor): an impair stage's delays, a
#: queue stage's RTT (so that a BDP threshold, rate x RTT, stays the same number of bytes)
DILATED_TIMES = ("delay_ms", "jitter_ms", "reorder_timeout_ms", "rtt_us")
#: settings of a trim stage that are rates (divided by it)
DILATED_RATES = ("rate_mbps",)
#: largest time dilation factor a network accepts
MAX_TIME_DILATION = 64.0


def check_time_dilation(value: Any, what: str = "time_dilation", auto: bool = True
                        ) -> float | str:
    """``value`` as a dilation factor (a float >= 1), or ``"auto"`` when ``auto`` allows it;
    anything else raises :class:`TopologyError` naming ``what``."""
    if auto and value == "auto":
        return "auto"
    ok = (isinstance(value, int | float) and not isinstance(value, bool)
          and 1.0 <= float(value) <= MAX_TIME_DILATION)
    if not ok:
        also = ' or "auto" (calibrated: the smallest factor that keeps the CPU unsaturated)' \
            if auto else ""
        raise TopologyError(f"{what}={value!r} must be a factor from 1 (real time) to "
                            f"{MAX_TIME_DILATION:g}{also}")
    return float(value)


def dilate_settings(program: str, settings: dict, factor: float) -> dict:
    """The settings an engine runs ``program`` with in a network dilated by ``factor``: the
    times of an ``impair`` stage multiplied, the rates of a queue stage divided (a value
    may be one number or a dict per port). Other programs are unchanged."""
    if factor == 1.0:
        return dict(settings)
    if program in IMPAIR_STAGES:
        scales = dict.fromkeys(DILATED_TIMES, factor)
    elif program in QUEUE_STAGES:
        scales = {**dict.fromkeys(DILATED_TIMES, factor),
                  **dict.fromkeys(DILATED_RATES, 1.0 / factor)}
    else:
        return dict(settings)
    out = dict(settings)
    for key, scale in scales.items():
        v = out.get(key)
        if isinstance(v, dict):
            out[key] = {p: x * scale for p, x in v.items()}
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[key] = v * scale
    return out


def dilate(plan: dict[str, list], factor: float) -> dict[str, list]:
    """A :func:`compose` plan as the engines of a network dilated by ``factor`` run it."""
    return {node: [(p, dilate_settings(p, s, factor)) for p, s in stages]
            for node, stages in plan.items()}


def _check_option_nodes(topo: TestbedTopo, options: DatapathOptions) -> None:
    for what, entries in (("impairments", options.impairments), ("trimming", options.trimming)):
        for entry in entries:
            if what == "trimming" and entry.node == EVERY_SWITCH:
                if entry.ports is not None:
                    raise TopologyError(
                        f"trimming on {EVERY_SWITCH!r} (every programmable switch) cannot name "
                        "ports: port names belong to one node; give an entry per node instead")
                continue
            if entry.node not in topo.programmable:
                raise TopologyError(
                    f"{what}: node {entry.node!r} is not a programmable node of this topology; "
                    f"programmable: {sorted(topo.programmable) or 'none'} (make it "
                    "programmable: switch='programmable', or smartnic=... for a host's NIC)")
    if options.nic_codec is not None and not topo.nic_of:
        raise TopologyError("a SmartNIC codec needs SmartNIC nodes: build the topology with "
                            "smartnic=True (or a list of host ranks)")


def _node_pipeline(topo: TestbedTopo, options: DatapathOptions, tables, name: str) -> list:
    is_nic = topo.switch_roles[name] == "smartnic"
    ports = node_ports(topo, name)
    core = _core(topo, options, tables, name, is_nic)
    link_egress, link_ingress = _link_impairments(topo, name, ports)
    opt_ingress = [i for i in options.impairments if i.node == name and i.direction == "ingress"]
    opt_egress = [i for i in options.impairments if i.node == name and i.direction != "ingress"]
    trims = [t for t in options.trimming if t.node == name]
    if not trims and not is_nic:  # an entry of its own wins over the one for every switch
        trims = [t for t in options.trimming if t.node == EVERY_SWITCH]
    own = [p for p, _ in core]
    if any(p in IMPAIR_STAGES for p in own) and link_egress:
        raise TopologyError(
            f"programs[{name!r}] has its own 'impair' stage, and delay_ms/loss_pct (no netem "
            "here) need the topology's; use one or the other")
    if any(p in IMPAIR_STAGES for p in own) and (opt_ingress or opt_egress):
        raise TopologyError(
            f"programs[{name!r}] has its own 'impair' stage, and impairments on {name!r} add "
            "one; use one or the other")
    if "trim" in own and trims:
        raise TopologyError(
            f"programs[{name!r}] has its own 'trim' stage, and trimming on {name!r} adds one; "
            "use one or the other")
    ingress = ([_link_settings(topo, name, ports, link_ingress, "ingress")] if link_ingress
               else []) + [_impair_settings(i, name, ports) for i in opt_ingress]
    egress = ([_link_settings(topo, name, ports, link_egress, "egress")] if link_egress
              else []) + [_impair_settings(i, name, ports) for i in opt_egress]
    ingress = [("impair", _one_impair_stage(ingress, name, ports))] if ingress else []
    egress = [("impair", _one_impair_stage(egress, name, ports))] if egress else []
    if ingress and egress:
        ingress = [("impair_ingress", s) for _, s in ingress]
    tail = [("trim", _trim_settings(topo, t, name, ports)) for t in trims]
    if not tail and options.shape_in_engine and not options.explicit_programs \
            and not any(p in QUEUE_STAGES for p in own):
        shape = _shape_settings(topo, name)
        tail = [("shape", shape)] if shape else []
    return ingress + core + egress + tail


def _core(topo: TestbedTopo, options: DatapathOptions, tables, name: str, is_nic: bool
          ) -> list:
    """The node's middle stages: override or default, aggregate, forwarding table, codec."""
    generic = "smartnic" if is_nic else "switch"
    override = topo.programs.get(name)
    from_generic = override is None and generic in topo.programs
    if override is None:
        override = topo.programs.get(generic)
    key = name if not from_generic else generic
    if override is not None:
        try:
            core = normalize_programs(override)
        except ValueError as exc:
            raise TopologyError(f"programs[{key!r}]: {exc}") from None
    elif is_nic:
        core = [("nic_codec", {}) if options.nic_codec is not None else ("wire", {})]
    else:
        core = [("forward", {})]
    if is_nic and options.nic_codec is not None:
        if "nic_codec" not in [p for p, _ in core]:
            raise TopologyError(
                f"programs[{key!r}] has no 'nic_codec' stage but a SmartNIC codec is asked "
                "for; add 'nic_codec' to the override or drop the codec")
        core = [(p, {**s, **options.nic_codec} if p == "nic_codec" else s) for p, s in core]
    if options.explicit_programs:
        return core
    names = [p for p, _ in core]
    if not is_nic:
        if "aggregate" not in names and name in aggregating_switches(topo):
            at = names.index("forward") if "forward" in names else 0
            core.insert(at, ("aggregate", {}))
        mac, ip = switch_identity(topo, name)
        core = [(p, {"agg_ip": ip, "agg_mac": mac, **(options.aggregate or {}), **s}
                 if p == "aggregate" else s) for p, s in core]
    table = {mac: [f"{name}-eth{p}" for p in group] for mac, group in tables[name].items()}
    for pname, settings in core:
        if pname == "forward":
            settings.setdefault("l2", table)
            settings.setdefault("learn", False)
    return core


def _link_impairments(topo: TestbedTopo, name: str, ports: list[str]
                      ) -> tuple[list[str], list[str]]:
    """(egress ports, ingress ports) of ``name`` whose links it must impair (no netem)."""
    if topo.impair_mode() != "datapath":
        return [], []
    egress, ingress = [], []
    for s in topo.link_specs:
        for me, port, peer in ((s.a, s.port_a, s.b), (s.b, s.port_b, s.a)):
            if me != name:
                continue
            egress.append(f"{me}-eth{port}")
            if peer not in topo.programmable:  # nobody else impairs peer -> me
                ingress.append(f"{me}-eth{port}")
    return [p for p in ports if p in egress], [p for p in ports if p in ingress]


def _link_settings(topo: TestbedTopo, name: str, ports: list[str], impaired: list[str],
                   direction: str) -> dict:
    values = {"loss": topo.loss_pct / 100.0, "delay_ms": topo.delay_ms}
    out: dict[str, Any] = {k: {p: (v if p in impaired else 0.0) for p in ports}
                           for k, v in values.items()}
    if direction == "ingress":
        out["direction"] = "ingress"
    out["seed"] = node_seed(topo.seed, name, direction)
    return out


def queue_bytes(bw_mbps: float, queue_ms: float) -> int:
    """Bytes of a link queue ``queue_ms`` deep at ``bw_mbps`` (at least one full frame)."""
    return max(FULL_FRAME_BYTES, int(bw_mbps * 125 * queue_ms))


def _link_rates(topo: TestbedTopo, name: str) -> dict[str, float]:
    """Port name -> link rate (Mb/s) of ``name``'s shaped links, in engine order."""
    return {f"{name}-eth{port}": float(bw)
            for port, bw in sorted(routing.adjacency(topo)[name].values()) if bw is not None}


def _shape_settings(topo: TestbedTopo, name: str) -> dict[str, Any] | None:
    """The ``shape`` stage of ``name``: its shaped ports at their link rates, each queue as deep
    as the kernel's would be. None when none of its links is shaped."""
    rates = _link_rates(topo, name)
    if not rates:
        return None
    if topo.queue_ms is None:
        return {"rate_mbps": rates}  # the stage's default depth: txqueuelen frames
    limits = {p: queue_bytes(bw, topo.queue_ms) for p, bw in rates.items()}
    slots = min(65536, max(64, -(-max(limits.values()) // SHAPE_SLOT_BYTES)))
    return {"rate_mbps": rates, "threshold_bytes": limits, "threshold_pkts": 0,
            "queue_slots": slots}


def engine_shaped_ports(topo: TestbedTopo, plan: dict[str, list]) -> set[str]:
    """Interfaces a :func:`compose` plan of ``topo`` shapes in an engine (the ports its
    ``shape`` stages give a rate): the network gives them no qdisc of its own."""
    out: set[str] = set()
    for node, stages in plan.items():
        ports = node_ports(topo, node)
        for program, settings in stages:
            rate = settings.get("rate_mbps") if program == "shape" else None
            if isinstance(rate, dict):  # by name or index (a bad one: the stage says so)
                out |= {ports[int(p)] if str(p).isdigit() and int(p) < len(ports) else p
                        for p in rate}
            elif rate is not None:
                out |= set(ports)
    return out


def _port_name(ref: int | str, name: str, ports: list[str], what: str) -> str:
    if isinstance(ref, bool) or not isinstance(ref, (int, str)):
        raise TopologyError(f"{what} on {name!r}: port {ref!r} must be an index or a name")
    if isinstance(ref, int):
        if not 0 <= ref < len(ports):
            raise TopologyError(f"{what} on {name!r}: port index {ref} is outside "
                                f"0..{len(ports) - 1} ({ports})")
        return ports[ref]
    if ref not in ports:
        raise TopologyError(f"{what} on {name!r}: {ref!r} is not one of its ports {ports}")
    return ref


def _per_port(value: Any, chosen: list[str] | None) -> Any:
    return value if chosen is None else dict.fromkeys(chosen, value)


def _impair_settings(imp: Impairment, name: str, ports: list[str]) -> dict[str, Any]:
    chosen = None if imp.ports is None else [_port_name(p, name, ports, "impairments")
                                             for p in imp.ports]
    return {"direction": imp.direction, "seed": imp.seed, "filter": imp.filter,
            **{k: _per_port(getattr(imp, k), chosen)
               for k in ("loss", "dup", "reorder", "delay_ms", "jitter_ms")}}


#: how the impairments of one direction combine into one stage, per port: independent draws
#: in sequence (a frame survives every loss, escapes every duplication and reordering)
_PROBABILITIES = ("loss", "dup", "reorder")


def _one_impair_stage(entries: list[dict], name: str, ports: list[str]) -> dict[str, Any]:
    """The settings of the one ``impair`` stage that applies ``entries`` (the link's own
    delay/loss, :class:`Impairment` settings) in one direction of node ``name``.

    Why one: the engine addresses a stage and its counters by name, so a second ``impair``
    stage would hide the first from the counters, the models and ``configure``. Per port,
    probabilities combine as independent draws in sequence (1 - prod(1 - p)), delays add and
    jitters (independent spreads) add in quadrature. Entries that filter different traffic
    cannot share a stage."""
    if len(entries) == 1:
        return entries[0]
    filters = {e.get("filter", "all") for e in entries}
    if len(filters) > 1:
        raise TopologyError(
            f"impairments on {name!r} ({entries[0].get('direction', 'egress')}): the entries "
            f"of one direction run as one stage, and these filter different traffic "
            f"({sorted(filters)}); give them one filter (the topology's delay_ms/loss_pct "
            "impair all traffic), or put them in different directions")

    def at(e: dict, key: str, port: str) -> float:
        v = e.get(key, 0.0)
        return float(v.get(port, 0.0) if isinstance(v, dict) else v)

    out: dict[str, Any] = {"direction": entries[0].get("direction", "egress"),
                           "filter": filters.pop(),
                           "seed": sum(e.get("seed", 0) for e in entries) % (1 << 63)}
    for key in _PROBABILITIES:
        out[key] = {p: round(1.0 - math.prod(1.0 - at(e, key, p) for e in entries), 12)
                    for p in ports}
    out["delay_ms"] = {p: round(sum(at(e, "delay_ms", p) for e in entries), 9) for p in ports}
    out["jitter_ms"] = {p: round(math.hypot(*(at(e, "jitter_ms", p) for e in entries)), 9)
                        for p in ports}
    return out


def _trim_settings(topo: TestbedTopo, tr: Trimming, name: str, ports: list[str]
                   ) -> dict[str, Any]:
    rate = tr.rate_mbps if tr.rate_mbps is not None else topo.bw_mbps
    if rate is None:
        raise TopologyError(f"trimming on {name!r}: give rate_mbps (the topology's links are "
                            "unshaped, so there is no link rate to drain the queue at)")
    if tr.mode not in TRIM_MODES:
        raise TopologyError(f"trimming on {name!r}: mode={tr.mode!r} must be one of "
                            f"{TRIM_MODES}")
    if tr.threshold_bdp is not None and tr.rtt_us is None:
        raise TopologyError(f"trimming on {name!r}: threshold_bdp needs rtt_us (the plane's "
                            "base RTT, µs)")
    s: dict[str, Any] = {"mode": tr.mode, "queue_slots": tr.queue_slots}
    s.update({k: getattr(tr, k) for k in ("trim_bytes", "rtt_us")
              if getattr(tr, k) is not None})
    if tr.mode == "uet":
        hosts = set(topo.host_names)
        s["last_hop"] = {f"{name}-eth{port}": _faces_host(topo, peer, hosts)
                         for peer, (port, _bw) in sorted(routing.adjacency(topo)[name].items())}
    # a BDP threshold or the byte one, for the chosen ports
    key, value = (("threshold_bdp", tr.threshold_bdp) if tr.threshold_bdp is not None
                  else ("threshold_bytes", tr.threshold_bytes))
    if tr.ports is None:
        s.update({"rate_mbps": rate, key: value})
        return s
    # Every port goes through the stage's queue: the chosen ones drain at rate_mbps with the
    # threshold, the others at their own link rate with no trimming below a full queue.
    rates = _link_rates(topo, name)
    others = dict.fromkeys(rates, NO_TRIM_BYTES)
    chosen = {}
    for ref in tr.ports:
        p = _port_name(ref, name, ports, "trimming")
        rates[p] = rate
        chosen[p] = value
    s["rate_mbps"] = rates
    if key == "threshold_bdp":  # the stage takes one threshold setting per port
        s["threshold_bytes"] = {p: v for p, v in others.items() if p not in chosen}
        s["threshold_bdp"] = chosen
    else:
        s["threshold_bytes"] = {**others, **chosen}
    return s


def _faces_host(topo: TestbedTopo, peer: str, hosts: set[str]) -> bool:
    """The link to ``peer`` is a last hop: it ends at a host, or at a host's SmartNIC."""
    return peer in hosts or topo.switch_roles.get(peer) == "smartnic"
