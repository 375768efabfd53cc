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
    {"cmd": "flood", "ports": ["tbl1-eth1", "tbl1-eth4"]}  -> the ports floods leave by now
    {"cmd": "config"}                                     -> the engine's config + stage names
    {"cmd": "trace", "count": 50}  then  {"cmd": "trace"} -> arm, then read packet records
    {"cmd": "stop"}
    errors                                                -> {"ok": false, "error": "..."}

The server side is polled from the engine's own loop (no threads, so commands never race the
data path) and never blocks it; a request longer than :data:`MAX_REQUEST_BYTES`, or a connection
beyond :data:`MAX_CLIENTS` at once, is answered with an error that says so and closed.
:class:`DatapathClient` is the Python client.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import sys
import threading
import time
import traceback
from typing import NoReturn

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


def listen(address: str, backlog: int = 64) -> socket.socket:
    """A listening Unix socket on ``address`` (abstract ``@name`` or a path), created in the
    calling process's network namespace. :class:`RuntimeError` if another engine holds it;
    a stale path socket of a crashed engine is replaced. ``backlog``: connections the kernel
    queues until the engine accepts them (a client finding the queue full must retry:
    :class:`DatapathClient` does)."""
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


#: the longest request line the engine reads (bytes, newline excluded). A longer one (or that
#: much data without a newline) is refused with an error answer and its connection closed:
#: without a bound one client could make the engine buffer any amount of memory. Real
#: requests are far smaller (a full forwarding table, 4096 entries, is ~150 KB).
MAX_REQUEST_BYTES = 1 << 20
#: an error answer's message is cut to this many characters (it may quote the request)
MAX_ERROR_CHARS = 4096
#: connections served at once; one more is answered with an error and closed (every
#: connection holds a descriptor and a buffer of the engine's)
MAX_CLIENTS = 64
#: requests served per connection and wake-up, so that one client that sends thousands in one
#: write cannot hold the packet loop (the rest are served on the next rounds)
LINES_PER_WAKEUP = 16
#: connections accepted per wake-up of the listening socket
ACCEPTS_PER_WAKEUP = 16


class _Conn:
    """One client connection: its socket, the bytes read but not yet served (``inbuf``), the
    answer bytes not yet sent (``outbuf``) and whether it closes once they are."""

    __slots__ = ("sock", "inbuf", "outbuf", "closing")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closing = False


def _answer(resp: dict) -> bytes:
    return json.dumps(resp).encode() + b"\n"


class ControlServer:
    """Non-blocking JSON-lines server; the engine polls :meth:`fds` (each for the events of
    :meth:`events`) and calls :meth:`handle`.

    ``path``: the address to listen on (abstract ``@name`` or a file path); ``fd``: a socket
    that already listens on it, inherited from the parent (see :func:`listen`), used instead
    of binding here.

    Hostile or broken clients cannot stop the engine: nothing ever blocks (an answer the client
    does not read waits in the connection's own buffer, and the connection is not read from
    until it has gone), a request over :data:`MAX_REQUEST_BYTES` or a connection beyond
    :data:`MAX_CLIENTS` is refused with an error answer saying why, and any failure of a
    request becomes an error answer.
    """

    def __init__(self, path: str, fd: int | None = None):
        self.path = path
        self.sock = (socket.socket(fileno=fd) if fd is not None else listen(path))
        self.sock.setblocking(False)
        self.clients: dict[int, _Conn] = {}

    def fds(self) -> list[int]:
        """Descriptors to poll (for :meth:`events`)."""
        return [self.sock.fileno(), *self.clients]

    def events(self, fd: int) -> int:
        """The poll events to wait for on ``fd``: ``POLLOUT`` while a connection has an answer
        to send or a request still to serve (the socket is writable, so the engine comes
        straight back), else ``POLLIN``."""
        c = self.clients.get(fd)
        if c is not None and (c.outbuf or c.closing or b"\n" in c.inbuf):
            return select.POLLOUT
        return select.POLLIN

    def handle(self, fd: int, dispatch) -> list[int]:
        """Serve ``fd`` (listening or client); return descriptors added or whose
        :meth:`events` changed (+: (re)register them) and removed (-).

        ``dispatch(request: dict) -> object`` runs a command; its return value becomes
        ``result``; exceptions become ``{"ok": false, "error": "<type>: <message>"}``.
        """
        if fd == self.sock.fileno():
            return self._accept()
        c = self.clients.get(fd)
        if c is None:  # closed earlier in this round
            return []
        before = self.events(fd)
        try:
            if not self._flush(c):
                return self._drop(fd)
            if not c.outbuf:
                if c.closing:
                    return self._drop(fd)
                if b"\n" not in c.inbuf:  # nothing left to serve: read more
                    try:
                        data = c.sock.recv(65536)
                    except BlockingIOError:
                        data = None
                    except OSError:
                        data = b""
                    if data == b"":
                        return self._drop(fd)
                    if data:
                        c.inbuf += data
                self._serve(c, dispatch)
                if not self._flush(c):
                    return self._drop(fd)
                if c.closing and not c.outbuf:
                    return self._drop(fd)
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the engine
            traceback.print_exc()
            return self._drop(fd)
        return [fd] if self.events(fd) != before else []

    def _accept(self) -> list[int]:
        added = []
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            except OSError as e:  # out of descriptors, or the client already left
                print(f"control: accept failed: {e}", file=sys.stderr, flush=True)
                break
            conn.setblocking(False)
            if len(self.clients) >= MAX_CLIENTS:
                # refused at once: the answer fits the fresh socket's buffer
                try:
                    conn.send(_answer({"ok": False, "error": (
                        f"too many control connections (at most {MAX_CLIENTS} at once); "
                        "close idle clients and retry")}))
                except OSError:
                    pass
                conn.close()
                continue
            self.clients[conn.fileno()] = _Conn(conn)
            added.append(conn.fileno())
        return added

    def _serve(self, c: _Conn, dispatch) -> None:
        """Answer up to :data:`LINES_PER_WAKEUP` complete requests of ``c`` (none while an
        earlier answer is unsent); refuse an over-long one."""
        for _ in range(LINES_PER_WAKEUP):
            if c.outbuf or c.closing:
                return
            end = c.inbuf.find(b"\n")
            if end < 0:
                if len(c.inbuf) > MAX_REQUEST_BYTES:
                    self._refuse_long(c)
                return
            if end > MAX_REQUEST_BYTES:
                self._refuse_long(c)
                return
            line = bytes(c.inbuf[:end])
            del c.inbuf[: end + 1]  # cheap: a bytearray drops its head in place
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise ValueError("request must be a JSON object")
                out = _answer({"ok": True, "result": dispatch(req)})
            except Exception as e:  # noqa: BLE001 - every failure goes back to the client
                msg = f"{type(e).__name__}: {e}"
                if len(msg) > MAX_ERROR_CHARS:
                    msg = msg[:MAX_ERROR_CHARS] + f"... ({len(msg)} characters)"
                out = _answer({"ok": False, "error": msg})
            c.outbuf += out

    def _refuse_long(self, c: _Conn) -> None:
        c.outbuf += _answer({"ok": False, "error": (
            f"request longer than {MAX_REQUEST_BYTES} bytes (or that much without a newline): "
            "refused; the connection is closed")})
        c.inbuf.clear()
        c.closing = True

    @staticmethod
    def _flush(c: _Conn) -> bool:
        """Send what the socket takes now (never wait); False when the client is gone."""
        while c.outbuf:
            try:
                n = c.sock.send(c.outbuf)
            except BlockingIOError:
                return True
            except OSError:
                return False
            del c.outbuf[:n]
        return True

    def _drop(self, fd: int) -> list[int]:
        c = self.clients.pop(fd, None)
        if c is not None:
            c.sock.close()
        return [-fd]

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

    def _dial(self) -> socket.socket | None:
        """A socket connected to :attr:`path`, or None where no engine listens there."""
        deadline = time.monotonic() + self.timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect(_sockaddr(self.path))
                return s
            except BlockingIOError:
                # the engine's queue of connections not yet accepted is full (a crowd of
                # clients): a Unix socket with a timeout does not wait for room, so retry
                s.close()
                if time.monotonic() > deadline:
                    raise ControlError(f"data-path engine of {self.node} accepted no connection "
                                       f"within {self.timeout} s (its queue is full)") from None
                time.sleep(0.01)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                return None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            s = self._dial()
            if s is None:
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
        kept = self._sock is not None
        s = self._connect()
        try:
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError) as e:
            if not kept:
                self._failed(s, cmd, e)
            # the engine this kept connection reached is gone (killed; perhaps restarted
            # since): the request reached no one, so it goes to the one listening now
            self.close()
            return self._request(cmd, args)
        except OSError as e:
            self._failed(s, cmd, e)
        return self._answer(s, cmd)

    def _answer(self, s: socket.socket, cmd: str) -> object:
        try:
            while b"\n" not in self._buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionResetError("connection closed")
                self._buf += chunk
        except OSError as e:
            self._failed(s, cmd, e)
        line, _, self._buf = self._buf.partition(b"\n")
        resp = json.loads(line)
        if not resp.get("ok"):
            raise ControlError(resp.get("error", "unknown error"))
        return resp.get("result")

    def _failed(self, s: socket.socket, cmd: str, e: OSError) -> NoReturn:
        refused = self._refusal(s)
        self.close()
        if refused is not None:  # the engine said why before it closed the connection
            raise ControlError(refused) from None
        what = "did not answer" if isinstance(e, TimeoutError) else "is gone"
        raise ControlError(f"data-path engine of {self.node} {what} ({cmd!r}: "
                           f"{type(e).__name__}: {e}); did it exit? see "
                           f"{os.path.join(RUN_DIR, self.node + '.log')}") from None

    def _refusal(self, s: socket.socket) -> str | None:
        """The error the engine answered before it closed the connection (too many
        connections, a request too long), read without waiting; None if there is none."""
        buf = self._buf
        try:
            s.setblocking(False)
            while b"\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass
        try:
            resp = json.loads(buf.partition(b"\n")[0])
        except ValueError:
            return None
        if isinstance(resp, dict) and resp.get("ok") is False:
            return str(resp.get("error", "refused"))
        return None

    def counters(self) -> dict:
        """All counters (ports, drops by reason, stages, cpu) right now."""
        return self.request("counters")

    def configure(self, stage: str, **settings) -> object:
        """Call ``stage.configure(**settings)`` in the engine (e.g. add a job, L2 entries)."""
        return self.request("configure", stage=stage, settings=settings)

    def set_coalesce(self, us: float) -> float:
        """Set the engine's interrupt-coalescing wait (µs; see ``Engine.set_coalesce``)."""
        return self.request("coalesce", us=us)

    def set_flood_ports(self, ports: list[str] | None) -> list[str]:
        """Set the ports floods leave by (None: all; see ``Engine.set_flood_ports``)."""
        return self.request("flood", ports=ports)

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
