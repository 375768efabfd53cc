"""What a control plane asks of a network's topology and routes, whoever runs the network.

:class:`FabricRoutes` is shared by :class:`~testbed.topologies.net.TestbedNet` (a network this
process builds) and :class:`~testbed.topologies.attached.AttachedNet` (one another process
runs): both have ``topo``, ``hosts`` (whose ``cmd`` runs a shell command in the host),
``time_dilation``, the routes' forwarding tables ``_tables``, ``_host_names`` and the engines'
control clients ``datapath_clients()``.
"""

from __future__ import annotations

import re
import threading

from . import aggtree, routing
from .base import (
    IMPAIR_STAGES,
    LinkImpairment,
    aggregating_switches,
    link_impairments,
    switch_identity,
)

#: Several threads may ask for the hop latency at once (a replay's tenants), and a node's shell
#: runs one command at a time.
_HOP_LATENCY_LOCK = threading.Lock()


class FabricRoutes:
    """Aggregation trees, first hops, aggregator identities and the hop latency of
    ``self.topo``."""

    topo: object
    hosts: list
    time_dilation: float
    _tables: dict
    _hop_latency: float | None = None
    #: nodes whose engines run an impair stage (:meth:`link_impairments`), found on first use
    _impair_nodes: list[str] | None = None

    def _host_names(self, hosts) -> list[str]:
        raise NotImplementedError

    def datapath_clients(self) -> dict:
        raise NotImplementedError

    def link_impairments(self) -> list[LinkImpairment]:
        """The impairments the engines' ``impair`` stages now apply beyond the topology's own
        ``loss_pct``, one record per impaired directed link (what
        :func:`testbed.collectives.flowmodel.predict` prices beside the topology): read from
        the engines, so a stage configured at run time counts. Empty without such stages."""
        clients = self.datapath_clients()
        if self._impair_nodes is None:  # an engine's stages are fixed when it starts
            self._impair_nodes = [node for node, c in clients.items()
                                  if set(c.config().get("stages", ())) & set(IMPAIR_STAGES)]
        return link_impairments(self.topo.link_specs,
                                {n: clients[n].counters() for n in self._impair_nodes},
                                own_loss_applied=self.topo.impair_mode() == "datapath")

    @property
    def routed_topo(self):
        """The topology the routes are computed on (a network with failed links: less them)."""
        return self.topo

    def ina_plan(self, hosts, port: int, tree=None) -> aggtree.InaPlan:
        """The aggregation tree of an INA job with workers on ``hosts`` (ranks, names or Host
        objects, in worker order) binding UDP ``port``: which switches aggregate, their members
        and parents, each worker's switch and member id (``tree``: None/'single', 'auto' or a
        list of switches; see :mod:`testbed.topologies.aggtree`)."""
        names = self._host_names(hosts)
        return aggtree.plan(self.routed_topo, [self.topo.host_names.index(h) for h in names],
                            port, tree, self._tables)

    def first_hop(self, switch: str, host: str, sport: int, dport: int) -> str:
        """The interface of programmable ``switch`` that a UDP flow to ``host`` leaves by."""
        return aggtree.egress_port(self.routed_topo, switch, host, sport, dport, self._tables)

    def aggregators(self) -> dict[str, dict]:
        """Programmable switch -> its aggregator identity ``{"ip", "mac"}``."""
        out = {}
        for sw in aggregating_switches(self.topo):
            mac, ip = switch_identity(self.topo, sw)
            out[sw] = {"ip": ip, "mac": mac}
        return out

    def hop_latency_s(self) -> float:
        """Estimated one-way latency per link (s): measured RTT/2 over the path's links.

        Measured once (10 pings between the first two hosts) and cached; with a single host,
        the configured per-link delay plus 20 us of forwarding.
        """
        with _HOP_LATENCY_LOCK:
            if self._hop_latency is None:
                self._hop_latency = self._measure_hop_latency_s()
            return self._hop_latency

    def _measure_hop_latency_s(self) -> float:
        if len(self.hosts) < 2:
            return self.topo.delay_ms * 1e-3 * self.time_dilation + 20e-6
        h1, h2 = self.hosts[:2]
        out = h1.cmd(f"ping -c 10 -i 0.01 -q {h2.IP()}")
        m = re.search(r"= [\d.]+/([\d.]+)/", out)
        if not m:
            raise RuntimeError(f"hop_latency_s: ping between {h1.name} and {h2.name} failed: "
                               f"{out!r}")
        hops = routing.path_hops(self.routed_topo, h1.name, h2.name)
        return float(m.group(1)) * 1e-3 / 2 / hops
