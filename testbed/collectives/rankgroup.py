"""The ranks of a pool process: forked children, a control line to each, and the one loop
that gathers a kind of message from every live rank.

Both pools, the collectives' (``python -m testbed.collectives.worker``) and the training
jobs' (``python -m testbed.workloads.pool``), fork their ranks, exchange JSON lines with them
(``port`` -> ``addrs`` -> ``ready`` -> ``go`` -> ``done`` ... ``exit``) and reap them through
:class:`RankGroup`, so the rules are the same for both:

* a rank that reports ``error`` or dies fails the gather, with a message naming the rank and
  its host; the others get ``min(timeout_s + 3, 30)`` s to report their own errors first (the
  first failure is often the cause of the next ones);
* a rank still silent at the gather's deadline fails it as a timeout;
* while gathering, a :class:`~testbed.collectives.cpumon.CpuMonitor` (when given) samples the
  ranks' threads (it catches threads that exit early);
* at the end every child gets ``exit``; one still alive 2 s later is SIGKILLed, and all are
  reaped.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable


class ControlLine:
    """Newline-delimited JSON over a socket: the pool's control channel to each rank."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def feed(self) -> list[dict] | None:
        """Read what is there; parsed messages, or None at EOF."""
        data = self.sock.recv(65536)
        if not data:
            return None
        self.buf += data
        return self._take_lines()

    def ready(self) -> list[dict]:
        """The complete messages now (what is buffered and what the socket holds), without
        blocking; ``EOFError`` when the peer closed the channel."""
        while select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the pool closed the control channel")
            self.buf += data
        return self._take_lines()

    def _take_lines(self) -> list[dict]:
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(json.loads(line))
        return out

    def recv(self) -> dict:
        """Block for the next message (children only)."""
        while b"\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("pool closed the control channel")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class RankFailure(RuntimeError):
    """Ranks failed, died or stayed silent while the pool gathered their messages; the
    message names each (rank and host). ``timeout``: one timed out or stayed silent."""

    def __init__(self, message: str, timeout: bool):
        super().__init__(message)
        self.timeout = timeout


def exit_text(status: int) -> str:
    """``waitpid`` status as words: ``signal SIGKILL`` or ``exit 1``."""
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def fork_with_line(child: Callable[[ControlLine], int],
                   close_in_child=()) -> tuple[int, ControlLine]:
    """Fork a child that runs ``child(its end of a new control line)`` and exits with what
    it returns (1 on an exception), after closing ``close_in_child`` (the parent's other
    channels). Returns (pid, the parent's end of the line)."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            a.close()
            for s in close_in_child:
                s.close()
            code = child(ControlLine(b))
        finally:
            os._exit(code)
    b.close()
    return pid, ControlLine(a)


#: After a rank died without reporting an error (killed, crashed), the others are stopped
#: this soon: what they would report (a peer gone, no RESULT) follows from that death, and
#: waiting for their timeouts would only delay the job's end.
DEATH_GRACE_S = 2.0
#: a watched file's handler: called when it is readable; False to stop watching it
Watch = Callable[[], bool]
#: a handler of a rank's message of another kind than the one gathered
OnMessage = Callable[[int, dict], None]


class RemotePool:
    """The coordinator's handle on a pool process on another server, started over ssh, that
    forks and runs ``ranks`` of the job there (``python -m testbed.collectives.remotepool``).
    The ssh session's stdin/stdout is its control line: the same JSON lines as a rank's,
    tagged with ``rank``; untagged ones are the pool's own (``pool``: its pid and its ranks'
    pids; ``mem``: its memory; ``checked``: its ranks' verdict for a repetition; ``error``:
    it failed)."""

    def __init__(self, server: str, ranks: list[int], argv: list[str], first: dict):
        self.server, self.ranks = server, list(ranks)
        a, b = socket.socketpair()
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - the ssh client's, read on failure
        self.proc = subprocess.Popen(argv, stdin=b, stdout=b, stderr=self.stderr)
        b.close()
        self.line = ControlLine(a)
        #: why it failed ("" while it did not), and whether a rank of it timed out
        self.failed = ""
        self.timeout = False
        #: its pid and its ranks' pids, on its server
        self.pid: int | None = None
        self.pids: dict[int, int] = {}
        self.mem_mb = 0.0
        #: repetition -> (max_abs_err, correct) of its ranks' outputs
        self.checks: dict[int, tuple[float, bool]] = {}
        self.line.send(first)

    def on_message(self, msg: dict) -> None:
        """An untagged message: the pool's own report."""
        if msg["type"] == "pool":
            self.pid = int(msg["pid"])
            self.pids = {int(r): int(p) for r, p in msg["pids"].items()}
        elif msg["type"] == "mem":
            self.mem_mb = float(msg["mem_mb"])
        elif msg["type"] == "checked":
            self.checks[int(msg["rep"])] = (float(msg["max_abs_err"]), bool(msg["correct"]))

    def why_lost(self) -> str:
        """How its control line ended: the ssh client's exit status and last words."""
        try:
            rc = self.proc.wait(2)
        except subprocess.TimeoutExpired:
            rc = None
        self.stderr.seek(0)
        tail = self.stderr.read()[-600:].decode(errors="replace").strip()
        return f"exited or lost its connection (ssh exit status {rc}" + (
            f": {tail})" if tail else ")")

    def close(self, wait_s: float) -> None:
        """Wait ``wait_s`` for the session to end (after ``exit``), then end it here: the
        pool there sees its line close and stops its ranks."""
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.line.sock.close()
        self.stderr.close()


class RankGroup:
    """The forked ranks of one pool and the control line to each.

    ``hosts``: rank -> host name (for messages); ``timeout_s``: the job's timeout (the grace
    the others get after a failure); ``monitor``: a CpuMonitor sampled while gathering.
    """

    def __init__(self, hosts: dict[int, str], timeout_s: float, monitor=None):
        self.hosts = dict(hosts)
        self.timeout_s = timeout_s
        self.monitor = monitor
        #: rank -> pid of its child (-1 once reaped)
        self.pids: dict[int, int] = {}
        self.lines: dict[int, ControlLine] = {}
        #: rank -> why it died (a dead rank fails every later gather too)
        self.dead: dict[int, str] = {}
        #: sockets a forked child must close (the pool's other channels)
        self.close_in_child: list[socket.socket] = []
        #: pools on other servers running the ranks this process does not fork
        self.remotes: list[RemotePool] = []

    def name(self, rank: int) -> str:
        """``rank R (host)``, as messages call a rank."""
        return f"rank {rank} ({self.hosts.get(rank, '?')})"

    def fork(self, rank: int, child: Callable[[ControlLine], int]) -> int:
        """Fork rank ``rank``: the child runs ``child(its control line)`` and exits with what it
        returns (1 on an exception). Returns the child's pid."""
        pid, line = fork_with_line(child, [c.sock for c in self.lines.values()]
                                   + [p.line.sock for p in self.remotes] + self.close_in_child)
        self.pids[rank] = pid
        self.lines[rank] = line
        return pid

    def start_remote(self, server: str, ranks: list[int], argv: list[str], job: dict) -> None:
        """Start the pool of ``server`` for ``ranks`` (``argv``: the ssh command that runs
        ``python -m testbed.collectives.remotepool`` there) and send it the job."""
        self.remotes.append(RemotePool(server, ranks, argv, {
            "type": "job", "job": job, "ranks": list(ranks), "server": server}))

    def live_pids(self) -> list[int]:
        """Pids of the children not reaped yet."""
        return [p for p in self.pids.values() if p > 0]

    def broadcast(self, msg: dict) -> None:
        """Send ``msg`` to every live rank (a remote pool passes it on to its ranks)."""
        for r, c in self.lines.items():
            if r not in self.dead:
                try:
                    c.send(msg)
                except OSError as e:  # it died since the last message: name it
                    if self.pids.get(r, -1) > 0:
                        self._died(r, {})
                    raise RankFailure(self.dead.get(r) or f"{self.name(r)}: its control "
                                      f"channel broke ({e})", timeout=False) from None
        for pool in self.remotes:
            if not pool.failed:
                pool.line.send(msg)

    def gather(self, kind: str, wait_s: float | None, on_message: OnMessage | None = None,
               watch: dict[socket.socket, Watch] | None = None) -> dict[int, dict]:
        """One message of ``kind`` from every live rank: rank -> message. ``wait_s``: how
        long they may stay silent (None: as long as they live); ``on_message(rank, msg)``
        handles messages of other kinds (a RuntimeError, KeyError or OSError it raises fails
        the rank with its text); ``watch``: socket -> handler called when it is readable
        (False: stop watching it). Ranks of a :class:`RemotePool` answer through its line.
        Raises :class:`RankFailure` naming every rank that failed, died or stayed silent."""
        got: dict[int, dict] = {}
        errors: dict[int, str] = {}
        state = {"timeout": False, "grace": None, "death": None}

        def fail(within: float | None = None) -> None:
            # after a failure, the others get a moment to report theirs
            end = time.monotonic() + (min(self.timeout_s + 3, 30) if within is None else within)
            state["grace"] = min(state["grace"] or end, end)

        def take(r: int, msg: dict) -> None:
            if msg["type"] == "error":
                errors[r] = msg["error"]
                state["timeout"] |= bool(msg.get("timeout", False))
                fail()
            elif msg["type"] == kind:
                got[r] = msg
            elif on_message is not None:
                try:
                    on_message(r, msg)
                except (RuntimeError, KeyError, OSError) as e:
                    errors[r] = str(e) or repr(e)
                    fail()

        sel = selectors.DefaultSelector()
        for r, c in self.lines.items():
            if r not in self.dead:
                sel.register(c.sock, selectors.EVENT_READ, r)
        for pool in self.remotes:
            if not pool.failed:
                sel.register(pool.line.sock, selectors.EVENT_READ, pool)
        for sock, fn in (watch or {}).items():
            sel.register(sock, selectors.EVENT_READ, fn)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        try:
            while any(r not in got and r not in errors and r not in self.dead
                      for r in self.hosts):
                now = time.monotonic()
                if (deadline is not None and now > deadline) or (
                        state["grace"] is not None and now > state["grace"]):
                    break
                for key, _ in sel.select(timeout=0.1):
                    if isinstance(key.data, RemotePool):
                        if not self._from_remote(key.data, take):
                            sel.unregister(key.fileobj)
                            state["timeout"] |= key.data.timeout
                            fail()
                    elif callable(key.data):
                        if not key.data():
                            sel.unregister(key.fileobj)
                    else:
                        r = key.data
                        try:
                            msgs = self.lines[r].feed()
                        except OSError:  # a rank killed with unread input resets the line
                            msgs = None
                        if msgs is None:
                            sel.unregister(key.fileobj)
                            self._died(r, errors)
                            silent_death = r not in errors
                            if silent_death and state["death"] is None:
                                state["death"] = self.name(r)
                            fail(DEATH_GRACE_S if silent_death else None)
                            continue
                        for msg in msgs:
                            take(r, msg)
                if self.monitor is not None:
                    self.monitor.sample()
        finally:
            sel.close()
        self.raise_failures(kind, wait_s, got, errors, state["timeout"], state["death"])
        return got

    def _from_remote(self, pool: RemotePool, take) -> bool:
        """Messages of a remote pool: tagged ones are its ranks'; False once it failed (its
        ranks count as dead from then on)."""
        try:
            msgs = pool.line.feed()
        except OSError:
            msgs = None
        for msg in msgs or []:
            if "rank" in msg:
                take(int(msg.pop("rank")), msg)
            elif msg["type"] == "error":
                pool.failed = pool.failed or msg["error"]
                pool.timeout = bool(msg.get("timeout", False))
            else:
                pool.on_message(msg)
        if msgs is None and not pool.failed:
            pool.failed = f"the pool {pool.why_lost()}"
        if pool.failed:
            for r in pool.ranks:
                self.dead.setdefault(r, "")
            return False
        return True

    def _died(self, rank: int, errors: dict[int, str]) -> None:
        """Rank ``rank`` closed its line: reap it and say how it ended."""
        _, status = os.waitpid(self.pids[rank], 0)
        self.pids[rank] = -1
        self.dead[rank] = "" if rank in errors else f"{self.name(rank)} died ({exit_text(status)})"

    def raise_failures(self, kind: str, wait_s: float | None, got: dict, errors: dict,
                       timeout: bool, death: str | None = None) -> None:
        """Raise :class:`RankFailure` when a rank of this gather failed, died or is silent
        (``death``: the rank whose death ended the wait, so the others were stopped)."""
        missing = [r for r in self.hosts if r not in got and r not in errors
                   and r not in self.dead]
        if not (errors or self.dead or missing):
            return
        lines = [d for d in self.dead.values() if d]
        lines += [f"server {p.server} (ranks {p.ranks}: "
                  f"{', '.join(self.hosts.get(r, '?') for r in p.ranks)}): {p.failed}"
                  for p in self.remotes if p.failed]
        lines += [f"{self.name(r)}: {e}" for r, e in sorted(errors.items())]
        if missing and death is not None:
            lines.append(f"ranks {missing} stopped: {death} died")
        elif missing:
            timeout = True
            silent = "" if wait_s is None else f" for {wait_s:.0f} s"
            lines.append(f"ranks {missing} silent{silent} while waiting for '{kind}'")
        raise RankFailure("; ".join(lines), timeout)

    def stop(self, wait_s: float = 2.0) -> None:
        """Tell every rank (and remote pool) to exit, wait for them, SIGKILL the ranks still
        alive after ``wait_s`` and reap all; a remote pool's session still open a moment
        later is ended here (that pool then stops its ranks)."""
        for c in [*self.lines.values(), *(p.line for p in self.remotes)]:
            with contextlib.suppress(OSError):
                c.send({"type": "exit"})
        deadline = time.monotonic() + wait_s
        for r, pid in self.pids.items():
            if pid <= 0:
                continue
            while not os.waitpid(pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):  # died meanwhile
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
            self.pids[r] = -1
        for pool in self.remotes:
            pool.close(wait_s + 3)
