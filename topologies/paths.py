"""The path one packet flow really takes through a testbed fabric.

Programmable nodes pick an ECMP member by the flow's 5-tuple hash (the ``forward`` stage's
``flow_hash``, recomputed by its Python twin); Linux bridges of a looped fabric hold one static
FDB entry per destination MAC (:func:`routing.pick_port`); a loop-free bridge fabric has one
path anyway. Pure functions of the topology description: no network needed.
"""

from __future__ import annotations

import struct

from testbed.datapath.forward import flow_hash_reference
from testbed.kernels.wire import TESTBED_UDP_PORT

from . import routing
from .base import AGGREGATOR_IP, AGGREGATOR_MAC, TestbedTopo, host_ip, host_mac


def flow_key(src_ip: str, dst_ip: str, sport: int, dport: int, proto: int = 17) -> bytes:
    """A minimal Ethernet/IPv4/L4 frame carrying the 5-tuple the ECMP hash reads."""
    ip = bytes([0x45, 0, 0, 0, 0, 0, 0, 0, 64, proto, 0, 0])
    ip += bytes(int(p) for p in src_ip.split(".")) + bytes(int(p) for p in dst_ip.split("."))
    return b"\0" * 12 + b"\x08\x00" + ip + struct.pack("!HH", sport, dport) + b"\0" * 4


def flow_path(topo: TestbedTopo, src: str, dst_mac: str, key: bytes,
              tables: dict | None = None) -> list[tuple[str, int, int]]:
    """``[(node, in port, out port), ...]`` of the switches (and SmartNICs) a frame from host
    ``src`` to ``dst_mac`` crosses, with ``key`` (:func:`flow_key`) its 5-tuple. The last entry
    is the node that owns ``dst_mac`` (out port -1) or the last switch before that host."""
    tables = tables if tables is not None else routing.forwarding_tables(topo)
    adj = routing.adjacency(topo)
    owner = routing.destinations(topo).get(dst_mac)
    if owner is None:
        raise ValueError(f"no node owns MAC {dst_mac}")
    if src not in adj or len(adj[src]) != 1:
        raise ValueError(f"{src!r} is not a host of this topology")
    prev, node = src, next(iter(adj[src]))
    hops: list[tuple[str, int, int]] = []
    while True:
        in_port = adj[node][prev][0]
        if node == owner:
            hops.append((node, in_port, -1))
            return hops
        group = tables[node].get(dst_mac)
        if not group:
            raise ValueError(f"{node} has no route to {dst_mac}")
        if len(group) == 1:
            out = group[0]
        elif node in topo.programmable:
            out = group[flow_hash_reference(key) % len(group)]
        else:
            out = routing.pick_port(group, dst_mac, topo.seed)
        hops.append((node, in_port, out))
        nxt = next(v for v, (p, _bw) in adj[node].items() if p == out)
        if nxt == owner and owner in topo.host_names:
            return hops
        if len(hops) > len(adj):
            raise RuntimeError(f"routing loop from {src} to {dst_mac}: {hops}")
        prev, node = node, nxt


def ina_members(topo: TestbedTopo, ranks: list[int], port: int) -> list[dict]:
    """The aggregator's member records for INA workers on host ranks ``ranks`` (worker id =
    position) that bind UDP ``port``: MAC, IP, port and the aggregator switch's port name
    their packets arrive on."""
    agg = topo.aggregator_switch
    if agg is None:
        raise ValueError("this topology has no aggregator (use switch='programmable')")
    tables = routing.forwarding_tables(topo)
    out = []
    for w, r in enumerate(ranks):
        host = topo.host_names[r]
        ip = host_ip(r)
        path = flow_path(topo, host, AGGREGATOR_MAC, flow_key(ip, AGGREGATOR_IP, port, TESTBED_UDP_PORT),
                         tables)
        node, in_port, _ = path[-1]
        assert node == agg, path
        out.append({"worker": w, "mac": host_mac(r), "ip": ip, "port": port,
                    "ingress": f"{agg}-eth{in_port}"})
    return out
