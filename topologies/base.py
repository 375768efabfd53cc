"""Common machinery of the testbed topologies: options, validation, naming, link records.

Every topology is a Mininet ``Topo`` whose graph is built in one ``build()`` method. The
options common to all kinds are validated in :class:`TestbedTopo` *before* any node or link
is recorded, so a bad parameter fails fast with a message naming it, never half-way through
building a network.

Naming (docs/architecture.md): hosts ``tbh1..`` (rank order), SmartNIC nodes ``tbn<i>`` in
front of host ``tbh<i>``, switches ``tbs..`` / ``tbl..`` / ``tbsp..`` / ``tbc..`` / ``tba..`` /
``tbe..``. Host of rank r gets IP 10.0.0.<r+1>/8 (skipping .254, the aggregator) and the MAC
``00:00:00:00:00:<r+1>`` (what Mininet's autoSetMacs would give, fixed explicitly so SmartNIC
nodes added in between do not shift it).
"""

from __future__ import annotations

import functools
import math
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from mininet.topo import Topo

#: Aggregator virtual addresses (docs/architecture.md, aggregation protocol).
AGGREGATOR_IP = "10.0.0.254"
AGGREGATOR_MAC = "02:54:42:00:00:fe"
#: SwitchML bitmap width: at most this many workers per aggregation job.
MAX_INA_WORKERS = 32
#: Linux IFNAMSIZ - 1: longest interface name the kernel accepts.
MAX_IFNAME = 15
#: Highest link rate we shape (HTB on a veth); Mininet's own guard is 1000 Mb/s, we lift it.
MAX_BW_MBPS = 100_000.0
#: Most hosts, and most switches of one tier, a topology may plan: far beyond what one
#: machine's namespaces and processes emulate, and checked before the graph is built (a
#: mistyped count would otherwise build millions of nodes until memory runs out).
MAX_NODES = 4096
SWITCH_KINDS = ("programmable", "bridge")


class TopologyError(ValueError):
    """A topology parameter is invalid; the message names it and the allowed values."""


@functools.lru_cache(maxsize=1)
def netem_available() -> bool:
    """Whether this kernel has sch_netem (probed once, in a throwaway network namespace)."""
    try:
        # A private namespace: the probe can never leave anything behind in the root one.
        r = subprocess.run(
            ["unshare", "--net", "sh", "-c",
             "ip link set lo up && tc qdisc add dev lo root netem delay 1ms"],
            capture_output=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def host_ip(rank: int) -> str:
    """IP (without prefix) of the host of ``rank``: 10.0.0.<rank+1>, skipping .254/.255."""
    num = rank + 1
    if num >= 254:  # keep 10.0.0.254 free for the aggregator
        num += 2
    return f"10.{(num >> 16) & 0xFF}.{(num >> 8) & 0xFF}.{num & 0xFF}"


def switch_identity(topo, switch: str) -> tuple[str, str]:
    """(MAC, IPv4) of ``switch``'s aggregator: the topology's aggregator switch answers the
    well-known ``AGGREGATOR_MAC``/``AGGREGATOR_IP``; every other programmable switch (trees,
    other jobs' roots) ``02:54:42:01:HH:LL`` / ``10.254.HH.LL`` by its rank among them."""
    if switch == topo.aggregator_switch:
        return AGGREGATOR_MAC, AGGREGATOR_IP
    fabric = sorted(s for s in topo.programmable if topo.switch_roles.get(s) != "smartnic")
    if switch not in fabric:
        raise TopologyError(f"{switch!r} is not a programmable switch of this topology; "
                            f"programmable switches: {fabric or 'none'}")
    k = fabric.index(switch) + 1
    return f"02:54:42:01:{k >> 8:02x}:{k & 0xFF:02x}", f"10.254.{k >> 8}.{k & 0xFF}"


def aggregating_switches(topo) -> list[str]:
    """Programmable switches (SmartNICs excepted): each runs an aggregate stage, unless the
    topology was built with ``aggregator=None`` (no in-network aggregation at all)."""
    params = topo.params if isinstance(getattr(topo, "params", None), dict) else {}
    option = getattr(topo, "aggregator_option", params.get("aggregator", "auto"))
    if option is None:
        return []
    return sorted(s for s in topo.programmable if topo.switch_roles.get(s) != "smartnic")


def host_mac(rank: int) -> str:
    """MAC of the host of ``rank``: 00:00:00:00:00:<rank+1> in hex (as autoSetMacs)."""
    num = rank + 1
    return ":".join(f"{(num >> (8 * i)) & 0xFF:02x}" for i in range(5, -1, -1))


@dataclass
class LinkSpec:
    """One link of a topology as the model and the results metadata see it."""

    a: str
    b: str
    port_a: int
    port_b: int
    bw_mbps: float | None  # None: unshaped
    delay_ms: float
    loss_pct: float
    role: str  # access | nic | uplink | core | bottleneck

    def to_dict(self) -> dict:
        """JSON-serialisable form."""
        return asdict(self)


#: The kernel's minimum TCP retransmission timeout (``TCP_RTO_MIN``), which a dilated network
#: stretches on every host like its other times (``TestbedNet``; the flow model prices it).
#: Unstretched, it fired on queueing delay: a dilated queue holds f times more wall time, and
#: on the star of 8 at f=12 the reduction server's round trips reached 300-600 ms, past the
#: kernel's 200 ms floor (10-21 spurious timeouts per 4 MiB run, every retransmission a
#: D-SACKed duplicate; none with the floor at 2.4 s).
TCP_RTO_MIN_US = 200_000


@dataclass(frozen=True)
class LinkImpairment:
    """What a data path's ``impair`` stage now does to the packets of one directed link
    ``src -> dst`` (probabilities in [0, 1]): the models price it. ``direction``: where the
    stage acts, ``"egress"`` at ``src`` (a duplicate crosses this link) or ``"ingress"`` at
    ``dst`` (it does not: copies start on the next link). ``testbed_only``: only testbed
    frames (INA's) are impaired. ``reorder_timeout_s``: how long a reordered packet waits at
    most for the packets it lets pass (wall time on the running network). ``cuts_trimmable``:
    the loss is a full queue's, at a port that cuts the UET-like transport's trimmable
    packets instead of dropping them (a provider's trimming plan): those are NACKed and resent
    within a round trip, so the loss is not theirs."""

    src: str
    dst: str
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    direction: str = "egress"
    testbed_only: bool = False
    reorder_timeout_s: float = 0.0
    cuts_trimmable: bool = False

    def to_dict(self) -> dict:
        """JSON-serialisable form."""
        return asdict(self)

    def combined(self, other: LinkImpairment) -> LinkImpairment:
        """This and ``other`` (of the same link) as one: independent effects one after the
        other, a copy counted from the earlier point, testbed frames only if both are, the
        trimmable ones cut only if both cut them."""
        def both(x: float, y: float) -> float:
            return 1.0 - (1.0 - x) * (1.0 - y)

        return LinkImpairment(self.src, self.dst, both(self.loss, other.loss),
                              both(self.dup, other.dup), both(self.reorder, other.reorder),
                              "egress" if "egress" in (self.direction, other.direction)
                              else "ingress", self.testbed_only and other.testbed_only,
                              max(self.reorder_timeout_s, other.reorder_timeout_s),
                              self.cuts_trimmable and other.cuts_trimmable)


#: program names of the data path's ``impair`` stage (egress or ingress; a node impaired in
#: both directions runs an ``impair_ingress`` stage beside its ``impair``; a node's program
#: override with one conflicts with the impairments ``pipeline.compose`` adds)
IMPAIR_STAGES = ("impair", "impair_ingress")


def own_link_loss(link_specs: Iterable[LinkSpec]) -> dict[tuple[str, str], float]:
    """Each lossy link's own ``loss_pct`` as a probability, for both of its directions."""
    return {(a, b): s.loss_pct / 100.0 for s in link_specs if s.loss_pct
            for a, b in ((s.a, s.b), (s.b, s.a))}


def link_impairments(link_specs: Iterable[LinkSpec], counters: dict[str, dict],
                     own_loss_applied: bool = False) -> list[LinkImpairment]:
    """What the ``impair`` stages whose engines' ``counters`` (node -> the engine's answer to
    ``counters``) are given now do to each directed link of ``link_specs``: one record per
    impaired link, the stages at both of its ends combined. An egress stage's port acts on
    the link leaving it, an ingress stage's on the link arriving there.

    ``own_loss_applied``: the stages also apply the links' own ``loss_pct`` (impairments in
    the data path, no netem). That loss is then left out of the records: the models price it
    from the topology, and counted twice it gave INA's contributions on a fat-tree k=4 at
    1 % a loss of 5.9 % on their three links instead of 3 %."""
    link_specs = list(link_specs)
    peers = {}
    for spec in link_specs:
        peers[f"{spec.a}-eth{spec.port_a}"] = (spec.a, spec.b)
        peers[f"{spec.b}-eth{spec.port_b}"] = (spec.b, spec.a)
    out: dict[tuple[str, str], LinkImpairment] = {}
    for data in counters.values():
        for stage in IMPAIR_STAGES:
            c = (data.get("stages") or {}).get(stage) or {}
            settings = c.get("settings")
            if not settings:  # no such stage, or an engine from before stages said what they do
                continue
            for port, v in settings["ports"].items():
                if port not in peers or not any(v.values()):
                    continue
                me, peer = peers[port]
                link = (me, peer) if c["direction"] == "egress" else (peer, me)
                imp = LinkImpairment(*link, direction=c["direction"],
                                     testbed_only=settings["filter"] == "testbed",
                                     reorder_timeout_s=settings["reorder_timeout_ms"] / 1e3, **v)
                out[link] = imp if link not in out else out[link].combined(imp)
    if own_loss_applied:
        own = own_link_loss(link_specs)
        for link, imp in list(out.items()):
            loss = max(0.0, 1.0 - (1.0 - imp.loss) / (1.0 - own.get(link, 0.0)))
            beyond = replace(imp, loss=loss if loss > 1e-12 else 0.0)
            if beyond.loss or beyond.dup or beyond.reorder:
                out[link] = beyond
            else:
                del out[link]
    return [out[k] for k in sorted(out)]


def _positive_number(name: str, value, *, allow_none: bool = False, maximum=None) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TopologyError(f"{name} must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise TopologyError(f"{name} must be > 0, got {value!r}")
    if maximum is not None and value > maximum:
        raise TopologyError(f"{name} must be <= {maximum:g}, got {value!r}")


def check_int(name: str, value, minimum: int, *, even: bool = False) -> None:
    """Raise :class:`TopologyError` unless ``value`` is an int >= ``minimum`` (and even)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise TopologyError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if even and value % 2:
        raise TopologyError(f"{name} must be even (2, 4, 6, ...), got {value!r}")


def check_bw(name: str, value, *, allow_none: bool = True) -> None:
    """Validate a bandwidth in Mb/s: > 0 and <= MAX_BW_MBPS (None = unshaped if allowed)."""
    _positive_number(name, value, allow_none=allow_none, maximum=MAX_BW_MBPS)


class TestbedTopo(Topo):
    """Base of all testbed topologies; subclasses implement :meth:`build_fabric`.

    Common keyword options:

    * ``bw_mbps`` (100): host access link rate (None: unshaped). Each end shapes its egress:
      HTB via TCLink ``bw=``, or the engine's ``shape`` stage on a programmable node.
    * ``delay_ms`` (0), ``loss_pct`` (0): per-link impairments of every link. With netem they
      go on the links; without it they go to the data path's ``impair`` stage on the
      programmable node at one end of each link (error if there is none).
    * ``switch`` ('bridge'): 'programmable', 'bridge', or a set of switch names that run the
      data path (the others are Linux bridges).
    * ``smartnic`` (False): True for every host, or host ranks (0-based) that get a SmartNIC
      node ``tbn<rank+1>`` between host and ToR.
    * ``programs`` (None): dict node name (or 'switch' / 'smartnic' for all of that kind) ->
      program options passed to the data-path node.
    * ``aggregator`` ('auto'): switch name that hosts the classic single-switch aggregator
      (``10.0.0.254``), None for no in-network aggregation at all (no ``aggregate`` stage on
      any switch); 'auto' picks the kind's natural place when that switch is programmable.
      Every programmable switch can be part of a job's aggregation tree
      (:mod:`testbed.topologies.aggtree`) unless this is None.
    * ``seed`` (0): seed of everything random (impairments, ECMP hash salt).
    * ``queue_ms`` (None): every shaped link's queue, in milliseconds at its rate (a ``bfifo``
      of ``bw x queue_ms`` bytes under the HTB class, the same limit in a programmable node's
      ``shape`` stage; with netem, netem's limit in full-size frames); None keeps the kernel's default, ``txqueuelen`` (1000) packets, which at a few
      Mb/s holds seconds of data. A queue about one round trip deep is what a datacenter switch
      port gives a flow; a long one lets a flow's ACKs wait behind other flows' data.
    """

    kind = "base"
    #: default aggregator location for 'auto' (a switch name), set by subclasses
    default_aggregator: str | None = None

    def __init__(self, *, bw_mbps=100.0, delay_ms=0.0, loss_pct=0.0, switch="bridge",
                 smartnic=False, programs=None, aggregator="auto", seed=0, queue_ms=None,
                 **kind_params):
        check_bw("bw_mbps", bw_mbps)
        _positive_number("queue_ms", queue_ms, allow_none=True, maximum=10_000)
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)) \
                or not math.isfinite(delay_ms) or delay_ms < 0:
            raise TopologyError(f"delay_ms must be a number >= 0, got {delay_ms!r}")
        if isinstance(loss_pct, bool) or not isinstance(loss_pct, (int, float)) \
                or not 0 <= loss_pct < 100:
            raise TopologyError(f"loss_pct must be a number in [0, 100), got {loss_pct!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TopologyError(f"seed must be an integer, got {seed!r}")
        if programs is not None and not isinstance(programs, dict):
            raise TopologyError(
                f"programs must be a dict node-name -> program options, got {programs!r}")
        self.bw_mbps = None if bw_mbps is None else float(bw_mbps)
        self.delay_ms = float(delay_ms)
        self.loss_pct = float(loss_pct)
        self.seed = seed
        self.queue_ms = None if queue_ms is None else float(queue_ms)
        self.programs = dict(programs or {})
        self.kind_params = dict(kind_params)
        self.validate_kind(**kind_params)  # kind-specific checks, before anything is recorded

        # What the model, the forwarding computation and describe() read.
        self.link_specs: list[LinkSpec] = []
        self.host_names: list[str] = []
        self.nic_of: dict[str, str] = {}  # host name -> SmartNIC node name
        self.switch_roles: dict[str, str] = {}
        self._switch_opt = switch
        self._smartnic_opt = smartnic
        self.aggregator_option = aggregator
        self._n_hosts_planned = self.planned_hosts()
        if self._n_hosts_planned > MAX_NODES:
            raise TopologyError(f"{self.kind} with {self.params()} plans "
                                f"{self._n_hosts_planned:,} hosts; at most {MAX_NODES} "
                                "(each is a network namespace and processes on this machine)")
        self._nic_ranks = self._resolve_smartnic(smartnic, self._n_hosts_planned)

        super().__init__()  # calls build()

        self.programmable = self._resolve_switch(switch)
        self.aggregator_switch = self._resolve_aggregator(aggregator)
        self._check_names()
        self._check_impairments()

    # ----- what subclasses provide -------------------------------------------------------
    def validate_kind(self, **kind_params) -> None:
        """Check the kind-specific parameters (raise TopologyError)."""

    def planned_hosts(self) -> int:
        """Number of hosts the kind will create (known from the parameters alone)."""
        raise NotImplementedError

    def build_fabric(self) -> None:
        """Add switches, hosts (via :meth:`add_host_at`) and links."""
        raise NotImplementedError

    def params(self) -> dict:
        """The kind-specific parameters as given (for describe())."""
        return dict(self.kind_params)

    # ----- building helpers --------------------------------------------------------------
    def build(self, *args, **params):  # noqa: D401 - Mininet's hook
        """Mininet's hook: build the whole graph (hosts in rank order)."""
        self.build_fabric()

    def add_switch(self, name: str, role: str) -> str:
        """Add a switch node with a unique dpid and record its role."""
        dpid = f"{len(self.switch_roles) + 1:016x}"
        self.addSwitch(name, dpid=dpid)
        self.switch_roles[name] = role
        return name

    def add_link(self, a: str, b: str, bw_mbps, role: str) -> None:
        """Add a link with the topology's impairments and record it."""
        self.addLink(a, b)
        pa, pb = self.port(a, b)
        self.link_specs.append(LinkSpec(a, b, pa, pb, None if bw_mbps is None else
                                        float(bw_mbps), self.delay_ms, self.loss_pct, role))

    def add_host_at(self, switch: str, bw_mbps=None) -> str:
        """Add the next host (rank order) attached to ``switch``, through a SmartNIC if asked."""
        rank = len(self.host_names)
        name = f"tbh{rank + 1}"
        self.addHost(name, ip=f"{host_ip(rank)}/8", mac=host_mac(rank))
        self.host_names.append(name)
        bw = self.bw_mbps if bw_mbps is None else bw_mbps
        if rank in self._nic_ranks:
            nic = f"tbn{rank + 1}"
            self.add_switch(nic, "smartnic")
            self.nic_of[name] = nic
            self.add_link(name, nic, bw, "nic")
            self.add_link(nic, switch, bw, "access")
        else:
            self.add_link(name, switch, bw, "access")
        return name

    # ----- resolution and checks (after the graph exists, before any network) -------------
    @staticmethod
    def _resolve_smartnic(opt, n_hosts: int) -> frozenset[int]:
        if opt is False or opt is None:
            return frozenset()
        if opt is True:
            return frozenset(range(n_hosts))
        if isinstance(opt, (str, bytes)) or not isinstance(opt, Iterable):
            raise TopologyError(
                f"smartnic must be False, True or a list of host ranks 0..{n_hosts - 1}, "
                f"got {opt!r}")
        ranks = list(opt)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < n_hosts]
        if bad:
            raise TopologyError(
                f"smartnic host ranks must be integers in 0..{n_hosts - 1}, got {bad!r}")
        return frozenset(ranks)

    def fabric_switches(self) -> list[str]:
        """Switch names excluding SmartNIC nodes, in creation order."""
        return [s for s, r in self.switch_roles.items() if r != "smartnic"]

    def _resolve_switch(self, opt) -> frozenset[str]:
        fabric = self.fabric_switches()
        nics = set(self.nic_of.values())
        if opt == "programmable":
            chosen = set(fabric)
        elif opt == "bridge":
            chosen = set()
        elif isinstance(opt, (str, bytes)) or not isinstance(opt, Iterable):
            raise TopologyError(
                f"switch must be one of {SWITCH_KINDS} or a set of switch names from "
                f"{fabric}, got {opt!r}")
        else:
            chosen = set(opt)
            unknown = sorted(chosen - set(fabric))
            if unknown:
                raise TopologyError(
                    f"switch names {unknown} are not switches of this {self.kind}; "
                    f"choose from {fabric}")
        return frozenset(chosen | nics)  # SmartNIC nodes always run the data path

    def _resolve_aggregator(self, opt) -> str | None:
        if opt is None:
            return None
        if opt == "auto":
            cand = self.default_aggregator
            if cand is None or cand not in self.programmable:
                return None
            if len(self.host_names) > MAX_INA_WORKERS:
                return None  # 'auto' never turns on an aggregator that cannot serve all hosts
            return cand
        if opt not in self.switch_roles or self.switch_roles[opt] == "smartnic":
            raise TopologyError(
                f"aggregator must be None, 'auto' or a switch name from "
                f"{self.fabric_switches()}, got {opt!r}")
        if opt not in self.programmable:
            raise TopologyError(
                f"aggregator {opt!r} is a Linux bridge; make it programmable "
                f"(switch='programmable' or include {opt!r} in switch=...)")
        if len(self.host_names) > MAX_INA_WORKERS:
            raise TopologyError(
                f"aggregator: in-network aggregation serves at most {MAX_INA_WORKERS} workers "
                f"(32-bit bitmap) but this topology has {len(self.host_names)} hosts; "
                "use fewer hosts or aggregator=None")
        return opt

    def _check_names(self) -> None:
        for node in self.g.node:
            nports = len(self.ports.get(node, {}))
            longest = f"{node}-eth{nports}"
            if len(longest) > MAX_IFNAME:
                raise TopologyError(
                    f"interface name {longest!r} is longer than {MAX_IFNAME} characters "
                    f"(Linux limit); reduce the number of hosts/ports of {node!r}")

    def _check_impairments(self) -> None:
        if not (self.delay_ms or self.loss_pct) or netem_available():
            return
        bare = [(s.a, s.b) for s in self.link_specs
                if s.a not in self.programmable and s.b not in self.programmable]
        if bare:
            raise TopologyError(
                f"delay_ms/loss_pct need netem (absent in this kernel) or a programmable node "
                f"at one end of each link to run the data path's impair stage; links {bare[:4]}"
                f"{' ...' if len(bare) > 4 else ''} have neither. Use switch='programmable' "
                "(or smartnic=True for host links), or drop delay_ms/loss_pct")

    # ----- read side -----------------------------------------------------------------------
    @property
    def n_hosts(self) -> int:
        """Number of hosts (workers)."""
        return len(self.host_names)

    def impair_mode(self) -> str:
        """'none', 'netem' or 'datapath': where the link impairments are applied."""
        if not (self.delay_ms or self.loss_pct):
            return "none"
        return "netem" if netem_available() else "datapath"

    def describe(self) -> dict:
        """JSON-serialisable summary of the topology (for results metadata)."""
        return {
            "kind": self.kind,
            "params": {
                **self.params(),
                "bw_mbps": self.bw_mbps,
                "delay_ms": self.delay_ms,
                "loss_pct": self.loss_pct,
                "switch": self._switch_opt if isinstance(self._switch_opt, str)
                else sorted(self._switch_opt),
                "smartnic": sorted(self._nic_ranks),
                "aggregator": self.aggregator_option,
                "seed": self.seed,
                "queue_ms": self.queue_ms,
            },
            "hosts": list(self.host_names),
            "switches": dict(self.switch_roles),
            "programmable": sorted(self.programmable),
            "aggregator": self.aggregator_switch,
            "impairments": self.impair_mode(),
            "links": [s.to_dict() for s in self.link_specs],
        }
