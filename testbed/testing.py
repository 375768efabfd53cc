"""Helpers for tests that need a small emulated network around the data path.

:func:`programmable_star` builds its network with :class:`~testbed.topologies.TestbedNet`
like everything else (emulation lock, static ARP, offloads and IPv6 off, teardown on every
exit path), with the programs given used exactly as written. :func:`shaped_rate_mbps`
measures a shaped path's TCP rate the way a noisy shared machine allows.
"""

from __future__ import annotations

import contextlib
import json
import time
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


def shaped_rate_mbps(client, server, server_ip: str, floor_mbps: float, tries: int = 3,
                     seconds: float = 2, port: int = 5299) -> float:
    """TCP rate from ``client`` to ``server`` (iperf3, slow start left out), the best of up to
    ``tries`` runs, stopping at the first at or above ``floor_mbps``. A shared machine's load
    can only slow a shaped flow, never lift it past its shaper: the best run measures the
    shaper, and a check of the upper bound stays as strict as with one run. A try that iperf3
    could not make (its server late on a loaded machine) counts as none; if none succeeds, the
    error says what iperf3 answered."""
    best, errors = None, []
    for _ in range(tries):
        srv = server.popen(["iperf3", "-s", "-1", "-p", str(port)])
        try:
            if not _listening(server, port, timeout=10.0):
                errors.append(f"no iperf3 server listened on port {port} within 10 s")
                continue
            out = client.cmd(f"iperf3 -c {server_ip} -p {port} -t {seconds} -O 1 -J")
        finally:
            srv.kill()
            srv.wait()
        got = None
        try:
            got = json.loads(out[out.index("{"):])
            rate = got["end"]["sum_received"]["bits_per_second"] / 1e6
        except (ValueError, KeyError) as e:
            errors.append(f"iperf3 gave no rate ({type(e).__name__} {e}): "
                          f"{got.get('error') if isinstance(got, dict) else out[-300:]!r}")
            continue
        best = rate if best is None else max(best, rate)
        if best >= floor_mbps:
            break
    if best is None:
        raise AssertionError(f"iperf3 {client.name} -> {server_ip}:{port} failed {tries} times: "
                             + "; ".join(errors))
    return best


def _listening(host, port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if host.cmd(f"ss -ltnH 'sport = :{port}'").strip():
            return True
        time.sleep(0.05)
    return False
