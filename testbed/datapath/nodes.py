"""Mininet node classes whose ports are served by the data-path engine.

* :class:`ProgrammableSwitch` - a Tofino-class switch: a Mininet ``Switch`` that lives in its own
  network namespace (like a host) and runs ``python -m testbed.datapath.engine`` there on
  ``start()``; ``stop()`` sends SIGTERM, waits, keeps the final counters in
  ``final_counters`` and removes its files (config, log on success).
* :class:`SmartNIC` - a BlueField-class bump in the wire: a two-port node between a host and its
  ToR; default program ``wire`` (port 0 <-> port 1), or ``nic_codec``, which converts
  payloads and forwards between the two ports itself.

``testbed.topologies.TestbedNet`` builds every network and picks these classes for the
programmable nodes of a topology, with the programs ``testbed.topologies.pipeline`` composes;
``testbed.testing.programmable_star`` is the small star the data-path tests use. A running
node is reached through its control channel, from the root network namespace only (the
provider's side; see ``testbed.datapath.control``)::

    sw.client().counters()

Node options: ``programs`` (list of ``(name, settings)`` / dicts / names), ``agg_ip`` /
``agg_mac`` (copied into the ``aggregate`` program's settings), ``rx_burst``, ``flood_ports``,
``ready_timeout`` (seconds to wait for the engine; the first start compiles kernels), and the
engine's I/O and scheduling settings :data:`ENGINE_KEYS` (copied into its config as given).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from mininet.node import Switch

from testbed.datapath.control import (
    RUN_DIR,
    ControlError,
    DatapathClient,
    control_address,
    listen,
    netns_id,
    socket_path,
)
from testbed.datapath.engine import COMPILING
from testbed.datapath.forks import EngineServer, ForkedProcess
from testbed.datapath.programs import normalize_programs

_OFFLOADS = ["tx", "off", "rx", "off", "gso", "off", "tso", "off", "gro", "off"]
#: engine settings a node passes through to its config (see ``testbed.datapath.engine``)
ENGINE_KEYS = ("io", "rx_ring_frames", "tx_ring_frames", "coalesce_us", "sched")


def not_ready_reason(log: str) -> str:
    """Why an engine that is still running did not answer in time, and what to do, from its
    log."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    if lines and lines[-1].startswith(COMPILING):
        return ("it was still compiling its kernels (Numba's cache was cold, and other "
                "processes compiled at the same time); run 'testbed warm' once, then run "
                "again, or give the node a longer ready_timeout")
    if not lines:
        return ("it had not started its program yet (Python start-up and imports on a "
                "loaded machine); see whether the CPUs are saturated ('testbed doctor', top)")
    return ("its kernels were ready but it did not open its ports and control socket: "
            "see the end of its log below")


class ProgrammableSwitch(Switch):
    """A switch whose ports are served by one engine process in the switch's namespace."""

    default_programs: list = [("forward", {})]

    def __init__(self, name: str, programs=None, agg_ip: str | None = None,
                 agg_mac: str | None = None, rx_burst: int = 256, flood_ports=None,
                 ready_timeout: float = 120.0, **params):
        params.setdefault("inNamespace", True)
        if not name.startswith("tb"):
            raise ValueError(f"node name {name!r} must start with 'tb' (see docs/architecture.md)")
        self.programs = normalize_programs(programs if programs is not None
                                           else self.default_programs)
        for pname, settings in self.programs:
            if pname == "aggregate":
                if agg_ip:
                    settings.setdefault("agg_ip", agg_ip)
                if agg_mac:
                    settings.setdefault("agg_mac", agg_mac)
        self.rx_burst = rx_burst
        self.engine_settings = {k: params.pop(k) for k in ENGINE_KEYS if k in params}
        self.flood_ports = flood_ports
        self.ready_timeout = ready_timeout
        self.engine: subprocess.Popen | ForkedProcess | None = None
        #: the fork server that starts this node's engine (set by the network that starts
        #: it; None: the engine is started as a process of its own)
        self.spawner: EngineServer | None = None
        #: the engine process this node shares with others (an engine group), else None
        self.shared: SharedEngine | None = None
        self.final_counters: dict | None = None
        Switch.__init__(self, name, **params)
        self._files = {k: os.path.join(RUN_DIR, f"{name}.{k}")
                       for k in ("json", "counters.json", "log")}

    # ports in Mininet order (port numbers 1..), the engine's port indices are 0..
    def port_names(self) -> list[str]:
        """Data ports of this node in engine order (index 0 = Mininet port 1)."""
        return [i.name for _, i in sorted(self.intfs.items()) if i.name != "lo"]

    def _disable_offloads(self) -> None:
        for intf in self.intfList():
            if intf.name == "lo":
                continue
            self.cmd("ethtool", "-K", intf.name, *_OFFLOADS)
            link = intf.link
            if link is not None:
                peer = link.intf2 if link.intf1 is intf else link.intf1
                peer.node.cmd("ethtool", "-K", peer.name, *_OFFLOADS)

    def config_dict(self) -> dict:
        """The engine config this node starts with."""
        return {"node": self.name, "ports": self.port_names(),
                "programs": [{"name": n, "settings": s} for n, s in self.programs],
                "flood_ports": self.flood_ports, "rx_burst": self.rx_burst,
                "control_socket": control_address(self.name), "disable_offloads": False,
                **self.engine_settings}

    def start(self, controllers) -> None:
        """Start the engine in this node's namespace and wait until it answers."""
        os.makedirs(RUN_DIR, exist_ok=True)
        for intf in self.intfList():
            if intf.name != "lo":
                self.cmd("ip link set", intf.name, "up")
        self._disable_offloads()
        self._run_engine("w")

    def _run_engine(self, log_mode: str) -> None:
        """Launch the engine (its log opened with ``log_mode``) and wait until it answers;
        a node of an engine group leaves that to its group."""
        if self.shared is not None:
            self.shared.arrive(self, log_mode)
            return
        log = open(self._files["log"], log_mode)  # noqa: SIM115 - handed to the child
        try:
            self.engine = self._launch_engine(log)
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Wait until this node's engine answers on its control channel (RuntimeError, with
        the reason and its log, when it exits or does not answer within ready_timeout)."""
        client = DatapathClient(self._control_address())
        deadline = time.monotonic() + self.ready_timeout
        try:
            while True:
                if self.engine.poll() is not None:
                    raise RuntimeError(f"{self.name}: engine exited with {self.engine.returncode}"
                                       f" during start:\n{self._log_tail()}")
                try:
                    client.request("ping")
                    break
                except (ControlError, OSError):
                    client.close()
                if time.monotonic() > deadline:
                    tail = self._log_tail()
                    self._kill()
                    raise RuntimeError(f"{self.name}: engine not ready after "
                                       f"{self.ready_timeout} s: {not_ready_reason(tail)}\n"
                                       f"its log ({self._files['log']}):\n{tail}")
                time.sleep(0.05)
        finally:
            client.close()

    def _launch_engine(self, log) -> subprocess.Popen | ForkedProcess:
        """Write the config and start the engine in this node's namespace, output to ``log``
        (a remote node starts it on its server instead). The control socket listens in this
        (root) network namespace and is inherited by the engine, which runs in the node's:
        reachable by the provider side, not from hosts."""
        ctl = self._prepare_engine()
        try:
            return self._spawn([*self._engine_argv(), f"testbed-node={self.name}"], log, [ctl])
        finally:
            ctl.close()  # the engine holds it now; when it exits, the address is free again

    def _prepare_engine(self):
        """Write this node's engine config and return its listening control socket (in
        this, the root, network namespace)."""
        if os.path.exists(self._files["counters.json"]):
            os.unlink(self._files["counters.json"])
        ctl = listen(control_address(self.name))
        try:
            config = dict(self.config_dict(), control_fd=ctl.fileno(), control_netns=netns_id())
            with open(self._files["json"], "w") as fh:
                json.dump(config, fh, indent=1)
        except BaseException:
            ctl.close()
            raise
        return ctl

    def _engine_argv(self) -> list[str]:
        return ["--config", self._files["json"], "--counters-out", self._files["counters.json"]]

    def _spawn(self, argv: list[str], log, controls: list) -> subprocess.Popen | ForkedProcess:
        """Start ``python -m testbed.datapath.engine ARGV`` in this node's namespace, from
        the fork server when there is one."""
        if self.spawner is not None and self.spawner.alive():
            return self.spawner.spawn(argv, self.pid, log, controls)
        return self.popen([sys.executable, "-m", "testbed.datapath.engine", *argv],
                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          pass_fds=tuple(c.fileno() for c in controls))

    def _control_address(self) -> str:
        """Where this node's control clients connect (a remote node: its forwarded path)."""
        return control_address(self.name)

    def engine_pid(self) -> int | None:
        """PID of the running engine on this machine (None when it is not running here)."""
        if self.engine is None or self.engine.poll() is not None:
            return None
        return int(self.engine.pid)

    def _signal_engine(self) -> None:
        self.engine.send_signal(signal.SIGTERM)

    def _read_counters(self) -> dict | None:
        try:
            with open(self._files["counters.json"]) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def _remove_engine_files(self, keep_log: bool) -> None:
        for k in ("json", "counters.json") + (() if keep_log else ("log",)):
            try:
                os.unlink(self._files[k])
            except FileNotFoundError:
                pass
        try:  # the engine removes it; a SIGKILLed one cannot
            os.unlink(socket_path(self.name))
        except FileNotFoundError:
            pass

    def _log_tail(self, n: int = 4000) -> str:
        try:
            with open(self._files["log"]) as fh:
                return fh.read()[-n:]
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.engine is not None and self.engine.poll() is None:
            self.engine.kill()
            self.engine.wait(5)

    def client(self) -> DatapathClient:
        """A control-channel client for this node's engine."""
        return DatapathClient(self._control_address())

    def stop_engine(self, timeout: float = 10.0) -> dict | None:
        """SIGTERM the engine, wait, return (and keep) its final counters."""
        if self.engine is None:
            return self.final_counters
        if self.shared is not None:
            self.shared.stop(timeout)
        elif self.engine.poll() is None:
            self._signal_engine()
            try:
                self.engine.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        rc = self.engine.returncode
        self.engine = None
        self.final_counters = self._read_counters()
        self._remove_engine_files(keep_log=rc != 0)
        if rc != 0 and (self.shared is None or self.shared.members[0] is self):
            who = self.name if self.shared is None else f"engine group {self.shared.nodes}"
            print(f"{who}: engine exited with {rc}; log kept at {self._files['log']}",
                  file=sys.stderr)
        return self.final_counters

    def restart_engine(self) -> float:
        """Start the engine again (after it died or was killed; a running one is stopped
        first) with the configuration it started with: its ports, programs and tables, and
        none of its run-time state (registered jobs, counters). Its log continues. Returns
        the seconds it took until the engine answered."""
        if self.shared is not None:
            raise RuntimeError(f"{self.name} shares its engine process with "
                               f"{[n for n in self.shared.nodes if n != self.name]} (an "
                               "engine group): they start and stop together, with the "
                               "network; build it without engine_groups to restart one")
        t0 = time.monotonic()
        if self.engine is not None and self.engine.poll() is None:
            self.stop_engine()
        elif self.engine is not None:  # died: reap it, keep its log for the record
            self.engine.wait()
            self.engine = None
        try:  # a killed engine leaves its socket path behind
            os.unlink(socket_path(self.name))
        except FileNotFoundError:
            pass
        with open(self._files["log"], "a") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} engine restarted ---\n")
        self._run_engine("a")
        return time.monotonic() - t0

    def stop(self, deleteIntfs: bool = True) -> None:
        """Stop the engine (final counters in ``final_counters``), then the node."""
        self.stop_engine()
        Switch.stop(self, deleteIntfs)

    def terminate(self) -> None:
        """Make sure no engine outlives the node."""
        self.stop_engine()
        Switch.terminate(self)


class SharedEngine:
    """One engine process serving several programmable nodes of a network (an engine group,
    :mod:`testbed.datapath.group`), with the ``links`` between them (pairs of interface
    names) carried in memory. Every member's ``start`` arrives here; the last one starts
    the process with every member's config and control socket, and waits until each answers.
    The members share the process handle (``engine``) and the first member's log; they stop
    together (:meth:`stop`, once, whoever asks first)."""

    def __init__(self, members: list[ProgrammableSwitch], links: list[tuple[str, str]]):
        self.members = list(members)
        self.nodes = [m.name for m in self.members]
        self.links = [tuple(link) for link in links]
        self._lock = threading.Lock()
        self._arrived: set[str] = set()
        self.proc: subprocess.Popen | ForkedProcess | None = None
        for m in self.members:
            m.shared = self
            m._files["log"] = self.members[0]._files["log"]

    def arrive(self, node: ProgrammableSwitch, log_mode: str) -> None:
        """``node`` is ready to be served; the last member to arrive starts the process."""
        with self._lock:
            self._arrived.add(node.name)
            if len(self._arrived) < len(self.members):
                return
            self._arrived.clear()
        self._launch(log_mode)

    def _launch(self, log_mode: str) -> None:
        first = self.members[0]
        spaces = {os.stat(f"/proc/{m.pid}/ns/net").st_ino for m in self.members}
        if len(spaces) > 1:
            raise RuntimeError(f"engine group {self.nodes}: its nodes are in different "
                               "network namespaces; one process serves them from one")
        controls = []
        log = open(first._files["log"], log_mode)  # noqa: SIM115 - handed to the child
        try:
            argv: list[str] = []
            for m in self.members:
                controls.append(m._prepare_engine())
                argv += m._engine_argv()
            for a, b in self.links:
                argv += ["--link", f"{a}={b}"]
            argv += [f"testbed-node={n}" for n in self.nodes]
            self.proc = first._spawn(argv, log, controls)
        finally:
            log.close()
            for c in controls:
                c.close()
        for m in self.members:
            m.engine = self.proc
        for m in self.members:
            m._wait_ready()

    def stop(self, timeout: float) -> None:
        """SIGTERM the process and wait for it (SIGKILL after ``timeout``); once."""
        with self._lock:
            proc = self.proc
            if proc is None or proc.poll() is not None:
                return
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


class SmartNIC(ProgrammableSwitch):
    """Two-port bump in the wire between a host (port 0) and its ToR (port 1)."""

    default_programs: list = [("wire", {})]

    def start(self, controllers) -> None:
        """Check the node has exactly two ports, then start the engine."""
        if len(self.port_names()) != 2:
            raise ValueError(f"SmartNIC {self.name} needs exactly 2 links (host, ToR), has "
                             f"{self.port_names()}")
        super().start(controllers)
