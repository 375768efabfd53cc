"""Control channel of a data-path engine: JSON lines over a Unix socket.

The engine listens on ``/run/testbed/<node>.sock`` (a path socket, so it is reachable from the
root namespace although the engine runs inside the node's network namespace). One request per
line, one response per line::

    {"cmd": "counters"}                                   -> {"ok": true, "result": {...}}
    {"cmd": "configure", "stage": "aggregate", "settings": {"jobs": {"1": {...}}}}
    {"cmd": "reset_job", "job_id": 1}
    {"cmd": "config"}                                     -> the engine's config + stage names
    {"cmd": "trace", "count": 50}  then  {"cmd": "trace"} -> arm, then read packet records
    {"cmd": "stop"}
    errors                                                -> {"ok": false, "error": "..."}

The server side is polled from the engine's own loop (no threads, so commands never race the
data path). :class:`DatapathClient` is the Python client.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

RUN_DIR = os.environ.get("TESTBED_RUN_DIR", "/run/testbed")


def socket_path(node: str) -> str:
    """Control socket path of ``node``."""
    return os.path.join(RUN_DIR, f"{node}.sock")


class ControlError(RuntimeError):
    """The engine refused a command (the message says why)."""


class ControlServer:
    """Non-blocking JSON-lines server; the engine polls :meth:`fds` and calls :meth:`handle`."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            # a stale socket from a crashed engine of the same node: nothing listens on it
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                probe.close()
                raise RuntimeError(f"another engine already listens on {path}")
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)
            finally:
                probe.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
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
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class DatapathClient:
    """Client of a running engine: ``DatapathClient("tbs1")`` or a socket path."""

    def __init__(self, node_or_sock_path: str, timeout: float = 10.0):
        path = node_or_sock_path
        if "/" not in path:
            path = socket_path(path)
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
                s.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
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
