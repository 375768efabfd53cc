"""``TestbedNet``: build, start, configure and tear down an emulated network.

Usage::

    from testbed.topologies import Star, TestbedNet
    with TestbedNet(Star(4, bw_mbps=100)) as net:
        net.pingall()
        h1, h2 = net.hosts[:2]
        print(h1.cmd("ping -c1", net.host_ips[1]))

Holding the machine-wide emulation lock for its whole life, the handle builds the Mininet
network (no controller, TCLink shaping, Linux bridges or the data path's programmable nodes),
then:

* turns off checksum/segmentation offloads on every veth (frames a userspace data path reads
  must carry real checksums and be at most one MTU), and IPv6 (no ND/MLD chatter in the
  measurements);
* installs static ARP entries on every host (all hosts + the aggregator 10.0.0.254), so no
  ARP broadcast is ever needed and the first packet of a run is not delayed;
* computes shortest-path forwarding with ECMP groups from the topology
  (:mod:`testbed.topologies.routing`) and pushes it to the programmable nodes; Linux bridges
  in a *looped* fabric (leaf-spine with >1 spine, fat-tree k>=4) get the same tables as
  static FDB entries (one ECMP member per destination MAC, chosen by hash), learning off, and
  flooding confined to a BFS spanning tree - so no STP and no 30 s convergence wait;
  loop-free bridge fabrics stay plain learning bridges;
* starts every programmable node with the pipeline :mod:`testbed.topologies.pipeline` composes
  from the topology and the optional :class:`~testbed.topologies.pipeline.DatapathOptions`
  (impairments, trimming, SmartNIC codec), and configures the aggregator on the chosen
  programmable switch.

**Time dilation** (``time_dilation=f``, time-warped emulation after Gupta et al., NSDI'06):
every link is shaped to ``bw_mbps / f``, every configured delay and jitter (netem, or the data
path's ``impair`` stages) is multiplied by f, every ``trim`` queue drains at its rate / f
(:func:`testbed.topologies.pipeline.dilate`) and the engines' interrupt-coalescing wait is
times f (so a dilated engine batches as many packets per wake-up), and so is every host's minimum
TCP retransmission timeout (:data:`TCP_RTO_MIN_US`). The network then carries the same packets f
times slower, so the emulator needs 1/f of the CPU per emulated second; whoever measures time
on it divides by f (``run_collective`` does). The topology, :meth:`TestbedNet.bottleneck_bps`
and :meth:`TestbedNet.programs_plan` keep describing the undilated network (what the model and
the reports speak of); :meth:`TestbedNet.hop_latency_s` is measured, so it is dilated wall
time. ``time_dilation="auto"`` starts at 1 and leaves the factor to a calibration
(:func:`testbed.collectives.dilation.calibrate`, which ``run_collective`` runs on first use);
:meth:`TestbedNet.set_time_dilation` changes the factor of a running network.

Leaving the ``with`` block - normally, by an exception, by KeyboardInterrupt or SIGTERM -
stops everything and removes every interface named after our nodes.

**Watchers** (:func:`watch_networks`): whoever wants to follow the networks of this process
(the notebooks' live fabric view, :mod:`testbed.experiment.live`) is told when each one is up
and when it is about to go down, whoever built it (an experiment, a launched script, a
replay); the builders need no option for it.

Why one module this long: :class:`TestbedNet` is the one way a network is built (demo, benches,
tests and experiments alike); its set-up, shaping checks, data-path programs and teardown belong
to that one owner.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from mininet.link import Link, TCIntf
from mininet.log import lg
from mininet.net import Mininet
from mininet.nodelib import LinuxBridge

from testbed import warm
from testbed.cleanup import cleanup, leftovers, remove_job_dirs, temp_dir
from testbed.datapath import forks
from testbed.datapath.control import RUN_DIR, DatapathClient
from testbed.datapath.engine import DEFAULT_COALESCE_US, MAX_COALESCE_US, rx_ring_frames
from testbed.datapath.nodes import ProgrammableSwitch, SharedEngine, SmartNIC
from testbed.netlock import emulation_lock, is_held

from . import cluster, routing
from .base import (
    AGGREGATOR_IP,
    AGGREGATOR_MAC,
    IMPAIR_STAGES,
    MAX_BW_MBPS,
    TCP_RTO_MIN_US,
    TestbedTopo,
    TopologyError,
    aggregating_switches,
    host_ip,
    host_mac,
    netem_available,
    switch_identity,
)
from .pipeline import (
    DILATED_RATES,
    DILATED_TIMES,
    FULL_FRAME_BYTES,
    QUEUE_STAGES,
    DatapathOptions,
    check_time_dilation,
    compose,
    dilate,
    dilate_settings,
    engine_shaped_ports,
    queue_bytes,
)
from .routes import FabricRoutes

#: ``(up, down)`` of every :func:`watch_networks` block now open, and the networks now up
_WATCHERS: list[tuple] = []
_UP: list[TestbedNet] = []
_WATCH_LOCK = threading.Lock()
#: Held while a network measures its hop latency (once, through its first host's shell).


@contextlib.contextmanager
def watch_networks(up, down=None):
    """While the block runs, call ``up(net)`` for every :class:`TestbedNet` of this process
    once it has started (at once for those up already), and ``down(net)`` just before it is
    torn down, in the thread that starts or stops it. A watcher that raises is reported on
    stderr; it never stops a network from starting or from being torn down."""
    with _WATCH_LOCK:
        _WATCHERS.append((up, down))
        running = list(_UP)
    try:
        for net in running:
            _tell(up, net)
        yield
    finally:
        with _WATCH_LOCK:
            _WATCHERS.remove((up, down))


def _tell(fn, net: TestbedNet) -> None:
    if fn is None:
        return
    try:
        fn(net)
    except Exception as e:  # noqa: BLE001 - a watcher never breaks the network
        print(f"testbed: network watcher {fn!r} failed: {type(e).__name__}: {e}",
              file=sys.stderr)


def _announce(net: TestbedNet, is_up: bool) -> None:
    """Tell the watchers that ``net`` is up (``is_up``) or about to go down."""
    with _WATCH_LOCK:
        if is_up:
            _UP.append(net)
        elif net in _UP:
            _UP.remove(net)
        else:
            return  # never announced up (it failed while starting)
        watchers = list(_WATCHERS)
    for up, down in watchers:
        _tell(up if is_up else down, net)


class TBIntf(TCIntf):
    """TCIntf whose bandwidth guard allows the testbed's range (Mininet stops at 1 Gb/s) and
    whose shaping queue can be sized (``queue_bytes``)."""

    bwParamMax = MAX_BW_MBPS

    def config(self, queue_bytes=None, **params):
        """Mininet's configuration, then the shaping queue: ``queue_bytes`` (None: the
        kernel's default) becomes a ``bfifo`` under the HTB class, or netem's limit in
        full-size frames where netem shapes delay or loss (netem has no byte limit)."""
        netem = bool(params.get("delay") or params.get("loss"))
        if queue_bytes is not None and netem:
            params["max_queue_size"] = max(1, -(-int(queue_bytes) // FULL_FRAME_BYTES))
        result = super().config(**params)
        if queue_bytes is not None and params.get("bw") is not None and not netem:
            out = self.tc(f"%s qdisc add dev %s parent 5:1 handle 20: bfifo limit "
                          f"{int(queue_bytes)}")
            if "rror" in out:
                raise RuntimeError(f"sizing the shaping queue of {self.name} failed: "
                                   f"{out.strip()} (queue_ms of the topology)")
        return result


#: device groups (``ip link set ... group``) a network's links are deleted by at teardown:
#: this plus the owner's pid modulo 65536 (two networks never tear down under one pid at once)
DEVICE_GROUP_BASE = 0x74620000


class TBLink(Link):
    """Link with :class:`TBIntf` on both ends (HTB shaping, optional netem)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("cls1", TBIntf)
        kwargs.setdefault("cls2", TBIntf)
        Link.__init__(self, *args, **kwargs)

    #: its devices were deleted with the network's others (:meth:`TestbedNet._delete_links`)
    gone = False

    def delete(self):
        """Delete the link (Mininet's stop), unless the network already deleted its devices:
        then only forget its interfaces."""
        if not self.gone:
            Link.delete(self)
            return
        for intf in (self.intf1, self.intf2):
            intf.node.delIntf(intf)
            intf.link = None
        self.intf1 = self.intf2 = None


class TBBridge(LinuxBridge):
    """Linux bridge that is fully configured *before* it goes up.

    IPv6 is turned off on the bridge and its ports, and ``port_setup`` (``bridge -batch``
    lines: learning/flood flags, static FDB entries) is applied while the bridge is still
    down - in a looped fabric, a bridge that came up flooding would start a broadcast storm
    (the first IPv6 router solicitation is enough) before we could restrict it.
    """

    def __init__(self, name, port_setup=(), **kwargs):
        self.port_setup = list(port_setup)
        super().__init__(name, **kwargs)

    def start(self, _controllers):
        """Create the bridge, attach and configure its ports, then bring it up."""
        self.cmd("ip link del", self, "2>/dev/null")
        self.cmd("ip link add", self, "type bridge")
        ports = [i.name for i in self.intfList() if self.name in i.name]
        remote = getattr(self, "put_file", None)
        if remote is not None:  # on a cluster server: its own /proc, through its shell
            self.cmd("sysctl -qw", *[f"net.ipv6.conf.{d}.disable_ipv6=1"
                                     for d in [self.name, *ports]])
        for dev in [self.name, *ports] if remote is None else []:
            with contextlib.suppress(OSError):
                with open(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6", "w") as f:
                    f.write("1")
        for dev in ports:
            self.cmd("ip link set", dev, "master", self)
        self.apply_setup(self.port_setup)
        self.cmd("ip link set", self, "up")

    def apply_setup(self, lines: list[str]) -> None:
        """Run ``bridge -batch`` lines on this bridge (at start, and when routes change)."""
        if not lines:
            return
        self.port_setup = list(lines)
        remote = getattr(self, "put_file", None)
        fd, path = tempfile.mkstemp(prefix="tb-br-", suffix=".batch")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        if remote is not None:
            remote(path, "\n".join(lines) + "\n")
        try:
            out = self.cmd("bridge -batch", path)
        finally:
            os.unlink(path)
        if out.strip():
            raise RuntimeError(f"configuring bridge {self.name} failed: {out.strip()}")

    def stop(self, deleteIntfs=True):  # noqa: N803 - Mininet's signature
        """Delete the bridge (and, by default, its interfaces)."""
        self.cmd("ip link del", self, "2>/dev/null")
        super(LinuxBridge, self).stop(deleteIntfs)


class TBTunnelLink(cluster.TunnelMixin, TBLink):
    """A link between two servers of a cluster network: VXLAN ends, HTB shaping."""

    delete = Link.delete  # two devices, one on each server: each end deleted


RemoteTBBridge = cluster.remote_bridge(TBBridge)
_REMOTE_CLASSES = {ProgrammableSwitch: cluster.RemoteProgrammableSwitch,
                   SmartNIC: cluster.RemoteSmartNIC, TBBridge: RemoteTBBridge}


@contextlib.contextmanager
def _quiet_mininet():
    old = lg.getEffectiveLevel()
    lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        lg.setLevel(old)


def _serialize_cmd(node) -> None:
    """Wrap ``node.cmd`` in a per-node lock (a Mininet shell serves one command at a time)."""
    if getattr(node, "_tb_cmd_lock", None) is not None:
        return
    lock = threading.Lock()
    plain = node.cmd

    def cmd(*args, **kwargs):
        with lock:
            return plain(*args, **kwargs)

    node._tb_cmd_lock = lock
    node.cmd = cmd


def _nonzero(v) -> bool:
    """Whether a stage setting (a number or a dict per port) is anything but zeros."""
    if isinstance(v, dict):
        return any(_nonzero(x) for x in v.values())
    return isinstance(v, int | float) and not isinstance(v, bool) and v != 0


def tcp_rto_min_cmd(intf: str, factor: float, per_netns: bool | None = None) -> str:
    """Shell command that sets a host's minimum TCP retransmission timeout to
    ``TCP_RTO_MIN_US x factor``: the per-namespace sysctl ``net.ipv4.tcp_rto_min_us`` (Linux
    6.11+), else the ``rto_min`` metric of every IPv4 route through ``intf`` (any kernel; only
    those routes). ``per_netns``: force one way (None: whichever the host's kernel has)."""
    us = int(round(TCP_RTO_MIN_US * factor))
    knob = "/proc/sys/net/ipv4/tcp_rto_min_us"
    sysctl = f"echo {us} > {knob}"
    routes = (f"ip -4 -o route show dev {intf} | sed 's/ rto_min lock [^ ]*//' | "
              f"while read -r r; do ip route replace $r dev {intf} rto_min {us // 1000}ms; done")
    if per_netns is None:
        return f"if [ -w {knob} ]; then {sysctl}; else {routes}; fi"
    return sysctl if per_netns else routes


def resolver_blackhole_cmd(keep: set[str] = frozenset(),
                           resolv_conf: str = "/etc/resolv.conf") -> str:
    """``ip route`` commands that make every IPv4 name server of ``resolv_conf`` unreachable
    from an emulated host: a server inside the emulated addresses (a cloud VM's 10.x
    resolver) would otherwise swallow the host's queries, and every name lookup there (gloo's
    and torch's reverse lookups of their peers, one per connection) would wait out the
    resolver's timeouts, 6 s each, instead of failing at once. An address in ``keep`` (an
    emulated node's, which answers a query with a refusal at once) keeps its route; '' when
    there is none left."""
    try:
        with open(resolv_conf) as f:
            text = f.read()
    except OSError:
        return ""
    servers = re.findall(r"^\s*nameserver\s+(\d{1,3}(?:\.\d{1,3}){3})\s*$", text, re.M)
    return "; ".join(f"ip route replace unreachable {ip}/32" for ip in dict.fromkeys(servers)
                     if not ip.startswith("127.") and ip not in keep)


def _clear_leftovers() -> None:
    """Remove what a dead earlier network left (its owner and guardian both died), saying so.

    Called holding the emulation lock: whatever of ours exists then belongs to no live run.
    Files are left to ``testbed cleanup``: they do not get in a new network's way, and an
    engine's kept log is what its user reads next."""
    left = {k: v for k, v in leftovers().items() if v and k != "files"}
    if not left:
        return
    what = ", ".join(f"{len(v)} {k}" for k, v in left.items())
    print(f"testbed: a previous run left {what} behind (its process died without tearing "
          "its network down); removing them", file=sys.stderr, flush=True)
    result = cleanup(force=True, files=False)
    if result["errors"]:
        raise TopologyError(f"could not remove a previous run's leftovers: {result['errors']}; "
                            "run 'testbed cleanup' and check what it reports")


def _root_ifaces() -> set[str]:
    return set(os.listdir("/sys/class/net"))


class TestbedNet(FabricRoutes):
    """A running emulated network for ``topo`` (a context manager; see the module docstring).

    Options: ``lock_timeout`` (s to wait for the emulation lock), ``offloads_off`` (True),
    ``static_arp`` (True), ``check_ping`` (False: run :meth:`pingall` at start and raise if
    any pair fails), ``engine_opts`` (dict passed to every programmable node), ``datapath``
    (:class:`~testbed.topologies.pipeline.DatapathOptions`: what the programmable nodes run
    beyond the topology's own pipelines), ``switch_nodes`` (switch name -> Mininet node
    parameters with ``cls``, replacing the Linux bridge of a switch that runs no data path,
    e.g. ``{"tbs1": {"cls": OVSSwitch, "datapath": "user"}}``; loop-free fabrics only, since
    looped ones rely on the bridges' static forwarding entries), ``time_dilation`` (a factor
    from 1 to 64, or ``"auto"``; see the module docstring), ``servers`` (a cluster network:
    ``["localhost", "host2", ...]`` or :class:`~testbed.topologies.cluster.Server` records;
    nodes are spread over them and links between servers become VXLAN tunnels, see
    :mod:`testbed.topologies.cluster` and docs/cluster.md), ``placement`` (with ``servers``:
    node -> server name that overrides the default placement), ``engine_groups`` (None: an
    engine process per programmable node; n: n processes, each serving a group of nodes
    that :func:`~testbed.topologies.routing.partition` keeps linked, with the links inside
    a group carried in memory, see :mod:`testbed.datapath.group`: a multi-switch fabric then
    costs the machine less CPU per packet, but a group's nodes die and stop together, cannot
    be restarted one by one, and its memory links cannot be failed).
    """

    def __init__(self, topo: TestbedTopo, *, lock_timeout: float = 600.0,
                 offloads_off: bool = True, static_arp: bool = True, check_ping: bool = False,
                 engine_opts: dict | None = None, datapath: DatapathOptions | None = None,
                 switch_nodes: dict[str, dict] | None = None,
                 time_dilation: float | str = 1.0, servers=None, placement=None,
                 engine_groups: int | None = None):
        if not isinstance(topo, TestbedTopo):
            raise TopologyError(
                f"topo must be a testbed topology (Star, LeafSpine, FatTree, Dumbbell, Incast "
                f"or make_topology(...)), got {type(topo).__name__}")
        self.topo = topo
        self.lock_timeout = lock_timeout
        self.offloads_off = offloads_off
        self.static_arp = static_arp
        self.check_ping = check_ping
        self.engine_opts = dict(engine_opts or {})
        if datapath is not None and not isinstance(datapath, DatapathOptions):
            raise TopologyError(f"datapath must be a DatapathOptions record, got "
                                f"{type(datapath).__name__}")
        self.datapath = datapath or DatapathOptions()
        self.switch_nodes = {k: dict(v) for k, v in (switch_nodes or {}).items()}
        requested = check_time_dilation(time_dilation)
        #: what was asked for: a factor, or "auto" (calibrated on first use)
        self.time_dilation_requested = requested
        #: the factor in effect (1.0 while "auto" waits for its calibration)
        self.time_dilation = 1.0 if requested == "auto" else requested
        #: the calibration that chose the factor (set by whoever calibrated), else None
        self.calibration = None
        self.mininet: Mininet | None = None
        self.timings: dict[str, float] = {}
        self._lock_cm = None
        self._tmpdir: str | None = None
        self._clients: dict = {}
        self._hop_latency: float | None = None
        self._old_sigterm = None
        self._preexisting: set[str] = set()
        self.forwarding_mode = "none"
        #: node -> the engine's final counters, filled at teardown
        self.final_counters: dict = {}
        self._tables = routing.forwarding_tables(topo)
        self._tree = routing.flood_tree(topo) if routing.has_loops(topo) else None
        #: links that have failed (link_down), as {a, b} pairs: the routes avoid them
        self._links_down: set[frozenset[str]] = set()
        #: interface name -> when (monotonic) its link failed, for every link down now
        self.down_interfaces: dict[str, float] = {}
        #: held while an engine is restarted (jobs sharing the network see one death at once)
        self.engine_lock = threading.RLock()
        #: node -> how many times its engine was restarted (a job's registration on it is
        #: gone once this changes)
        self.engine_starts: dict[str, int] = {}
        #: the fork server of this network's engines while it runs (None: each engine is
        #: started as a process of its own)
        self.engine_server: forks.EngineServer | None = None
        #: helper processes kept while the network runs (:meth:`keep`), by name
        self._kept: dict[str, object] = {}
        self._kept_lock = threading.Lock()
        self._check_switch_nodes()
        # bad overrides and options fail here, before anything is built
        self._engine_shaped = engine_shaped_ports(topo, self.programs_plan())
        #: cluster networks: the servers, node -> server name, the links that are tunnels
        self.servers = cluster.parse_servers(servers) if servers is not None else None
        if placement is not None and servers is None:
            raise TopologyError("placement needs servers=[...] (a cluster network)")
        self.placement = (cluster.place(topo, self.servers, placement)
                          if self.servers is not None else None)
        if self.servers is not None and self.switch_nodes:
            raise TopologyError("switch_nodes cannot be combined with servers (replacement "
                                "switch classes do not run on remote servers)")
        #: server name -> ssh connection (remote servers of a running cluster network)
        self.connections: dict[str, cluster.Connection] = {}
        self._server_locks: list[cluster.ServerLock] = []
        #: per tunnelled server pair: measured underlay rate/latency, the emulated rate the
        #: tunnels carry, and whether the underlay is slower (``tunnel_bound``)
        self.tunnels: list[dict] = []
        #: the programmable nodes each engine process serves (engine_groups; none by
        #: default), and per group the links it carries in memory (interface pairs)
        self.engine_groups, self._group_links = self._plan_engine_groups(engine_groups)
        self._group_of = {x: i for i, g in enumerate(self.engine_groups) for x in g}

    @property
    def memory_links(self) -> list[tuple[str, str]]:
        """The links engine groups carry in memory (interface pairs)."""
        return [link for links in self._group_links for link in links]

    def _plan_engine_groups(self, n: int | None) -> tuple[list[list[str]],
                                                         list[list[tuple[str, str]]]]:
        """The engine groups of ``engine_groups=n`` (see the class docstring) and, per
        group, the links it carries in memory; TopologyError for what a group cannot
        carry."""
        if n is None:
            return [], []
        nodes = sorted(self.topo.programmable)
        if not nodes:
            raise TopologyError("engine_groups: this topology has no programmable nodes "
                                "(build it with switch='programmable')")
        try:
            groups = routing.partition(self.topo, nodes, n)
        except ValueError as e:
            raise TopologyError(f"engine_groups: {e}") from None
        if self.servers is not None:
            raise TopologyError("engine_groups cannot be combined with servers: a group's "
                                "nodes share one process on one server")
        if self.engine_opts.get("io", "ring") != "ring":
            raise TopologyError("engine_groups need the engines' PACKET_MMAP rings "
                                "(engine_opts io='ring'), got io="
                                f"{self.engine_opts['io']!r}")
        group_of = {x: i for i, g in enumerate(groups) for x in g}
        links: list[list[tuple[str, str]]] = [[] for _ in groups]
        for spec in self.topo.link_specs:
            if group_of.get(spec.a, -1) != group_of.get(spec.b, -2):
                continue
            ends = (self._intf_name(spec.a, spec.port_a), self._intf_name(spec.b, spec.port_b))
            unshaped = [e for e in ends if e not in self._engine_shaped]
            if spec.bw_mbps is not None and unshaped:
                raise TopologyError(
                    f"engine_groups: link {spec.a}-{spec.b} is shaped by the kernel's HTB on "
                    f"{unshaped}, which a link carried in memory never crosses; shape in the "
                    "engines (DatapathOptions(shape_in_engine=True), the default)")
            links[group_of[spec.a]].append(ends)
        return groups, links

    # ----- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> TestbedNet:
        t0 = time.monotonic()
        nested = is_held()  # this process's own nodes already run (a netns server's, ...)
        self._lock_cm = emulation_lock(timeout=self.lock_timeout)
        self._lock_cm.__enter__()
        self.timings["lock_wait_s"] = time.monotonic() - t0
        try:
            self._install_sigterm()
            if not nested:
                _clear_leftovers()
            self._start()
            _announce(self, True)
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._teardown()

    def _install_sigterm(self) -> None:
        # SIGTERM (e.g. a test timeout, `kill`) must tear down like Ctrl-C does.
        if threading.current_thread() is not threading.main_thread():
            return

        def _on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        self._old_sigterm = signal.signal(signal.SIGTERM, _on_term)

    def _start(self) -> None:
        topo = self.topo
        t = time.monotonic()
        if self.servers is not None:
            self._start_cluster()
            self.timings["cluster_s"] = time.monotonic() - t
            t = time.monotonic()
        self._assign_classes()
        self._assign_link_params()
        self._preexisting = _root_ifaces()
        clash = [n for n in self._our_names() if n in self._preexisting]
        if clash:
            raise TopologyError(
                f"interfaces {sorted(clash)[:5]} already exist: a previous network was not "
                "cleaned up; run 'testbed cleanup'")
        self.mininet = Mininet(topo=topo, switch=LinuxBridge, link=TBLink, controller=None,
                               autoSetMacs=False, build=False, waitConnected=False)
        # Mininet prints harmless tc/bridge-nf warnings as errors; shaping is verified below.
        with _quiet_mininet():
            self.mininet.build()
            self.timings["build_s"] = time.monotonic() - t
            t = time.monotonic()
            self._start_switches()
        self.timings["start_s"] = time.monotonic() - t
        t = time.monotonic()
        self._tmpdir = temp_dir("net")
        self._configure_hosts()
        self._configure_root_ifaces()
        self._configure_forwarding()
        self.timings["configure_s"] = time.monotonic() - t
        if self.check_ping:
            t = time.monotonic()
            res = self.pingall()
            self.timings["ping_s"] = time.monotonic() - t
            if res["failed"]:
                raise RuntimeError(f"pingall failed for {res['failed'][:8]} "
                                   f"({len(res['failed'])}/{res['pairs']} pairs)")

    def _start_switches(self) -> None:
        """Start bridges, then all programmable nodes in parallel (each waits for its engine:
        Mininet's serial start would add the engines' start-up times)."""
        mn = self.mininet
        prog = [sw for sw in mn.switches if sw.name in self.topo.programmable]
        others = [sw for sw in mn.switches if sw.name not in self.topo.programmable]
        for sw in others:
            sw.start([])
        # Node classes that queue their start-up commands (Open vSwitch) run them now, as
        # Mininet's own start does.
        for cls in sorted({type(sw) for sw in others}, key=str):
            if hasattr(cls, "batchStartup"):
                cls.batchStartup([sw for sw in others if type(sw) is cls])
        if prog:
            # compiled once here, not by every engine at once (on 2 cores, 20 engines that
            # compile the same kernels each take 10x longer than one, past their timeout)
            stages = sorted({name for sw in prog for name, _ in getattr(sw, "programs", ())})
            warm.ensure_stages(stages, groups=bool(self.engine_groups))
            self._share_engines(prog)
            self._start_engine_server(prog, stages)
            # Node start-up touches neighbours' shells too (offloads on the peer end): make
            # every node's cmd() exclusive while the threads run.
            for node in mn.hosts + mn.switches:
                _serialize_cmd(node)
            with ThreadPoolExecutor(max_workers=min(8, len(prog))) as ex:
                for fut in [ex.submit(sw.start, []) for sw in prog]:
                    fut.result()

    def _share_engines(self, prog: list) -> None:
        """Give the nodes of each engine group of more than one node their shared engine
        (:class:`~testbed.datapath.nodes.SharedEngine`), with the group's memory links."""
        by_name = {sw.name: sw for sw in prog}
        for group, links in zip(self.engine_groups, self._group_links, strict=True):
            if len(group) > 1:
                SharedEngine([by_name[x] for x in group], links)

    def _start_engine_server(self, prog: list, stages: list[str]) -> None:
        """Start the fork server the engines of ``prog`` start from
        (:mod:`testbed.datapath.forks`), loading their ``stages`` and ring I/O kernels once;
        nothing with ``TESTBED_ENGINE_START=exec``."""
        if forks.start_mode() != "fork":
            return
        os.makedirs(RUN_DIR, exist_ok=True)
        self.engine_server = forks.EngineServer(
            stages=stages,
            log_path=os.path.join(RUN_DIR, f"forks.{os.getpid()}.{id(self):x}.log"))
        for sw in prog:
            sw.spawner = self.engine_server

    def keep(self, name: str, start):
        """A helper process this network keeps while it runs, e.g. the collectives' pool
        server: ``start()`` makes it on first use (and again when the one before died:
        ``alive()`` false); the network ``close()``s it when it stops."""
        with self._kept_lock:
            helper = self._kept.get(name)
            if helper is None or not helper.alive():
                if helper is not None:
                    with contextlib.suppress(Exception):
                        helper.close()
                helper = self._kept[name] = start()
            return helper

    def _close_kept(self) -> None:
        with self._kept_lock:
            kept, self._kept = self._kept, {}
        for helper in kept.values():
            with contextlib.suppress(Exception):
                helper.close()

    def _stop_engines(self) -> None:
        """Stop all engines in parallel, keeping their final counters, then their fork
        server."""
        mn = self.mininet
        prog = [sw for sw in mn.switches if hasattr(sw, "stop_engine")]
        try:
            if prog:
                with ThreadPoolExecutor(max_workers=min(8, len(prog))) as ex:
                    results = list(ex.map(lambda sw: (sw.name, sw.stop_engine()), prog))
                self.final_counters = dict(results)
        finally:
            server, self.engine_server = self.engine_server, None
            if server is not None:
                server.close()

    def _teardown(self) -> None:
        t = time.monotonic()
        # Ctrl-C / SIGTERM during teardown would leave half a network: note them, finish,
        # then raise.
        main = threading.current_thread() is threading.main_thread()
        pending: list[int] = []

        def _defer(signum, frame):
            pending.append(signum)

        old_int = signal.signal(signal.SIGINT, _defer) if main else None
        old_term = signal.signal(signal.SIGTERM, _defer) if main else None
        try:
            _announce(self, False)
            for client in self._clients.values():
                with contextlib.suppress(Exception):
                    client.close()
            self._clients = {}
            self._close_kept()
            if self.mininet is not None:
                with contextlib.suppress(Exception):
                    self._stop_engines()
                with contextlib.suppress(Exception):
                    self._delete_links()
                try:
                    self.mininet.stop()
                except Exception:  # noqa: BLE001 - keep going, the sweep below finishes the job
                    pass
            self._sweep()
            self._stop_cluster()
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None
        finally:
            if main:
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, self._old_sigterm if self._old_sigterm is not None
                              else old_term)
                self._old_sigterm = None
            if self._lock_cm is not None:
                lock, self._lock_cm = self._lock_cm, None
                lock.__exit__(None, None, None)
            if not is_held():  # no other network of this process is up: none of its jobs runs
                remove_job_dirs(RUN_DIR)  # one a Ctrl-C caught before its job's cleanup began
            self.timings["teardown_s"] = time.monotonic() - t
        if pending:
            raise KeyboardInterrupt(f"signal {pending[0]} during teardown (teardown completed)")

    def _delete_links(self) -> None:
        """Delete the veth pairs of the links with an end in this namespace in one request:
        their root ends join a device group (``ip -batch``) and ``ip link del group`` takes
        them all, peers included, in one batch. An ``ip link del`` per link waits out a
        grace period of the kernel's each time: 100 veth pairs took 1.6 s one by one and
        0.05 s as a group; a fat-tree k=8's 384 links were 8.5 s of its 12.5 s teardown.
        Links this cannot delete (tunnels, ends on other servers, a failed request) are
        left to Mininet's stop, one by one as before."""
        picked = {}
        for link in self.mininet.links:
            if type(link) is not TBLink:  # tunnels: a VXLAN device per end, per server
                continue
            root = [i for i in (link.intf1, link.intf2) if not i.node.inNamespace
                    and getattr(i.node, "connection", None) is None]
            if root:
                picked[root[0].name] = link
        if not picked:
            return
        group = DEVICE_GROUP_BASE + os.getpid() % 0x10000
        lines = "".join(f"link set dev {name} group {group}\n" for name in picked)
        subprocess.run(["ip", "-force", "-batch", "-"], input=lines, text=True,
                       capture_output=True, check=False)
        gone = subprocess.run(["ip", "link", "del", "group", str(group)], capture_output=True,
                              check=False).returncode == 0
        left = _root_ifaces() & set(picked)
        for name, link in picked.items():
            link.gone = gone and name not in left

    def _our_names(self) -> set[str]:
        """Root-namespace interface names our nodes would create."""
        names = set()
        for s in self.topo.link_specs:
            names.add(f"{s.a}-eth{s.port_a}")
            names.add(f"{s.b}-eth{s.port_b}")
        names.update(self.topo.switch_roles)  # bridge devices
        return names

    def _sweep(self) -> None:
        """Remove whatever Mininet's stop left behind (interfaces, bridges, node shells)."""
        if self.mininet is not None:
            for node in self.mininet.hosts + self.mininet.switches:
                shell = getattr(node, "shell", None)
                if shell is not None and shell.poll() is None:
                    with contextlib.suppress(Exception):
                        node.terminate()
        left = (self._our_names() & _root_ifaces()) - self._preexisting
        for name in sorted(left):
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)

    # ----- cluster networks ------------------------------------------------------------------
    def _start_cluster(self) -> None:
        """Connect to every remote server, hold its emulation lock (a server on this
        machine's own kernel is covered by the lock we hold), measure the underlay of every
        server pair that carries tunnels."""
        for srv in self.servers[1:]:
            conn = cluster.Connection(srv)
            self.connections[srv.name] = conn
            if not conn.same_kernel():
                self._server_locks.append(cluster.ServerLock(conn, self.lock_timeout))
        local = self.servers[0].name
        pairs = {tuple(sorted((self.placement[s.a], self.placement[s.b])))
                 for s in cluster.crossing_links(self.topo, self.placement)}
        for a, b in sorted(pairs):
            links = [s for s in cluster.crossing_links(self.topo, self.placement)
                     if {self.placement[s.a], self.placement[s.b]} == {a, b}]
            entry = {"servers": [a, b], "links": [f"{s.a}-{s.b}" for s in links],
                     "carried_mbps": sum(s.bw_mbps or 0 for s in links),
                     "unshaped": any(s.bw_mbps is None for s in links)}
            if local in (a, b):
                other = b if a == local else a
                ips = self._underlay_ips(local, other)
                entry.update(cluster.measure_underlay(self.connections[other], ips[local],
                                                      ips[other]))
            else:  # measured only from this machine (docs/cluster.md)
                entry.update(rate_mbps=None, latency_ms=None)
            self.tunnels.append(entry)

    def _underlay_ips(self, a: str, b: str) -> dict[str, str]:
        """Server name -> the address its tunnel end uses, for the server pair (a, b)."""
        by_name = {s.name: s for s in self.servers}
        remote = {n: by_name[n].tunnel_ip or cluster.resolve(by_name[n].address)
                  for n in (a, b) if not by_name[n].is_local}
        out = dict(remote)
        for n in (a, b):
            if by_name[n].is_local:
                out[n] = cluster.local_ip_towards(next(iter(remote.values())))
        return out

    def hosts_on_other_kernels(self) -> list[str]:
        """Hosts placed on a server that runs another kernel than this machine's: a process
        here cannot enter their network namespaces (the collectives start a pool on that
        server for them; training jobs still refuse them)."""
        if not self.placement:
            return []
        out = []
        for h in self.hosts:
            conn = self.connections.get(self.placement.get(h.name))
            if conn is not None and not conn.same_kernel():
                out.append(h.name)
        return out

    def tunnel_report(self) -> list[dict]:
        """Per tunnelled server pair: links, the rate they carry at the current dilation,
        measured underlay rate and latency, ``tunnel_bound`` (underlay slower than the
        links it carries: the run measures the tunnel, not the emulated network)."""
        out = []
        for t in self.tunnels:
            carried = t["carried_mbps"] / self.time_dilation
            rate = t.get("rate_mbps")
            out.append({**t, "carried_mbps": round(carried, 3),
                        "tunnel_bound": bool(rate is not None and
                                             (t["unshaped"] or rate < carried))})
        return out

    def tunnel_flags(self) -> dict:
        """Columns a cluster network adds to every report row: ``tunnel_bound`` and
        ``tunnel_why`` (empty for a network on one machine)."""
        if self.servers is None:
            return {}
        bound = [t for t in self.tunnel_report() if t["tunnel_bound"]]
        why = "; ".join(f"{'-'.join(t['servers'])}: underlay {t['rate_mbps']} Mb/s < "
                        f"{t['carried_mbps']} Mb/s of tunnelled links" for t in bound)
        return {"tunnel_bound": bool(bound), "tunnel_why": why}

    def server_memory(self) -> dict[str, float]:
        """Server name -> resident memory (MiB) of what this network runs there: node shells
        and data-path engines, summed from each server's own ``ps`` (the collectives' worker
        pools report their own memory in ``mem_mb``, the other servers' pools included)."""
        mn = self._require_running()
        local = self.servers[0].name if self.servers else cluster.LOCAL
        pids: dict[str, list[int]] = {}
        for node in mn.hosts + mn.switches:
            srv = (self.placement or {}).get(node.name, local)
            found = [node.pid]
            eng = (node.server_pid() if hasattr(node, "server_pid")
                   else node.engine_pid() if hasattr(node, "engine_pid") else None)
            found += [eng] if eng is not None else []
            pids.setdefault(srv, []).extend(int(p) for p in found if p)
        out = {}
        for srv, plist in sorted(pids.items()):
            cmd = f"ps -o rss= -p {','.join(map(str, sorted(set(plist))))}"
            if srv in self.connections:
                text = self.connections[srv].run(cmd, check=False)
            else:
                text = subprocess.run(cmd.split(), capture_output=True, text=True,
                                      check=False).stdout
            out[srv] = round(sum(int(x) for x in text.split() if x.isdigit()) / 1024, 1)
        return out

    def _stop_cluster(self) -> None:
        """Remove our interfaces left on remote servers, release their locks, disconnect."""
        names = " ".join(sorted(self._our_names()))
        for conn in self.connections.values():
            with contextlib.suppress(Exception):
                conn.run(f"for i in {names}; do [ -e /sys/class/net/$i ] && ip link del $i; "
                         "done; true", check=False, timeout=30)
        for lock in self._server_locks:
            lock.release()
        self._server_locks = []
        for conn in self.connections.values():
            conn.close()
        self.connections = {}

    # ----- building ------------------------------------------------------------------------
    def _check_switch_nodes(self) -> None:
        topo = self.topo
        for name, params in self.switch_nodes.items():
            if name not in topo.switch_roles or name in topo.programmable:
                bridges = sorted(set(topo.switch_roles) - set(topo.programmable))
                raise TopologyError(f"switch_nodes: {name!r} is not a switch that runs no data "
                                    f"path; choose from {bridges}")
            if "cls" not in params:
                raise TopologyError(f"switch_nodes[{name!r}]: give the node class as 'cls'")
            if self._tree is not None:
                raise TopologyError(f"switch_nodes: this {topo.kind} has loops, so its bridges "
                                    "need static forwarding entries; replace bridges only in "
                                    "loop-free fabrics")

    def _assign_classes(self) -> None:
        topo = self.topo
        for name in topo.switch_roles:
            if name in topo.programmable:
                continue
            info = dict(topo.nodeInfo(name))
            info.pop("port_setup", None)
            if name in self.switch_nodes:
                info.update(self.switch_nodes[name])
            else:
                info["cls"] = TBBridge
                info["port_setup"] = self._bridge_setup(name) if self._tree is not None else []
            topo.setNodeInfo(name, info)
        plan = self.programs_plan()
        for name in topo.programmable:
            info = dict(topo.nodeInfo(name))
            is_nic = topo.switch_roles[name] == "smartnic"
            info["cls"] = SmartNIC if is_nic else ProgrammableSwitch
            info["programs"] = dilate({name: plan[name]}, self.time_dilation)[name]
            if not is_nic and self._tree is not None:
                info["flood_ports"] = self._flood_ports(name)
            info.update(self.engine_opts)
            info["coalesce_us"] = self._coalesce_us(self.time_dilation)
            if "rx_ring_frames" not in self.engine_opts:
                info["rx_ring_frames"] = self._rx_ring_frames(name)
            topo.setNodeInfo(name, info)
        self._assign_servers()

    def _assign_servers(self) -> None:
        """Remote node classes (with server and connection) for nodes placed on other
        servers; every other node drops what an earlier cluster network gave it."""
        topo = self.topo
        by_name = {s.name: s for s in self.servers or []}
        for node in [*topo.host_names, *topo.switch_roles]:
            info = dict(topo.nodeInfo(node))
            info.pop("server", None)
            info.pop("connection", None)
            if node in topo.host_names:
                info.pop("cls", None)
            srv = by_name.get((self.placement or {}).get(node))
            if srv is not None and not srv.is_local:
                base = info.get("cls")
                cls = cluster.RemoteHost if node in topo.host_names else _REMOTE_CLASSES.get(base)
                if cls is None:
                    raise TopologyError(f"{node}: a {getattr(base, '__name__', base)} node "
                                        "cannot run on a remote server")
                info.update(cls=cls, server=srv, connection=self.connections[srv.name])
            topo.setNodeInfo(node, info)

    def programs_plan(self) -> dict[str, list]:
        """Node -> the ``[(program, settings), ...]`` its engine starts with (no network
        needed; composed by :func:`testbed.topologies.pipeline.compose`)."""
        return compose(self.topo, self.datapath, self._tables)

    def set_time_dilation(self, factor: float) -> None:
        """Run the network at dilation ``factor`` from now on (see the module docstring):
        reshape every link and re-time the ``impair`` and ``trim`` stages, the
        coalescing wait of every engine and every host's minimum TCP RTO.

        Call it between runs: a link's queue is rebuilt, so packets queued on it are lost.
        Raises :class:`TopologyError` for a bad factor, or when an engine runs two stages of
        the same name that would need new settings (the control channel addresses stages by
        name: build such a network with its factor instead).
        """
        f = check_time_dilation(factor, "set_time_dilation(factor)", auto=False)
        mn = self._require_running()
        updates = self._dilated_stage_updates(f)
        by_intf = {}
        for s in self.topo.link_specs:
            by_intf[self._intf_name(s.a, s.port_a)] = s
            by_intf[self._intf_name(s.b, s.port_b)] = s
        old, self.time_dilation = self.time_dilation, f
        self._hop_latency = None  # its serialisation part changed with the rates
        try:
            errors = []
            for link in mn.links:
                for intf in (link.intf1, link.intf2):
                    spec = by_intf.get(intf.name)
                    params = self._link_params(spec, intf.name) if spec is not None else {}
                    if not params:
                        continue
                    if self.offloads_off:
                        params.update(txo=False, rxo=False)
                    with _quiet_mininet():
                        out = intf.config(**params) or {}
                    errors += [f"{intf.name}: {o.strip()}" for o in out.get("tcoutputs", [])
                               if "rror" in o]
            if errors:
                raise RuntimeError(f"reshaping links for time dilation {f:g} failed: "
                                   f"{errors[:3]}")
            for node, stages in updates.items():
                client = self._clients[node]
                for stage, settings in stages:
                    client.configure(stage, **settings)
            for node in sorted(self.topo.programmable):
                if node in self._clients:
                    self._clients[node].set_coalesce(self._coalesce_us(f))
            for h in self.hosts:
                out = h.cmd(tcp_rto_min_cmd(h.defaultIntf().name, f))
                if "rror" in out:
                    raise RuntimeError(f"setting {h.name}'s minimum TCP RTO failed: {out}")
        except BaseException:
            self.time_dilation = old
            raise

    def _coalesce_us(self, factor: float) -> float:
        """The engines' interrupt-coalescing wait at dilation ``factor``: the configured one
        (``engine_opts["coalesce_us"]``, else the engine's default) times the factor, like
        every other time of the network. Unstretched, a dilated engine would find f times
        fewer packets per wake-up and pay its per-wake-up cost per packet (measured, fat-tree
        k=4, 16 workers, f=16, 4 MiB ring and reduction server: engine CPU 0.25 of a core and
        a worker waiting 11-14 % of the run for a CPU with 50 µs; 0.14-0.18 and 5-8 % with
        800 µs, fidelity 1.03-1.07 either way)."""
        base = float(self.engine_opts.get("coalesce_us", DEFAULT_COALESCE_US))
        return min(base * factor, MAX_COALESCE_US)

    def _rx_ring_frames(self, node: str) -> int:
        """RX ring slots of ``node``'s ports: sized for its fastest link at the dilation the
        network is built with (``engine.rx_ring_frames``; an unshaped link gets the most). A
        later, smaller factor keeps them: frames a full ring refused show as the port's
        ``rx_kernel_drops``."""
        rates = [s.bw_mbps for s in self.topo.link_specs if node in (s.a, s.b)]
        fastest = None if not rates or None in rates else max(rates)
        return rx_ring_frames(fastest, self.time_dilation,
                              self._coalesce_us(self.time_dilation))

    def _dilated_stage_updates(self, factor: float) -> dict[str, list[tuple[str, dict]]]:
        """Node -> ``[(stage, settings), ...]`` that re-time its engine for ``factor``: the
        time and rate settings of its ``impair``, ``trim`` and ``shape`` stages (none when
        they are all zero). Raises :class:`TopologyError` when such a stage's name is not unique."""
        out: dict[str, list[tuple[str, dict]]] = {}
        for node, stages in self.programs_plan().items():
            names = [p for p, _ in stages]
            for program, settings in stages:
                if program not in (*IMPAIR_STAGES, *QUEUE_STAGES):
                    continue
                new = dilate_settings(program, settings, factor)
                keys = [k for k in (*DILATED_TIMES, *DILATED_RATES)
                        if k in settings and _nonzero(settings[k])]
                if not keys:
                    continue
                if names.count(program) > 1:
                    raise TopologyError(
                        f"set_time_dilation: {node} runs {names.count(program)} '{program}' "
                        "stages, which its control channel cannot tell apart; build the "
                        "network with TestbedNet(..., time_dilation=factor) instead")
                out.setdefault(node, []).append((program, {k: new[k] for k in keys}))
        return out

    def _flood_ports(self, name: str) -> list[str]:
        """Ports of a programmable switch that floods may use: host-facing + flood-tree."""
        topo = self.topo
        adj = routing.adjacency(topo)
        return [self._intf_name(name, port) for peer, (port, _bw) in sorted(adj[name].items())
                if peer not in topo.switch_roles or topo.switch_roles[peer] == "smartnic"
                or frozenset((name, peer)) in self._tree]

    def _link_params(self, s, intf: str) -> dict:
        """Mininet parameters of interface ``intf`` of link spec ``s`` at the current dilation
        factor. A port its engine shapes gets no rate (no HTB qdisc)."""
        params = {}
        if s.bw_mbps is not None and intf not in self._engine_shaped:
            params["bw"] = s.bw_mbps / self.time_dilation
            if self.topo.queue_ms is not None:  # bytes: the same under dilation
                params["queue_bytes"] = queue_bytes(s.bw_mbps, self.topo.queue_ms)
        if self.topo.impair_mode() == "netem":
            if s.delay_ms:
                params["delay"] = f"{s.delay_ms * self.time_dilation:g}ms"
            if s.loss_pct:
                params["loss"] = s.loss_pct
        return params

    def _assign_link_params(self) -> None:
        topo = self.topo
        for i, s in enumerate(topo.link_specs):
            info = topo.linkInfo(s.a, s.b)
            for key in ("bw", "delay", "loss", "txo", "rxo", "cls", "tunnel", "queue_bytes",
                        "params1", "params2"):
                info.pop(key, None)
            # per end: a port its engine shapes has no rate of its own
            ends = {s.a: self._intf_name(s.a, s.port_a), s.b: self._intf_name(s.b, s.port_b)}
            info["params1"] = self._link_params(s, ends[info["node1"]])
            info["params2"] = self._link_params(s, ends[info["node2"]])
            params = {}
            if self.offloads_off:
                params.update(txo=False, rxo=False)
            if self.placement is not None and self.placement[s.a] != self.placement[s.b]:
                a, b = self.placement[s.a], self.placement[s.b]
                params.update(cls=TBTunnelLink, tunnel={
                    "vni": cluster.VNI_BASE + i, "ips": self._underlay_ips(a, b)})
            info.update(params)
            topo.setlinkInfo(s.a, s.b, info)

    def _configure_hosts(self) -> None:
        """One shell round trip per host: IPv6 off, offloads off, static ARP (batch file), the
        minimum TCP RTO for the network's dilation, no route to the machine's name servers."""
        hosts = self.hosts
        ips = self.host_ips
        blackhole = resolver_blackhole_cmd(
            {*ips, AGGREGATOR_IP, *(switch_identity(self.topo, sw)[1]
                                    for sw in aggregating_switches(self.topo))})
        shaped = self._shaped_ifaces()
        for rank, h in enumerate(hosts):
            intf = h.defaultIntf().name
            parts = ["sysctl -qw net.ipv6.conf.all.disable_ipv6=1 "
                     "net.ipv6.conf.default.disable_ipv6=1"]
            if self.offloads_off:
                parts.append(f"ethtool -K {intf} tx off rx off tso off gso off gro off "
                             ">/dev/null 2>&1")
            if self.static_arp:
                path = os.path.join(self._tmpdir, f"{h.name}.neigh")
                lines = [f"neigh replace {ip} lladdr {host_mac(r2)} dev {intf} nud permanent"
                         for r2, ip in enumerate(ips) if r2 != rank]
                for sw in aggregating_switches(self.topo):  # every aggregator identity
                    mac, ip = switch_identity(self.topo, sw)
                    lines.append(f"neigh replace {ip} lladdr {mac} dev {intf} nud permanent")
                if not self.topo.programmable:  # the well-known address, for bridges too
                    lines.append(f"neigh replace {AGGREGATOR_IP} lladdr {AGGREGATOR_MAC} "
                                 f"dev {intf} nud permanent")
                text = "\n".join(lines) + "\n"
                with open(path, "w") as f:
                    f.write(text)
                if hasattr(h, "put_file"):  # a host on another server reads its own copy
                    h.put_file(path, text)
                parts.append(f"ip -batch {path}")
            parts.append(tcp_rto_min_cmd(intf, self.time_dilation))
            if blackhole:
                parts.append(blackhole)
            parts.append(f"tc qdisc show dev {intf}")
            out = h.cmd("; ".join(parts))
            if "rror" in out:
                raise RuntimeError(f"configuring host {h.name} failed: {out.strip()}")
            if shaped.get(intf) and " htb " not in out:
                raise RuntimeError(f"HTB shaping missing on {h.name}:{intf}: {out.strip()}")

    def _configure_root_ifaces(self) -> None:
        """Verify the HTB shaping of the switch-side interfaces in the root namespace.

        (Their IPv6 is turned off by :class:`TBBridge` / the data path's nodes, and their
        checksum offloads by TCLink's ``txo``/``rxo``; segmentation happens at the hosts,
        whose offloads are all off.)"""
        root = [n for n in sorted(self._our_names()) if os.path.exists(f"/sys/class/net/{n}")]
        # Verify that every shaped root-namespace interface really got its HTB qdisc.
        out = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True,
                             check=False).stdout
        htb = set(re.findall(r"qdisc htb \S+ dev (\S+) root", out))
        missing = [n for n, bw in self._shaped_ifaces().items()
                   if bw and n in root and n not in htb]
        bridges = set(self.topo.switch_roles) - set(self.topo.programmable)
        for srv, conn in self.connections.items():  # bridges' ports on the other servers
            there = [n for n, bw in self._shaped_ifaces().items() if bw and
                     n.rsplit("-eth", 1)[0] in bridges and
                     self.placement[n.rsplit("-eth", 1)[0]] == srv]
            if there:
                htb = set(re.findall(r"qdisc htb \S+ dev (\S+) root",
                                     conn.run("tc qdisc show", check=False)))
                missing += [f"{srv}:{n}" for n in there if n not in htb]
        if missing:
            raise RuntimeError(f"HTB shaping missing on {missing[:5]} (tc failed; see "
                               "'tc qdisc show')")

    def _shaped_ifaces(self) -> dict[str, bool]:
        """Interface name -> whether the kernel shapes it (an HTB qdisc: its link has a rate
        and no engine shapes that end)."""
        out = {}
        for s in self.topo.link_specs:
            for node, port in ((s.a, s.port_a), (s.b, s.port_b)):
                name = self._intf_name(node, port)
                out[name] = s.bw_mbps is not None and name not in self._engine_shaped
        return out

    def _configure_forwarding(self) -> None:
        topo = self.topo
        loops = self._tree is not None
        bridges = [s for s in topo.switch_roles if s not in topo.programmable]
        if topo.programmable:
            self._program_datapath(self._tables, self._tree)
        if topo.programmable and bridges:
            self.forwarding_mode = "datapath+static-fdb" if loops else "datapath+learning"
        elif topo.programmable:
            self.forwarding_mode = "datapath"
        else:
            self.forwarding_mode = "static-fdb" if loops else "learning"

    def _intf_name(self, node: str, port: int) -> str:
        return f"{node}-eth{port}"

    def _bridge_setup(self, br: str) -> list[str]:
        """``bridge -batch`` lines for a bridge in a looped fabric: learning off on every
        port, flooding only on flood-tree links, static FDB from the routing tables."""
        topo = self.topo
        adj = routing.adjacency(topo)
        lines = []
        for peer, (port, _bw) in sorted(adj[br].items()):
            dev = self._intf_name(br, port)
            flags = "learning off"
            if peer in topo.switch_roles and frozenset((br, peer)) not in self._tree:
                flags += " flood off mcast_flood off bcast_flood off"
            lines.append(f"link set dev {dev} {flags}")
        for mac, group in sorted(self._tables[br].items()):
            port = routing.pick_port(group, mac, topo.seed)
            lines.append(f"fdb replace {mac} dev {self._intf_name(br, port)} master static")
        return lines

    def _program_datapath(self, tables, tree) -> None:
        """Connect a control client to every programmable node (tables went in at start)."""
        for name in sorted(self.topo.programmable):
            self._clients[name] = DatapathClient(name)

    # ----- what the upper layers use -----------------------------------------------------
    def _require_running(self) -> Mininet:
        if self.mininet is None:
            raise RuntimeError("the network is not running: use 'with TestbedNet(topo) as net:'")
        return self.mininet

    @property
    def hosts(self) -> list:
        """Mininet Host objects in rank order (tbh1 = rank 0)."""
        mn = self._require_running()
        return [mn.get(h) for h in self.topo.host_names]

    @property
    def host_ips(self) -> list[str]:
        """Host IPs in rank order (10.0.0.<rank+1>)."""
        return [host_ip(r) for r in range(self.topo.n_hosts)]

    @property
    def n(self) -> int:
        """Number of hosts."""
        return self.topo.n_hosts

    @property
    def aggregator(self) -> dict | None:
        """``{'ip', 'mac', 'switch'}`` of the in-network aggregator, or None."""
        sw = self.topo.aggregator_switch
        if sw is None:
            return None
        return {"ip": AGGREGATOR_IP, "mac": AGGREGATOR_MAC, "switch": sw}

    def switch_client(self, name: str):
        """The data path's control client of programmable node ``name``."""
        self._require_running()
        if name not in self._clients:
            raise KeyError(f"{name!r} is not a programmable node of this network; "
                           f"programmable: {sorted(self._clients)}")
        return self._clients[name]

    def datapath_clients(self) -> dict:
        """Node name -> data-path control client, for every programmable node."""
        self._require_running()
        return dict(self._clients)

    def engine_pids(self) -> list[int]:
        """PIDs of the running data-path engines (whose CPU can make a run ``cpu_bound``)."""
        mn = self._require_running()
        pids = []
        for node in mn.switches:
            pid = node.engine_pid() if hasattr(node, "engine_pid") else None
            if pid is not None:
                pids.append(pid)
        return list(dict.fromkeys(pids))  # an engine group's nodes share one

    def _host_names(self, hosts) -> list[str]:
        if hosts is None:
            return list(self.topo.host_names)
        names = []
        for h in hosts:
            if isinstance(h, int) and not isinstance(h, bool):
                if not 0 <= h < self.n:
                    raise ValueError(f"hosts: rank {h} outside 0..{self.n - 1}")
                names.append(self.topo.host_names[h])
            else:
                name = getattr(h, "name", h)
                if name not in self.topo.host_names:
                    raise ValueError(f"hosts: {h!r} is not a host of this network")
                names.append(name)
        return names

    def bottleneck_bps(self, hosts=None, pattern: str = "ring",
                       aggregator: str | None = None) -> float | None:
        """The alpha-beta model's bandwidth B (bit/s) for a collective among ``hosts``.

        ``hosts``: ranks, names or Host objects (default: all). ``pattern``: 'ring' (ring
        algorithms), 'ina' (every host to the aggregator and back), 'all_to_one' (reduction
        server / incast). The per-flow rate of the most loaded link when all the pattern's
        flows run at once, ECMP splitting flows equally. None when the used links are unshaped.
        ``aggregator``: INA's (a tree's root; default the topology's aggregator switch).
        """
        mbps = routing.bottleneck_mbps(self.routed_topo, self._host_names(hosts), pattern,
                                       aggregator)
        return None if mbps is None else mbps * 1e6

    def describe(self) -> dict:
        """JSON-serialisable description for results metadata (topology + runtime choices)."""
        d = self.topo.describe()
        d["forwarding"] = self.forwarding_mode
        d["programs"] = {n: [p for p, _ in progs] for n, progs in self.programs_plan().items()}
        d["netem"] = netem_available()
        d["aggregator_addr"] = self.aggregator
        d["host_ips"] = self.host_ips
        d["time_dilation"] = self.time_dilation
        d["time_dilation_requested"] = self.time_dilation_requested
        if self._links_down:
            d["links_down"] = ["-".join(p) for p in self.links_down]
        if self.servers is not None:
            d["cluster"] = {"servers": [s.name for s in self.servers],
                            "placement": dict(self.placement), "tunnels": self.tunnel_report()}
        return d

    def pingall(self, sample: int | None = None, timeout_s: float = 1.0) -> dict:
        """Ping between hosts (all ordered pairs, or ring + a seeded sample for big networks).

        ``sample``: max pairs per source beyond the ring neighbour (default: all pairs up to
        16 hosts, else 3). Sources ping in parallel. Returns ``{'pairs', 'failed': [(src,
        dst)], 'loss'}``; a pair counts as failed only if a retry also fails.
        """
        hosts = self.hosts
        ips = self.host_ips
        n = len(hosts)
        if sample is None:
            sample = n if n <= 16 else 3
        rng = random.Random(self.topo.seed)
        targets: dict[int, list[int]] = {}
        for i in range(n):
            others = [j for j in range(n) if j != i]
            if sample >= n - 1:
                targets[i] = others
            else:
                ring = (i + 1) % n
                rest = [j for j in others if j != ring]
                targets[i] = [ring] + rng.sample(rest, min(sample, len(rest)))
        w = max(1, int(round(timeout_s)))
        for i, h in enumerate(hosts):
            dsts = " ".join(ips[j] for j in targets[i])
            h.sendCmd(f"for d in {dsts}; do ping -c1 -W{w} -q $d >/dev/null 2>&1 || "
                      f"ping -c2 -W{w} -q $d >/dev/null 2>&1 || echo FAIL $d; done")
        failed = []
        ip_rank = {ip: r for r, ip in enumerate(ips)}
        for h in hosts:
            out = h.waitOutput()
            for m in re.finditer(r"FAIL (\S+)", out):
                failed.append((h.name, self.topo.host_names[ip_rank[m.group(1)]]))
        pairs = sum(len(v) for v in targets.values())
        return {"pairs": pairs, "failed": failed, "loss": len(failed) / pairs if pairs else 0.0}

    def counters(self) -> dict:
        """All counters: ``datapath`` (node -> its stages' counters) and ``ports`` (root-ns
        switch interfaces -> kernel statistics)."""
        self._require_running()
        dp = {}
        for name, client in self._clients.items():
            dp[name] = client.counters()
        ports = {}
        for name in sorted(self._our_names()):
            base = f"/sys/class/net/{name}/statistics"
            if not os.path.isdir(base):
                continue
            stats = {}
            for key in ("rx_packets", "tx_packets", "rx_bytes", "tx_bytes", "rx_dropped",
                        "tx_dropped"):
                with contextlib.suppress(OSError, ValueError):
                    with open(f"{base}/{key}") as f:
                        stats[key] = int(f.read())
            ports[name] = stats
        return {"datapath": dp, "ports": ports}

    def dead_engines(self) -> dict[str, int]:
        """Programmable nodes whose data-path engine has exited: node -> exit status
        (negative: killed by that signal)."""
        mn = self._require_running()
        dead = {}
        for node in list(mn.switches) + list(mn.hosts):
            eng = getattr(node, "engine", None)
            if eng is not None and eng.poll() is not None:
                dead[node.name] = eng.returncode
        return dead

    # ----- link failures ---------------------------------------------------------------
    @property
    def links_down(self) -> list[tuple[str, str]]:
        """The links that have failed (:meth:`link_down`), as sorted name pairs."""
        return sorted(tuple(sorted(p)) for p in self._links_down)

    @property
    def routed_topo(self):
        """The topology less the links that are down: what the routes, the INA trees and the
        models (``flowmodel.predict(net.routed_topo, ...)``) see. ``topo`` when none is."""
        return routing.without_links(self.topo, self._links_down)

    def link_down(self, a: str, b: str) -> dict:
        """Fail the link between nodes ``a`` and ``b``: both its interfaces go down (what was
        in flight on it is lost), then every switch's routes are recomputed over the links
        left (ECMP over the remaining paths) and pushed to the engines and bridges; later INA
        jobs get trees around it. Refused (``TopologyError``) when it would cut a host off, on
        a link to another server, or where explicit programs replace the routes. Returns
        ``{"link", "state", "interfaces", "routes_changed", "seconds"}``."""
        return self._set_link(a, b, up=False)

    def link_up(self, a: str, b: str) -> dict:
        """Restore a link :meth:`link_down` failed: its interfaces come up, then the routes
        use it again. ``TopologyError`` when it is not down."""
        return self._set_link(a, b, up=True)

    def _set_link(self, a: str, b: str, up: bool) -> dict:
        with self.engine_lock:  # not while an engine restarts: its routes are pushed after
            return self._change_link(a, b, up)

    def _change_link(self, a: str, b: str, up: bool) -> dict:
        t0 = time.monotonic()
        self._require_running()
        try:
            specs = routing.links_between(self.topo, a, b)
        except ValueError as e:
            raise TopologyError(str(e)) from None
        pair = frozenset((a, b))
        name = f"{a}-{b}"
        if up and pair not in self._links_down:
            raise TopologyError(f"link {name} is not down (links down: "
                                f"{['-'.join(p) for p in self.links_down] or 'none'})")
        if not up and pair in self._links_down:
            raise TopologyError(f"link {name} is down already")
        if self.datapath.explicit_programs and self.topo.programmable:
            raise TopologyError("this network's programs are given explicitly, so its routes "
                                "are not the testbed's to recompute: build it without "
                                "explicit programs to fail links")
        if a in self._group_of and self._group_of.get(a) == self._group_of.get(b):
            raise TopologyError(f"link {name} is carried in memory by an engine group "
                                f"({self.engine_groups[self._group_of[a]]}): no interface of "
                                "it to take down; build the network without engine_groups "
                                "to fail it")
        remote = [n for n in (a, b) if self.placement and self.placement.get(n) !=
                  self.servers[0].name]
        if remote:
            raise TopologyError(f"link {name} has an end on another server ({remote}): link "
                                "failures are emulated on this server's links only")
        down = self._links_down - {pair} if up else self._links_down | {pair}
        routed = routing.without_links(self.topo, down)
        lost = routing.unreachable_hosts(routed)
        if lost:
            raise TopologyError(f"taking {name} down would cut {lost} off from the other "
                                "hosts: fail a link that has a path around it (on a multipath "
                                "fabric), or stop the host's worker instead")
        intfs = [self._intf_name(n, port) for s in specs
                 for n, port in ((s.a, s.port_a), (s.b, s.port_b))]
        if up:  # the ports first, then the routes that use them
            self._links_down = down
            self._ifaces_state(intfs, "up")
            for i in intfs:
                self.down_interfaces.pop(i, None)
            changed = self._reroute()
        else:  # the routes move only once the loss is there, as a failure detector sees it
            self._ifaces_state(intfs, "down")
            self._links_down = down
            self.down_interfaces.update({i: t0 for i in intfs})
            changed = self._reroute()
        return {"link": name, "state": "up" if up else "down", "interfaces": intfs,
                "routes_changed": changed, "seconds": round(time.monotonic() - t0, 4)}

    def _ifaces_state(self, intfs: list[str], state: str) -> None:
        mn = self._require_running()
        for intf in intfs:
            node = mn.get(intf.rsplit("-eth", 1)[0])
            out = node.cmd(f"ip link set dev {intf} {state}")
            if out.strip():
                raise RuntimeError(f"setting {intf} {state} failed: {out.strip()}")

    def _reroute(self) -> int:
        """Recompute the routes over the links that are up and push what changed: a
        ``forward`` stage's static L2 entries, a looped fabric's bridge FDB and flood ports.
        Returns the number of (switch, destination) entries that changed."""
        routed = self.routed_topo
        tables = routing.forwarding_tables(routed)
        changed = {sw: {mac: g for mac, g in t.items() if self._tables[sw].get(mac) != g}
                   for sw, t in tables.items()}
        # a switch left without a path to a destination keeps its old entry: its ports
        # towards it are down, so nothing it forwards there arrives anyway
        gone = sum(len(set(self._tables[sw]) - set(t)) for sw, t in tables.items())
        self._tables = tables
        if self._tree is not None:
            self._tree = routing.flood_tree(routed)
        plan = self.programs_plan() if self.topo.programmable else {}
        if self._tree is not None:  # floods follow the new spanning tree
            for sw in sorted(self.topo.programmable):
                if self.topo.switch_roles[sw] != "smartnic":
                    self._clients[sw].set_flood_ports(self._flood_ports(sw))
        for sw, entries in changed.items():
            if not entries:
                continue
            if sw in self.topo.programmable:
                if "forward" in [p for p, _ in plan.get(sw, [])]:
                    self._clients[sw].configure("forward", l2={
                        mac: [self._intf_name(sw, p) for p in g] for mac, g in entries.items()})
            elif self._tree is not None:
                self.mininet.get(sw).apply_setup(self._bridge_setup(sw))
        return sum(len(e) for e in changed.values()) + gone

    def restart_engine(self, name: str) -> float:
        """Start programmable node ``name``'s engine again (dead, killed, or running: stopped
        first) with its programs and tables, re-timed for the network's time dilation; its
        registered INA jobs and counters are gone (the control plane registers jobs again).
        Returns the seconds until it answered; ``KeyError`` for a node that has no engine."""
        with self.engine_lock:
            return self._restart_engine(name)

    def _restart_engine(self, name: str) -> float:
        mn = self._require_running()
        if name not in self._clients:
            raise KeyError(f"{name!r} is not a programmable node of this network; "
                           f"programmable: {sorted(self._clients)}")
        with contextlib.suppress(Exception):
            self._clients[name].close()
        took = mn.get(name).restart_engine()
        self.engine_starts[name] = self.engine_starts.get(name, 0) + 1
        client = self._clients[name] = DatapathClient(name)
        if self._links_down:  # it started with the routes of the intact fabric: today's
            if "forward" in [p for p, _ in self.programs_plan().get(name, [])]:
                client.configure("forward", l2={mac: [self._intf_name(name, p) for p in g]
                                                for mac, g in self._tables[name].items()})
            if self._tree is not None and self.topo.switch_roles[name] != "smartnic":
                client.set_flood_ports(self._flood_ports(name))
        # it started with the settings of the build's dilation: re-time it for today's
        for stage, settings in self._dilated_stage_updates(self.time_dilation).get(name, []):
            client.configure(stage, **settings)
        client.set_coalesce(self._coalesce_us(self.time_dilation))
        return took
