"""Processes forked from one warm process instead of each started afresh.

Every engine used to be its own ``python -m testbed.datapath.engine``: each imported numpy,
Numba and its stages and loaded their kernels before answering, about 0.45 s of CPU and
100 MB of private memory apiece (measured on a fat-tree k=4: 20 engines on 2 cores took
9-11 s to start, 0.94 CPU-s each). A network now starts one *fork server* first, running the
same module (``python -m testbed.datapath.engine --fork-server``, so an engine is still an
engine to ``testbed cleanup`` and to anyone reading ``ps``). It imports and loads the kernels
of the network's stages and its ring I/O once, then forks a child per node; a child shares the
loaded code copy-on-write, enters the node's network namespace and runs the engine's
:func:`~testbed.datapath.engine.main` with the node's config, log and control socket.

The collectives' pools are forked the same way (:class:`PoolServer`, ``python -m
testbed.collectives.worker --fork-server``): an INA collective's pool spent 0.5-0.6 s of its
0.65 s set-up importing Numba and loading the client's kernels, every time.

Requests go over a Unix socket pair, one JSON line each with file descriptors attached
(``SCM_RIGHTS``): ``spawn`` (the child's log, its network namespace when it has one, the
descriptors it serves; answer: the pid) and ``status`` (the exit status of a child that has
exited; the server is its parent and reaps it). Lifetimes: the server ends when its socket
closes (its owner closed it or died); its children hold ``PR_SET_PDEATHSIG`` = SIGTERM
towards it, so they stop cleanly and write their counters; every child also follows the
network's owner (:func:`testbed.lifeline.follow_owner`), as a started engine does.

:class:`ForkedProcess` is the owner's handle of a forked child with the part of
:class:`subprocess.Popen` the switches and the collective runner use (``pid``, ``poll``,
``wait``, ``send_signal``, ``kill``, ``returncode``); it watches the child through a pidfd,
so a signal never reaches a reused pid. ``TESTBED_ENGINE_START=exec`` starts every engine as
its own process, as before (for comparison, or where forking misbehaves), and
``TESTBED_POOL_START=exec`` every collective's pool.
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
from collections.abc import Callable, Iterable

START_ENV = "TESTBED_ENGINE_START"
#: how the collectives' pools start (the same two modes)
POOL_START_ENV = "TESTBED_POOL_START"
START_MODES = ("fork", "exec")
#: the server's own log, which it removes when it ends well (set for the server only)
SERVER_LOG_ENV = "TESTBED_FORK_SERVER_LOG"
#: seconds the owner waits for the server to load its kernels (a cold cache compiles them)
READY_TIMEOUT_S = 600.0
MAX_MESSAGE = 1 << 20
#: descriptors a spawn request may carry: the log, the namespace and a control socket per
#: node (an engine group has several); the kernel's limit per message (SCM_MAX_FD) is 253
MAX_SPAWN_FDS = 253
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def start_mode(env: str = START_ENV) -> str:
    """How engines (or, with ``env=POOL_START_ENV``, the collectives' pools) start:
    ``fork`` (from a warm server, the default) or ``exec``."""
    mode = os.environ.get(env, "fork").strip().lower() or "fork"
    if mode not in START_MODES:
        raise ValueError(f"{env}={mode!r}: use one of {', '.join(START_MODES)}")
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
#: what a forked child runs: ``run(argv, the descriptors it serves)`` -> its exit status
ChildMain = Callable[[list[str], list[int]], int]


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _take_env(env: dict[str, str]) -> None:
    """Adopt the owner's environment as it is now: the server started with the owner's
    environment of that moment; ``PYTHONPATH`` entries added since also go on ``sys.path``
    (before the installed packages, as at an interpreter's start), and the plug-in registries
    scan the entry points again (a plug-in installed since)."""
    before = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    os.environ.clear()
    os.environ.update(env)
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and p not in before and p not in sys.path]
    if added:
        sys.path[1:1] = added
    if "testbed.kernels.plugins" in sys.modules:
        sys.modules["testbed.kernels.plugins"].refresh()


def _child(req: dict, fds: list[int], server_sock: socket.socket, run: ChildMain) -> int:
    """In the forked child: become the requested process. Returns its exit status."""
    log_fd, *rest = fds
    netns_fd = rest.pop(0) if req.get("netns") else None
    server_sock.close()
    libc = _libc()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()  # a Ctrl-C to the owner's terminal is the owner's to handle
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return 70
    if os.getppid() != req["server_pid"]:
        return 0  # the server died before the line above: nobody waits for this child
    if netns_fd is not None:
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
    if req.get("cwd"):
        with contextlib.suppress(OSError):  # gone since: the server's, as a process would keep
            os.chdir(req["cwd"])
    _take_env(req["env"])
    return run(req["argv"], rest)


def _reap(statuses: dict[int, int], children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            statuses[pid] = os.waitstatus_to_exitcode(status)


def serve(fd: int, preload: Callable[[], str], run: ChildMain) -> int:
    """The fork server's loop on the socket ``fd`` (see the module docstring): ``preload()``
    loads what the children share and says what (for the log); each child runs ``run``.

    A server that ends well (its owner closed the socket, or was gone by the time it was
    ready) removes its own log (:data:`SERVER_LOG_ENV`): an owner interrupted while it
    started the server never learns of it, and the log would outlive both."""
    log_path = os.environ.pop(SERVER_LOG_ENV, None)
    rc = _serve(fd, preload, run)
    if rc == 0 and log_path:
        with contextlib.suppress(OSError):
            os.unlink(log_path)
    return rc


def _serve(fd: int, preload: Callable[[], str], run: ChildMain) -> int:
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ends when its owner closes the socket
    t0 = time.monotonic()
    what = preload()
    # what is loaded now is shared by every child: keep the collector off those pages
    gc.collect()
    gc.freeze()
    print(f"fork server: {what} ready in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        _send(sock, {"ready": True, "pid": os.getpid()})
    except OSError:  # the network was torn down while this loaded: nothing to serve
        return 0
    try:
        return _requests(sock, run)
    except (BrokenPipeError, ConnectionResetError):
        # the owner closed its end before an answer (a Ctrl-C while it asked for a
        # child): it is gone, as at the end of the stream
        return 0


def _requests(sock: socket.socket, run: ChildMain) -> int:
    """Answer the owner's requests until it closes the socket (0)."""
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
            need = 2 if req.get("netns") else 1  # the log, and the namespace
            if len(fds) < need:
                for f in fds:
                    os.close(f)
                _send(sock, {"error": f"spawn needs {need} descriptors, got {len(fds)}"})
                continue
            sys.stdout.flush()
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                rc = 1
                try:
                    rc = _child(dict(req, server_pid=me), fds, sock, run)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 1
                except BaseException:  # noqa: BLE001 - reported in the child's log
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
class ForkedProcess:
    """A forked child, seen from its owner (a :class:`subprocess.Popen` look-alike)."""

    def __init__(self, server: ForkServer, pid: int):
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
        """The exit status once the child has exited (negative: the signal), else None."""
        if self.returncode is None and self._exited(0):
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit; :class:`subprocess.TimeoutExpired` after ``timeout``."""
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
        """Signal the child (through its pidfd: never another process that reused its pid)."""
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


class ForkServer:
    """The owner's side of a fork server: start it, spawn children from it, close it.

    ``module`` and ``args``: the server's command (``python -m MODULE --fork-server FD
    ARGS``); ``what``: what it serves, for errors. Thread-safe: a network starts its switches
    from several threads, and tenants run collectives at once.
    """

    def __init__(self, module: str, args: list[str], log_path: str, what: str):
        self.log_path = log_path
        self.what = what
        self._lock = threading.Lock()
        # message boundaries kept: one request, one answer, each with its descriptors
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock: socket.socket | None = ours
        try:
            with open(log_path, "w") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", module, "--fork-server", str(theirs.fileno()),
                     *args],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(theirs.fileno(),), env={**os.environ, SERVER_LOG_ENV: log_path})
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
                self._close_socket()
                self._end()
                raise RuntimeError(f"the {self.what}' fork server did not start "
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
                raise RuntimeError(f"the {self.what}' fork server is closed")
            _send(self._sock, req, fds)
            msg, _ = _recv(self._sock)
        if msg is None:
            raise RuntimeError(f"the {self.what}' fork server exited; its log "
                               f"({self.log_path}):\n{self._log_tail()}")
        if "error" in msg:
            raise RuntimeError(f"fork server: {msg['error']}")
        return msg

    def fork(self, argv: list[str], log, netns_pid: int | None = None,
             fds: Iterable[int] = ()) -> ForkedProcess:
        """Fork a child that runs the server's child main with ``argv``, its output to the
        open file ``log``, in the network namespace of process ``netns_pid`` (None: the
        server's), serving the descriptors ``fds``; in this process's working folder and
        environment."""
        self.wait_ready()
        netns = [os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY)] \
            if netns_pid is not None else []
        try:
            msg = self._ask({"op": "spawn", "argv": argv, "env": dict(os.environ),
                             "cwd": os.getcwd(), "netns": bool(netns)},
                            (log.fileno(), *netns, *fds))
        finally:
            for f in netns:
                os.close(f)
        return ForkedProcess(self, int(msg["pid"]))

    def status(self, pid: int) -> int | None:
        """The exit status of exited child ``pid`` (None if the server no longer knows)."""
        try:
            return self._ask({"op": "status", "pid": pid}).get("returncode")
        except (RuntimeError, OSError):
            return None

    def alive(self) -> bool:
        return self._sock is not None and self.proc.poll() is None

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _end(self, timeout: float = 5.0) -> bool:
        """Wait for the server to exit, killing it after ``timeout``; whether it was killed."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return True
        return False

    def close(self, timeout: float = 5.0) -> None:
        """End the server (its children get SIGTERM from their parent-death signal: stop
        them first to keep what they write at the end). Its log stays only when it failed on
        its own (did not start, or exited with an error): a server that ends well removes
        it itself (:func:`serve`), and one this owner had to kill (still loading, or not
        ended after ``timeout``) has nothing to tell, so the owner removes it."""
        with self._lock:
            self._close_socket()
        if self._end(timeout):
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


class EngineServer(ForkServer):
    """The fork server of a network's engines: ``stages`` are what they run (their kernels
    and the ring I/O's load once in the server)."""

    def __init__(self, stages: Iterable[str], log_path: str):
        self.stages = sorted(set(stages))
        super().__init__("testbed.datapath.engine", ["--stages", ",".join(self.stages)],
                         log_path, "engines")

    def spawn(self, argv: list[str], netns_pid: int, log,
              controls: list[socket.socket]) -> ForkedProcess:
        """Fork an engine with arguments ``argv`` (those of ``python -m
        testbed.datapath.engine``) in the network namespace of process ``netns_pid``, its
        output to the open file ``log``, listening on ``controls`` (one per ``--config``)."""
        return self.fork(argv, log, netns_pid, [c.fileno() for c in controls])


class PoolServer(ForkServer):
    """The fork server of a network's collective pools (``python -m
    testbed.collectives.worker --fork-server``: Numba and the INA client's kernels loaded
    once); a pool forked from it runs ``python -m testbed.collectives.worker ARGV``."""

    def __init__(self, log_path: str):
        super().__init__("testbed.collectives.worker", [], log_path, "collective pools")
