"""A running network another process owns, seen by a control plane in the root namespace.

``testbed up FILE`` builds a network and keeps it; the provider (``testbed provider serve
--attach``) runs beside it as its own process, so that it can be stopped, killed and started
again while the network and the tenants' jobs go on. :class:`AttachedNet` gives the provider
what it uses of a :class:`~testbed.topologies.net.TestbedNet` — the topology, the hosts
(name, shell pid, address; commands started in them with ``mnexec``), the engines' control
clients, aggregation trees and routes, the hop latency —
from the topology (which fixes addresses and routes) and the owner's node pids. It builds,
changes and tears down nothing but the switch registrations its user makes.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from testbed.datapath.control import ControlError, DatapathClient

from . import routing
from .base import host_ip, host_mac
from .routes import FabricRoutes


@dataclass(frozen=True)
class AttachedHost:
    """An emulated host of an attached network: its name, its shell's pid (``mnexec -a``)."""

    name: str
    pid: int
    rank: int

    def IP(self) -> str:  # noqa: N802 - Mininet's name, which the control plane calls
        """The host's address (fixed by its rank, as the topology assigns it)."""
        return host_ip(self.rank)

    def MAC(self) -> str:  # noqa: N802 - as above
        """The host's MAC (fixed by its rank)."""
        return host_mac(self.rank)

    def defaultIntf(self) -> SimpleNamespace:  # noqa: N802 - as above
        """The host's one interface (Mininet names it ``<host>-eth0``)."""
        return SimpleNamespace(name=f"{self.name}-eth0")

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """``cmd`` started in the host's namespaces, in a session of its own (as Mininet's
        ``Host.popen``: ``mnexec -da PID``); ``kw`` as :class:`subprocess.Popen` takes them."""
        return subprocess.Popen(["mnexec", "-da", str(self.pid), *cmd], **kw)

    def cmd(self, command: str) -> str:
        """The output of the shell ``command`` run in the host (its own shell: the owner's
        stays free)."""
        out = subprocess.run(["mnexec", "-a", str(self.pid), "sh", "-c", command],
                             capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr


class AttachedNet(FabricRoutes):
    """The network of ``topo`` that another process runs; ``pids``: node name -> its shell's
    pid (what ``testbed up`` records); ``time_dilation``: the network's factor. Raises
    ``ValueError`` when a host of the topology has no pid or an engine does not answer."""

    def __init__(self, topo, pids: dict[str, int], time_dilation: float = 1.0,
                 links_down: Callable[[], list[str]] | None = None):
        self.topo = topo
        self.time_dilation = float(time_dilation)
        #: the owner's failed links now ("tbl1-tbsp1" each): asked again at every plan
        self._links_down = links_down or list
        self._routed: tuple[tuple[str, ...], object, dict] | None = None
        missing = [h for h in topo.host_names if h not in pids]
        if missing:
            raise ValueError(f"the running network has no pid for hosts {missing}: it is not "
                             "the network of this topology")
        self.hosts = [AttachedHost(h, int(pids[h]), r) for r, h in enumerate(topo.host_names)]
        self._hosts = {h.name: h for h in self.hosts}
        self._clients: dict[str, DatapathClient] = {}
        for node in sorted(topo.programmable):
            client = DatapathClient(node)
            try:
                client.config()
            except (ControlError, OSError) as e:
                self.close()
                raise ValueError(f"the engine of {node} does not answer ({e}): is the network "
                                 "up ('testbed up FILE')?") from None
            self._clients[node] = client

    def _routes(self) -> tuple[object, dict]:
        """(routed topology, forwarding tables) for the links down now (cached per set)."""
        down = tuple(sorted(self._links_down()))
        if self._routed is None or self._routed[0] != down:
            topo = routing.without_links(self.topo, [d.split("-") for d in down])
            self._routed = (down, topo, routing.forwarding_tables(topo))
        return self._routed[1], self._routed[2]

    @property
    def routed_topo(self):
        """The topology less the links the owner has failed (``testbed link down``)."""
        return self._routes()[0]

    @property
    def _tables(self) -> dict:
        return self._routes()[1]

    @property
    def mininet(self) -> AttachedNet:
        """Itself: what the control plane asks Mininet for (``get(name)``) it answers."""
        return self

    def _host_names(self, hosts) -> list[str]:
        names = [getattr(h, "name", h) for h in hosts]
        for n in names:
            self.get(n)
        return names

    def get(self, name: str) -> AttachedHost:
        """The host ``name``."""
        if name not in self._hosts:
            raise KeyError(f"{name!r} is not a host of this network; hosts: {sorted(self._hosts)}")
        return self._hosts[name]

    def describe(self) -> dict:
        """The topology's description (``TestbedTopo.describe``)."""
        return self.topo.describe()

    def switch_client(self, name: str) -> DatapathClient:
        """The data path's control client of programmable node ``name``."""
        if name not in self._clients:
            raise KeyError(f"{name!r} is not a programmable node of this network; "
                           f"programmable: {sorted(self._clients)}")
        return self._clients[name]

    def datapath_clients(self) -> dict[str, DatapathClient]:
        """Node name -> data-path control client, for every programmable node."""
        return dict(self._clients)

    def close(self) -> None:
        """Close the control clients (the network stays as it is)."""
        for c in self._clients.values():
            c.close()
        self._clients = {}
