"""Flow-level model of a collective on a real topology: phases of flows on the paths the
switches really use, max-min fair rates, per-hop latency.

``predict(topology, spec)`` is a pure function of a topology description (a ``TestbedTopo``
or its ``describe()`` dict) and a :class:`CollectiveSpec`; it builds no network, so a notebook
can ask "what would this cost" before running anything. ``runner.run_collective`` puts its
result in every row's ``model_s``.

How a prediction is made:

1. **Flows and paths.** Each algorithm is a sequence of phases; a phase is a set of flows
   that run at once, each with a byte count (see :func:`phases`). A flow's path is the one the
   network forwards it on (:func:`testbed.topologies.routing.flow_path`): programmable
   switches hash the 5-tuple with the data path's ECMP hash, and the 5-tuple is known because
   the collectives bind deterministic ports (:mod:`testbed.collectives.ports`); Linux bridges
   of a looped fabric follow their static FDB; loop-free fabrics have one path. Flows between
   ranks on one host (a co-located reduction server) use no link.
2. **Wire bytes.** A flow of D payload bytes puts ``D * wire`` bytes on every directed link
   of its path and, for TCP, ``D * ack`` bytes of ACKs on every link of the ACKs' own path
   (the reverse 5-tuple as forwarded, not always the data path reversed):
   TCP ``wire = 1514/1448`` (MSS 1448 with timestamps in a 1514 B frame), ``ack = 33/1448``
   (a 66 B delayed ACK per two segments); INA ``wire = 1094/1024`` (256 int32 + 70 B of
   headers), no ACKs. HTB shapes whole frames, so a link of ``bw_mbps`` carries
   ``bw_mbps * 1e6 / 8`` wire bytes per second in each direction.
3. **Rates: max-min fairness by progressive filling.** All unfrozen flows' payload rates grow
   together; a directed link is full when ``sum(rate_f * weight_f) = capacity``, which freezes
   every flow on it; repeat until every flow is frozen. Within a phase the rates are
   recomputed whenever a flow finishes (a fluid simulation), and the phase ends with its last
   flow. A flow that crosses no shaped link makes the model fail with a clear error.
4. **Latency.** A phase adds ``hops * hop_latency_s`` for its longest path (for a ring's
   step and the chain broadcast, whose ranks relay each other's data without a barrier, the
   mean of its paths: :func:`_trip_hops`), times the number of one-way trips the phase
   waits for (1 for a TCP step, 2 for a halving-doubling round with a rendezvous, 2 for a
   reduction-server round trip, 4 for INA: the exponent bootstrap round trip plus the last
   packet's round trip; 2 for the SmartNIC variant, which has no bootstrap round). Phases
   follow one another: a flow of phase k+1 starts when phase k ended. For halving-doubling
   that is what its rendezvous makes true (a pair's round starts when both partners
   finished the previous one, and on these networks the two give the same time); without
   it an early rank's message would share its partner's downlink with the partner's
   previous round (``hd``'s docstring has the measurements).
5. **Pipelining fill.** The reduction server returns piece 0 once every worker's piece 0
   arrived: + ``piece / r_min`` (the slowest flow's rate); the chain broadcast's last rank gets
   the first chunk after ``n - 2`` relays: + ``(n - 2) * chunk / r_min``.
6. **INA's window and loss**: a window too small for the round trip, and the retransmission
   cost under loss to first order in the loss rate (:func:`ina_extra_s`), each tree edge's
   loss from the impaired links of its paths; a reordered frame of the last window waits
   out its ``impair`` stage's timeout.
7. **Impairments** (``loss_pct`` and a running network's ``impair`` stages,
   ``predict(..., impairments=net.link_impairments())``): a duplicated frame loads every
   link after the point it is copied (an aggregating switch takes INA's copies in).
8. **TCP and the UET-like transport under loss** (:func:`_loss_s`): a window-bound flow that
   loses a packet stalls for a round trip loaded with the queues in front of its ACKs; a
   phase waits for its worst flow.

The closed-form alpha-beta model (:func:`testbed.collectives.model.predict`) is the special
case of one switch where every phase's flows cross distinct links and every link carries data
both ways: on a star the two give the same time for ring, halving-doubling and INA, and for
the reduction server with as many servers as workers (``tests/collectives/test_collectives_flowmodel.py``
checks it). Where they differ on a star, the flow model is the finer one: one-way phases
(binomial broadcast, the halving-doubling fold) leave a link direction without reverse data,
so its payload share is 1448/1514 instead of 1448/1547; with fewer reduction servers than
workers, piece 0 waits for the busier server link. Beyond one switch the two differ where the
closed form cannot look: colliding ECMP flows share an uplink, halving-doubling's rounds have
their own pairs, oversubscribed uplinks carry several flows.

``time_dilation`` (a factor f >= 1, for runs on a dilated network): the emulation runs every
link at ``bw / f`` and stretches every timer by f, so the model computes the dilated run's
wall time (rates divided by f, INA's timeout floor times f, ``hop_latency_s`` as measured on
the dilated network) and returns it divided by f: the time the undilated network would take.
What dilation does not stretch is the emulator's own fixed cost per packet and per hop, which
the measured hop latency carries: divided by f, it shrinks. A dilated run is therefore exact in
its bandwidth terms and in every configured delay and timeout, and slightly optimistic in the
per-packet software latency, which real switches do not have anyway.

Why one module this long: each algorithm's phases are built on the same path solver and max-min
rate allocation; one file keeps the model's single contract (topology description + spec ->
time) and its algorithms side by side.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from testbed.collectives import alltoall, compress, hd
from testbed.collectives import model as ab
from testbed.collectives.algorithms import is_offloaded, peer_algorithm
from testbed.collectives.ports import (
    INA_AGG_PORT,
    a2a_port,
    ina_worker_port,
    tcp_port,
    tcp_tuple,
    uet_port,
)
from testbed.collectives.report import shard_bounds
from testbed.collectives.spec import HD_RENDEZVOUS_BYTES, CollectiveSpec
from testbed.collectives.uet import ACK_EVERY
from testbed.collectives.uet import DEFAULT_ENTROPIES as UET_ENTROPIES
from testbed.collectives.uet import MAX_WINDOW as UET_MAX_WINDOW
from testbed.kernels.wire import MTU_PAYLOAD, PAYLOAD_OFFSET, TESTBED_UDP_PORT
from testbed.topologies import aggtree, routing
from testbed.topologies.base import (
    TCP_RTO_MIN_US,
    LinkImpairment,
    TopologyError,
    own_link_loss,
)

__all__ = ["Flow", "Phase", "Prediction", "predict", "predict_s", "phases", "max_min_rates",
           "ina_extra_s", "incast_s", "IncastPrediction", "InaTree", "ina_worker_port", "INA_AGG_PORT",
           "tcp_port", "placement", "transfers_s", "all_to_all_s", "TCP_WIRE", "TCP_ACK",
           "INA_WIRE", "DEFAULT_HOP_S", "LinkImpairment", "as_impairments"]

#: Wire bytes per TCP payload byte on the data path, and of ACKs on the reverse path.
TCP_WIRE = ab.TCP_FRAME / ab.TCP_MSS
TCP_ACK = ab.TCP_ACK_SHARE / ab.TCP_MSS
#: Wire bytes per INA payload byte (each direction; no ACKs).
INA_WIRE = ab.INA_FRAME / ab.INA_PAYLOAD
#: The UET-like transport (testbed.collectives.uet): frame bytes per payload byte, and its
#: ACKs (one header-and-SACK frame every ACK_EVERY packets) on the reverse path
UET_WIRE = (PAYLOAD_OFFSET + MTU_PAYLOAD) / MTU_PAYLOAD
UET_ACK = (PAYLOAD_OFFSET + 8) / (ACK_EVERY * MTU_PAYLOAD)
#: Per-hop latency without a measurement: the configured link delay plus this forwarding
#: allowance (the value ``TestbedNet.hop_latency_s`` assumes when it cannot ping).
DEFAULT_HOP_S = 20e-6
#: INA's retransmission timeout floor (SwitchML's 10 ms; ``inakernel.T0``, not imported here:
#: the kernels module loads Numba, and the model must stay cheap to import)
INA_RTO_FLOOR_S = 0.010
#: Ports of transfers whose real ports are ephemeral (:func:`transfers_s`): Linux's range
EPHEMERAL_PORT = 40000
#: Payload and header bytes of an INA packet: the THC variant keeps the 70 B of headers.
INA_HDR = ab.INA_FRAME - ab.INA_PAYLOAD


@dataclass(frozen=True)
class Flow:
    """``nbytes`` payload bytes from node ``src`` to node ``dst``.

    ``sport``/``dport``/``proto`` form the 5-tuple the ECMP hash reads; ``wire``: wire bytes
    per payload byte on the path, ``ack``: on the reverse path (TCP ACKs)."""

    src: str
    dst: str
    nbytes: float
    sport: int
    dport: int
    proto: int = 6
    wire: float = TCP_WIRE
    ack: float = TCP_ACK
    #: the path of an INA RESULT is its contribution's path reversed (results_via ingress)
    reverse_of: tuple[str, str, int, int] | None = None
    #: source ports the flow's packets are sprayed over (the UET-like transport): its bytes
    #: spread evenly over the paths they hash onto; empty: one path, ``sport``'s
    spray: tuple[int, ...] = ()


@dataclass
class Phase:
    """Flows that run at once; ``trips``: one-way path latencies the phase waits for;
    ``fill_bytes``: pipelining fill, paid at the slowest flow's rate."""

    name: str
    flows: list[Flow]
    trips: float = 1.0
    fill_bytes: float = 0.0
    #: packets per worker (INA: what the loss model counts)
    packets: int = 0
    #: links of the phase's longest one-way trip when it is not one flow's path (an INA
    #: tree: worker to root through every level); None: the longest flow path
    trip_hops: int | None = None
    #: the flows relay one another's data (a ring step, the chain broadcast): each rank
    #: waits only for its predecessor, so a trip costs the paths' mean latency, not the
    #: longest (:func:`_trip_hops`)
    relay: bool = False


@dataclass
class PhaseResult:
    """A phase's predicted time and why: the initial rate (payload B/s) and path per flow,
    and the most loaded directed link."""

    name: str
    time_s: float
    transfer_s: float
    latency_s: float
    fill_s: float
    rates: list[tuple[Flow, float, list[str]]]
    bottleneck: tuple[str, str] | None
    #: wire bytes the phase puts on each directed link (its flows' data on their paths,
    #: sprayed flows spread over theirs, TCP ACKs on their own 5-tuple's path)
    link_bytes: dict[tuple[str, str], float] = field(default_factory=dict)


@dataclass
class Prediction:
    """The model's answer: ``time_s`` (None when the model does not apply, see ``notes``)."""

    time_s: float | None
    phases: list[PhaseResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: INA: time its window and losses add (:func:`ina_extra_s`), included in ``time_s``
    ina_extra_s: float = 0.0
    time_dilation: float = 1.0
    #: TCP or the UET-like transport: time its flows' losses add (:func:`_loss_s`), included
    #: in ``time_s``
    loss_s: float = 0.0

    @property
    def applies(self) -> bool:
        """Whether ``time_s`` is a prediction (else ``notes`` say why not)."""
        return self.time_s is not None

    def sent_bytes(self) -> dict[str, float]:
        """Wire bytes each node sends in the collective (payload times its wire factor;
        TCP ACKs aside): what a host's uplink counter should show per run."""
        out: dict[str, float] = {}
        for p in self.phases:
            for f, _rate, _path in p.rates:
                out[f.src] = out.get(f.src, 0.0) + f.nbytes * f.wire
        return out

    def link_bytes(self) -> dict[tuple[str, str], float]:
        """Wire bytes the collective puts on each directed link, every phase together."""
        out: dict[tuple[str, str], float] = {}
        for p in self.phases:
            for link, b in p.link_bytes.items():
                out[link] = out.get(link, 0.0) + b
        return out

    def summary(self) -> str:
        """One line per phase: time, slowest rate and bottleneck link."""
        lines = []
        for p in self.phases:
            slow = min((r for _f, r, _p in p.rates), default=float("nan"))
            lines.append(f"{p.name:>12}: {p.time_s * 1e3:9.3f} ms  slowest flow "
                         f"{slow * 8 / 1e6:8.2f} Mb/s  bottleneck {p.bottleneck}")
        total = "n/a" if self.time_s is None else f"{self.time_s:.4f} s"
        lines.append(f"total {total}" + (f" (INA window/loss {self.ina_extra_s:.4f} s)"
                                          if self.ina_extra_s else "")
                     + (f" (transport loss {self.loss_s:.4f} s)" if self.loss_s else "")
                     + "".join(f"\n  note: {n}" for n in self.notes))
        return "\n".join(lines)


# ------------------------------------------------------------------------------ placement

def placement(host_names: list[str], spec: CollectiveSpec) -> tuple[list[str], list[str]]:
    """(worker hosts, server hosts) as ``runner.placement`` puts them: the first n hosts
    work; reduction servers take the next m hosts, or are spread over the workers when the
    topology has too few hosts (``spec.hosts``: the hosts to use, by rank)."""
    if spec.hosts is not None:
        host_names = [host_names[r] for r in spec.hosts]
    n = spec.workers or len(host_names)
    workers = list(host_names[:n])
    if spec.algo != "rs":
        return workers, []
    m = spec.servers
    if n + m <= len(host_names):
        return workers, list(host_names[n:n + m])
    return workers, [workers[(j * n) // m] for j in range(m)]


# ------------------------------------------------------------------------------ phases

class _Ranks:
    """Rank -> host and the TCP flow between two ranks (deterministic ports)."""

    def __init__(self, hosts: list[str], job_id: int, itemsize: int, transport: str = "tcp",
                 port_of=tcp_port):
        self.hosts = hosts
        self.job = job_id
        self.itemsize = itemsize
        self.transport = transport
        self.port_of = port_of  # the connections' port map (an all-to-all's: a2a_port)

    def tcp(self, src: int, dst: int, elems: float) -> Flow:
        """The flow of a message between two ranks over the job's transport: TCP on its
        deterministic ports, or the UET-like transport sprayed over its entropies."""
        if self.transport == "uet":
            ports = tuple(uet_port(self.job, e) for e in range(UET_ENTROPIES))
            return Flow(self.hosts[src], self.hosts[dst], elems * self.itemsize, ports[0],
                        TESTBED_UDP_PORT, 17, UET_WIRE, UET_ACK, spray=ports)
        sport, dport = tcp_tuple(self.job, src, dst, self.port_of)
        return Flow(self.hosts[src], self.hosts[dst], elems * self.itemsize, sport, dport)


def _sizes(count: int, parts: int) -> list[int]:
    b = shard_bounds(count, parts)
    return [int(b[i + 1] - b[i]) for i in range(parts)]


def _ring_steps(rk: _Ranks, n: int, sizes: list[int], rs: bool, ag: bool) -> list[Phase]:
    """Ring steps (``ring._ring``): step k of the reduce-scatter, rank r sends shard
    (r-1-k) mod n to r+1; step k of the allgather, shard (r-k) mod n."""
    out = []
    if rs:
        for k in range(n - 1):
            out.append(Phase(f"rs step {k}", [rk.tcp(r, (r + 1) % n, sizes[(r - 1 - k) % n])
                                             for r in range(n)], relay=True))
    if ag:
        for k in range(n - 1):
            out.append(Phase(f"ag step {k}", [rk.tcp(r, (r + 1) % n, sizes[(r - k) % n])
                                             for r in range(n)], relay=True))
    return out


def _trip_hops(ph: Phase, paths: list[list]) -> float:
    """Links of one of ``ph``'s one-way trips, given its flows' paths.

    A relaying phase (``ph.relay``) takes the mean: a ring is a cycle in which each rank
    forwards what its left neighbour sent, with no barrier between steps, so over its
    steps it advances by its links' mean latency (the cycle mean), and a chain's relays
    add up their own paths. The ring of a fat-tree k=8 mostly joins hosts under one edge
    switch (2 links) and 6 links only between pods: 2.6 links on average, 6 at most. Its
    128 ranks' 1 MiB ring at dilation 64 took 0.179 s; the longest path priced it at 0.199 s
    (measured/model 0.90), the mean at 0.187 s (0.96).
    """
    if ph.trip_hops is not None:
        return ph.trip_hops
    hops = [len(p) - 1 for p in paths]
    if not hops:
        return 0
    return sum(hops) / len(hops) if ph.relay else max(hops)


def _hd_trips(flows: list[Flow]) -> float:
    """One-way trips of a halving-doubling round: its data, plus the rendezvous' "entered"
    message first when the round's messages are large (``hd._meet``)."""
    return 2.0 if max(f.nbytes for f in flows) >= HD_RENDEZVOUS_BYTES else 1.0


def _hd_rounds(rk: _Ranks, count: int, p: int, old, halving: bool,
               doubling: bool) -> list[Phase]:
    """Recursive halving then doubling among p virtual ranks (``hd._halving`` /
    ``hd._doubling``): exact element counts of every exchanged range, per round."""
    b = shard_bounds(count, p)
    out = []
    if halving:
        rng = {v: (0, p) for v in range(p)}
        d = p // 2
        while d >= 1:
            flows = []
            for v in range(p):
                s0, s1 = rng[v]
                mid = (s0 + s1) // 2
                keep, give = ((mid, s1), (s0, mid)) if v & d else ((s0, mid), (mid, s1))
                flows.append(rk.tcp(old(v), old(v ^ d), int(b[give[1]] - b[give[0]])))
                rng[v] = keep
            out.append(Phase(f"halving d={d}", flows, trips=_hd_trips(flows)))
            d //= 2
    if doubling:
        rng = {v: (v, v + 1) for v in range(p)}
        d = 1
        while d < p:
            flows = []
            for v in range(p):
                s0, s1 = rng[v]
                flows.append(rk.tcp(old(v), old(v ^ d), int(b[s1] - b[s0])))
            for v in range(p):
                s0, s1 = rng[v]
                o0, o1 = rng[v ^ d]
                rng[v] = (min(s0, o0), max(s1, o1))
            out.append(Phase(f"doubling d={d}", flows, trips=_hd_trips(flows)))
            d *= 2
    return out


def _ina_phase(hosts: list[str], tree: InaTree, job_id: int, packets: int, up_bytes: float,
               down_bytes: float, up_wire: float, down_wire: float, nic: bool) -> Phase:
    """Every edge of the aggregation tree carries one contribution stream up and one RESULT
    stream down at once (the switches aggregate as packets arrive: a pipeline); the phase waits
    for the trips from a worker to the root and back."""
    port = ina_worker_port(job_id)  # SmartNIC-offloaded workers bind it too
    flows = []
    edges = [(h, tree.parent[h], port) for h in hosts]
    edges += [(s, p, INA_AGG_PORT) for s, p in tree.parent.items()
              if p is not None and s not in hosts]
    for child, parent, sport in edges:
        flows.append(Flow(child, parent, up_bytes, sport, INA_AGG_PORT, 17, up_wire, 0.0))
        flows.append(Flow(parent, child, down_bytes, INA_AGG_PORT, sport, 17, down_wire, 0.0,
                          reverse_of=(child, parent, sport, INA_AGG_PORT)))
    return Phase("ina", flows, trips=2.0 if nic else 4.0, packets=packets,
                 trip_hops=tree.trip_hops if len(tree.parent) > len(hosts) + 1 else None)


@dataclass
class InaTree:
    """An INA job's aggregation tree as the model needs it: node -> the switch it sends to
    (None for the root), and the links of the longest worker-to-root chain."""

    root: str
    parent: dict[str, str | None]
    trip_hops: int

    @classmethod
    def of(cls, topo, workers: list[str], spec: CollectiveSpec, tables=None) -> InaTree:
        """The tree :func:`testbed.topologies.aggtree.plan` gives ``spec.placement["tree"]``."""
        ranks = [topo.host_names.index(h) for h in workers]
        tree = (spec.placement or {}).get("tree")
        plan = aggtree.plan(topo, ranks, ina_worker_port(spec.job_id), tree, tables)
        parent: dict[str, str | None] = {plan.root: None}
        for h, w in zip(workers, plan.workers, strict=True):
            parent[h] = w["switch"]
        for s, node in plan.nodes.items():
            if node["parent"] is not None:
                parent[s] = node["parent"]["switch"]
        port = ina_worker_port(spec.job_id)

        def hops(a: str, b: str, sport: int) -> int:
            return len(routing.flow_path(topo, a, b, sport, INA_AGG_PORT, 17, tables)) - 1

        def chain(node: str) -> int:
            p = parent[node]
            if p is None:
                return 0
            return hops(node, p, port if node in workers else INA_AGG_PORT) + chain(p)

        return cls(plan.root, parent, max(chain(h) for h in workers))


def _compressed_phases(spec: CollectiveSpec, workers: list[str]) -> list[Phase]:
    """The compressed ring allreduce as ``compress.allreduce`` runs it (same
    :func:`compress.wire_plan`): a summable payload reduce-scattered and allgathered in its
    wire type (THC first agrees on a norm: n-1 steps of one 8-byte scalar), or every
    worker's blob (8 B length prefix + payload) allgathered; over the job's transport."""
    n = len(workers)
    kind, elems, itemsize = compress.wire_plan(spec.compressor, spec.compressor_params,
                                               spec.count, n)
    if kind == "allgather":
        rk = _Ranks(workers, spec.job_id, 1, spec.transport)
        return [Phase(f"ag step {k}", [rk.tcp(r, (r + 1) % n, elems) for r in range(n)],
                      relay=True) for k in range(n - 1)]
    out = []
    if compress.ring_carrier(spec.compressor) == "levels":
        rk8 = _Ranks(workers, spec.job_id, 8, spec.transport)
        out += [Phase(f"norm step {k}", [rk8.tcp(r, (r + 1) % n, 1) for r in range(n)],
                      relay=True) for k in range(n - 1)]
    return out + _ring_steps(_Ranks(workers, spec.job_id, itemsize, spec.transport), n,
                             _sizes(elems, n), rs=True, ag=True)


def _thc_wire(spec: CollectiveSpec, n: int) -> tuple[int, float, float, float, float]:
    """(packets, up payload, down payload, up wire ratio, down wire ratio) of INA + THC per
    worker: K packets of E int8 lanes up, the same K packets back in the widest RESULT lane
    the sums can need (int8 when n * g/2 <= 127, else int16: an upper bound, the switch may
    narrow a slot's lanes)."""
    # Function-level imports: the INA client and the compressors load Numba kernels.
    from testbed.collectives.ina import thc_elems, thc_layout
    from testbed.kernels.compressors import get_compressor

    comp = get_compressor("thc", **spec.compressor_params)
    E = thc_elems(n, comp.g)
    d = thc_layout(comp, spec.count, E, 0, 0)[0]
    K = -(-d // E)
    lane = 1 if n * (comp.g // 2) <= 127 else 2
    up, down = K * E, K * E * lane
    return K, up, down, (INA_HDR + E) / E, (INA_HDR + E * lane) / (E * lane)


def phases(spec: CollectiveSpec, workers: list[str], servers: list[str] | None = None,
           aggregator: str | InaTree | None = None) -> list[Phase]:
    """The phases of ``spec`` among ``workers`` (host names in rank order), ``servers``
    (reduction servers, ranks n..n+m-1) and the ``aggregator`` (INA: a switch name, or the
    job's :class:`InaTree`)."""
    n = len(workers)
    servers = list(servers or [])
    count, op, algo = spec.count, spec.op, spec.algo
    rk = _Ranks(workers + servers, spec.job_id, spec.itemsize, spec.transport)
    chunk_el = max(1, spec.chunk_bytes // spec.itemsize)
    if is_offloaded(algo):
        if aggregator is None:
            raise ValueError(f"algo={algo!r} needs an aggregator switch; this topology has "
                             "none (make a switch programmable, aggregator='auto')")
        if isinstance(aggregator, str):
            aggregator = InaTree(aggregator, {aggregator: None, **dict.fromkeys(workers,
                                                                              aggregator)}, 0)
        if spec.compressor is not None:
            return [_ina_phase(workers, aggregator, spec.job_id, *_thc_wire(spec, n), nic=False)]
        return [_ina_phase(workers, aggregator, spec.job_id, -(-count // ab.INA_ELEMS),
                           spec.nbytes, spec.nbytes, INA_WIRE, INA_WIRE, nic=algo == "nic")]
    if spec.compressor is not None:  # compress.allreduce: reduce-scatter or allgather
        return _compressed_phases(spec, workers)
    if algo == "rs":
        m = len(servers)
        if m < 1:
            raise ValueError("algo='rs' needs at least one server host")
        sizes = _sizes(count, m)
        flows = [rk.tcp(w, n + j, sizes[j]) for w in range(n) for j in range(m)]
        flows += [rk.tcp(n + j, w, sizes[j]) for w in range(n) for j in range(m)]
        piece = min(ab.rs_chunk_bytes(spec.nbytes, m, spec.chunk_bytes), spec.nbytes / m)
        return [Phase("reduce+return", flows, trips=2.0, fill_bytes=piece)]
    return peer_algorithm(algo).phases(op, n, count, chunk_el, rk)


def ring_phases(op: str, n: int, count: int, chunk_el: int, rk: _Ranks) -> list[Phase]:
    """The ring's phases: a pipelined chain for broadcast, else its reduce-scatter and/or
    allgather steps."""
    if op == "broadcast":
        fill = max(n - 2, 0) * min(chunk_el, count) * rk.itemsize
        return [Phase("chain", [rk.tcp(r, r + 1, count) for r in range(n - 1)],
                      trips=n - 1, fill_bytes=fill, relay=True)]
    sizes = _sizes(count, n)
    return _ring_steps(rk, n, sizes, rs=op in ("allreduce", "reduce_scatter"),
                       ag=op in ("allreduce", "allgather"))


def hd_phases(op: str, n: int, count: int, rk: _Ranks) -> list[Phase]:
    """Halving-doubling's phases: binomial rounds for broadcast, else its halving and/or
    doubling rounds (allreduce folding the ranks past the largest power of two first)."""
    if op == "broadcast":  # binomial tree: round d, ranks < d send everything to rank + d
        out, d = [], 1
        while d < n:
            out.append(Phase(f"binomial d={d}", [rk.tcp(r, r + d, count)
                                                  for r in range(d) if r + d < n]))
            d *= 2
        return out
    if op in ("reduce_scatter", "allgather"):
        return _hd_rounds(rk, count, n, lambda v: v, halving=op == "reduce_scatter",
                          doubling=op == "allgather")
    p, rem, _new, old = hd.fold(n)
    out = []
    if rem:  # the odd one of each of the first rem pairs hands its array over ...
        out.append(Phase("fold", [rk.tcp(2 * i + 1, 2 * i, count) for i in range(rem)]))
    out += _hd_rounds(rk, count, p, old, halving=True, doubling=True)
    if rem:  # ... and gets the sum back
        out.append(Phase("unfold", [rk.tcp(2 * i, 2 * i + 1, count) for i in range(rem)]))
    return out


# ------------------------------------------------------------------------------ rates

def max_min_rates(weights: list[dict], capacity: dict, caps: list[float] | None = None
                  ) -> list[float]:
    """Max-min fair payload rates by progressive filling.

    ``weights[f]``: {link: wire bytes per payload byte of flow f on that link};
    ``capacity``: {link: wire bytes/s} (links not in it are unconstrained); ``caps``:
    optional per-flow upper bounds. Every unfrozen flow's rate grows by the same amount until
    a link fills (sum of rate * weight = capacity) or a flow reaches its cap; those flows
    freeze; repeat. Raises ValueError for a flow that no capacity bounds."""
    nf = len(weights)
    rate = [0.0] * nf
    frozen = [False] * nf
    caps = caps or [math.inf] * nf
    on_link: dict = {}
    for f, w in enumerate(weights):
        for link, x in w.items():
            if link in capacity and x > 0:
                on_link.setdefault(link, []).append(f)
    used = dict.fromkeys(on_link, 0.0)
    while not all(frozen):
        inc, full = math.inf, []
        for link, fs in on_link.items():
            wsum = sum(weights[f][link] for f in fs if not frozen[f])
            if wsum <= 0:
                continue
            room = max(capacity[link] - used[link], 0.0) / wsum
            if room < inc * (1 - 1e-12):
                inc, full = room, [link]
            elif room <= inc * (1 + 1e-12):
                full.append(link)
        cap_inc = min((caps[f] - rate[f] for f in range(nf) if not frozen[f]), default=math.inf)
        if math.isinf(inc) and math.isinf(cap_inc):
            free = [f for f in range(nf) if not frozen[f]]
            raise ValueError(f"flows {free} cross no shaped link: the model needs a bandwidth "
                             "(give the topology bw_mbps)")
        step = min(inc, cap_inc)
        for f in range(nf):
            if not frozen[f]:
                rate[f] += step
                for link, x in weights[f].items():
                    if link in used:
                        used[link] += step * x
        if step == inc:
            for link in full:
                for f in on_link[link]:
                    frozen[f] = True
        for f in range(nf):
            if not frozen[f] and math.isfinite(caps[f]) and \
                    caps[f] - rate[f] <= 1e-12 * max(caps[f], 1.0):
                frozen[f] = True
    return rate


def as_impairments(impairments) -> list[LinkImpairment]:
    """``impairments`` (None, or :class:`LinkImpairment` records or their ``to_dict()``
    forms, as ``TestbedNet.link_impairments()`` gives them) as records."""
    out = []
    for imp in impairments or ():
        if isinstance(imp, dict):
            try:
                imp = LinkImpairment(**imp)
            except TypeError as e:
                raise ValueError(f"impairment {imp!r}: {e}; give LinkImpairment records") from None
        if not isinstance(imp, LinkImpairment):
            raise TypeError(f"impairments must be LinkImpairment records, got "
                            f"{type(imp).__name__}")
        out.append(imp)
    return out


def _frames(f: Flow) -> bool | str:
    """Which impairments act on ``f``'s frames: every frame's (``False``), or testbed
    frames' (``True``: INA's, UDP to or from the aggregation port, which an impairment with
    ``filter="testbed"`` acts on too), or ``"uet"``: the UET-like transport's (testbed frames
    too), which a queue that cuts trimmable packets does not lose."""
    if f.spray:
        return "uet"
    return f.proto == 17 and INA_AGG_PORT in (f.sport, f.dport)


class _Network:
    """Directed link capacities (wire B/s) and the paths of flows (cached per 5-tuple)."""

    def __init__(self, topo, dilation: float, impairments=None):
        self.topo = topo
        self.dilation = dilation
        self.adj = routing.adjacency(topo)
        self.tables = routing.forwarding_tables(topo)
        self.capacity = {}
        for s in topo.link_specs:
            if s.bw_mbps is not None:
                c = s.bw_mbps * 1e6 / 8 / dilation
                self.capacity[(s.a, s.b)] = c
                self.capacity[(s.b, s.a)] = c
        self._paths: dict = {}
        # directed link -> its impairments, per kind of frame (:func:`_frames`)
        self.impaired: dict[bool | str, dict[tuple[str, str], LinkImpairment]] = {
            False: {}, True: {}, "uet": {}}
        links = [LinkImpairment(a, b, loss=p)
                 for (a, b), p in own_link_loss(topo.link_specs).items()]
        for imp in links + as_impairments(impairments):
            for kind in (False, True, "uet"):
                if kind is False and imp.testbed_only:
                    continue
                act = imp
                if kind == "uet" and imp.cuts_trimmable:  # cut and resent, not lost
                    act = dataclasses.replace(imp, loss=0.0)
                key = (imp.src, imp.dst)
                have = self.impaired[kind].get(key)
                self.impaired[kind][key] = act if have is None else have.combined(act)

    def impairments_of(self, f: Flow, path: list[str]) -> list[LinkImpairment]:
        """The impairments on the directed links of ``path`` that act on ``f``'s frames."""
        table = self.impaired[_frames(f)]
        if not table:
            return []
        return [table[k] for k in zip(path, path[1:], strict=False) if k in table]

    def path_loss(self, f: Flow) -> float:
        """Probability that a frame of ``f`` is lost somewhere on its path (a sprayed flow's
        frames: on the path each takes, spread evenly over them)."""
        losses = []
        for path, _ack in self.routes(f):
            keep = 1.0
            for imp in self.impairments_of(f, path):
                keep *= 1.0 - imp.loss
            losses.append(1.0 - keep)
        return sum(losses) / len(losses)

    def routes(self, f: Flow) -> list[tuple[list[str], list[str]]]:
        """(data path, ACK path) of each route ``f``'s packets take: one, or one per source
        port a sprayed flow uses."""
        if f.spray:
            return [(self.path(f.src, f.dst, sport, f.dport, f.proto),
                     self.path(f.dst, f.src, f.dport, sport, f.proto)) for sport in f.spray]
        return [(self.flow_path(f), self.ack_path(f))]

    def path(self, src: str, dst: str, sport: int, dport: int, proto: int) -> list[str]:
        key = (src, dst, sport, dport, proto)
        if key not in self._paths:
            self._paths[key] = routing.flow_path(self.topo, src, dst, sport, dport, proto,
                                                 tables=self.tables)
        return self._paths[key]

    def flow_path(self, f: Flow) -> list[str]:
        if f.reverse_of is not None:
            s, d, sp, dp = f.reverse_of
            return self.path(s, d, sp, dp, f.proto)[::-1]
        return self.path(f.src, f.dst, f.sport, f.dport, f.proto)

    def ack_path(self, f: Flow) -> list[str]:
        """The path of ``f``'s ACKs: the reverse 5-tuple as the fabric forwards it, which on
        a bridge fabric's static FDB or under ECMP need not be the data path reversed."""
        return self.path(f.dst, f.src, f.dport, f.sport, f.proto)

    def weights(self, f: Flow) -> dict:
        if f.spray:  # an equal share of the bytes (and of the ACKs) on each sprayed path
            w: dict = {}
            share = 1.0 / len(f.spray)
            for data, ack in self.routes(f):
                for path, x in ((data, f.wire), (ack, f.ack)):
                    for a, b in zip(path, path[1:], strict=False):
                        w[(a, b)] = w.get((a, b), 0.0) + x * share
            return w
        w = {}
        table = self.impaired[_frames(f)]
        for path, x in ((self.flow_path(f), f.wire), (self.ack_path(f) if f.ack else [], f.ack)):
            copies = 1.0  # duplicated frames load every link after the point they appear
            for link in zip(path, path[1:], strict=False):
                imp = table.get(link)
                if imp is not None and imp.direction == "egress":
                    copies *= 1.0 + imp.dup
                w[link] = w.get(link, 0.0) + x * copies
                if imp is not None and imp.direction != "egress":
                    copies *= 1.0 + imp.dup
        return w


def _run_phase(net: _Network, ph: Phase, hop_s: float) -> PhaseResult:
    """Fluid simulation of one phase: max-min rates, recomputed whenever a flow finishes."""
    flows = [f for f in ph.flows if f.src != f.dst and f.nbytes > 0]
    if not flows:
        return PhaseResult(ph.name, 0.0, 0.0, 0.0, 0.0, [], None)
    weights = [net.weights(f) for f in flows]
    left = [float(f.nbytes) for f in flows]
    active = list(range(len(flows)))
    t = 0.0
    first: list[float] | None = None
    while active:
        r = max_min_rates([weights[i] for i in active], net.capacity)
        if first is None:
            first = r
        dt = min(left[i] / ri for i, ri in zip(active, r, strict=True))
        still = []
        for i, ri in zip(active, r, strict=True):
            left[i] -= ri * dt
            if left[i] > 1e-9 * flows[i].nbytes:
                still.append(i)
        t += dt
        active = still
    assert first is not None
    latency = ph.trips * _trip_hops(ph, [net.flow_path(f) for f in flows]) * hop_s
    fill = ph.fill_bytes / min(first) if ph.fill_bytes else 0.0
    load: dict = {}
    for w, ri in zip(weights, first, strict=True):
        for link, x in w.items():
            load[link] = load.get(link, 0.0) + x * ri
    util = {k: v / net.capacity[k] for k, v in load.items() if k in net.capacity}
    bneck = max(util, key=util.get) if util else None
    rates = [(f, ri, net.flow_path(f)) for f, ri in zip(flows, first, strict=True)]
    carried: dict = {}
    for f, w in zip(flows, weights, strict=True):
        for link, x in w.items():
            carried[link] = carried.get(link, 0.0) + f.nbytes * x
    return PhaseResult(ph.name, t + latency + fill, t, latency, fill, rates, bneck, carried)


# ------------------------------------------------------------------------------ INA window, loss

def ina_extra_s(*, n: int, packets: int, window: int, p_up: float, p_down: float,
                frame_s: float, rtt_s: float, rto_s: float | None = None,
                rto_floor_s: float = INA_RTO_FLOOR_S) -> float:
    """Extra time of an INA allreduce beyond its bandwidth time: its window and, to first
    order in the loss rate, its losses.

    ``packets``: data packets per worker (K); ``window``: slots per worker (W); ``p_up`` /
    ``p_down``: probability that a contribution / a RESULT is lost on its way (client-side
    ``spec.loss`` and every impaired link of the path); ``frame_s``: time one frame takes on
    the worker's bottleneck; ``rtt_s``: unloaded round trip; ``rto_floor_s``: the timeout's
    floor (10 ms, times the dilation on a dilated network). The formula::

        rho   = 1 - (1 - p_up)**n * (1 - p_down)    # a worker's slot round needs a retry:
                                                    # any of the n contributions or its own
                                                    # RESULT was lost
        RTO   = max(10 ms, 2 * (rtt + W * frame))   # SwitchML's 10 ms, or srtt + 4 rttvar
                                                    # of the loaded round trip, ~2x it
        extra = K * rho / (1 - rho) * frame         # retransmitted frames on the worker link:
                                                    # every member resends a stalled round,
                                                    # again if the resend stalls too
              + max(0, (K / W) * (rtt + rho * RTO) - K * frame)
                                                    # a slot's chain of K/W rounds, each
                                                    # stalled by an RTO with probability rho,
                                                    # beyond what the bandwidth hides
              + RTO * (1 - (1 - rho)**W)            # the run ends with its last slot: one
                                                    # stall in the last window is not hidden

    Every member resends a stalled round, not only the one whose packet was lost: a worker
    cannot tell its own loss from another member's (``inakernel.fast_retransmit``), and the
    switch drops the copies it already counted. With 16 workers on a fat-tree k=4 whose
    contributions cross three links at 1 % loss each, rho is 0.40 and the workers resent 0.61
    frames per frame (rho / (1 - rho) = 0.67; their own losses alone would be 0.06): the
    resent frames, not the lost ones, are what loads the links. A stall of one slot
    is hidden while the other W - 1 keep the link busy, which is why only the chain bound and
    the last window add time. Without loss only the chain bound remains:
    a window too small for the round trip (``K / W * rtt > K * frame``) limits the rate.
    Second-order effects (several losses of one packet, RTO doubling) are left out: the
    formula is meant for loss rates of a few per cent per path. Where rho is large, a run
    whose last resend stalls again waits out doubled timeouts: on that fat-tree such runs took
    about twice the model's time, the others 1.0-1.26 of it.
    """
    if not (0 <= p_up < 1 and 0 <= p_down < 1):
        raise ValueError(f"loss probabilities must be in [0, 1), got {p_up}, {p_down}")
    rho = 1 - (1 - p_up) ** n * (1 - p_down)
    rto = rto_s if rto_s is not None else max(rto_floor_s, 2 * (rtt_s + window * frame_s))
    retx = packets * rho / (1 - rho) * frame_s
    chain = max(0.0, packets / window * (rtt_s + rho * rto) - packets * frame_s)
    tail = rto * (1 - (1 - rho) ** window)
    return retx + chain + tail


def _ina_extra(spec: CollectiveSpec, ph: Phase, res: PhaseResult, net: _Network,
               hop_s: float, dilation: float) -> float:
    """:func:`ina_extra_s` for the INA phase ``ph`` (its result ``res``) on ``net``, in the
    wall time of a network dilated by ``dilation``, plus what reordering adds at the end.

    Every tree edge carries its contributions up and its RESULTs down on paths of their own;
    the impaired links of each (``loss_pct``, ``impair`` stages) give its loss probability. A
    slot's round needs every edge's contribution and the worker's RESULT through each level
    down to it: ``p_up`` is the per-contribution loss that gives the same probability for
    all edges at once, ``p_down`` the worst worker's chain of RESULT paths (the client's own
    ``spec.loss`` on both). A reordered frame waits for ``reorder_k`` later frames of its
    port, which the last window may not have: it then waits out the stage's reorder timeout
    (``+ timeout x (1 - (1 - r)^W)``, the worst path's reorder probability r)."""
    up = [(f, r, p) for f, r, p in res.rates if f.reverse_of is None]  # contributions
    if not up:
        return 0.0
    keep_up, parent = 1.0, {}
    for f, _r, _p in up:
        keep_up *= (1.0 - spec.loss) * (1.0 - net.path_loss(f))
        parent[f.src] = f.dst
    p_up = 1.0 - keep_up ** (1.0 / len(up))
    down = {f.reverse_of[0]: net.path_loss(f) for f, _r, _p in res.rates
            if f.reverse_of is not None}

    def chain_keep(node: str) -> float:  # no RESULT lost from the root down to ``node``
        return 1.0 if node not in parent else (1.0 - down.get(node, 0.0)) * chain_keep(
            parent[node])

    leaves = [c for c in parent if c not in parent.values()]
    p_down = 1.0 - (1.0 - spec.loss) * min(chain_keep(c) for c in leaves)
    # a slot's round trip crosses each level
    hops = ph.trip_hops if ph.trip_hops is not None else max(len(p) - 1 for _f, _r, p in up)
    f, r, _ = min(up, key=lambda x: x[1])  # the slowest worker
    extra = ina_extra_s(n=len(up), packets=ph.packets, window=spec.window, p_up=p_up,
                        p_down=p_down, frame_s=f.nbytes / r / ph.packets,
                        rtt_s=2 * hops * hop_s, rto_floor_s=INA_RTO_FLOOR_S * dilation)
    held = 0.0
    for fl, _r, path in res.rates:
        imps = [i for i in net.impairments_of(fl, path) if i.reorder > 0]
        if imps:
            stay = math.prod(1.0 - i.reorder for i in imps)
            held = max(held, max(i.reorder_timeout_s for i in imps)
                       * (1.0 - stay ** min(spec.window, ph.packets)))
    return extra + held


# ------------------------------------------------------------------------------ TCP under loss

#: Frames a shaped link's queue holds when the topology gives no ``queue_ms`` (the kernel's
#: txqueuelen under an HTB class; the ``shape`` stage's default depth is the same)
DEFAULT_QUEUE_FRAMES = 1000


def _queue_limit(topo, capacity_bps: float, dilation: float) -> float:
    """Bytes a shaped link's queue holds (``queue_ms`` at its undilated rate, or
    :data:`DEFAULT_QUEUE_FRAMES` full frames)."""
    # a topology object's attribute, or its description's parameter
    q_ms = topo.queue_ms if hasattr(topo, "queue_ms") else topo.params.get("queue_ms")
    if q_ms is None:
        return DEFAULT_QUEUE_FRAMES * ab.TCP_FRAME
    return max(ab.TCP_FRAME, capacity_bps * dilation / 8 * float(q_ms) / 1e3)


def _segment(f: Flow) -> int:
    """Payload bytes per packet of a host transfer: TCP's MSS, or the UET-like transport's."""
    return MTU_PAYLOAD if f.spray else ab.TCP_MSS


def _loss_s(spec: CollectiveSpec, res: PhaseResult, net: _Network, hop_s: float) -> float:
    """Time a phase of host transfers (TCP, or the UET-like transport) loses to its flows'
    losses, to first order (wall time of the network as modelled).

    Each flow is window-bound: a TCP flow keeps ``tcp_window_clamp`` bytes of its algorithm in
    flight (:func:`testbed.collectives.model.tcp_window_clamp`, else the testbed's
    ``flow_window_bytes``), a UET flow its largest congestion window
    (``testbed.collectives.uet.MAX_WINDOW`` packets); where its path loses a share p of its
    packets, Reno's window under loss if that is less (``MSS x sqrt(3 / 2p)``, Mathis et al.:
    the UET-like sender halves its window per loss and grows it a packet per round trip too).
    So the queue of the link it is bottlenecked on holds what the base round trip does not:
    ``window - rate x rtt_base``, at most the queue's limit. A loss stalls its flow until the
    resent packet is acknowledged, a round trip loaded with the queues its ACKs wait in and the
    other flows' queues on its data path (its own data keeps its link busy meanwhile); losses
    within one round trip are recovered together. So a flow
    of N packets with loss probability p on its path, lasting T at its rate, is stalled
    ``k = max(1, min(N p, T / rtt))`` loaded round trips when it loses any (probability
    ``1 - (1 - p)^N``), and the phase, which ends with its last flow, waits for the worst::

        extra = (1 - prod_f (1 - p_f)^N_f) * max_f k_f * rtt_f

    A sprayed flow's loss, queues and round trip are the means over the paths its packets
    take.

    Why (measured on the emulated fabrics, ``testbed bench impairments``): a lone flow's rate
    and a lone 256 KiB or 1 MiB message's time hardly change under 0.5-2 % loss, while a
    ring's steps do, most where a lossless neighbour's full window queues in front of a
    lossy flow's ACKs (a ring of 4 with 0.5-2 % loss at one leaf of a leaf-spine: 1.8-2.0x
    the lossless time; over the UET-like transport, 1 % loss: 1.6-1.8x). The worst flow, not
    the sum of the flows' stalls, is an underestimate where the stalls of a ring's flows chain
    through its steps (a star whose every flow loses).

    Where a TCP flow's path also reorders, a lost retransmission is no longer found by the
    reordering window: it waits out the retransmission timeout (``max(TCP_RTO_MIN, 2 rtt)``,
    the floor dilated with the network), once per episode with probability p, and any flow's
    timeout stalls the phase (measured on a star of 4 with 1 % loss: no timeouts; with 5 %
    reordering too, 8-12 in 3 runs of a 4 MiB ring, 1.7-2.2x the loss-only time). The
    UET-like transport places packets by offset, so reordering costs it nothing."""
    flows = [(f, r) for f, r, _path in res.rates if (f.proto == 6 or f.spray) and r > 0]
    lossy = [(f, r, net.path_loss(f), net.routes(f)) for f, r in flows]
    if not any(p > 0 for _f, _r, p, _routes in lossy):
        return 0.0
    load: dict = {}
    for f, r in flows:
        for link, x in net.weights(f).items():
            load[link] = load.get(link, 0.0) + x * r
    queued: dict = {}  # link -> (bytes queued there, per flow)
    for f, r, p, routes in lossy:
        links = list(dict.fromkeys(k for path, _ack in routes
                                   for k in zip(path, path[1:], strict=False)))
        cap = min((net.capacity[k] for k in links if k in net.capacity), default=None)
        if cap is None:
            continue
        if f.spray:
            window = UET_MAX_WINDOW * MTU_PAYLOAD
        else:
            window = ab.tcp_window_clamp(spec.algo, cap * 8) or ab.flow_window_bytes(cap * 8)
        if p > 0:  # Reno's window under random loss (Mathis et al.): 1.22 / sqrt(p) segments
            window = min(window, _segment(f) * math.sqrt(1.5 / p))
        full = [k for k in links if k in net.capacity and
                load.get(k, 0.0) >= net.capacity[k] * (1 - 1e-6)]
        if not full:
            continue
        hops = sum(len(path) - 1 for path, _ack in routes) / len(routes)
        base = 2 * hops * hop_s
        limit = _queue_limit(net.topo, net.capacity[full[0]] * 8, net.dilation)
        here = queued.setdefault(full[0], {})
        here[f] = max(0.0, window - r * base) * f.wire
        total = sum(here.values())
        if total > limit:  # a full queue drops its tail: it holds its limit at most
            for g in here:
                here[g] *= limit / total

    def delay(path, without=None) -> float:
        """Queueing delay along ``path``, less ``without``'s own queue."""
        out = 0.0
        for link in zip(path, path[1:], strict=False):
            q = queued.get(link)
            if q:
                out += sum(b for g, b in q.items() if g is not without) / net.capacity[link]
        return out

    keep, worst, timeouts = 1.0, 0.0, 0.0
    rto_min = TCP_RTO_MIN_US / 1e6 * net.dilation
    for f, r, p, routes in lossy:
        if p <= 0:
            continue
        packets = f.nbytes / _segment(f)
        rtt = sum(2 * (len(path) - 1) * hop_s + delay(path, f) + delay(ack)
                  for path, ack in routes) / len(routes)
        keep *= (1.0 - p) ** packets
        if rtt <= 0:
            continue
        episodes = max(1.0, min(packets * p, f.nbytes / r / rtt))
        worst = max(worst, episodes * rtt)
        if not f.spray and any(i.reorder > 0 for i in net.impairments_of(f, routes[0][0])):
            # a lost retransmission among reordered frames waits out the timeout
            timeouts += (1.0 - (1.0 - p) ** packets) * episodes * p * max(rto_min, 2 * rtt)
    return (1.0 - keep) * worst + timeouts


# ------------------------------------------------------------------------------ predict

def predict(topology, spec: CollectiveSpec, *, workers: list[str] | None = None,
            servers: list[str] | None = None, hop_latency_s: float | None = None,
            time_dilation: float = 1.0, results_via: str = "ingress",
            impairments=None) -> Prediction:
    """Predicted time of ``spec`` on ``topology`` (see the module docstring).

    ``topology``: a ``TestbedTopo`` or its ``describe()`` dict. ``workers`` / ``servers``:
    host names (default: :func:`placement`). ``hop_latency_s``: one-way latency per link
    (default: the configured ``delay_ms`` plus :data:`DEFAULT_HOP_S`; a running
    ``TestbedNet`` measures it: ``net.hop_latency_s()``). ``results_via``: how the aggregator
    returns INA results, ``"ingress"`` (the data path's default) or ``"forward"`` (ECMP).
    ``impairments``: :class:`LinkImpairment` records of the links' ``impair`` stages beyond
    the topology's ``loss_pct`` (a running network's ``net.link_impairments()``): their
    duplicates load the links after them, and INA's losses and reordering are priced
    (:func:`_ina_extra`), and so is the host transports' loss recovery (:func:`_loss_s`).
    """
    if not isinstance(spec, CollectiveSpec):
        raise TypeError(f"spec must be a CollectiveSpec, got {type(spec).__name__}")
    topo = routing.as_topology(topology)
    spec.validate(len(topo.host_names))
    _check_dilation(time_dilation)
    if results_via not in ("ingress", "forward"):
        raise ValueError(f"results_via={results_via!r} must be 'ingress' or 'forward'")
    if workers is None or (spec.algo == "rs" and servers is None):
        w0, s0 = placement(topo.host_names, spec)
        workers = w0 if workers is None else list(workers)
        servers = s0 if servers is None else list(servers)
    bad = [h for h in list(workers) + list(servers or []) if h not in topo.host_names]
    if bad:
        raise ValueError(f"hosts {bad} are not hosts of this topology ({topo.host_names[:4]}...)")
    hop_s = _hop_s(topo, hop_latency_s, time_dilation)
    net = _Network(topo, float(time_dilation), impairments)
    agg: str | InaTree | None = topo.aggregator_switch
    if is_offloaded(spec.algo) and ((spec.placement or {}).get("tree") not in (None, "single")
                                        or agg is not None):
        try:
            agg = InaTree.of(topo, list(workers), spec, net.tables)
        except TopologyError as e:
            raise ValueError(f"CollectiveSpec.placement: {e}") from None
    phs = phases(spec, list(workers), list(servers or []), agg)
    if results_via == "forward":  # RESULTs hashed onto their own ECMP path
        for p in phs:
            p.flows = [dataclasses.replace(f, reverse_of=None) for f in p.flows]
    results = [_run_phase(net, p, hop_s) for p in phs]
    total = sum(r.time_s for r in results)
    notes = []
    extra_s = loss_s = 0.0
    if is_offloaded(spec.algo):
        extra_s = _ina_extra(spec, phs[0], results[0], net, hop_s, float(time_dilation))
        total += extra_s
    else:
        loss_s = sum(_loss_s(spec, r, net, hop_s) for r in results)
        total += loss_s
    f = float(time_dilation)
    return Prediction(total / f, results, notes, extra_s / f, f, loss_s / f)


@dataclass
class ConcurrentJob:
    """One job of :func:`predict_concurrent`: ``spec`` (its ``repetitions`` run back to
    back) on ``workers`` (``servers`` for rs), starting ``start_s`` after the first."""

    spec: CollectiveSpec
    workers: list[str]
    servers: list[str] = field(default_factory=list)
    start_s: float = 0.0


#: At most this many rounds of a job's repetitions in ``predict_concurrent(until_each=...)``.
MAX_CYCLES = 200


def predict_concurrent(topology, jobs: list[ConcurrentJob], *,
                       hop_latency_s: float | None = None,
                       time_dilation: float = 1.0,
                       rep_ends: list[list[float]] | None = None,
                       until_each: int | None = None, impairments=None) -> list[float]:
    """Each job's completion time (from its own start, undilated) when ``jobs`` run at once
    and share the fabric's links: one fluid simulation of every job's phases in turn (a
    phase's flows, then its latency and pipelining fill, during which the job sends
    nothing), all active flows of all jobs sharing every link max-min fairly, the rates
    recomputed whenever a flow or a wait ends or a job starts. What :func:`predict` adds to an
    INA job alone for its window and losses is added to its time here too. The fair sharing is
    the model's assumption (TCP against TCP; INA's UDP without ``ina_cc`` takes more in
    practice: ``testbed bench ina-sharing`` measures by how much). ``rep_ends``: a list that
    gets, per job, the time each of its repetitions ended (from its start, undilated; an
    INA job's window and loss time counted once per repetition). ``until_each``: every job
    starts its repetitions over until each job has ended at least that many (at most
    :data:`MAX_CYCLES` rounds of its repetitions), so that the repetitions ended until then
    all ran beside every other job: a steady state's iteration times. ``impairments``: as
    :func:`predict` takes them."""
    topo = routing.as_topology(topology)
    _check_dilation(time_dilation)
    f = float(time_dilation)
    hop_s = _hop_s(topo, hop_latency_s, f)
    net = _Network(topo, f, impairments)
    plan = []  # per job: its phases in order (repetitions unrolled), start, INA extra
    per_rep: list[int] = []  # per job: phases in one repetition
    for j in jobs:
        spec = j.spec
        spec.validate(len(topo.host_names))
        agg: str | InaTree | None = topo.aggregator_switch
        if is_offloaded(spec.algo) and ((spec.placement or {}).get("tree")
                                            not in (None, "single") or agg is not None):
            try:
                agg = InaTree.of(topo, list(j.workers), spec, net.tables)
            except TopologyError as e:
                raise ValueError(f"CollectiveSpec.placement: {e}") from None
        phs = phases(spec, list(j.workers), list(j.servers), agg)
        extra = 0.0  # per repetition: INA's window and loss, TCP's loss (priced alone)
        if is_offloaded(spec.algo):
            alone = _run_phase(net, phs[0], hop_s)
            extra = _ina_extra(spec, phs[0], alone, net, hop_s, f)
        elif net.impaired["uet" if spec.transport == "uet" else False]:
            extra = sum(_loss_s(spec, _run_phase(net, ph, hop_s), net, hop_s)
                        for ph in phs)
        plan.append((phs * spec.repetitions, j.start_s * f, extra))
        per_rep.append(len(phs))
    # per job: phase index, the flows of its phase still sending (flow, weights, bytes
    # left), the time its wait ends (latency/fill, or its start), when it finished
    state = [{"k": -1, "flows": [], "wait": start, "end": None, "first": None}
             for _phs, start, _x in plan]
    t = 0.0
    while any(st["end"] is None for st in state):
        for ji, st in enumerate(state):  # jobs whose wait is over move to their next phase
            phs = plan[ji][0]
            while st["end"] is None and not st["flows"] and st["wait"] <= t + 1e-12:
                st["k"] += 1
                if st["k"] and st["k"] % max(per_rep[ji], 1) == 0:
                    reps = st.setdefault("reps", [])
                    reps.append((t - plan[ji][1] + plan[ji][2] * (len(reps) + 1)) / f)
                if st["k"] >= len(phs):
                    if until_each is not None and phs and len(st["reps"]) < MAX_CYCLES * max(
                            len(phs) // max(per_rep[ji], 1), 1) and any(
                            len(o.get("reps", ())) < until_each for o in state):
                        st["k"] = 0  # others have not ended enough: this job goes on
                    else:
                        st["end"] = t
                        break
                ph = phs[st["k"]]
                flows = [fl for fl in ph.flows if fl.src != fl.dst and fl.nbytes > 0]
                st["flows"] = [[fl, net.weights(fl), float(fl.nbytes)] for fl in flows]
                st["first"] = None
                st["latency"] = ph.trips * _trip_hops(
                    ph, [net.flow_path(fl) for fl in flows]) * hop_s
                st["fill_bytes"] = ph.fill_bytes
                if not flows:
                    st["wait"] = t + st["latency"]
        active = [(ji, i) for ji, st in enumerate(state) if st["end"] is None
                  for i in range(len(st["flows"]))]
        waits = [st["wait"] for st in state if st["end"] is None and not st["flows"]
                 and st["wait"] > t]
        if not active and not waits:
            continue
        dt = min(w - t for w in waits) if waits else math.inf
        rates = []
        if active:
            rates = max_min_rates([state[ji]["flows"][i][1] for ji, i in active], net.capacity)
            for (ji, i), r in zip(active, rates, strict=True):
                if state[ji]["first"] is None or r < state[ji]["first"]:
                    state[ji]["first"] = r  # the phase's slowest rate: its fill is paid at it
                dt = min(dt, state[ji]["flows"][i][2] / r)
        t += dt
        for (ji, i), r in zip(active, rates, strict=True):
            state[ji]["flows"][i][2] -= r * dt
        for st in state:
            if st["end"] is None and st["flows"]:
                st["flows"] = [x for x in st["flows"] if x[2] > 1e-9 * x[0].nbytes]
                if not st["flows"]:  # the phase's transfer is done: its latency and fill
                    fill = st["fill_bytes"] / st["first"] if st["fill_bytes"] and \
                        st["first"] else 0.0
                    st["wait"] = t + st["latency"] + fill
    if rep_ends is not None:
        rep_ends[:] = [st.get("reps", []) for st in state]
    return [(st["end"] - start + extra * max(len(st.get("reps", ())), 1)) / f
            for st, (_phs, start, extra) in zip(state, plan, strict=True)]


def _check_dilation(time_dilation) -> None:
    if isinstance(time_dilation, bool) or not isinstance(time_dilation, int | float) \
            or not time_dilation >= 1:
        raise ValueError(f"time_dilation={time_dilation!r} must be a number >= 1")


def _hop_s(topo, hop_latency_s: float | None, time_dilation: float) -> float:
    """The one-way latency per link: as measured, else the configured delay plus
    :data:`DEFAULT_HOP_S`."""
    if hop_latency_s is None:
        delay = max((s.delay_ms for s in topo.link_specs), default=0.0)
        hop_latency_s = delay * 1e-3 * time_dilation + DEFAULT_HOP_S
    return float(hop_latency_s)


def transfers_s(topology, transfers: list[tuple[str, str, float]], *,
                hop_latency_s: float | None = None, time_dilation: float = 1.0) -> float:
    """Time of TCP transfers that start together, ``(source host, destination host, payload
    bytes)`` each, until the last ends: max-min fair rates on their paths (a fluid simulation,
    as a collective's phase) plus one trip of latency. A send/recv is one transfer; an
    all-to-all among n ranks is n(n-1) at once (what gloo's does: every pair's part posted
    together). Their ports are not known (gloo binds ephemeral ones), so on a multipath fabric
    the ECMP paths taken here are one draw of the hash, not necessarily the run's."""
    flows = [Flow(s, d, float(b), sport=EPHEMERAL_PORT + i, dport=EPHEMERAL_PORT - 1 - i)
             for i, (s, d, b) in enumerate(transfers)]
    return _phases_s(topology, {h for s, d, _ in transfers for h in (s, d)},
                     [Phase("transfers", flows)], hop_latency_s, time_dilation)


def _phases_s(topology, hosts, phases_: list[Phase], hop_latency_s: float | None,
              time_dilation: float) -> float:
    """Undilated seconds of ``phases_`` one after another among ``hosts`` of ``topology``
    (``ValueError`` naming hosts it lacks)."""
    topo = routing.as_topology(topology)
    bad = sorted(set(hosts) - set(topo.host_names))
    if bad:
        raise ValueError(f"hosts {bad} are not hosts of this topology")
    _check_dilation(time_dilation)
    f = float(time_dilation)
    net, hop = _Network(topo, f), _hop_s(topo, hop_latency_s, f)
    return sum(_run_phase(net, ph, hop).time_s for ph in phases_) / f


def all_to_all_phases(n: int, part_bytes: float, rk: _Ranks) -> list[Phase]:
    """The testbed's all-to-all (``alltoall.all_to_all``) of ``part_bytes`` per pair: every
    pair's part at once when parts are small, else n-1 pairwise steps (rank r to r+k), each
    after a ready-to-receive trip. ``rk`` with ``itemsize`` 1."""
    if n < 2:
        return []
    if not alltoall.pairwise(part_bytes):
        return [Phase("all pairs", [rk.tcp(a, b, part_bytes) for a in range(n)
                                    for b in range(n) if a != b])]
    return [Phase(f"shift {k}", [rk.tcp(r, (r + k) % n, part_bytes) for r in range(n)],
                  trips=2.0) for k in range(1, n)]


def all_to_all_s(topology, workers: list[str], nbytes: float, *, job_id: int = 0,
                 hop_latency_s: float | None = None, time_dilation: float = 1.0) -> float:
    """Time of the testbed's all-to-all among ``workers`` (host names in rank order), each
    rank's array ``nbytes`` (n equal parts) on job ``job_id``'s ports (undilated)."""
    n = len(workers)
    port_of = a2a_port if alltoall.own_connections(n) else tcp_port
    return _phases_s(topology, workers,
                     all_to_all_phases(n, nbytes / n, _Ranks(list(workers), job_id, 1,
                                                             port_of=port_of)),
                     hop_latency_s, time_dilation)


def predict_s(topology, spec: CollectiveSpec, **kw) -> float:
    """:func:`predict`'s time in seconds (NaN when the model does not apply)."""
    p = predict(topology, spec, **kw)
    return float("nan") if p.time_s is None else p.time_s


# ------------------------------------------------------------------------------ incast

@dataclass
class IncastPrediction:
    """Incast through a trimming (or drop-tail) port: time (None when the model does not
    apply), the bytes that cross the bottleneck and the fraction of packets trimmed."""

    time_s: float | None
    bottleneck_bytes: float
    trimmed_frac: float
    note: str = ""


def incast_s(*, senders: int, frames: int, frame_bytes: int, trimmed_bytes: int,
             access_mbps: float, port_mbps: float, threshold_bytes: float,
             mode: str | None = "trim") -> IncastPrediction:
    """Incast of ``senders`` x ``frames`` frames of ``frame_bytes`` into one port.

    Senders push at their access rate C (aggregate rate n C); the port drains at R. Without
    congestion (n C <= R) the time is one sender's bytes at C. Otherwise the port's data queue
    fills to ``threshold_bytes`` first (all frames pass), then (``mode="trim"``) every frame
    that arrives while it is full is cut to ``trimmed_bytes`` and served first (NDP header
    queue): with arrival rate ``lam = n C / F`` frames/s, data frames get through at
    ``a = (R - lam h) / (F - h)`` per second, so the port stays exactly busy. The run ends when
    the senders are done plus the time to drain the full data queue::

        time = frames * F / C + threshold / R

    (or all bytes / R when the queue never fills). ``mode="drop_tail"``: without congestion
    as above; with it, drops are recovered in NACK rounds after an idle timeout, which this
    model does not describe: ``time_s`` is None and ``note`` says so. ``mode=None``: no
    queue of ours (the kernel's qdisc), the model is all bytes / R.
    """
    if senders < 1 or frames < 0 or frame_bytes <= 0 or not 0 < trimmed_bytes <= frame_bytes:
        raise ValueError("need senders >= 1, frames >= 0, 0 < trimmed_bytes <= frame_bytes")
    if access_mbps <= 0 or port_mbps <= 0 or threshold_bytes < 0:
        raise ValueError("need access_mbps > 0, port_mbps > 0, threshold_bytes >= 0")
    if mode not in ("trim", "drop_tail", None):
        raise ValueError(f"mode={mode!r} must be 'trim', 'drop_tail' or None")
    C, R = access_mbps * 1e6 / 8, port_mbps * 1e6 / 8
    F, h = float(frame_bytes), float(trimmed_bytes)
    total = senders * frames * F
    t_send = frames * F / C
    if mode is None or senders * C <= R:
        return IncastPrediction(max(t_send, total / R), total, 0.0)
    t_fill = threshold_bytes / (senders * C - R)
    if t_fill >= t_send:  # the queue never reaches the threshold: nothing trimmed or dropped
        return IncastPrediction(max(t_send, total / R), total, 0.0)
    if mode == "drop_tail":
        return IncastPrediction(None, float("nan"), 0.0,
                                "drop-tail: the queue overflows and the receiver recovers the "
                                "drops in NACK rounds after its idle timeout; not modelled")
    lam = senders * C / F
    if lam * h >= R:
        return IncastPrediction(None, float("nan"), 1.0,
                                "even the trimmed headers exceed the port rate: headers are "
                                "dropped too; not modelled")
    a = (R - lam * h) / (F - h)
    passed = lam * t_fill + a * (t_send - t_fill)
    n_all = senders * frames
    passed = min(passed, n_all)
    crossed = passed * F + (n_all - passed) * h
    return IncastPrediction(t_send + threshold_bytes / R, crossed, 1 - passed / n_all)


def uet_incast_s(*, senders: int, nbytes: int, port_mbps: float, rtt_s: float, trims: int,
                 trimmed_bytes: int = 128, payload: int | None = None) -> IncastPrediction:
    """Incast of ``senders`` x ``nbytes`` over the UET-like transport into a UET trimming port.

    Every packet crosses the port whole once (a cut one is resent whole after its NACK), and
    every cut adds its ``trimmed_bytes`` frame, served ahead of data: the port is busy
    (work-conserving) for ``(all frames + trims x trimmed frame) / R``, plus the round trip of
    the last NACK and its resend. ``trims``: how many packets the port cut (the transport's
    congestion response sets it; measured, or an estimate). ``payload``: transport bytes per
    packet (default the testbed's MTU payload).
    """
    if senders < 1 or nbytes < 0 or port_mbps <= 0 or rtt_s < 0 or trims < 0:
        raise ValueError("need senders >= 1, nbytes >= 0, port_mbps > 0, rtt_s >= 0, trims >= 0")
    payload = payload or MTU_PAYLOAD
    full, rest = divmod(nbytes, payload)
    frames = full * (PAYLOAD_OFFSET + payload) + (PAYLOAD_OFFSET + rest if rest else 0)
    total = senders * frames
    crossed = total + trims * trimmed_bytes
    packets = senders * (full + (1 if rest else 0))
    return IncastPrediction(crossed / (port_mbps * 1e6 / 8) + (rtt_s if trims else 0.0),
                            crossed, trims / packets if packets else 0.0)
