"""A second "server" on this machine: a network namespace running its own sshd.

Cluster networks (:mod:`testbed.topologies.cluster`) reach their servers only over ssh and
join them by VXLAN tunnels over the servers' own addresses. :class:`NetnsServer` gives a test
(or someone trying the cluster mode on one machine) such a server without a second machine:

* a named network namespace ``tb-srvK`` with a veth ``tbsrvKr`` (root side, ``10.250.K.1``) /
  ``tbsrvKs`` (server side, ``10.250.K.2``), MTU 9000 so a VXLAN-encapsulated 1500-byte frame
  fits;
* an ``sshd`` in it (``ip netns exec``: its sessions see the namespace's own ``/sys``), root
  login by an ed25519 key generated for this server only, ``UseDNS no``, its files under
  ``/run/testbed/tb-srvK/`` (so ``testbed cleanup`` recognises it);
* :attr:`NetnsServer.server` - the :class:`~testbed.topologies.cluster.Server` record that
  reaches it (address, key, options).

What it proves and what it does not: every command for the server's nodes, every link on it,
its data-path engines, their control sockets, its tunnels and its cleanup really go over ssh
and the VXLAN underlay. But the namespace shares this machine's kernel, file system and PID
namespace: a file written "remotely" is also visible locally, a remote pid is a local pid, and
the CPU is the same CPU. It holds this machine's emulation lock for its whole life (a
``tb-*`` namespace is what ``testbed cleanup`` removes, so it may exist only while its owner
holds the lock; a ``TestbedNet`` built inside takes the same lock again, re-entrantly). The cluster code never relies on that where it has a remote way (it
copies files and forwards sockets over ssh, and runs a collective's ranks of this server in a
pool started here over ssh), and says where it still does (a training job's pool enters every
host's namespace from one process, which needs one PID namespace).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

from testbed.cleanup import temp_dir
from testbed.netlock import emulation_lock
from testbed.topologies.cluster import Server

SSHD = "/usr/sbin/sshd"
RUN_DIR = "/run/testbed"


class ServerUnavailable(RuntimeError):
    """This machine cannot host a netns server (no sshd, no ssh client, not root)."""


def available() -> str | None:
    """Why a :class:`NetnsServer` cannot start here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    for tool, pkg in ((SSHD, "openssh-server"), ("ssh", "openssh-client"),
                      ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            return f"{tool} not found: install {pkg} ('make setup' does)"
    return None


def _run(*cmd: str, netns: str | None = None) -> str:
    full = (["ip", "netns", "exec", netns] if netns else []) + list(cmd)
    res = subprocess.run(full, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise ServerUnavailable(f"{' '.join(full)} failed: {res.stderr.strip()}")
    return res.stdout


class NetnsServer:
    """Context manager: start netns server ``index`` (2..250), yield it, tear it all down."""

    def __init__(self, index: int = 2, ready_timeout: float = 20.0,
                 lock_timeout: float = 600.0):
        if not isinstance(index, int) or not 2 <= index <= 250:
            raise ValueError(f"index must be an integer 2..250 (it names tb-srvK and "
                             f"10.250.K.0/24), got {index!r}")
        self.index = index
        self.netns = f"tb-srv{index}"
        self.root_if, self.srv_if = f"tbsrv{index}r", f"tbsrv{index}s"
        self.root_ip, self.address = f"10.250.{index}.1", f"10.250.{index}.2"
        self.dir = os.path.join(RUN_DIR, self.netns)
        # the client key lives outside the run folder: ssh clients naming it are this
        # machine's, not the server's, and a cleanup on the server must not take them for its own
        self._keydir = temp_dir("srv-key")
        self.key = os.path.join(self._keydir, "id_ed25519")
        self.ready_timeout = ready_timeout
        self.sshd: subprocess.Popen | None = None
        self.server: Server | None = None
        self.lock_timeout = lock_timeout
        self._lock = None

    def __enter__(self) -> NetnsServer:
        why = available()
        if why:
            raise ServerUnavailable(why)
        self._lock = emulation_lock(timeout=self.lock_timeout)
        self._lock.__enter__()
        if os.path.exists(f"/run/netns/{self.netns}"):
            self.close()
            raise ServerUnavailable(f"netns {self.netns} exists already: a previous run was not "
                                    "cleaned up; run 'testbed cleanup'")
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.root_if, "mtu", "9000", "type", "veth", "peer", "name",
             self.srv_if, "mtu", "9000", "netns", self.netns)
        _run("ip", "addr", "add", f"{self.root_ip}/24", "dev", self.root_if)
        _run("ip", "link", "set", self.root_if, "up")
        _run("ip", "addr", "add", f"{self.address}/24", "dev", self.srv_if, netns=self.netns)
        _run("ip", "link", "set", self.srv_if, "up", netns=self.netns)
        _run("ip", "link", "set", "lo", "up", netns=self.netns)
        for path in (self.key, os.path.join(self.dir, "host_ed25519")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.netns, "-f", path)
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
        cfg = os.path.join(self.dir, "sshd_config")
        with open(cfg, "w") as f:
            f.write("\n".join([
                f"ListenAddress {self.address}", "Port 22",
                f"HostKey {self.dir}/host_ed25519",
                f"AuthorizedKeysFile {self.dir}/authorized_keys",
                f"PidFile {self.dir}/sshd.pid",
                "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "UseDNS no",
                "MaxSessions 500", "MaxStartups 200", "AllowStreamLocalForwarding yes",
                "StreamLocalBindUnlink yes", "LogLevel ERROR", ""]))
        log = open(os.path.join(self.dir, "sshd.log"), "w")  # noqa: SIM115 - the child's
        try:
            self.sshd = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, SSHD, "-D", "-e", "-f", cfg],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)  # a server outlives its client's process group
        finally:
            log.close()
        self.server = Server(self.address, name=self.netns, user="root",
                             ssh_options=("-i", self.key, "-o", "IdentitiesOnly=yes",
                                          "-o", "StrictHostKeyChecking=no",
                                          "-o", "UserKnownHostsFile=/dev/null"))
        deadline = time.monotonic() + self.ready_timeout
        while True:
            res = subprocess.run(self.server.ssh_base() + [self.server.dest, "true"],
                                 capture_output=True, text=True, check=False,
                                 stdin=subprocess.DEVNULL)
            if res.returncode == 0:
                return
            if self.sshd.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(self.dir, "sshd.log")) as f:
                    tail = f.read()[-2000:]
                raise ServerUnavailable(f"sshd in {self.netns} did not answer: "
                                        f"{res.stderr.strip()} {tail}")
            time.sleep(0.1)

    def close(self) -> None:
        """Stop sshd, delete the veth and the namespace, remove the files."""
        if self.sshd is not None:
            if self.sshd.poll() is None:
                self.sshd.terminate()
                try:
                    self.sshd.wait(5)
                except subprocess.TimeoutExpired:
                    self.sshd.kill()
                    self.sshd.wait(5)
            self.sshd = None
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self._keydir, ignore_errors=True)
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.__exit__(None, None, None)
