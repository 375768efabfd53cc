"""k-ary fat-tree (Al-Fares et al.): k pods, (k/2)^2 core switches, k^3/4 hosts."""

from __future__ import annotations

from .base import TestbedTopo, check_int


class FatTree(TestbedTopo):
    """Fat-tree of even ``k`` >= 2, every link at ``bw_mbps``.

    Pod p has k/2 aggregation switches ``tba..`` and k/2 edge switches ``tbe..``; each edge
    switch has k/2 hosts and links to every aggregation switch of its pod; aggregation switch
    j of every pod links to the k/2 core switches ``tbc<j*k/2+1>..``. Numbering is global:
    ``tba<p*k/2+j+1>``. The aggregator ('auto') sits on the first core switch ``tbc1``.
    """

    kind = "fat_tree"
    default_aggregator = "tbc1"

    def __init__(self, k: int = 4, **opts):
        super().__init__(k=k, **opts)

    def validate_kind(self, k) -> None:
        """k must be an even integer >= 2."""
        check_int("k", k, 2, even=True)

    def planned_hosts(self) -> int:
        """k^3 / 4."""
        k = self.kind_params["k"]
        return k ** 3 // 4

    def build_fabric(self) -> None:
        """Core, then pod by pod: aggregation, edge with hosts, and the links."""
        k = self.kind_params["k"]
        h = k // 2
        bw = self.bw_mbps
        cores = [self.add_switch(f"tbc{c + 1}", "core") for c in range(h * h)]
        for p in range(k):
            aggs = [self.add_switch(f"tba{p * h + j + 1}", "agg") for j in range(h)]
            for e in range(h):
                edge = self.add_switch(f"tbe{p * h + e + 1}", "edge")
                for _ in range(h):
                    self.add_host_at(edge)
                for agg in aggs:
                    self.add_link(edge, agg, bw, "uplink")
            for j, agg in enumerate(aggs):
                for c in range(h):
                    self.add_link(agg, cores[j * h + c], bw, "core")
