"""Datacenter topologies and the emulated network handle.

* Topologies (declarative Mininet ``Topo`` classes): :class:`Star`, :class:`LeafSpine`,
  :class:`FatTree`, :class:`Dumbbell`, :class:`Incast`; or by name with
  :func:`make_topology` (``star``, ``leaf_spine``, ``fat_tree``, ``dumbbell``, ``incast``).
* :class:`~testbed.topologies.net.TestbedNet`: build, start and tear down a network under the
  emulation lock (imported lazily: it pulls in Mininet's runtime and the data path); every
  emulated network is built by it.
* :func:`testbed.topologies.pipeline.compose`: which data-path stages each programmable node
  runs (pure; ``TestbedNet.programs_plan()`` returns it).
"""

from __future__ import annotations

import inspect

from .base import AGGREGATOR_IP, AGGREGATOR_MAC, TestbedTopo, TopologyError, netem_available
from .dumbbell import Dumbbell, Incast
from .fattree import FatTree
from .leafspine import LeafSpine
from .star import Star

#: kind name -> topology class
TOPOLOGIES: dict[str, type[TestbedTopo]] = {
    "star": Star,
    "leaf_spine": LeafSpine,
    "fat_tree": FatTree,
    "dumbbell": Dumbbell,
    "incast": Incast,
}


def make_topology(kind: str, **params) -> TestbedTopo:
    """Build the topology of ``kind`` with keyword ``params`` (validated before anything).

    Example: ``make_topology('leaf_spine', leaves=2, spines=2, hosts_per_leaf=4,
    oversubscription=2.0, bw_mbps=100)``.
    """
    cls = TOPOLOGIES.get(kind)
    if cls is None:
        raise TopologyError(f"unknown topology kind {kind!r}; allowed: {sorted(TOPOLOGIES)}")
    try:
        return cls(**params)
    except TypeError as exc:  # unknown keyword: say which ones exist

        kind_args = [p for p in inspect.signature(cls.__init__).parameters
                     if p not in ("self", "opts")]
        common = [p for p in inspect.signature(TestbedTopo.__init__).parameters
                  if p not in ("self", "kind_params")]
        raise TopologyError(
            f"bad parameters for {kind!r}: {exc}; allowed: {kind_args + common}") from None


def __getattr__(name):
    # Lazy: importing the topologies must not import Mininet's net runtime or the data path.
    if name == "TestbedNet":
        from .net import TestbedNet

        return TestbedNet
    raise AttributeError(name)


__all__ = [
    "AGGREGATOR_IP", "AGGREGATOR_MAC", "TOPOLOGIES", "Dumbbell", "FatTree", "Incast",
    "LeafSpine", "Star", "TestbedNet", "TestbedTopo", "TopologyError", "make_topology",
    "netem_available",
]
