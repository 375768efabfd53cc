"""Dumbbell (two switches joined by a bottleneck link) and Incast (many senders, one receiver)."""

from __future__ import annotations

from .base import TestbedTopo, check_bw, check_int


class Dumbbell(TestbedTopo):
    """``n_left`` hosts on ``tbs1``, ``n_right`` on ``tbs2``, joined by one bottleneck link.

    Hosts ``tbh1..tbh<n_left>`` are on the left; the rest on the right. The bottleneck link
    ``tbs1 - tbs2`` runs at ``bottleneck_mbps`` (default: ``bw_mbps``). The aggregator
    ('auto') sits on the left switch ``tbs1``.
    """

    kind = "dumbbell"
    default_aggregator = "tbs1"

    def __init__(self, n_left: int = 1, n_right: int = 1, bottleneck_mbps=None, **opts):
        super().__init__(n_left=n_left, n_right=n_right, bottleneck_mbps=bottleneck_mbps,
                         **opts)

    def validate_kind(self, n_left, n_right, bottleneck_mbps) -> None:
        """n_left, n_right >= 1; bottleneck_mbps > 0 (or None: same as bw_mbps)."""
        check_int("n_left", n_left, 1)
        check_int("n_right", n_right, 1)
        check_bw("bottleneck_mbps", bottleneck_mbps)

    def planned_hosts(self) -> int:
        """n_left + n_right."""
        return self.kind_params["n_left"] + self.kind_params["n_right"]

    def build_fabric(self) -> None:
        """Two switches, the bottleneck between them, hosts left then right."""
        p = self.kind_params
        left = self.add_switch("tbs1", "tor")
        right = self.add_switch("tbs2", "tor")
        for _ in range(p["n_left"]):
            self.add_host_at(left)
        for _ in range(p["n_right"]):
            self.add_host_at(right)
        bneck = p["bottleneck_mbps"] if p["bottleneck_mbps"] is not None else self.bw_mbps
        self.add_link(left, right, bneck, "bottleneck")


class Incast(TestbedTopo):
    """``n_senders`` senders and one receiver on one switch ``tbs1``.

    The receiver is rank 0 (``tbh1``); senders are ``tbh2..tbh<n_senders+1>``. All senders'
    traffic to the receiver leaves through the one switch port facing it, whose link runs at
    ``receiver_mbps`` (default: ``bw_mbps``) - the incast bottleneck.
    """

    kind = "incast"
    default_aggregator = "tbs1"

    def __init__(self, n_senders: int = 2, receiver_mbps=None, **opts):
        super().__init__(n_senders=n_senders, receiver_mbps=receiver_mbps, **opts)

    def validate_kind(self, n_senders, receiver_mbps) -> None:
        """n_senders >= 1; receiver_mbps > 0 (or None: same as bw_mbps)."""
        check_int("n_senders", n_senders, 1)
        check_bw("receiver_mbps", receiver_mbps)

    def planned_hosts(self) -> int:
        """n_senders + 1 receiver."""
        return self.kind_params["n_senders"] + 1

    @property
    def receiver(self) -> str:
        """Name of the receiving host."""
        return self.host_names[0]

    def build_fabric(self) -> None:
        """One switch; the receiver first (rank 0), then the senders."""
        p = self.kind_params
        sw = self.add_switch("tbs1", "tor")
        rbw = p["receiver_mbps"] if p["receiver_mbps"] is not None else self.bw_mbps
        self.add_host_at(sw, bw_mbps=rbw)
        for _ in range(p["n_senders"]):
            self.add_host_at(sw)

    def describe(self) -> dict:
        """As the base, plus the receiver's name."""
        d = super().describe()
        d["receiver"] = self.receiver
        return d
