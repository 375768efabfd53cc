"""Star: ``n_hosts`` hosts on one switch ``tbs1`` (the ToR; hosts the aggregator)."""

from __future__ import annotations

from .base import TestbedTopo, check_int


class Star(TestbedTopo):
    """``n_hosts`` hosts ``tbh1..`` each on its own port of the single switch ``tbs1``.

    Example: ``Star(8, bw_mbps=100, switch='programmable')``. Common options: see
    :class:`~testbed.topologies.base.TestbedTopo`.
    """

    kind = "star"
    default_aggregator = "tbs1"

    def __init__(self, n_hosts: int = 2, **opts):
        super().__init__(n_hosts=n_hosts, **opts)

    def validate_kind(self, n_hosts) -> None:
        """n_hosts must be an integer >= 1."""
        check_int("n_hosts", n_hosts, 1)

    def planned_hosts(self) -> int:
        """Number of hosts."""
        return self.kind_params["n_hosts"]

    def build_fabric(self) -> None:
        """One switch, every host on it."""
        tor = self.add_switch("tbs1", "tor")
        for _ in range(self.kind_params["n_hosts"]):
            self.add_host_at(tor)
