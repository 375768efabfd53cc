"""Leaf-spine (two-tier Clos): every leaf connects to every spine."""

from __future__ import annotations

import math

from .base import MAX_BW_MBPS, MAX_NODES, TestbedTopo, TopologyError, check_int


class LeafSpine(TestbedTopo):
    """``leaves`` leaves ``tbl1..`` x ``spines`` spines ``tbsp1..``, ``hosts_per_leaf`` each.

    The uplink rate is derived so that a leaf's downlink capacity divided by its uplink
    capacity equals ``oversubscription``::

        uplink_mbps = hosts_per_leaf * bw_mbps / (spines * oversubscription)

    unless ``uplink_mbps`` is given explicitly. Hosts are numbered leaf by leaf. The
    aggregator ('auto') sits on the first spine ``tbsp1``.
    """

    kind = "leaf_spine"
    default_aggregator = "tbsp1"

    def __init__(self, leaves: int = 2, spines: int = 2, hosts_per_leaf: int = 2,
                 oversubscription: float = 1.0, uplink_mbps=None, **opts):
        super().__init__(leaves=leaves, spines=spines, hosts_per_leaf=hosts_per_leaf,
                         oversubscription=oversubscription, uplink_mbps=uplink_mbps, **opts)

    def validate_kind(self, leaves, spines, hosts_per_leaf, oversubscription,
                      uplink_mbps) -> None:
        """Counts >= 1; oversubscription a finite number > 0 leaving a usable uplink."""
        check_int("leaves", leaves, 1)
        check_int("spines", spines, 1)
        check_int("hosts_per_leaf", hosts_per_leaf, 1)
        if spines > MAX_NODES:  # the hosts are bounded by the base, the spines are not
            raise TopologyError(f"spines must be at most {MAX_NODES}, got {spines:,}")
        if isinstance(oversubscription, bool) or not isinstance(oversubscription, (int, float)) \
                or not math.isfinite(oversubscription) or oversubscription <= 0:
            raise TopologyError(
                "oversubscription must be a finite number > 0 (1.0 = non-blocking, 4.0 = "
                f"uplinks carry a quarter of the downlink capacity), got {oversubscription!r}")
        if uplink_mbps is not None:
            if isinstance(uplink_mbps, bool) or not isinstance(uplink_mbps, (int, float)) \
                    or not 0 < uplink_mbps <= MAX_BW_MBPS:
                raise TopologyError(
                    f"uplink_mbps must be a number in (0, {MAX_BW_MBPS:g}] or None "
                    f"(derived from oversubscription), got {uplink_mbps!r}")

    def planned_hosts(self) -> int:
        """leaves * hosts_per_leaf."""
        return self.kind_params["leaves"] * self.kind_params["hosts_per_leaf"]

    def uplink_mbps(self) -> float | None:
        """Rate of each leaf-spine link (None: unshaped, when the access links are)."""
        p = self.kind_params
        if p["uplink_mbps"] is not None:
            return float(p["uplink_mbps"])
        if self.bw_mbps is None:
            return None
        up = p["hosts_per_leaf"] * self.bw_mbps / (p["spines"] * p["oversubscription"])
        # HTB cannot shape meaningfully below ~0.1 Mb/s: that is "no uplink bandwidth".
        if up < 0.1:
            raise TopologyError(
                f"oversubscription={p['oversubscription']!r} leaves {up:.4g} Mb/s per uplink "
                "(< 0.1 Mb/s, effectively none); use a smaller oversubscription")
        return min(up, MAX_BW_MBPS)

    def build_fabric(self) -> None:
        """Spines, then each leaf with its hosts and its uplinks to every spine."""
        p = self.kind_params
        up = self.uplink_mbps()
        spines = [self.add_switch(f"tbsp{j + 1}", "spine") for j in range(p["spines"])]
        for i in range(p["leaves"]):
            leaf = self.add_switch(f"tbl{i + 1}", "leaf")
            for _ in range(p["hosts_per_leaf"]):
                self.add_host_at(leaf)
            for sp in spines:
                self.add_link(leaf, sp, up, "uplink")

    def leaf_of(self, host: str) -> str:
        """Name of the leaf a host hangs off (through its SmartNIC if any)."""
        rank = self.host_names.index(host)
        return f"tbl{rank // self.kind_params['hosts_per_leaf'] + 1}"
