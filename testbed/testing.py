"""Helpers for tests that need a small emulated network around the data path.

:func:`programmable_star` builds its network with :class:`~testbed.topologies.TestbedNet`
like everything else (emulation lock, static ARP, offloads and IPv6 off, teardown on every
exit path), with the programs given used exactly as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from testbed.datapath.programs import normalize_programs
from testbed.topologies import Star
from testbed.topologies.net import TestbedNet
from testbed.topologies.pipeline import DatapathOptions


@contextlib.contextmanager
def programmable_star(n_hosts: int, programs=None, nic_programs=None,
                      **switch_opts) -> Iterator[tuple]:
    """A star ``tbh1..tbhN -- tbs1`` whose switch runs ``programs`` (default ``forward``).

    Yields ``(mininet, hosts, switch)``: the Mininet network, its hosts in rank order and the
    ``tbs1`` node. Links are unshaped. The programs run exactly as given (no forwarding table
    is filled in: a ``forward`` stage learns; an ``aggregate`` stage makes ``tbs1`` the
    aggregator). With ``nic_programs`` every host reaches the switch through its own SmartNIC
    ``tbnK`` running them. ``switch_opts``: engine options of every programmable node
    (``rx_burst``, ``ready_timeout``, ...). Hosts have MACs ``00:00:00:00:00:0K`` and IPs
    ``10.0.0.K``.
    """
    progs = normalize_programs(programs if programs is not None else ["forward"])
    overrides: dict = {"tbs1": progs}
    if nic_programs is not None:
        overrides["smartnic"] = normalize_programs(nic_programs)
    aggregator = "tbs1" if any(p == "aggregate" for p, _ in progs) else None
    topo = Star(n_hosts, bw_mbps=None, switch="programmable", smartnic=nic_programs is not None,
                programs=overrides, aggregator=aggregator)
    with TestbedNet(topo, engine_opts=switch_opts,
                    datapath=DatapathOptions(explicit_programs=True)) as net:
        yield net.mininet, net.hosts, net.mininet.get("tbs1")
