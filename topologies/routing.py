"""Pure graph computations over a testbed topology: shortest paths, ECMP groups, flood tree,
forwarding tables and the alpha-beta model's bottleneck bandwidth.

No Mininet objects here: everything is computed from ``topo.link_specs`` so it can be
tested without building a network, and is the one source both the programmable switches'
tables and the Linux-bridge static FDBs are derived from.
"""

from __future__ import annotations

import zlib
from collections import deque

from .base import AGGREGATOR_MAC, TestbedTopo, host_mac


def adjacency(topo: TestbedTopo) -> dict[str, dict[str, tuple[int, float | None]]]:
    """node -> {neighbour: (local port number, link bw in Mb/s or None)}."""
    adj: dict[str, dict[str, tuple[int, float | None]]] = {}
    for s in topo.link_specs:
        adj.setdefault(s.a, {})[s.b] = (s.port_a, s.bw_mbps)
        adj.setdefault(s.b, {})[s.a] = (s.port_b, s.bw_mbps)
    return adj


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
    root = topo.fabric_switches()[0]
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
    """MAC -> node where that MAC lives: every host, and the aggregator's virtual MAC."""
    dst = {host_mac(r): h for r, h in enumerate(topo.host_names)}
    if topo.aggregator_switch is not None:
        dst[AGGREGATOR_MAC] = topo.aggregator_switch
    return dst


def forwarding_tables(topo: TestbedTopo) -> dict[str, dict[str, list[int]]]:
    """For every switch (SmartNICs included): dst MAC -> ECMP group of output port numbers.

    Ports are Mininet port numbers (interface ``<switch>-eth<port>``). The aggregator's own
    switch gets no entry for the aggregator MAC (its aggregate stage consumes those packets).
    """
    adj = adjacency(topo)
    tables: dict[str, dict[str, list[int]]] = {s: {} for s in topo.switch_roles}
    for mac, node in destinations(topo).items():
        dist = distances_to(adj, node)
        for sw in topo.switch_roles:
            hops = next_hops(adj, dist, sw)
            if hops:
                tables[sw][mac] = [adj[sw][v][0] for v in hops]
    return tables


def pick_port(group: list[int], mac: str, seed: int = 0) -> int:
    """Deterministic single choice from an ECMP group for a destination (static FDB)."""
    return group[zlib.crc32(f"{seed}:{mac}".encode()) % len(group)]


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


def bottleneck_mbps(topo: TestbedTopo, hosts: list[str], pattern: str = "ring") -> float | None:
    """Per-flow bottleneck rate (Mb/s) when all flows of ``pattern`` run at once.

    Each flow is spread over its equal-cost shortest paths; a directed link carrying total
    flow fraction L at capacity C gives every flow on it C / L. The minimum over links is the
    rate the alpha-beta model uses as B. Returns None when every used link is unshaped.
    """
    adj = adjacency(topo)
    total: dict[tuple[str, str], float] = {}
    for src, dst in flows_for(pattern, hosts, topo.aggregator_switch):
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
