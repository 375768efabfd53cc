"""What a control plane asks of a network's topology and routes, whoever runs the network.

:class:`FabricRoutes` is shared by :class:`~testbed.topologies.net.TestbedNet` (a network this
process builds) and :class:`~testbed.topologies.attached.AttachedNet` (one another process
runs): both have ``topo``, the routes' forwarding tables ``_tables`` and ``_host_names``.
"""

from __future__ import annotations

from . import aggtree
from .base import aggregating_switches, switch_identity


class FabricRoutes:
    """Aggregation trees, first hops and aggregator identities of ``self.topo``."""

    topo: object
    _tables: dict

    def _host_names(self, hosts) -> list[str]:
        raise NotImplementedError

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
