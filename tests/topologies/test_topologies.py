"""Topologies, routing/model computations and the TestbedNet handle.

The first half needs no network (graph, validation, model). The ``mininet`` half builds real
networks under the emulation lock: every kind pings, a shaped link carries what was asked
(iperf3), an oversubscribed leaf-spine's uplink carries its derived rate, the programmable star
forwards, and teardown leaves nothing - also after an exception or Ctrl-C inside the ``with``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from testbed.testing import shaped_rate_mbps
from testbed.topologies import (
    AGGREGATOR_IP,
    TOPOLOGIES,
    Dumbbell,
    FatTree,
    Incast,
    LeafSpine,
    Star,
    TopologyError,
    make_topology,
    netem_available,
    routing,
)
from testbed.topologies import (
    TestbedTopo as BaseTopo,
)
from testbed.topologies.base import host_ip, host_mac

# ----- graph, naming, validation (no network) --------------------------------------------


@pytest.mark.parametrize("kind, params", [
    ("star", {"n_hosts": 5000}),
    ("leaf_spine", {"leaves": 1 << 40}),
    ("leaf_spine", {"hosts_per_leaf": 1 << 40}),
    ("leaf_spine", {"spines": 1 << 40, "bw_mbps": None}),  # no uplink rate refuses it first
    ("fat_tree", {"k": 1 << 20}),
])
def test_a_count_beyond_what_one_machine_emulates_is_refused_before_building(kind, params):
    """A mistyped count (found by the experiment-file fuzz test: 2**40 leaves) is refused at
    once, naming the limit, instead of building nodes until memory runs out."""
    with pytest.raises(TopologyError, match="at most 4096"):
        make_topology(kind, **params)


def test_star_naming_addresses_and_links():
    t = Star(3, bw_mbps=50)
    assert t.host_names == ["tbh1", "tbh2", "tbh3"]
    assert t.switch_roles == {"tbs1": "tor"}
    assert [t.nodeInfo(h)["ip"] for h in t.host_names] == ["10.0.0.1/8", "10.0.0.2/8",
                                                           "10.0.0.3/8"]
    assert t.nodeInfo("tbh3")["mac"] == "00:00:00:00:00:03"
    assert [(s.a, s.b, s.bw_mbps, s.role) for s in t.link_specs] == [
        ("tbh1", "tbs1", 50.0, "access"), ("tbh2", "tbs1", 50.0, "access"),
        ("tbh3", "tbs1", 50.0, "access")]
    json.dumps(t.describe())  # JSON-serialisable for results metadata


def test_host_addresses_skip_the_aggregator():
    ips = {host_ip(r) for r in range(600)}
    assert AGGREGATOR_IP not in ips and len(ips) == 600
    assert host_ip(252) == "10.0.0.253" and host_ip(253) == "10.0.1.0"
    assert host_mac(255) == "00:00:00:00:01:00"


def test_leaf_spine_structure_and_derived_uplink():
    t = LeafSpine(leaves=3, spines=2, hosts_per_leaf=4, bw_mbps=100, oversubscription=4.0)
    assert t.n_hosts == 12
    assert sorted(t.fabric_switches()) == ["tbl1", "tbl2", "tbl3", "tbsp1", "tbsp2"]
    uplinks = [s for s in t.link_specs if s.role == "uplink"]
    assert len(uplinks) == 6
    # 4 hosts x 100 Mb/s down, 2 uplinks: 400 / (2 x 4.0) = 50 Mb/s each
    assert {s.bw_mbps for s in uplinks} == {50.0}
    assert t.leaf_of("tbh5") == "tbl2"
    assert LeafSpine(2, 2, 2, uplink_mbps=7).uplink_mbps() == 7.0


@pytest.mark.parametrize("k", [2, 4, 6])
def test_fat_tree_counts(k):
    t = FatTree(k)
    h = k // 2
    roles = list(t.switch_roles.values())
    assert t.n_hosts == k ** 3 // 4
    assert roles.count("core") == h * h
    assert roles.count("agg") == roles.count("edge") == k * h
    # host links + edge-agg + agg-core: k^3/4 each
    assert len(t.link_specs) == 3 * k ** 3 // 4
    assert routing.has_loops(t) == (k >= 4)


def test_dumbbell_and_incast():
    d = Dumbbell(2, 3, bottleneck_mbps=10, bw_mbps=100)
    assert d.host_names == ["tbh1", "tbh2", "tbh3", "tbh4", "tbh5"]
    (bn,) = [s for s in d.link_specs if s.role == "bottleneck"]
    assert (bn.a, bn.b, bn.bw_mbps) == ("tbs1", "tbs2", 10.0)
    i = Incast(4, receiver_mbps=20)
    assert i.receiver == "tbh1" and i.n_hosts == 5
    assert i.link_specs[0].bw_mbps == 20.0 and i.link_specs[1].bw_mbps == 100.0


def test_smartnic_insertion():
    t = Star(3, smartnic=[0, 2], switch="programmable")
    assert t.nic_of == {"tbh1": "tbn1", "tbh3": "tbn3"}
    assert ("tbh1", "tbn1", "nic") in [(s.a, s.b, s.role) for s in t.link_specs]
    assert ("tbn1", "tbs1", "access") in [(s.a, s.b, s.role) for s in t.link_specs]
    assert t.programmable == {"tbs1", "tbn1", "tbn3"}
    assert routing.path_hops(t, "tbh1", "tbh2") == 3


def test_registry_builds_every_kind():
    params = {"star": {"n_hosts": 2}, "leaf_spine": {"leaves": 2}, "fat_tree": {"k": 2},
              "dumbbell": {"n_left": 1, "n_right": 1}, "incast": {"n_senders": 2}}
    assert set(params) == set(TOPOLOGIES)
    for kind, p in params.items():
        t = make_topology(kind, **p)
        assert t.kind == kind and t.n_hosts >= 2
        assert all(n.startswith("tb") for n in t.g.node)
    with pytest.raises(TopologyError, match="allowed: .*fat_tree.*leaf_spine"):
        make_topology("torus")
    with pytest.raises(TopologyError, match="bad parameters for 'star'.*n_hosts"):
        make_topology("star", hosts=3)


BAD = [
    ("star", {"n_hosts": 0}, "n_hosts must be an integer >= 1"),
    ("star", {"n_hosts": 2.5}, "n_hosts must be an integer"),
    ("fat_tree", {"k": 3}, "k must be even"),
    ("fat_tree", {"k": 0}, "k must be an integer >= 2"),
    ("star", {"n_hosts": 2, "bw_mbps": 0}, "bw_mbps must be > 0"),
    ("star", {"n_hosts": 2, "bw_mbps": -5}, "bw_mbps must be > 0"),
    ("star", {"n_hosts": 2, "bw_mbps": 1e9}, "bw_mbps must be <="),
    ("star", {"n_hosts": 2, "delay_ms": -1}, "delay_ms must be a number >= 0"),
    ("star", {"n_hosts": 2, "loss_pct": 100}, r"loss_pct must be a number in \[0, 100\)"),
    ("star", {"n_hosts": 2, "queue_ms": 0}, "queue_ms must be > 0"),
    ("star", {"n_hosts": 2, "queue_ms": "deep"}, "queue_ms must be a finite number"),
    ("leaf_spine", {"oversubscription": 0}, "oversubscription must be a finite number > 0"),
    ("leaf_spine", {"oversubscription": float("inf")}, "oversubscription must be a finite"),
    ("leaf_spine", {"oversubscription": 1e6}, "leaves .* Mb/s per uplink"),
    ("leaf_spine", {"spines": 0}, "spines must be an integer >= 1"),
    ("leaf_spine", {"uplink_mbps": 0}, "uplink_mbps must be a number in"),
    ("dumbbell", {"bottleneck_mbps": 0}, "bottleneck_mbps must be > 0"),
    ("incast", {"n_senders": 0}, "n_senders must be an integer >= 1"),
    ("star", {"n_hosts": 2, "switch": "ovs"}, "switch must be one of"),
    ("star", {"n_hosts": 2, "switch": {"tbs9"}}, r"switch names \['tbs9'\]"),
    ("star", {"n_hosts": 2, "smartnic": [5]}, "smartnic host ranks must be integers in 0..1"),
    ("star", {"n_hosts": 2, "smartnic": "yes"}, "smartnic must be False, True or a list"),
    ("star", {"n_hosts": 40, "switch": "programmable", "aggregator": "tbs1"},
     "at most 32 workers"),
    ("star", {"n_hosts": 2, "aggregator": "tbs1"}, "aggregator 'tbs1' is a Linux bridge"),
    ("star", {"n_hosts": 2, "switch": "programmable", "aggregator": "tbx"},
     "aggregator must be None, 'auto' or a switch name"),
    ("star", {"n_hosts": 2, "programs": ["forward"]}, "programs must be a dict"),
]


@pytest.mark.parametrize("kind,params,msg", BAD, ids=[f"{k}-{m[:24]}" for k, _, m in BAD])
def test_validation_errors_name_the_parameter(kind, params, msg):
    with pytest.raises(TopologyError, match=msg):
        make_topology(kind, **params)


def test_interface_name_too_long():
    class LongNames(BaseTopo):
        kind = "long"

        def planned_hosts(self):
            return 1

        def build_fabric(self):
            sw = self.add_switch("tbverylongname", "tor")
            self.add_host_at(sw)

    with pytest.raises(TopologyError, match="longer than 15 characters"):
        LongNames()


@pytest.mark.skipif(netem_available(), reason="netem present: impairments go on the links")
def test_impairments_without_netem_need_a_programmable_node():
    with pytest.raises(TopologyError, match="need netem .* or a programmable node"):
        Star(2, delay_ms=1)
    Star(2, delay_ms=1, switch="programmable")  # the switch's impair stage hosts them
    with pytest.raises(TopologyError, match="links \\[\\('tbh2', 'tbs2'\\)\\] have neither"):
        Dumbbell(1, 1, loss_pct=1, switch={"tbs1"})
    Dumbbell(1, 1, loss_pct=1, switch={"tbs1"}, smartnic=[1])


# ----- routing and the model ----------------------------------------------------------------


def test_forwarding_tables_have_ecmp_groups():
    t = LeafSpine(2, 2, 2, switch="programmable")
    tab = routing.forwarding_tables(t)
    # leaf 1: own hosts on their ports, remote hosts over both spines (ECMP)
    assert tab["tbl1"]["00:00:00:00:00:01"] == [1]
    assert tab["tbl1"]["00:00:00:00:00:03"] == [3, 4]
    # the aggregator MAC leads to spine 1 from the leaves, and is not forwarded at tbsp1
    assert tab["tbl1"]["02:54:42:00:00:fe"] == [3]
    assert "02:54:42:00:00:fe" not in tab["tbsp1"]
    ft = routing.forwarding_tables(FatTree(4))
    assert len(ft["tbe1"]["00:00:00:00:00:10"]) == 2  # edge -> both aggs of its pod
    assert len(ft["tba1"]["00:00:00:00:00:10"]) == 2  # agg -> both of its cores


def test_flood_tree_spans_all_nodes_without_cycles():
    t = FatTree(4)
    tree = routing.flood_tree(t)
    nodes = set(t.g.node)
    assert len(tree) == len(nodes) - 1
    assert set().union(*tree) == nodes


def test_bottleneck_model():
    d = Dumbbell(2, 2, bottleneck_mbps=10, bw_mbps=100)
    assert routing.bottleneck_mbps(d, d.host_names, "ring") == 10.0
    assert routing.bottleneck_mbps(d, d.host_names, "all_to_one") == 5.0  # 2 flows share it
    assert routing.bottleneck_mbps(d, ["tbh1", "tbh2"], "ring") == 100.0  # stays left
    ls = LeafSpine(2, 2, 2, bw_mbps=100, oversubscription=2.0, switch="programmable")
    assert ls.uplink_mbps() == 50.0
    # ring: one flow leaves each leaf, split over 2 uplinks of 50 -> 100 (access-bound)
    assert routing.bottleneck_mbps(ls, ls.host_names, "ring") == 100.0
    # ina: both hosts of leaf 2 send to spine 1 over the single 50 Mb/s uplink
    assert routing.bottleneck_mbps(ls, ls.host_names, "ina") == 25.0
    assert routing.bottleneck_mbps(Star(4, bw_mbps=None), ["tbh1", "tbh2"]) is None
    with pytest.raises(ValueError, match="pattern must be one of"):
        routing.bottleneck_mbps(d, d.host_names, "tree")


# ----- real networks ----------------------------------------------------------------------------

@pytest.fixture
def held_lock():
    """Hold the emulation lock for the whole test (TestbedNet re-enters it), so the
    "nothing left" checks after the network is gone cannot see another session's network."""
    from testbed.netlock import emulation_lock

    with emulation_lock():
        yield


def _our_root_ifaces(topo) -> list[str]:
    names = set(topo.switch_roles)
    for s in topo.link_specs:
        names.add(f"{s.a}-eth{s.port_a}")
        names.add(f"{s.b}-eth{s.port_b}")
    return sorted(names & set(os.listdir("/sys/class/net")))


def _pids_alive(pids) -> list[int]:
    alive = []
    for p in pids:
        try:
            os.kill(p, 0)
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(p)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


def _node_pids(net) -> list[int]:
    pids = [n.pid for n in net.mininet.hosts + net.mininet.switches if n.pid]
    pids += [n.engine.pid for n in net.mininet.switches if getattr(n, "engine", None)]
    return pids


def _assert_gone(topo, pids):
    deadline = time.monotonic() + 5
    while _pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_alive(pids) == []
    assert _our_root_ifaces(topo) == []
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    ours = set(topo.g.node)
    names = [re.split(r"[@\s]", ln, maxsplit=1)[0] for ln in out.splitlines()]
    assert [n for n in names if re.sub(r"-eth\d+$", "", n) in ours] == []


@pytest.mark.mininet
@pytest.mark.parametrize("kind,params", [
    ("star", {"n_hosts": 3}),
    ("leaf_spine", {"leaves": 2, "spines": 2, "hosts_per_leaf": 2}),
    ("fat_tree", {"k": 4}),
    ("dumbbell", {"n_left": 2, "n_right": 1, "bottleneck_mbps": 20}),
    ("incast", {"n_senders": 3}),
])
def test_every_kind_builds_pings_and_tears_down(kind, params, held_lock):
    from testbed.topologies import TestbedNet

    topo = make_topology(kind, **params)
    with TestbedNet(topo) as net:
        res = net.pingall(sample=3 if kind == "fat_tree" else None)
        assert res["failed"] == [] and res["pairs"] >= net.n
        assert [h.name for h in net.hosts] == topo.host_names
        assert net.hosts[1].IP() == net.host_ips[1] == "10.0.0.2"
        assert net.aggregator is None  # bridges only
        desc = net.describe()
        json.dumps(desc)
        assert desc["kind"] == kind
        assert desc["forwarding"] == ("static-fdb" if routing.has_loops(topo) else "learning")
        # measured once, whoever asks first: a replay's tenants ask from their threads at once
        with ThreadPoolExecutor(4) as pool:
            hops = list(pool.map(lambda _: net.hop_latency_s(), range(4)))
        assert hops[0] > 0 and len(set(hops)) == 1
        pids = _node_pids(net)
    _assert_gone(topo, pids)


def test_name_servers_are_made_unreachable_except_emulated_addresses(tmp_path):
    from testbed.topologies.net import resolver_blackhole_cmd

    conf = tmp_path / "resolv.conf"
    conf.write_text("# a cloud VM's\nsearch example\nnameserver 10.255.255.53\n"
                    "nameserver 127.0.0.53\nnameserver ::1\n nameserver 10.0.0.2 \n"
                    "nameserver 10.255.255.53\noptions timeout:5\n")
    assert resolver_blackhole_cmd({"10.0.0.2"}, str(conf)) == \
        "ip route replace unreachable 10.255.255.53/32"
    conf.write_text("nameserver 127.0.0.53\n")
    assert resolver_blackhole_cmd(set(), str(conf)) == ""
    assert resolver_blackhole_cmd(set(), str(tmp_path / "missing")) == ""


@pytest.mark.mininet
def test_peer_name_lookups_in_a_host_fail_at_once(held_lock):
    """gloo and torch look their peers' names up, one lookup per connection: a host must not
    send those queries into the emulated network, where a 10.x name server never answers
    (each lookup waited 6 s, a launched job's rendezvous 7-9 s)."""
    from testbed.topologies import TestbedNet
    from testbed.topologies.net import resolver_blackhole_cmd

    servers = re.findall(r"unreachable (\S+)/32", resolver_blackhole_cmd())
    with TestbedNet(Star(2, bw_mbps=100)) as net:
        h1 = net.hosts[0]
        for ip in servers:
            assert h1.cmd(f"ip route show {ip}").split() == ["unreachable", ip]
        t0 = time.monotonic()
        h1.cmd(f"getent hosts {net.host_ips[1]}")
        took = time.monotonic() - t0
    assert took < 4.0, f"a reverse lookup in an emulated host took {took:.1f} s"


@pytest.mark.mininet
def test_shaped_access_link_rate_is_what_was_asked(held_lock):
    from testbed.topologies import TestbedNet

    # with a sized shaping queue: 50 ms at 20 Mb/s is a 125 000 B bfifo under the HTB class
    with TestbedNet(Star(2, bw_mbps=20, queue_ms=50)) as net:
        h1, h2 = net.hosts
        got = shaped_rate_mbps(h1, h2, net.host_ips[1], 18.0)
        assert net.bottleneck_bps() == 20e6
        qdisc = h1.cmd(f"tc qdisc show dev {h1.defaultIntf().name}")
        assert "bfifo 20: parent 5:1 limit 125000b" in qdisc, qdisc
        assert net.topo.describe()["params"]["queue_ms"] == 50
    assert 18.0 <= got <= 22.0, got  # +-10 %


@pytest.mark.mininet
def test_oversubscribed_leaf_spine_uplink_rate(held_lock):
    from testbed.topologies import TestbedNet

    # 2 hosts x 40 Mb/s per leaf, 1 spine, 4:1 -> 20 Mb/s uplink
    topo = LeafSpine(2, 1, 2, bw_mbps=40, oversubscription=4.0)
    assert topo.uplink_mbps() == 20.0
    with TestbedNet(topo) as net:
        h1, h3 = net.hosts[0], net.hosts[2]
        cross = shaped_rate_mbps(h1, h3, net.host_ips[2], 18.0)
        assert net.bottleneck_bps([0, 2]) == 20e6
    assert 18.0 <= cross <= 22.0, cross


@pytest.mark.mininet
def test_programmable_star_forwards_and_has_the_aggregator(held_lock):
    pytest.importorskip("testbed.datapath.nodes")
    from testbed.topologies import TestbedNet

    topo = Star(3, switch="programmable", bw_mbps=20)
    with TestbedNet(topo) as net:
        assert net.forwarding_mode == "datapath"
        # the engine shapes the switch's ports itself (its 'shape' stage), not the kernel
        got = shaped_rate_mbps(net.hosts[0], net.hosts[1], net.host_ips[1], 18.0)
        assert 18.0 <= got <= 22.0, got
        assert " htb " not in subprocess.run(["tc", "qdisc", "show", "dev", "tbs1-eth2"],
                                             capture_output=True, text=True).stdout
        assert net.aggregator == {"ip": "10.0.0.254", "mac": "02:54:42:00:00:fe",
                                  "switch": "tbs1"}
        assert net.pingall()["failed"] == []
        c = net.counters()["datapath"]["tbs1"]
        assert set(c["stages"]) == {"aggregate", "forward", "shape"}
        assert c["stages"]["shape"]["totals"]["passed"] + \
            c["stages"]["shape"]["totals"]["enqueued"] > 0
        assert c["stages"]["forward"]["unicast"] > 0
        assert net.switch_client("tbs1").request("ping") == "pong"
        with pytest.raises(KeyError, match="not a programmable node"):
            net.switch_client("tbh1")
        pids = _node_pids(net)
    assert net.final_counters["tbs1"]["stages"]["forward"]["unicast"] > 0
    _assert_gone(topo, pids)


class Boom(Exception):
    pass


@pytest.mark.mininet
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_exception_inside_with_still_tears_down(exc):
    from testbed.netlock import LOCK_PATH, emulation_lock
    from testbed.topologies import TestbedNet

    topo = LeafSpine(2, 2, 1)
    net = TestbedNet(topo)
    with pytest.raises(exc):
        with net:
            pids = _node_pids(net)
            assert _our_root_ifaces(topo)
            raise exc("inside the with")
    # TestbedNet released the lock: taken back here at once unless another session grabbed it
    with emulation_lock(path=LOCK_PATH):
        _assert_gone(topo, pids)
    assert net._lock_cm is None and net.timings["teardown_s"] > 0


@pytest.mark.mininet
def test_failed_start_tears_down_and_names_the_problem(held_lock):
    from testbed.topologies import TestbedNet

    topo = Star(2)
    net = TestbedNet(topo)
    net._configure_hosts = lambda: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        with net:
            pass
    _assert_gone(topo, [n.pid for n in net.mininet.hosts + net.mininet.switches])


@pytest.mark.mininet
def test_programmable_leaf_spine_ecmp_smartnic_and_mixed_bridges(held_lock):
    pytest.importorskip("testbed.datapath.nodes")
    from testbed.topologies import TestbedNet

    # spines run the data path, leaves are bridges with static FDBs; host 0 has a SmartNIC
    topo = LeafSpine(2, 2, 2, switch={"tbsp1", "tbsp2"}, smartnic=[0])
    with TestbedNet(topo) as net:
        assert net.forwarding_mode == "datapath+static-fdb"
        assert net.aggregator["switch"] == "tbsp1"
        assert net.pingall()["failed"] == []
        dp = net.counters()["datapath"]
        assert set(dp) == {"tbsp1", "tbsp2", "tbn1"}
        assert dp["tbn1"]["stages"]["wire"]
        # the leaves spread destinations over both spines (static ECMP member per MAC)
        assert all(dp[s]["stages"]["forward"]["unicast"] > 0 for s in ("tbsp1", "tbsp2"))
        pids = _node_pids(net)
    _assert_gone(topo, pids)


@pytest.mark.mininet
@pytest.mark.skipif(netem_available(), reason="netem present: delay goes on the links")
def test_delay_without_netem_runs_in_the_datapath_impair_stages(held_lock):
    pytest.importorskip("testbed.datapath.nodes")
    from testbed.topologies import TestbedNet

    topo = Star(2, switch="programmable", delay_ms=5)
    with TestbedNet(topo) as net:
        stages = net.counters()["datapath"]["tbs1"]["stages"]
        assert list(stages) == ["impair_ingress", "aggregate", "forward", "impair", "shape"]
        assert net.describe()["impairments"] == "datapath"
        out = net.hosts[0].cmd(f"ping -c 10 -i 0.05 -q {net.host_ips[1]}")
        rtt_min, rtt_avg = map(float, re.search(r"= ([\d.]+)/([\d.]+)/", out).groups())
    # h1 -> s1 -> h2 -> s1 -> h1: four impaired link traversals of 5 ms each; the fastest
    # round trip (a busy machine delays single pings: the average ranged 21-36 ms) holds
    # the delay and little else
    assert 20.0 <= rtt_min <= 20.0 * 1.5, (rtt_min, rtt_avg)


def test_program_overrides_and_the_aggregate_stage():
    pytest.importorskip("testbed.datapath.nodes")
    from testbed.topologies import TestbedNet

    def names(net):
        return {n: [p for p, _ in progs] for n, progs in net.programs_plan().items()}

    ls = TestbedNet(LeafSpine(2, 2, 1, switch="programmable",
                              programs={"switch": ["aggregate", "forward"]}))
    # every programmable switch aggregates (any can be in a job's tree), each as itself
    assert names(ls) == {s: ["aggregate", "forward", "shape"]
                         for s in ("tbl1", "tbl2", "tbsp1", "tbsp2")}
    idents = {n: (dict(p)["aggregate"]["agg_ip"], dict(p)["aggregate"]["agg_mac"])
              for n, p in ls.programs_plan().items()}
    assert idents["tbsp1"] == ("10.0.0.254", "02:54:42:00:00:fe")  # the classic aggregator
    assert len(set(idents.values())) == 4
    fwd = dict(ls.programs_plan()["tbl1"])["forward"]
    assert fwd["learn"] is False and fwd["l2"]["00:00:00:00:00:02"] == ["tbl1-eth2", "tbl1-eth3"]
    star = TestbedNet(Star(2, switch="programmable", smartnic=True,
                           programs={"tbs1": ["forward", ("trim", {})], "smartnic": ["wire"]}))
    assert names(star) == {"tbs1": ["aggregate", "forward", "trim"], "tbn1": ["wire", "shape"],
                           "tbn2": ["wire", "shape"]}
    with pytest.raises(TopologyError, match=r"programs\['tbs1'\]"):
        TestbedNet(Star(2, switch="programmable", programs={"tbs1": [42]}))
    if not netem_available():
        with pytest.raises(TopologyError, match="has its own 'impair' stage"):
            TestbedNet(Star(2, switch="programmable", delay_ms=1,
                            programs={"tbs1": ["forward", "impair"]}))
        imp = TestbedNet(Star(2, switch="programmable", loss_pct=10, smartnic=[0]))
        plan = imp.programs_plan()
        # tbs1-tbn1: both ends programmable, each impairs its egress; tbh2-tbs1: tbs1 both ways
        eg = dict(plan["tbs1"])["impair"]["loss"]
        assert eg == {"tbs1-eth1": 0.1, "tbs1-eth2": 0.1}
        ing = plan["tbs1"][0][1]["loss"]
        assert ing == {"tbs1-eth1": 0.0, "tbs1-eth2": 0.1}


@pytest.mark.mininet
def test_sigterm_tears_down(tmp_path):
    """A process killed with SIGTERM inside the ``with`` still removes its network."""
    import signal
    import sys

    from testbed.netlock import emulation_lock

    script = tmp_path / "net.py"
    script.write_text(
        "import time\n"
        "from testbed.topologies import Star, TestbedNet\n"
        "with TestbedNet(Star(2)) as net:\n"
        "    print('UP', *[n.pid for n in net.mininet.hosts + net.mininet.switches],"
        " flush=True)\n"
        "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("UP"), line
        pids = [int(p) for p in line.split()[1:]]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # the test failed early: still let it tear down
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode != 0  # it was interrupted, not finished
    with emulation_lock():
        _assert_gone(Star(2), pids)
