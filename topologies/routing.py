"""Pure graph computations over a testbed topology: shortest paths, ECMP groups, flood tree,
forwarding tables, the path one flow takes, and the alpha-beta model's bottleneck bandwidth.

No Mininet objects here: everything is computed from ``topo.link_specs`` so it can be
tested without building a network, and is the one source both the programmable switches'
tables and the Linux-bridge static FDBs are derived from. A topology is a ``TestbedTopo`` or
its ``describe()`` dict (plain data, e.g. read back from a results folder's metadata):
:func:`as_topology` turns the latter into a :class:`TopologyView` the functions here accept.

:func:`flow_path` follows one flow hop by hop the way the network forwards it: a programmable
node picks the ECMP member by the data path's own hash of the 5-tuple
(``testbed.datapath.forward.flow_hash_reference``, the Python twin of the ``forward`` kernel's
``flow_hash``), a Linux bridge of a looped fabric by its static FDB entry (:func:`pick_port`,
one member per destination MAC), a bridge of a loop-free fabric by the only shortest path.
"""

from __future__ import annotations

import copy
import struct
import zlib
from collections import deque
from dataclasses import dataclass, field

from .base import (
    LinkSpec,
    TestbedTopo,
    aggregating_switches,
    host_ip,
    host_mac,
    switch_identity,
)


@dataclass
class TopologyView:
    """What the routing functions read of a topology, built from its ``describe()`` dict."""

    kind: str
    link_specs: list[LinkSpec]
    host_names: list[str]
    switch_roles: dict[str, str]
    programmable: frozenset[str]
    aggregator_switch: str | None
    seed: int = 0
    params: dict = field(default_factory=dict)

    def fabric_switches(self) -> list[str]:
        """Switch names excluding SmartNIC nodes, in creation order."""
        return [s for s, r in self.switch_roles.items() if r != "smartnic"]


def as_topology(topo) -> TestbedTopo | TopologyView:
    """``topo`` itself when it is a topology object, else a :class:`TopologyView` of a
    ``TestbedTopo.describe()`` dict (keys ``kind``, ``hosts``, ``switches``, ``programmable``,
    ``aggregator``, ``links``, ``params.seed``)."""
    if hasattr(topo, "link_specs") and hasattr(topo, "switch_roles"):
        return topo
    if not isinstance(topo, dict):
        raise TypeError(f"topology must be a TestbedTopo or its describe() dict, got "
                        f"{type(topo).__name__}")
    missing = [k for k in ("hosts", "switches", "links") if k not in topo]
    if missing:
        raise ValueError(f"topology description lacks {missing}: pass TestbedTopo.describe() "
                         "(or the 'topology' entry of a results folder's metadata)")
    try:
        links = [LinkSpec(**d) for d in topo["links"]]
    except TypeError as e:
        raise ValueError(f"topology description: bad link record ({e}); links must be "
                         "LinkSpec.to_dict() entries") from None
    params = dict(topo.get("params") or {})
    return TopologyView(kind=str(topo.get("kind", "")), link_specs=links,
                        host_names=list(topo["hosts"]), switch_roles=dict(topo["switches"]),
                        programmable=frozenset(topo.get("programmable") or ()),
                        aggregator_switch=topo.get("aggregator"),
                        seed=int(params.get("seed", 0)), params=params)


def adjacency(topo) -> dict[str, dict[str, tuple[int, float | None]]]:
    """node -> {neighbour: (local port number, link bw in Mb/s or None)}."""
    adj: dict[str, dict[str, tuple[int, float | None]]] = {}
    for s in topo.link_specs:
        adj.setdefault(s.a, {})[s.b] = (s.port_a, s.bw_mbps)
        adj.setdefault(s.b, {})[s.a] = (s.port_b, s.bw_mbps)
    return adj


def partition(topo, nodes: list[str], n: int) -> list[list[str]]:
    """``nodes`` in ``n`` groups of near-equal size that keep links inside: each group grows
    from the first node not yet placed (in name order), always adding the node with the most
    links into it (ties: fewest links elsewhere, then name), so a fat-tree's pod or a leaf
    with its spines stays together. What an engine group is built from
    (``TestbedNet(engine_groups=n)``)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max(1, len(nodes)):
        raise ValueError(f"groups must be a whole number from 1 to {len(nodes)} (the nodes), "
                         f"got {n!r}")
    adj = adjacency(topo)
    left = sorted(nodes)
    groups: list[list[str]] = []
    for g in range(n):
        size = len(left) // (n - g)
        group = [left.pop(0)]
        while len(group) < size:
            inside = set(group)
            best = min(left, key=lambda x, inside=inside: _pull(adj, inside, x))
            left.remove(best)
            group.append(best)
        groups.append(sorted(group))
    return groups


def _pull(adj, inside: set[str], x: str) -> tuple[int, int, str]:
    """How much ``x`` belongs with ``inside`` (smaller: more): links into it, then others."""
    links = adj.get(x, {})
    into = sum(1 for y in links if y in inside)
    return (-into, len(links) - into, x)


def links_between(topo, a: str, b: str) -> list[LinkSpec]:
    """The links joining nodes ``a`` and ``b`` (either order); ``ValueError`` naming the
    node, or the neighbours of ``a``, when there is none."""
    nodes = {x for s in topo.link_specs for x in (s.a, s.b)}
    for n in (a, b):
        if n not in nodes:
            raise ValueError(f"no node {n!r} in this topology; nodes: {sorted(nodes)}")
    found = [s for s in topo.link_specs if {s.a, s.b} == {a, b}]
    if not found:
        peers = sorted(adjacency(topo)[a])
        raise ValueError(f"no link between {a} and {b}; {a}'s links go to {peers}")
    return found


def without_links(topo, down) -> TestbedTopo | TopologyView:
    """``topo`` less the links in ``down`` (pairs of node names, either order): what the
    routes, aggregation trees and models see while those links have failed. ``topo`` itself
    when ``down`` is empty; else a shallow copy with its own ``link_specs``."""
    pairs = {frozenset(p) for p in down}
    if not pairs:
        return topo
    view = copy.copy(topo)
    view.link_specs = [s for s in topo.link_specs if frozenset((s.a, s.b)) not in pairs]
    return view


def unreachable_hosts(topo) -> list[str]:
    """Hosts cut off from the fabric by ``topo``'s missing links: those outside the largest
    group of hosts that reach each other (none when the fabric is connected)."""
    adj = adjacency(topo)
    groups: list[list[str]] = []
    seen: set[str] = set()
    for h in topo.host_names:
        if h in seen:
            continue
        reach = set(distances_to(adj, h)) if h in adj else {h}
        group = [x for x in topo.host_names if x in reach]
        seen.update(group)
        groups.append(group)
    main = max(groups, key=len, default=[])
    return [h for h in topo.host_names if h not in main]


def distances_to(adj, dst: str) -> dict[str, int]:
    """Hop distance of every node to ``dst`` (BFS). Hosts do not forward transit traffic."""
    dist = {dst: 0}
    q = deque([dst])
    while q:
        u = q.popleft()
        for v in adj[u]:
            if v in dist:
                continue
            dist[v] = dist[u] + 1
            # A host (tbh*) is a leaf of the graph: never expand through it.
            if not v.startswith("tbh"):
                q.append(v)
    return dist


def next_hops(adj, dist: dict[str, int], node: str) -> list[str]:
    """Neighbours of ``node`` one hop closer to the destination (the ECMP group), sorted."""
    d = dist.get(node)
    if d is None or d == 0:
        return []
    return sorted(v for v in adj[node] if dist.get(v) == d - 1)


def has_loops(topo: TestbedTopo) -> bool:
    """Whether the switch graph has a cycle (then flooding must be confined to a tree)."""
    nodes = {s.a for s in topo.link_specs} | {s.b for s in topo.link_specs}
    # A connected graph is a tree iff |E| = |V| - 1.
    return len(topo.link_specs) > len(nodes) - 1


def flood_tree(topo: TestbedTopo, adj=None) -> set[frozenset[str]]:
    """Links (as {a, b}) of a BFS spanning tree rooted at the first fabric switch.

    Broadcast and unknown-unicast flooding is allowed only on these links, so a looped
    fabric (leaf-spine with >1 spine, fat-tree k>=4) needs no STP.
    """
    adj = adj or adjacency(topo)
    root = next(s for s in topo.fabric_switches() if s in adj)  # one with a live link
    seen = {root}
    tree: set[frozenset[str]] = set()
    q = deque([root])
    while q:
        u = q.popleft()
        for v in sorted(adj[u]):
            if v not in seen:
                seen.add(v)
                tree.add(frozenset((u, v)))
                q.append(v)
    return tree


def destinations(topo: TestbedTopo) -> dict[str, str]:
    """MAC -> node where that MAC lives: every host, and every programmable switch's
    aggregator identity (:func:`~testbed.topologies.base.switch_identity`)."""
    dst = {host_mac(r): h for r, h in enumerate(topo.host_names)}
    for sw in aggregating_switches(topo):
        dst[switch_identity(topo, sw)[0]] = sw
    return dst


def forwarding_tables(topo: TestbedTopo) -> dict[str, dict[str, list[int]]]:
    """For every switch (SmartNICs included): dst MAC -> ECMP group of output port numbers.

    Ports are Mininet port numbers (interface ``<switch>-eth<port>``). The aggregator's own
    switch gets no entry for the aggregator MAC (its aggregate stage consumes those packets).
    """
    adj = adjacency(topo)
    tables: dict[str, dict[str, list[int]]] = {s: {} for s in topo.switch_roles}
    for mac, node in destinations(topo).items():
        if node not in adj:
            continue  # a switch whose links have all failed: nobody reaches it
        dist = distances_to(adj, node)
        for sw in topo.switch_roles:
            hops = next_hops(adj, dist, sw) if sw in adj else []
            if hops:
                tables[sw][mac] = [adj[sw][v][0] for v in hops]
    return tables


def pick_port(group: list[int], mac: str, seed: int = 0) -> int:
    """Deterministic single choice from an ECMP group for a destination (static FDB)."""
    return group[zlib.crc32(f"{seed}:{mac}".encode()) % len(group)]


def node_address(topo, node: str) -> tuple[str, str]:
    """(IPv4, MAC) that packets to ``node`` carry: a host's, or a programmable switch's
    aggregator identity."""
    if node in topo.host_names:
        r = topo.host_names.index(node)
        return host_ip(r), host_mac(r)
    if node in aggregating_switches(topo):
        mac, ip = switch_identity(topo, node)
        return ip, mac
    raise ValueError(f"{node!r} is neither a host nor a programmable switch of this topology; "
                     f"hosts: {topo.host_names[:4]}..., switches: {aggregating_switches(topo)}")


def flow_frame(src_ip: str, dst_ip: str, proto: int, sport: int, dport: int) -> bytes:
    """The first 38 bytes of an Ethernet/IPv4 frame of a flow: all the ECMP hash reads."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 8, 0, 0, 64, proto, 0,
                     bytes(int(b) for b in src_ip.split(".")),
                     bytes(int(b) for b in dst_ip.split(".")))
    return b"\x00" * 12 + b"\x08\x00" + ip + struct.pack("!HH", sport, dport)


def flow_hops(topo, src: str, dst: str, sport: int, dport: int, proto: int = 6,
              tables: dict | None = None, first_port: int | None = None
              ) -> list[tuple[str, int, int]]:
    """``[(node, in port, out port), ...]`` of a flow from ``src`` to ``dst`` (hosts, or
    programmable switches by their aggregator identity) as the network forwards it (see the
    module docstring), ends included (the source's in port and the destination's out port are
    -1; ports are Mininet port numbers). ``tables``: a precomputed :func:`forwarding_tables`
    of ``topo`` (saves recomputing it per flow). ``first_port``: the port ``src`` sends on
    instead of its table's choice (an aggregator's RESULT leaves by the port its member's
    packets came in on)."""
    # Function-level import: the data path module loads Numba (start-up time), which the
    # other functions here do not need.
    from testbed.datapath.forward import flow_hash_reference

    topo = as_topology(topo)
    tables = forwarding_tables(topo) if tables is None else tables
    adj = adjacency(topo)
    src_ip = node_address(topo, src)[0]
    dst_ip, dst_mac = node_address(topo, dst)
    h = flow_hash_reference(flow_frame(src_ip, dst_ip, proto, sport, dport))
    static_fdb = has_loops(topo)
    by_port = {u: {p: v for v, (p, _bw) in nbrs.items()} for u, nbrs in adj.items()}
    hops: list[tuple[str, int, int]] = []
    node, in_port = src, -1
    while node != dst:
        if len(hops) > len(adj):
            raise RuntimeError(f"forwarding loop from {src} to {dst}: {hops}")
        if node == src and first_port is not None:
            port = first_port
        elif node in topo.switch_roles:
            group = tables[node].get(dst_mac)
            if not group:
                raise ValueError(f"no route from {node} to {dst} ({dst_mac})")
            if node in topo.programmable:
                port = group[h % len(group)]
            elif static_fdb:
                port = pick_port(group, dst_mac, topo.seed)
            else:
                port = group[0]  # loop-free fabric: the only shortest path
        else:  # a host has one link
            if node != src:
                raise ValueError(f"path from {src} to {dst} runs through host {node}")
            port = next(iter(adj[node].values()))[0]
        hops.append((node, in_port, port))
        nxt = by_port[node][port]
        in_port = adj[nxt][node][0]
        node = nxt
    hops.append((dst, in_port, -1))
    return hops


def flow_path(topo, src: str, dst: str, sport: int, dport: int, proto: int = 6,
              tables: dict | None = None) -> list[str]:
    """Nodes a flow from ``src`` to ``dst`` crosses, ends included (see :func:`flow_hops`)."""
    return [node for node, _, _ in flow_hops(topo, src, dst, sport, dport, proto, tables)]


def _flow_paths(adj, src: str, dst: str) -> dict[tuple[str, str], float]:
    """Fraction of a src->dst flow on each directed link, splitting equally at ECMP groups."""
    dist = distances_to(adj, dst)
    if src not in dist:
        raise ValueError(f"no path from {src} to {dst}")
    frac = {src: 1.0}
    load: dict[tuple[str, str], float] = {}
    # Walk level by level towards dst.
    frontier = [src]
    while frontier:
        nxt: dict[str, float] = {}
        for u in frontier:
            hops = next_hops(adj, dist, u)
            for v in hops:
                share = frac[u] / len(hops)
                load[(u, v)] = load.get((u, v), 0.0) + share
                if v != dst:
                    nxt[v] = nxt.get(v, 0.0) + share
        frac = nxt
        frontier = sorted(nxt)
    return load


def ecmp_links(topo, src: str, dst: str, adj=None) -> set[tuple[str, str]]:
    """The directed links some equal-cost shortest path from ``src`` to ``dst`` takes (every
    link a flow sprayed over all of them may cross). ``adj``: ``adjacency(topo)`` when the
    caller has it (saves building it per pair)."""
    adj = adjacency(as_topology(topo)) if adj is None else adj
    return {link for link, f in _flow_paths(adj, src, dst).items() if f > 0}


def flows_for(pattern: str, hosts: list[str], aggregator: str | None) -> list[tuple[str, str]]:
    """The (src, dst) flows a collective pattern puts on the network at once.

    * ``ring``: rank i -> rank i+1 (mod n) among ``hosts`` (ring allreduce/allgather steps).
    * ``ina``: every host -> aggregator switch and back (in-network aggregation).
    * ``all_to_one``: every other host -> ``hosts[0]`` and back (reduction server, incast).
    """
    n = len(hosts)
    if pattern == "ring":
        return [(hosts[i], hosts[(i + 1) % n]) for i in range(n)] if n > 1 else []
    if pattern == "ina":
        if aggregator is None:
            raise ValueError("pattern='ina' needs an aggregator; this network has none")
        return [(h, aggregator) for h in hosts] + [(aggregator, h) for h in hosts]
    if pattern == "all_to_one":
        return [(h, hosts[0]) for h in hosts[1:]] + [(hosts[0], h) for h in hosts[1:]]
    raise ValueError(f"pattern must be one of 'ring', 'ina', 'all_to_one', got {pattern!r}")


def bottleneck_mbps(topo: TestbedTopo, hosts: list[str], pattern: str = "ring",
                    aggregator: str | None = None) -> float | None:
    """Per-flow bottleneck rate (Mb/s) when all flows of ``pattern`` run at once
    (``aggregator``: INA's, default the topology's aggregator switch; a tree's root).

    Each flow is spread over its equal-cost shortest paths; a directed link carrying total
    flow fraction L at capacity C gives every flow on it C / L. The minimum over links is the
    rate the alpha-beta model uses as B. Returns None when every used link is unshaped.
    """
    adj = adjacency(topo)
    total: dict[tuple[str, str], float] = {}
    for src, dst in flows_for(pattern, hosts, aggregator or topo.aggregator_switch):
        for link, f in _flow_paths(adj, src, dst).items():
            total[link] = total.get(link, 0.0) + f
    rates = [adj[u][v][1] / load for (u, v), load in total.items()
             if adj[u][v][1] is not None and load > 0]
    return min(rates) if rates else None


def path_hops(topo: TestbedTopo, src: str, dst: str) -> int:
    """Number of links on a shortest path from ``src`` to ``dst``."""
    adj = adjacency(topo)
    dist = distances_to(adj, dst)
    if src not in dist:
        raise ValueError(f"no path from {src} to {dst}")
    return dist[src]
