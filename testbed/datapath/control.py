"""Control channel of a data-path engine: JSON lines over a Unix socket.

A node's engine listens on the *abstract* Unix socket ``@/run/testbed/<node>.sock`` (no file:
the name lives in a network namespace's own table of abstract sockets). The node creates the
listening socket in the root network namespace, where the orchestrator and the provider run,
and hands it to its engine, which runs inside the node's namespace (:func:`listen`). So the
provider side (collective runners, ``testbed switch``, the fabric manager, tests) reaches
every switch, while tenant code inside an emulated host, which runs in the host's own network
namespace, cannot: a path socket under the shared run directory would be reachable from every
host, since hosts share the file system. A client that is refused from another namespace gets
an error that says so (:class:`DatapathClient`). An engine started by hand may still listen
on a path (``control_socket`` with a ``/`` and no leading ``@``).

One request per line, one response per line::

    {"cmd": "counters"}                                   -> {"ok": true, "result": {...}}
    {"cmd": "configure", "stage": "aggregate", "settings": {"jobs": {"1": {...}}}}
    {"cmd": "reset_job", "job_id": 1}
    {"cmd": "coalesce", "us": 800}
    {"cmd": "config"}                                     -> the engine's config + stage names
    {"cmd": "trace", "count": 50}  then  {"cmd": "trace"} -> arm, then read packet records
    {"cmd": "stop"}
    errors                                                -> {"ok": false, "error": "..."}

The server side is polled from the engine's own loop (no threads, so commands never race the
data path). :class:`DatapathClient` is the Python client.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

RUN_DIR = os.environ.get("TESTBED_RUN_DIR", "/run/testbed")
#: an address starting with this is an abstract Unix socket name (Linux), not a file
ABSTRACT = "@"


def socket_path(node: str) -> str:
    """The name of ``node``'s control socket (under the run directory; see
    :func:`control_address` for the address engines actually listen on)."""
    return os.path.join(RUN_DIR, f"{node}.sock")


def control_address(node: str) -> str:
    """Control address of ``node``: the abstract socket ``@<socket_path(node)>``."""
    return ABSTRACT + socket_path(node)


def _sockaddr(address: str) -> str:
    """What ``bind``/``connect`` take for ``address`` (abstract names start with a NUL)."""
    return "\0" + address[len(ABSTRACT):] if address.startswith(ABSTRACT) else address


def netns_id() -> str:
    """This process's network namespace (``net:[inode]``), or "" where /proc cannot tell."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def listening_elsewhere(node: str) -> bool:
    """Whether ``node`` runs (its engine config is in the run directory) with its control
    socket in another network namespace than this process's: the caller is inside a host."""
    try:
        with open(os.path.join(RUN_DIR, f"{node}.json")) as fh:
            where = json.load(fh).get("control_netns")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(where) and where != netns_id()


def listen(address: str, backlog: int = 8) -> socket.socket:
    """A listening Unix socket on ``address`` (abstract ``@name`` or a path), created in the
    calling process's network namespace. :class:`RuntimeError` if another engine holds it;
    a stale path socket of a crashed engine is replaced."""
    if not address.startswith(ABSTRACT):
        os.makedirs(os.path.dirname(address) or ".", exist_ok=True)
        if os.path.exists(address):
            # a stale socket from a crashed engine of the same node: nothing listens on it
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(address)
                raise RuntimeError(f"another engine already listens on {address}")
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(address)
            finally:
                probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_sockaddr(address))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RuntimeError(f"another engine already listens on {address} (stop it, or "
                               "run 'testbed cleanup' after a crash)") from None
        raise
    sock.listen(backlog)
    return sock


class ControlError(RuntimeError):
    """The engine refused a command (the message says why)."""


class ControlServer:
    """Non-blocking JSON-lines server; the engine polls :meth:`fds` and calls :meth:`handle`.

    ``path``: the address to listen on (abstract ``@name`` or a file path); ``fd``: a socket
    that already listens on it, inherited from the parent (see :func:`listen`), used instead
    of binding here.
    """

    def __init__(self, path: str, fd: int | None = None):
        self.path = path
        self.sock = (socket.socket(fileno=fd) if fd is not None else listen(path))
        self.sock.setblocking(False)
        self.clients: dict[int, tuple[socket.socket, bytearray]] = {}

    def fds(self) -> list[int]:
        """Descriptors to poll for input."""
        return [self.sock.fileno(), *self.clients]

    def handle(self, fd: int, dispatch) -> list[int]:
        """Serve ``fd`` (listening or client); return descriptors added (+) / removed (-).

        ``dispatch(request: dict) -> object`` runs a command; its return value becomes
        ``result``; exceptions become ``{"ok": false, "error": str(e)}``.
        """
        changes: list[int] = []
        if fd == self.sock.fileno():
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return changes
            conn.setblocking(False)
            self.clients[conn.fileno()] = (conn, bytearray())
            changes.append(conn.fileno())
            return changes
        conn, buf = self.clients[fd]
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return changes
        except OSError:
            data = b""
        if not data:
            self._drop(fd)
            return [-fd]
        buf += data
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise ValueError("request must be a JSON object")
                resp = {"ok": True, "result": dispatch(req)}
            except Exception as e:  # noqa: BLE001 - every failure goes back to the client
                resp = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            try:
                conn.setblocking(True)
                conn.settimeout(2.0)
                conn.sendall(json.dumps(resp).encode() + b"\n")
                conn.setblocking(False)
            except OSError:
                self._drop(fd)
                return [-fd]
        return changes

    def _drop(self, fd: int) -> None:
        conn, _ = self.clients.pop(fd)
        conn.close()

    def close(self) -> None:
        """Close all connections and remove the socket file."""
        for fd in list(self.clients):
            self._drop(fd)
        self.sock.close()
        if not self.path.startswith(ABSTRACT):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class DatapathClient:
    """Client of a running engine: ``DatapathClient("tbs1")`` (its abstract control address,
    reachable from the root network namespace only), an address ``"@name"`` or a socket path.
    """

    def __init__(self, node_or_sock_path: str, timeout: float = 10.0):
        path = node_or_sock_path
        if "/" not in path:
            path = control_address(path)
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""
        self._lock = threading.Lock()  # one request/response at a time (threads may share it)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect(_sockaddr(self.path))
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                forwarded = self.path[len(ABSTRACT):] if self.path.startswith(ABSTRACT) else ""
                if forwarded and os.path.exists(forwarded):
                    # a node on another server of a cluster network: its engine's socket is
                    # an ssh forward, which OpenSSH can only put on a path (docs/cluster.md)
                    self.path = forwarded
                    return self._connect()
                if self.path.startswith(ABSTRACT) and listening_elsewhere(self.node):
                    raise ControlError(
                        f"switch control channel {self.path} is not reachable from this "
                        "network namespace: data-path engines are configured only from the "
                        "provider's (root) namespace, not by tenant code inside an emulated "
                        "host; ask the provider service for a plan instead (see "
                        "docs/provider.md)") from None
                raise ControlError(f"no engine listening on {self.path}; is the node started?")\
                    from None
            self._sock = s
        return self._sock

    @property
    def node(self) -> str:
        """The node this client talks to (from its socket's name)."""
        return os.path.basename(self.path).removesuffix(".sock")

    def request(self, cmd: str, **args) -> object:
        """Send one command and return its result. Raises :class:`ControlError` when the
        engine refuses it, and when the engine is gone or silent (the message names the node;
        no bare OS error reaches the caller)."""
        with self._lock:
            return self._request(cmd, args)

    def _request(self, cmd: str, args: dict) -> object:
        s = self._connect()
        try:
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
            while b"\n" not in self._buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionResetError("connection closed")
                self._buf += chunk
        except OSError as e:
            self.close()
            what = "did not answer" if isinstance(e, TimeoutError) else "is gone"
            raise ControlError(f"data-path engine of {self.node} {what} ({cmd!r}: "
                               f"{type(e).__name__}: {e}); did it exit? see "
                               f"{os.path.join(RUN_DIR, self.node + '.log')}") from None
        line, _, self._buf = self._buf.partition(b"\n")
        resp = json.loads(line)
        if not resp.get("ok"):
            raise ControlError(resp.get("error", "unknown error"))
        return resp.get("result")

    def counters(self) -> dict:
        """All counters (ports, drops by reason, stages, cpu) right now."""
        return self.request("counters")

    def configure(self, stage: str, **settings) -> object:
        """Call ``stage.configure(**settings)`` in the engine (e.g. add a job, L2 entries)."""
        return self.request("configure", stage=stage, settings=settings)

    def set_coalesce(self, us: float) -> float:
        """Set the engine's interrupt-coalescing wait (µs; see ``Engine.set_coalesce``)."""
        return self.request("coalesce", us=us)

    def reset_job(self, job_id: int) -> object:
        """Free a job's aggregation slots after a worker died (see aggregate.reset_job)."""
        return self.request("reset_job", job_id=job_id)

    def config(self) -> dict:
        """The engine's configuration (node, ports, programs with settings, stage names)."""
        return self.request("config")

    def trace(self, count: int | None = None) -> dict:
        """``count`` given: record the next ``count`` frames; else return what was recorded
        (``{"remaining": n, "records": [...]}``, see :mod:`testbed.datapath.trace`)."""
        return self.request("trace", count=count) if count is not None else self.request("trace")

    def stop(self) -> object:
        """Ask the engine to exit cleanly (it writes its final counters)."""
        try:
            return self.request("stop")
        finally:
            self.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the engine answers (it opens the socket only once it is ready)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request("ping")
                return
            except (ControlError, OSError):
                self.close()
                if time.monotonic() > deadline:
                    raise ControlError(f"engine at {self.path} not ready after {timeout} s")\
                        from None
                time.sleep(0.05)

    def close(self) -> None:
        """Close the connection."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._buf = b""

    def __enter__(self) -> DatapathClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
