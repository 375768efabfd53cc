"""Trimming as a plan: the switch ports a UET job's packets cross trim while its plan runs.

A plan whose ring runs over the UET-like transport (``Plan.transport == "uet"``, offered to
jobs whose tenants say their workers run it: ``Hints.transports``) sprays its packets over
every equal-cost path, and a switch that *trims* instead of dropping turns a packet lost to a
full queue into a NACK within a round trip (``testbed.collectives.uet``). On a running
network :class:`PortTrimmer` keeps exactly the ports that needs trimming:

* which ports: at every programmable switch, the egress port of each directed link that some
  equal-cost path of the ring's messages (rank i to rank i+1) or of their ACKs and NACKs (the
  other way) takes (:func:`trim_ports`);
* how: the switch's ``shape`` stage (its engine's queue per shaped port,
  ``testbed.datapath.trim.ShapeStage``) turns those ports to ``mode = "uet"`` with a
  trimmable-only threshold of :data:`TRIM_THRESHOLD_BYTES` (1.5 times that on ports facing a
  host, UET's last hop, whose cuts are marked so): the job's trimmable packets are cut above
  it, its ACKs and NACKs overtake the data, and any other traffic on the port (a TCP tenant)
  keeps the drop-tail limit the port had, so no one else is cut short. Every other port of a
  ``shape`` stage is ``drop_tail`` again.

A switch whose engine has no ``shape`` stage (HTB shaping, or an experiment's own ``trim``
stage, which the experiment configured) is left as it is and listed in
:attr:`PortTrimmer.skipped`; its packets are sprayed but not trimmed there.
"""

from __future__ import annotations

from testbed.datapath.trim import LASTHOP_FACTOR
from testbed.topologies import routing

#: The data-queue depth above which a trimming port cuts a trimmable packet: about the
#: bandwidth-delay product UET recommends for a 100 Mb/s port at the few milliseconds of round
#: trip a loaded emulated fabric has (a 32 KiB queue is 2.6 ms at 100 Mb/s), and what
#: ``testbed bench trimming`` measured UET's gain with
TRIM_THRESHOLD_BYTES = 32 * 1024


def trim_ports(topo, hosts: list[str]) -> dict[str, dict[str, bool]]:
    """Per programmable switch of ``topo``, the ports a UET ring of ``hosts`` (in rank order)
    sends on, each with whether it faces a host (UET's last hop)."""
    topo = routing.as_topology(topo)
    adj = routing.adjacency(topo)
    prog = set(topo.programmable)
    host_names = set(topo.host_names)
    out: dict[str, dict[str, bool]] = {}
    n = len(hosts)
    for i in range(n if n > 2 else n - 1):
        a, b = hosts[i], hosts[(i + 1) % n]
        for src, dst in ((a, b), (b, a)):  # the data one way, its ACKs and NACKs the other
            for u, v in routing.ecmp_links(topo, src, dst, adj):
                if u in prog:
                    out.setdefault(u, {})[f"{u}-eth{adj[u][v][0]}"] = v in host_names
    return out


class PortTrimmer:
    """Keeps the ``shape`` ports of a running network's programmable switches trimming where
    the plans' UET rings send, and only there (see the module docstring).

    ``threshold_bytes``: the trimmable-only threshold of a trimming port. :attr:`trimming`:
    per switch, the ports trimming now; :attr:`by_job`: per UET job, the ports it asked for;
    :attr:`errors`: switches that refused or did not answer (tried again at the next sync);
    :attr:`skipped`: switches a plan wanted but whose engines have no ``shape`` stage.
    """

    def __init__(self, net, threshold_bytes: int = TRIM_THRESHOLD_BYTES):
        if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int) \
                or threshold_bytes <= 0:
            raise ValueError(f"threshold_bytes must be a positive integer, got "
                             f"{threshold_bytes!r}")
        self.net = net
        self.threshold_bytes = threshold_bytes
        self.trimming: dict[str, set[str]] = {}
        self.by_job: dict[str, dict[str, list[str]]] = {}
        self.errors: dict[str, str] = {}
        self.skipped: set[str] = set()
        self._synced = False

    def sync(self, plans: dict, jobs: dict[str, dict]) -> None:
        """Make the ports trim exactly where the UET plans of ``plans`` (job -> Plan) send
        (``jobs``: the manager's job table, for each job's hosts). The first sync sets every
        switch (a restarted provider's ports are whatever the last one left)."""
        topo = getattr(self.net, "routed_topo", self.net.topo)
        want: dict[str, dict[str, bool]] = {}
        self.by_job = {}
        for job, plan in plans.items():
            if getattr(plan, "transport", "tcp") != "uet" or job not in jobs:
                continue
            ports = trim_ports(topo, list(jobs[job]["hosts"]))
            self.by_job[job] = {sw: sorted(p) for sw, p in ports.items()}
            for sw, p in ports.items():
                want.setdefault(sw, {}).update(p)
        clients = self.net.datapath_clients()
        todo = set(clients) if not self._synced else (set(want) | set(self.trimming)
                                                      | set(self.errors))
        self.skipped = set()
        for sw in sorted(todo & set(clients)):
            ports = want.get(sw, {})
            if self._synced and sw not in self.errors \
                    and set(ports) == self.trimming.get(sw, set()):
                continue
            try:
                if not self._configure(clients[sw], ports):
                    if ports:
                        self.skipped.add(sw)
                    continue
            except Exception as e:  # noqa: BLE001 - a switch that refuses is tried again
                self.errors[sw] = f"{type(e).__name__}: {e}"
                continue
            self.errors.pop(sw, None)
            if ports:
                self.trimming[sw] = set(ports)
            else:
                self.trimming.pop(sw, None)
        self._synced = True

    def _configure(self, client, ports: dict[str, bool]) -> bool:
        """Turn ``ports`` (name -> faces a host) of one switch's ``shape`` stage into UET
        trimming ports and every other port of it back to drop-tail; False when the switch's
        engine has no ``shape`` stage."""
        shape = client.counters().get("stages", {}).get("shape")
        if shape is None:
            return False
        names = list(shape.get("ports", {}))
        thr = int(self.threshold_bytes)
        client.configure("shape", mode={p: "uet" if p in ports else "drop_tail" for p in names},
                         trim_threshold_bytes={p: int(thr * LASTHOP_FACTOR) if ports.get(p)
                                               else thr if p in ports else 0 for p in names},
                         last_hop={p: bool(ports.get(p, False)) for p in names})
        return True

    def close(self) -> None:
        """Every port back to drop-tail (the plans that wanted trimming are gone)."""
        self.sync({}, {})
