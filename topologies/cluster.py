"""One emulated network across several servers (Mininet Cluster Edition's model).

``TestbedNet(topo, servers=[...], placement=...)`` places every node of ``topo`` on a server;
this module holds the pieces it uses:

* :class:`Server` - how to reach a server over ssh (``localhost`` is the machine running
  ``TestbedNet``, and must come first);
* :func:`place` - which server holds each node: by default each leaf/edge switch (any switch
  with hosts) goes with its hosts and SmartNICs, groups spread evenly over the servers, and
  every other switch joins the server most of its placed neighbours are on (least loaded on a
  tie), so only fabric links cross servers;
* :class:`Connection` - one multiplexed ssh connection per remote server (``ControlMaster``):
  every node shell, command, file copy and engine of that server is a session on it, and
  the engines' control sockets are forwarded over it (``ssh -O forward -L local:remote``);
* remote node classes (Mininet's ``RemoteMixin``: the node's shell is ``ssh -tt server
  mnexec ...``, its ``popen`` is ssh too): :class:`RemoteHost`, :class:`RemoteBridge`, and
  :class:`RemoteProgrammableSwitch` / :class:`RemoteSmartNIC`, whose data-path engine runs on
  the server that holds the node (config copied there, control socket forwarded back,
  counters read back over ssh, stopped by its remote pid);
* :class:`TunnelLink` - a link whose ends are on different servers: a VXLAN device created
  on each server (over the servers' own addresses), moved into the node, shaped like every
  other link (HTB, or the engine's ``shape`` stage at a programmable end).

Why VXLAN and not Mininet's own tunnels: its ``RemoteSSHLink`` carries every frame through
two userspace ssh processes (encrypted; needs ``PermitTunnel``), and its ``RemoteGRELink``
needs the ``ip_gre`` module, which kernels without loadable modules lack; VXLAN is in the
kernel here, stays in the kernel on both ends, and is what data centres use for the same job.
Mininet's ``RemoteOVSSwitch`` does not fit at all: our switches are our own engines.

Why not ``MininetCluster`` itself: its placers only know hosts and switches (not "a leaf with
its hosts"), its pre-check needs ``sudo``, and its cleanup runs ``mn -c`` on every server,
which would remove other people's networks; the node classes and the placement idea are
what carries over.

Why one module this long: placement, the ssh connections, the remote node classes and the
tunnel links are the one piece of ``TestbedNet`` that knows about servers; kept together, every
remote step (start, forward, read back, stop) can be read next to the connection it rides on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from subprocess import Popen

from mininet.examples.cluster import RemoteMixin
from mininet.node import Host

from testbed.cleanup import cleanup, temp_dir
from testbed.datapath.control import RUN_DIR, socket_path
from testbed.datapath.nodes import ProgrammableSwitch, SmartNIC
from testbed.netlock import emulation_lock

from .base import TestbedTopo, TopologyError

LOCAL = "localhost"
VXLAN_PORT = 4789
VNI_BASE = 4200
#: bytes VXLAN adds to a frame on the underlay (outer Ethernet, IPv4, UDP, VXLAN)
VXLAN_OVERHEAD = 50


@dataclasses.dataclass(frozen=True)
class Server:
    """A server of a cluster network.

    ``address``: host name or IP that ssh reaches (``localhost``: this machine); ``name``: how
    placements and reports call it (default: the address); ``user``: ssh login (root, the
    testbed builds namespaces); ``ssh_options``: extra ssh arguments (``-i KEY``, ``-o ...``);
    ``tunnel_ip``: the address other servers send its tunnels' packets to (default: the
    address, resolved).
    """

    address: str
    name: str = ""
    user: str = "root"
    ssh_options: tuple = ()
    tunnel_ip: str | None = None

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.address)

    @property
    def is_local(self) -> bool:
        """Whether this is the machine running the network's owner."""
        return self.address in (LOCAL, "127.0.0.1")

    @property
    def dest(self) -> str:
        """ssh destination ``user@address``."""
        return f"{self.user}@{self.address}"

    def ssh_base(self) -> list[str]:
        """The ssh command (no destination) with our options: never ask for a password (the
        server's own options come first: ssh keeps the first value of each)."""
        return ["ssh", *self.ssh_options, "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                "-o", "ConnectTimeout=10"]


def parse_servers(servers) -> list[Server]:
    """Servers from names / ``user@host`` strings / :class:`Server` records; the first must
    be ``localhost`` (the machine that builds and owns the network)."""
    if isinstance(servers, (str, Server)) or not servers:
        raise TopologyError("servers must be a non-empty list, e.g. ['localhost', "
                            "'10.0.0.2'] (the first one is this machine)")
    out = []
    for s in servers:
        if isinstance(s, str):
            user, _, host = s.rpartition("@")
            s = Server(host, user=user or "root")
        if not isinstance(s, Server):
            raise TopologyError(f"servers: {s!r} is neither a host name nor a Server record")
        out.append(s)
    if not out[0].is_local:
        raise TopologyError(f"servers: the first server must be 'localhost' (this machine "
                            f"runs the network's owner), got {out[0].address!r}")
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise TopologyError(f"servers: names must be unique, got {names}")
    if sum(s.is_local for s in out) != 1:
        raise TopologyError("servers: 'localhost' may appear only once")
    return out


def place(topo: TestbedTopo, servers: list[Server], placement=None) -> dict[str, str]:
    """Node name -> server name for every node of ``topo``.

    ``placement``: None (the default rule, see the module docstring) or a dict node -> server
    name (or server index) that pins some nodes; the rest follow the default rule.
    """
    names = [s.name for s in servers]
    pinned: dict[str, str] = {}
    if placement is not None:
        if not isinstance(placement, dict):
            raise TopologyError("placement must be a dict node -> server name (or index), "
                                f"got {type(placement).__name__}")
        nodes = set(topo.host_names) | set(topo.switch_roles)
        for node, srv in placement.items():
            if node not in nodes:
                raise TopologyError(f"placement: {node!r} is not a node of this topology")
            if isinstance(srv, int) and not isinstance(srv, bool) and 0 <= srv < len(names):
                srv = names[srv]
            if srv not in names:
                raise TopologyError(f"placement[{node!r}]: {srv!r} is not a server; servers: "
                                    f"{names}")
            pinned[node] = srv
    adj: dict[str, set[str]] = {}
    for s in topo.link_specs:
        adj.setdefault(s.a, set()).add(s.b)
        adj.setdefault(s.b, set()).add(s.a)
    hosts = set(topo.host_names)
    nics = {n for n, r in topo.switch_roles.items() if r == "smartnic"}
    # a group: a switch with hosts, plus its hosts and the SmartNICs between them
    groups: list[list[str]] = []
    for sw in topo.switch_roles:
        if sw in nics:
            continue
        members = []
        for peer in sorted(adj.get(sw, ())):
            if peer in hosts:
                members.append(peer)
            elif peer in nics:
                members += [peer] + sorted(adj[peer] & hosts)
        if members:
            groups.append([sw, *members])
    out = dict(pinned)
    load = {n: sum(1 for v in out.values() if v == n) for n in names}
    for i, group in enumerate(groups):
        srv = next((out[n] for n in group if n in out), names[i * len(names) // len(groups)])
        for n in group:
            out.setdefault(n, srv)
            load[srv] += 1
    rest = [s for s in topo.switch_roles if s not in out]
    while rest:  # fabric switches next to placed ones first
        rest.sort(key=lambda s: -sum(p in out for p in adj.get(s, ())))
        sw = rest.pop(0)
        votes = {n: sum(1 for p in adj.get(sw, ()) if out.get(p) == n) for n in names}
        srv = max(names, key=lambda n: (votes[n], -load[n]))
        out[sw] = srv
        load[srv] += 1
    for h in topo.host_names:  # a host on no switch (cannot happen in our kinds)
        out.setdefault(h, names[0])
    return out


def crossing_links(topo: TestbedTopo, where: dict[str, str]) -> list:
    """Link specs whose two ends are on different servers (the tunnels)."""
    return [s for s in topo.link_specs if where[s.a] != where[s.b]]


def local_ip_towards(ip: str) -> str:
    """This machine's source address for packets to ``ip`` (``ip route get``)."""
    out = subprocess.run(["ip", "route", "get", ip], capture_output=True, text=True,
                         check=False).stdout
    m = re.search(r" src (\S+)", out)
    if not m:
        raise TopologyError(f"no route from this machine to server {ip}: {out.strip()}")
    return m.group(1)


def resolve(address: str) -> str:
    """IPv4 address of a host name (an IP stays as it is)."""
    try:
        return socket.gethostbyname(address)
    except OSError as e:
        raise TopologyError(f"server {address!r}: cannot resolve its address ({e})") from None


class Connection:
    """One ssh ControlMaster connection to a remote server; commands are sessions on it."""

    def __init__(self, server: Server, ready_timeout: float = 20.0):
        self.server = server
        self._dir = temp_dir("ssh")
        self.ctl = os.path.join(self._dir, "ctl")
        self.forwards: list[tuple[str, str]] = []
        self.master = Popen(server.ssh_base() + [
            "-M", "-S", self.ctl, "-N", "-o", "ControlPersist=no",
            "-o", "StreamLocalBindUnlink=yes", "-o", "ServerAliveInterval=5", server.dest],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while subprocess.run(self.prefix() + ["-O", "check", server.dest], capture_output=True,
                             check=False).returncode != 0:
            if self.master.poll() is not None or time.monotonic() > deadline:
                err = self.master.stderr.read().decode(errors="replace") \
                    if self.master.poll() is not None else "timed out"
                self.close()
                raise TopologyError(
                    f"cannot reach server {server.name} over ssh as {server.dest}: "
                    f"{err.strip()}. Check that 'ssh {server.dest} true' works without a "
                    "password (docs/cluster.md)")
            time.sleep(0.05)
        self._boot_id: str | None = None

    def prefix(self) -> list[str]:
        """ssh command through this connection, without the destination."""
        return self.server.ssh_base() + ["-S", self.ctl]

    def argv(self, command: str, tty: bool = False) -> list[str]:
        """Local argv that runs shell ``command`` on the server."""
        return self.prefix() + (["-tt"] if tty else []) + [self.server.dest, command]

    def run(self, command: str, input: str | None = None, check: bool = True,
            timeout: float = 60.0) -> str:
        """Run shell ``command`` on the server; its stdout (stderr too when it fails)."""
        res = subprocess.run(self.argv(command), input=input, capture_output=True, text=True,
                             check=False, timeout=timeout,
                             stdin=None if input is not None else subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise RuntimeError(f"on {self.server.name}: {command[:200]!r} exited "
                               f"{res.returncode}: {(res.stderr or res.stdout).strip()[-800:]}")
        return res.stdout

    def put(self, path: str, text: str) -> None:
        """Write ``text`` to ``path`` on the server (creating its folder)."""
        q = shlex.quote(path)
        self.run(f"mkdir -p {shlex.quote(os.path.dirname(path))} && cat > {q}", input=text)

    def forward(self, local: str, remote: str) -> None:
        """Forward local unix socket ``local`` to ``remote`` on the server."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local)
        res = subprocess.run(self.prefix() + ["-O", "forward", "-L", f"{local}:{remote}",
                                              self.server.dest], capture_output=True,
                             text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"forwarding {local} to {self.server.name}:{remote} failed: "
                               f"{res.stderr.strip()}")
        self.forwards.append((local, remote))

    def cancel(self, local: str) -> None:
        """Stop forwarding ``local`` (and remove the socket file)."""
        for fw in [f for f in self.forwards if f[0] == local]:
            subprocess.run(self.prefix() + ["-O", "cancel", "-L", f"{fw[0]}:{fw[1]}",
                                            self.server.dest], capture_output=True, check=False)
            self.forwards.remove(fw)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local)

    @property
    def boot_id(self) -> str:
        """The server kernel's boot id: equal to ours when the "server" is this machine."""
        if self._boot_id is None:
            self._boot_id = self.run("cat /proc/sys/kernel/random/boot_id").strip()
        return self._boot_id

    def same_kernel(self) -> bool:
        """Whether the server runs on this machine's kernel (a netns server)."""
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() == self.boot_id

    def close(self) -> None:
        """Cancel forwards, end the master connection."""
        for local, _ in list(self.forwards):
            self.cancel(local)
        if self.master.poll() is None:
            subprocess.run(self.prefix() + ["-O", "exit", self.server.dest],
                           capture_output=True, check=False)
            try:
                self.master.wait(5)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait(5)
        if self.master.stderr:
            self.master.stderr.close()
        with contextlib.suppress(OSError):
            os.unlink(self.ctl)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


class ServerLock:
    """The emulation lock of a remote server, held for as long as this object lives.

    ``flock`` on the server's lock file inside one ssh session that waits on its stdin: when
    the session ends (closed, or this process died), the server's kernel releases the lock.
    """

    def __init__(self, conn: Connection, timeout: float, path: str = "/run/testbed/"
                 "emulation.lock"):
        q = shlex.quote(path)
        cmd = (f"mkdir -p {shlex.quote(os.path.dirname(path))} && flock -w {timeout:.0f} {q} "
               "sh -c 'echo locked; exec cat >/dev/null' || echo busy")
        self.conn = conn
        self.proc = Popen(conn.argv(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        line = self.proc.stdout.readline().strip()
        if line != "locked":
            self.release()
            raise TopologyError(f"server {conn.server.name}: its emulation lock {path} is "
                                f"busy (another testbed network runs there); waited "
                                f"{timeout:.0f} s")

    def release(self) -> None:
        """Let go of the lock (end the session)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class RemoteNodeMixin(RemoteMixin):
    """A Mininet node whose shell and processes run on ``server`` through ``connection``.

    Mininet's ``RemoteMixin`` minus its ``sudo`` and ``mn -c`` clean-up hook: we log in as
    root, and cleaning a server is ``testbed cleanup`` there (only what is ours).
    """

    def __init__(self, name, server: Server | None = None,
                 connection: Connection | None = None, **kwargs):
        if server is None or connection is None:
            raise TopologyError(f"{name}: a remote node needs its server and connection")
        self.server, self.serverIP, self.user = server.name, server.address, server.user
        self.connection = connection
        self.dest = server.dest
        self.sshcmd = connection.prefix() + ["-tt", server.dest]
        self.controlPath, self.splitInit, self.isRemote = None, False, True
        self.shell, self.pid = None, None
        super(RemoteMixin, self).__init__(name, **kwargs)

    def _popen(self, cmd, sudo=True, tt=True, **params):  # noqa: ARG002 - Mininet's signature
        """Spawn ``cmd`` on the server (quoted for its shell) through the connection."""
        if isinstance(cmd, str):
            cmd = cmd.split()
        ssh = self.sshcmd if tt else [a for a in self.sshcmd if a != "-tt"]
        params.update(start_new_session=True)
        return Popen(ssh + [shlex.join(cmd)], **params)

    def put_file(self, path: str, text: str) -> None:
        """Write a file on this node's server."""
        self.connection.put(path, text)


class RemoteHost(RemoteNodeMixin, Host):
    """A host on a remote server."""


def remote_bridge(bridge_cls):
    """A remote variant of the testbed's Linux bridge class (which lives with the builder)."""

    class RemoteBridge(RemoteNodeMixin, bridge_cls):
        """A Linux bridge in a remote server's root namespace."""

    RemoteBridge.__name__ = f"Remote{bridge_cls.__name__}"
    return RemoteBridge


class RemoteEngineMixin:
    """Runs a programmable node's engine on its server.

    The config goes to the server over ssh; the engine's control socket is a server path,
    forwarded to the usual local one, so control clients work unchanged; counters are read
    back over ssh; stopping sends SIGTERM to the engine's pid on the server.
    """

    def _remote_path(self, kind: str) -> str:
        return os.path.join(RUN_DIR, "remote", f"{self.name}.{kind}")

    def config_dict(self) -> dict:
        """The engine config, with the control socket at its server path."""
        return {**super().config_dict(), "control_socket": self._remote_path("sock")}

    def _control_address(self) -> str:
        """The local end of the ssh forward (a path: OpenSSH forwards to files only)."""
        return socket_path(self.name)

    def _launch_engine(self, log) -> Popen:
        conn = self.connection
        conn.put(self._remote_path("json"), json.dumps(self.config_dict(), indent=1))
        pidf = self._remote_path("pid")
        argv = [sys.executable, "-m", "testbed.datapath.engine", "--config",
                self._remote_path("json"), "--counters-out", self._remote_path("counters.json"),
                f"testbed-node={self.name}"]
        cmd = (f"rm -f {self._remote_path('counters.json')} {self._remote_path('sock')}; "
               f"echo $$ > {pidf}; exec mnexec -a {self.pid} {shlex.join(argv)}")
        proc = Popen(conn.argv(f"sh -c {shlex.quote(cmd)}"), stdout=log,
                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        conn.forward(socket_path(self.name), self._remote_path("sock"))
        self.remote_pid = None
        return proc

    def server_pid(self) -> int | None:
        """The running engine's pid on its server."""
        if self.engine is None or self.engine.poll() is not None:
            return None
        if self.remote_pid is None:
            with contextlib.suppress(RuntimeError, ValueError):
                self.remote_pid = int(self.connection.run(f"cat {self._remote_path('pid')}"))
        return self.remote_pid

    def engine_pid(self) -> int | None:
        """The engine's pid on this machine: only when the server shares our kernel."""
        pid = self.server_pid()
        return pid if pid is not None and self.connection.same_kernel() else None

    def _signal_engine(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.connection.run(f"kill -TERM $(cat {self._remote_path('pid')}) 2>/dev/null",
                                check=False, timeout=10)

    def _kill(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.connection.run(f"kill -KILL $(cat {self._remote_path('pid')}) 2>/dev/null",
                                check=False, timeout=10)
        super()._kill()

    def _read_counters(self) -> dict | None:
        try:
            return json.loads(self.connection.run(
                f"cat {self._remote_path('counters.json')}", timeout=10))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            return None

    def _remove_engine_files(self, keep_log: bool) -> None:
        self.connection.cancel(socket_path(self.name))
        paths = " ".join(self._remote_path(k) for k in ("json", "counters.json", "pid", "sock"))
        folder = os.path.dirname(self._remote_path("json"))
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.connection.run(f"rm -f {paths}; rmdir {folder} 2>/dev/null", check=False,
                                timeout=10)
        if not keep_log:  # the log is written here, by the ssh session's output
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._files["log"])


class RemoteProgrammableSwitch(RemoteEngineMixin, RemoteNodeMixin, ProgrammableSwitch):
    """A programmable switch whose node and engine live on a remote server."""


class RemoteSmartNIC(RemoteEngineMixin, RemoteNodeMixin, SmartNIC):
    """A SmartNIC node whose engine runs on a remote server."""


def _run_on(node, command: str) -> str:
    """Run ``command`` in the root namespace of ``node``'s server."""
    conn = getattr(node, "connection", None)
    if conn is not None:
        return conn.run(command, check=False)
    res = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)
    return res.stdout + res.stderr


class TunnelMixin:
    """A link between nodes on different servers: one VXLAN device per end.

    Each end is created in its server's root namespace (``ip link add NAME type vxlan id VNI
    local OWN remote PEER``: the underlay socket stays there) and moved into the node, where
    it is shaped like any link. ``tunnel``: ``{"vni", "ips": {server: underlay address}}``.
    """

    def __init__(self, node1, node2, tunnel=None, **kwargs):
        if tunnel is None:
            raise TopologyError("a tunnel link needs its tunnel settings")
        self.tunnel = tunnel
        super().__init__(node1, node2, **kwargs)

    def makeIntfPair(self, intfname1, intfname2, addr1=None, addr2=None,  # noqa: N802, N803
                     node1=None, node2=None, deleteIntfs=True):  # noqa: N803, ARG002
        """Create the two VXLAN ends instead of a veth pair."""
        ips, vni = self.tunnel["ips"], self.tunnel["vni"]
        ends = ((node1, intfname1, addr1, node2), (node2, intfname2, addr2, node1))
        for node, name, addr, peer in ends:
            own, other = ips[_server_of(node)], ips[_server_of(peer)]
            mac = f" address {addr}" if addr else ""
            move = f" && ip link set {name} netns {node.pid}" if node.inNamespace else ""
            out = _run_on(node, f"ip link del {name} 2>/dev/null; ip link add {name}{mac} "
                                f"mtu 1500 type vxlan id {vni} local {own} remote {other} "
                                f"dstport {VXLAN_PORT} nolearning{move} && echo ok")
            if "ok" not in out.split():
                raise RuntimeError(f"creating tunnel end {name} on {_server_of(node)} failed: "
                                   f"{out.strip()}")


def _server_of(node) -> str:
    return getattr(node, "server", None) or LOCAL


def measure_underlay(conn: Connection | None, src_ip: str, dst_ip: str, seconds: float = 1.0,
                     port: int = 5399) -> dict:
    """Rate (Mb/s, TCP, iperf3) and one-way latency (ms, ping RTT/2) from this machine to a
    server's underlay address ``dst_ip`` (``conn`` reaches that server), as its tunnels see
    them."""
    out = {"src": src_ip, "dst": dst_ip}
    ping = subprocess.run(["ping", "-c", "5", "-i", "0.05", "-q", dst_ip], capture_output=True,
                          text=True, check=False).stdout
    m = re.search(r"= [\d.]+/([\d.]+)/", ping)
    out["latency_ms"] = round(float(m.group(1)) / 2, 4) if m else None
    server = Popen(conn.argv(f"iperf3 -s -1 -B {dst_ip} -p {port}"), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rate = None
        for _ in range(50):  # until the server listens
            res = subprocess.run(["iperf3", "-c", dst_ip, "-p", str(port), "-t", f"{seconds:g}",
                                  "-J"], capture_output=True, text=True, check=False)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rate = json.loads(res.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6
                break
            if server.poll() is not None:  # it served a failed attempt, or could not start
                break
            time.sleep(0.1)
        out["rate_mbps"] = None if rate is None else round(rate, 1)
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(5)
    return out


def cleanup_servers(servers, wait: float = 10.0) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Clean the remote servers of a cluster network over ssh, then this machine.

    Each server runs its own ``testbed cleanup`` (same venv path as here), which removes only
    what is ours there; a "server" on this machine's kernel (a netns server) is cleaned under
    the lock this call holds for that kernel, so it skips taking it again. Returns this
    machine's result (as :func:`testbed.cleanup.cleanup`) and server name -> that server's report (its output,
    or why it could not be cleaned).
    """
    remote: dict[str, str] = {}
    with emulation_lock(timeout=wait, guard=False):
        for srv in parse_servers(["localhost", *servers])[1:]:
            try:
                conn = Connection(srv)
            except Exception as e:  # noqa: BLE001 - reported per server
                remote[srv.name] = f"not cleaned: {e}"
                continue
            try:
                force = " --force" if conn.same_kernel() else ""
                remote[srv.name] = conn.run(f"COLUMNS=200 {sys.executable} -m testbed.cli cleanup{force}",
                                            check=False, timeout=120).strip()
            finally:
                conn.close()
        local = cleanup(force=False, wait=wait)
    return local, remote
