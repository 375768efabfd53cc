"""``testbed bench cluster``: what splitting a network over two servers costs.

Builds the same programmable leaf-spine twice in one run: on this machine alone (the anchor),
then split over this machine and a netns server reached by ssh
(:class:`testbed.nsserver.NetnsServer`; only fabric links cross, as VXLAN tunnels). For each it
records the set-up time (lock wait excluded: connecting to the servers and measuring their
underlay, building, starting the engines, configuring), the resident memory per server
(:meth:`TestbedNet.server_memory`) and one INA and one ring allreduce (time, correctness,
``tunnel_bound``); the cluster row gives its set-up time as a ratio to the anchor's. The second
server shares this machine's CPU, so the ratio measures the ssh/tunnel overhead, not a gain.
"""

from __future__ import annotations

from testbed.bench.protocol import Outcome
from testbed.collectives import CollectiveSpec, run_collective
from testbed.nsserver import NetnsServer
from testbed.topologies import LeafSpine, TestbedNet

SETUP_KEYS = ("cluster_s", "build_s", "start_s", "configure_s")


def measure_split(leaves: int, hosts_per_leaf: int, bw_mbps: float, servers=None) -> dict:
    """Build the leaf-spine (on ``servers`` when given), run INA and ring once, tear down."""
    topo = LeafSpine(leaves=leaves, spines=2, hosts_per_leaf=hosts_per_leaf, bw_mbps=bw_mbps,
                     switch="programmable")
    row: dict = {"servers": 1 if servers is None else len(servers),
                 "hosts": leaves * hosts_per_leaf}
    with TestbedNet(topo, servers=servers) as net:
        row["setup_s"] = round(sum(net.timings.get(k, 0.0) for k in SETUP_KEYS), 3)
        row.update({k: round(net.timings[k], 3) for k in SETUP_KEYS if k in net.timings})
        row["mem_mib"] = net.server_memory()
        row["tunnels"] = net.tunnel_report()
        for algo in ("ina", "ring"):
            spec = CollectiveSpec(algo=algo, nbytes=1 << 20, timeout_s=30)
            (r,) = run_collective(net, spec)
            row[f"{algo}_time_s"] = round(r["time_s"], 4)
            row[f"{algo}_correct"] = r["correct"]
            row[f"{algo}_cpu_bound"] = r["cpu_bound"]
            row["tunnel_bound"] = r.get("tunnel_bound", False)
    row["teardown_s"] = round(net.timings["teardown_s"], 3)
    return row


def measure(emit, quick: bool, leaves: int, hosts_per_leaf: int, bw: float) -> Outcome:
    """``testbed bench cluster`` (:mod:`testbed.bench.protocol`): the anchor row (one
    machine) and the split row; ok when INA and ring were exact in both."""
    with NetnsServer(2) as srv:
        anchor = measure_split(leaves, hosts_per_leaf, bw)
        emit(anchor)
        split = measure_split(leaves, hosts_per_leaf, bw, servers=["localhost", srv.server])
    split["setup_vs_one_machine"] = round(split["setup_s"] / anchor["setup_s"], 2)
    emit(split)
    rows = [anchor, split]
    return Outcome(rows, ok=all(r["ina_correct"] and r["ring_correct"] for r in rows))
