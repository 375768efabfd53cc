"""Aggregation trees: which switches aggregate an INA job's contributions, and how they connect.

A job's tree is a set of programmable switches and a root. Each worker sends its contributions
to the first tree switch on its path to the root (its *parent*); each tree switch below the root
sends its partial sums to the first tree switch on its own path to the root; the root's RESULT
comes back down the same tree (``docs/protocol.md``). A single-switch job is a tree of one.

Paths are the ones the fabric really uses (:func:`testbed.topologies.routing.flow_hops`: the
data path's ECMP hash of each flow's 5-tuple), so every registered ingress port is the port a
member's packets arrive on. :func:`plan` is a pure function of the topology: the control plane
(``TestbedNet.ina_plan``) registers what it returns, and a notebook can look at a tree without
building a network.

``tree``:

* ``None`` / ``"single"``: the topology's aggregator switch alone (the classic placement);
* ``"auto"``: the lowest common ancestor tree: the root is the switch that every worker reaches
  in the fewest hops (then: the smallest tree, then the name), and every programmable switch on
  the workers' paths to it aggregates, except ones that would pass a single child's partial sums
  on unchanged;
* a list of switch names: exactly these aggregate, the first is the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.kernels.wire import TESTBED_UDP_PORT

from . import routing
from .base import MAX_INA_WORKERS, TopologyError, aggregating_switches, host_ip, host_mac

UDP = 17


@dataclass
class InaPlan:
    """A job's aggregation tree, ready to register (see the module docstring).

    ``nodes``: switch -> ``{"members": [...], "parent": {...} | None}`` in the ``aggregate``
    stage's job-setting format (ports by interface name); ``workers``: per worker, in the order
    given, ``{"switch", "mac", "ip", "member"}``: the switch it sends to, that switch's
    aggregator identity and the worker's member id there.
    """

    root: str
    nodes: dict[str, dict] = field(default_factory=dict)
    workers: list[dict] = field(default_factory=list)

    @property
    def tree(self) -> list[str]:
        """The aggregating switches, root first, then by name."""
        return [self.root] + sorted(s for s in self.nodes if s != self.root)

    def depth(self) -> int:
        """Switch levels from a worker to the root (1 for a single switch)."""
        def up(s: str) -> int:
            p = self.nodes[s]["parent"]
            return 1 if p is None else 1 + up(p["switch"])
        return max((up(w["switch"]) for w in self.workers), default=0)

    def registrations(self, slots: int, seq0: int, lanes: int) -> dict[str, dict]:
        """Per switch, the ``aggregate`` stage's setting of the job (see :func:`registrations`)."""
        return registrations(self, slots, seq0, lanes)


def _first_of(hops: list[tuple[str, int, int]], nodes: set[str]) -> str | None:
    for node, _, _ in hops[1:]:
        if node in nodes:
            return node
    return None


def _lca_root(topo, hosts: list[str], port: int, candidates: list[str], tables) -> str:
    best = None
    for c in candidates:
        try:
            paths = [routing.flow_hops(topo, h, c, port, TESTBED_UDP_PORT, UDP, tables)
                     for h in hosts]
        except ValueError:
            continue
        key = (max(len(p) for p in paths), len({n for p in paths for n, _, _ in p}), c)
        if best is None or key < best:
            best = key
    if best is None:
        raise TopologyError("no programmable switch reaches every worker")
    return best[2]


def plan(topo, ranks: list[int], port: int, tree=None, tables: dict | None = None) -> InaPlan:
    """The aggregation tree of an INA job whose workers are on host ranks ``ranks`` (worker
    order) and bind UDP ``port``; ``tree`` as in the module docstring. Raises
    :class:`TopologyError` naming what is wrong."""
    topo = routing.as_topology(topo)
    tables = routing.forwarding_tables(topo) if tables is None else tables
    candidates = aggregating_switches(topo)
    hosts = [topo.host_names[r] for r in ranks]
    if tree is None or tree == "single":
        if topo.aggregator_switch is None and candidates:
            raise TopologyError(
                f"this {getattr(topo, 'kind', 'topology')} has no one aggregating switch "
                f"(programmable: {candidates}, but no single switch is on every worker's "
                "path, e.g. several spines): give the tree, tree='auto' (the lowest switch "
                "all paths cross, with the leaves aggregating below it) or a list of switches")
        if topo.aggregator_switch is None:
            raise TopologyError("in-network aggregation needs an aggregator: build the topology "
                                "with switch='programmable' (or give a tree of switches)")
        root, chosen, prune = topo.aggregator_switch, {topo.aggregator_switch}, False
    elif tree == "auto":
        root = _lca_root(topo, hosts, port, candidates, tables)
        chosen = {n for h in hosts
                  for n, _, _ in routing.flow_hops(topo, h, root, port, TESTBED_UDP_PORT, UDP,
                                                   tables)
                  if n in candidates}
        prune = True
    elif isinstance(tree, (list, tuple)) and tree:
        bad = [s for s in tree if s not in candidates]
        if bad:
            raise TopologyError(f"tree: {bad} are not programmable switches of this topology; "
                                f"programmable switches: {candidates or 'none'}")
        root, chosen, prune = tree[0], set(tree), False
    else:
        raise TopologyError(f"tree must be 'auto', 'single', or a list of switch names (root "
                            f"first), got {tree!r}")
    hop = {}  # (src, dst) -> the flow's hops

    def hops(src: str, dst: str, sport: int) -> list[tuple[str, int, int]]:
        if (src, dst) not in hop:
            hop[(src, dst)] = routing.flow_hops(topo, src, dst, sport, TESTBED_UDP_PORT, UDP,
                                                tables)
        return hop[(src, dst)]

    parent_of: dict[str, str | None] = {}
    for h in hosts:
        p = _first_of(hops(h, root, port), chosen)
        if p is None:
            raise TopologyError(f"tree: worker {h}'s path to {root} crosses none of {sorted(chosen)}")
        parent_of[h] = p
    for s in chosen - {root}:
        parent_of[s] = _first_of(hops(s, root, TESTBED_UDP_PORT), chosen)
    parent_of[root] = None
    children: dict[str, list[str]] = {s: [] for s in chosen}
    for c, p in parent_of.items():
        if p is not None:
            children[p].append(c)
    if prune:  # a switch with one child only relays: its child reports to its parent instead
        for s in sorted(chosen - {root}):
            if s in children and len(children[s]) == 1:
                (c,) = children.pop(s)
                p = parent_of.pop(s)
                parent_of[c] = p
                children[p] = [c if x == s else x for x in children[p]]
        while len(children[root]) == 1 and children[root][0] in children:
            new_root = children[root][0]
            del children[root], parent_of[root]
            root = new_root
            parent_of[root] = None
    unused = [s for s in children if not children[s]]
    if unused:
        raise TopologyError(f"tree: {sorted(unused)} aggregate nobody's contributions (no "
                            "worker's path to the root crosses them); leave them out")
    out = InaPlan(root)
    order = {h: i for i, h in enumerate(hosts)}
    member_id: dict[str, int] = {}
    for s, kids in children.items():
        kids = sorted(kids, key=lambda c: (c not in order, order.get(c, 0), c))
        if len(kids) > MAX_INA_WORKERS:
            direct = sum(c in order for c in kids)
            fix = (f"{direct} of the job's workers sit directly below it, and no tree splits "
                   f"them: run at most {MAX_INA_WORKERS} workers below one switch (fewer "
                   "hosts per leaf, or pick the job's hosts)" if direct > MAX_INA_WORKERS
                   else "use a deeper tree")
            raise TopologyError(f"tree: {s} would aggregate {len(kids)} members; a switch serves "
                                f"at most {MAX_INA_WORKERS} (32-bit bitmap): {fix}")
        members = []
        for i, c in enumerate(kids):
            member_id[c] = i
            if c in order:
                r = ranks[order[c]]
                last = hops(c, s, port)[-1]
                members.append({"worker": i, "mac": host_mac(r), "ip": host_ip(r),
                                "port": port, "ingress": f"{s}-eth{last[1]}"})
            else:
                ip, mac = routing.node_address(topo, c)
                last = hops(c, s, TESTBED_UDP_PORT)[-1]
                members.append({"worker": i, "mac": mac, "ip": ip, "port": TESTBED_UDP_PORT,
                                "ingress": f"{s}-eth{last[1]}"})
        out.nodes[s] = {"members": members, "parent": None}
    for s in children:
        p = parent_of[s]
        if p is None:
            continue
        ip, mac = routing.node_address(topo, p)
        up = hops(s, p, TESTBED_UDP_PORT)
        # the parent's RESULT leaves by the port s's partial sums arrived on (results_via
        # ingress), then follows the fabric's forwarding: where it arrives is s's parent port
        down = routing.flow_hops(topo, p, s, TESTBED_UDP_PORT, TESTBED_UDP_PORT, UDP, tables,
                                 first_port=up[-1][1])
        out.nodes[s]["parent"] = {"switch": p, "mac": mac, "ip": ip,
                                  "egress": f"{s}-eth{up[0][2]}",
                                  "ingress": f"{s}-eth{down[-1][1]}", "index": member_id[s]}
    for h in hosts:
        s = parent_of[h]
        ip, mac = routing.node_address(topo, s)
        out.workers.append({"switch": s, "mac": mac, "ip": ip, "member": member_id[h]})
    return out


def registrations(p: InaPlan, slots: int, seq0: int, lanes: int) -> dict[str, dict]:
    """Per switch, the ``aggregate`` stage's setting of the job (parents without the planner's
    ``switch`` key)."""
    out = {}
    for s, node in p.nodes.items():
        spec = {"slots": slots, "seq0": seq0, "lanes": lanes, "members": node["members"]}
        if node["parent"] is not None:
            spec["parent"] = {k: v for k, v in node["parent"].items() if k != "switch"}
        out[s] = spec
    return out


def egress_port(topo, switch: str, host: str, sport: int, dport: int,
                tables: dict | None = None) -> str:
    """The interface ``switch`` sends a UDP flow to ``host`` out of (the fabric's real path):
    where a shared pool's host fallback rewrite leaves the switch."""
    hops = routing.flow_hops(topo, switch, host, sport, dport, UDP, tables)
    return f"{switch}-eth{hops[0][2]}"
