"""Engines forked from one warm process instead of each started afresh.

Every engine used to be its own ``python -m testbed.datapath.engine``: each imported numpy,
Numba and its stages and loaded their kernels before answering, about 0.45 s of CPU and
100 MB of private memory apiece (measured on a fat-tree k=4: 20 engines on 2 cores took
9-11 s to start, 0.94 CPU-s each). A network now starts one *fork server* first, running the
same module (``python -m testbed.datapath.engine --fork-server``, so an engine is still an
engine to ``testbed cleanup`` and to anyone reading ``ps``). It imports and loads the kernels
of the network's stages and port counts once, then forks a child per node; a child shares the
loaded code copy-on-write, enters the node's network namespace and runs the engine's
:func:`~testbed.datapath.engine.main` with the node's config, log and control socket.

Requests go over a Unix socket pair, one JSON line each with file descriptors attached
(``SCM_RIGHTS``): ``spawn`` (the node's network namespace, its log, its control socket;
answer: the pid) and ``status`` (the exit status of a child that has exited; the server is
its parent and reaps it). Lifetimes: the server ends when its socket closes (its owner
closed it or died); its children hold ``PR_SET_PDEATHSIG`` = SIGTERM towards it, so they
stop cleanly and write their counters; every child also follows the network's owner
(:func:`testbed.lifeline.follow_owner`), as a started engine does.

:class:`EngineProcess` is the owner's handle of a forked engine with the part of
:class:`subprocess.Popen` the switches use (``pid``, ``poll``, ``wait``, ``send_signal``,
``kill``, ``returncode``); it watches the child through a pidfd, so a signal never reaches
a reused pid. ``TESTBED_ENGINE_START=exec`` starts every engine as its own process, as
before (for comparison, or where forking misbehaves).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

START_ENV = "TESTBED_ENGINE_START"
START_MODES = ("fork", "exec")
#: seconds the owner waits for the server to load its kernels (a cold cache compiles them)
READY_TIMEOUT_S = 600.0
MAX_MESSAGE = 1 << 20
#: descriptors a spawn request may carry: the namespace, the log and a control socket per
#: node (an engine group has several); the kernel's limit per message (SCM_MAX_FD) is 253
MAX_SPAWN_FDS = 253
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def start_mode() -> str:
    """How engines start: ``fork`` (from a warm server, the default) or ``exec``."""
    mode = os.environ.get(START_ENV, "fork").strip().lower() or "fork"
    if mode not in START_MODES:
        raise ValueError(f"{START_ENV}={mode!r}: use one of {', '.join(START_MODES)}")
    return mode


def _send(sock: socket.socket, obj: dict, fds: Iterable[int] = ()) -> None:
    data = (json.dumps(obj) + "\n").encode()
    fds = list(fds)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], anc)


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors sent with it; (None, []) when the peer closed."""
    size = socket.CMSG_SPACE(max_fds * 4) if max_fds else 0
    data, anc, _flags, _ = sock.recvmsg(MAX_MESSAGE, size)
    fds: list[int] = []
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(raw[:len(raw) - len(raw) % a.itemsize])
            fds.extend(a)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


# ----- the server (runs in the fork server process) ---------------------------------------
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _child(req: dict, fds: list[int], server_sock: socket.socket) -> int:
    """In the forked child: become the node's engine. Returns its exit status."""
    netns_fd, log_fd, *control_fds = fds
    server_sock.close()
    libc = _libc()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()  # a Ctrl-C to the owner's terminal is the owner's to handle
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return 70
    if os.getppid() != req["server_pid"]:
        return 0  # the server died before the line above: nobody waits for this engine
    if libc.setns(netns_fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        os.write(log_fd, f"cannot enter the node's network namespace: "
                         f"{os.strerror(err)}\n".encode())
        return 71
    os.close(netns_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in (null, log_fd):
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    from testbed.datapath.engine import main

    return main(req["argv"], control_fds=control_fds)


def _reap(statuses: dict[int, int], children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            statuses[pid] = os.waitstatus_to_exitcode(status)


def serve(fd: int, stages: list[str], port_counts: list[int]) -> int:
    """The fork server's loop on the socket ``fd`` (see the module docstring)."""
    from testbed.datapath.engine import preload_kernels

    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ends when its owner closes the socket
    t0 = time.monotonic()
    preload_kernels(stages, port_counts)
    # what is loaded now is shared by every child: keep the collector off those pages
    gc.collect()
    gc.freeze()
    print(f"fork server: kernels of {stages} for {port_counts} ports ready in "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    try:
        _send(sock, {"ready": True, "pid": os.getpid()})
    except OSError:  # the network was torn down while this loaded: nothing to serve
        return 0
    statuses: dict[int, int] = {}
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.5)
        _reap(statuses, children)
        if not ready:
            continue
        req, fds = _recv(sock, max_fds=MAX_SPAWN_FDS)
        if req is None:
            return 0
        if req.get("op") == "spawn":
            if len(fds) < 3:
                for f in fds:
                    os.close(f)
                _send(sock, {"error": f"spawn needs at least 3 descriptors, got {len(fds)}"})
                continue
            sys.stdout.flush()
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                rc = 1
                try:
                    rc = _child(dict(req, server_pid=me), fds, sock)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 1
                except BaseException:  # noqa: BLE001 - reported in the engine's log
                    import traceback

                    traceback.print_exc()
                finally:
                    with contextlib.suppress(Exception):
                        sys.stdout.flush()
                        sys.stderr.flush()
                    os._exit(rc)
            for f in fds:
                os.close(f)
            children.add(pid)
            _send(sock, {"pid": pid})
        elif req.get("op") == "status":
            pid = int(req["pid"])
            if pid in children:
                _, status = os.waitpid(pid, 0)  # asked once its pidfd said it exited
                children.discard(pid)
                statuses[pid] = os.waitstatus_to_exitcode(status)
            _send(sock, {"returncode": statuses.pop(pid, None)})
        else:
            _send(sock, {"error": f"unknown op {req.get('op')!r}"})


# ----- the owner's side ---------------------------------------------------------------
class EngineProcess:
    """A forked engine, seen from its owner (a :class:`subprocess.Popen` look-alike)."""

    def __init__(self, server: EngineServer, pid: int):
        self.server = server
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["fork", pid]
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # exited already (and reaped by its server)
            self._pidfd = None

    def _exited(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(ready)

    def poll(self) -> int | None:
        """The exit status once the engine has exited (negative: the signal), else None."""
        if self.returncode is None and self._exited(0):
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the engine to exit; :class:`subprocess.TimeoutExpired` after ``timeout``."""
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def _collect(self) -> None:
        rc = self.server.status(self.pid)
        self.returncode = -signal.SIGKILL if rc is None else rc  # server gone: status lost
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        """Signal the engine (through its pidfd: never another process that reused its pid)."""
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self):
        if getattr(self, "_pidfd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)


class EngineServer:
    """The owner's side of a fork server: start it, spawn engines from it, close it.

    ``stages`` and ``port_counts``: what the network's engines run (their kernels load once
    in the server). Thread-safe: a network starts its switches from several threads.
    """

    def __init__(self, stages: Iterable[str], port_counts: Iterable[int], log_path: str):
        self.stages = sorted(set(stages))
        self.port_counts = sorted(set(port_counts))
        self.log_path = log_path
        self._lock = threading.Lock()
        # message boundaries kept: one request, one answer, each with its descriptors
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock: socket.socket | None = ours
        try:
            with open(log_path, "w") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "testbed.datapath.engine", "--fork-server",
                     str(theirs.fileno()), "--stages", ",".join(self.stages),
                     "--port-counts", ",".join(map(str, self.port_counts))],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self._ready = False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the server has loaded its kernels (RuntimeError with its log if it
        died or took longer than ``timeout``)."""
        with self._lock:
            if self._ready:
                return
            ready, _, _ = select.select([self._sock], [], [], timeout)
            msg = _recv(self._sock)[0] if ready else None
            if not msg or not msg.get("ready"):
                self.close()
                raise RuntimeError(f"the engines' fork server did not start "
                                   f"({'it exited' if ready else f'not ready in {timeout:.0f} s'})"
                                   f"; its log ({self.log_path}):\n{self._log_tail()}")
            self._ready = True

    def _log_tail(self) -> str:
        try:
            with open(self.log_path) as fh:
                return fh.read()[-4000:]
        except OSError:
            return "(no log)"

    def _ask(self, req: dict, fds: Iterable[int] = ()) -> dict:
        with self._lock:
            if self._sock is None:
                raise RuntimeError("the engines' fork server is closed")
            _send(self._sock, req, fds)
            msg, _ = _recv(self._sock)
        if msg is None:
            raise RuntimeError(f"the engines' fork server exited; its log ({self.log_path}):"
                               f"\n{self._log_tail()}")
        if "error" in msg:
            raise RuntimeError(f"fork server: {msg['error']}")
        return msg

    def spawn(self, argv: list[str], netns_pid: int, log,
              controls: list[socket.socket]) -> EngineProcess:
        """Fork an engine with arguments ``argv`` (those of ``python -m
        testbed.datapath.engine``) in the network namespace of process ``netns_pid``, its
        output to the open file ``log``, listening on ``controls`` (one per ``--config``)."""
        self.wait_ready()
        netns = os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY)
        try:
            msg = self._ask({"op": "spawn", "argv": argv, "env": dict(os.environ)},
                            (netns, log.fileno(), *(c.fileno() for c in controls)))
        finally:
            os.close(netns)
        return EngineProcess(self, int(msg["pid"]))

    def status(self, pid: int) -> int | None:
        """The exit status of exited child ``pid`` (None if the server no longer knows)."""
        try:
            return self._ask({"op": "status", "pid": pid}).get("returncode")
        except (RuntimeError, OSError):
            return None

    def alive(self) -> bool:
        return self._sock is not None and self.proc.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """End the server (its children get SIGTERM from their parent-death signal: stop
        the engines first to keep their counters)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
