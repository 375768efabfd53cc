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


#: a watched file's handler: called when it is readable; False to stop watching it
Watch = Callable[[], bool]
#: a handler of a rank's message of another kind than the one gathered
OnMessage = Callable[[int, dict], None]


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

    def name(self, rank: int) -> str:
        """``rank R (host)``, as messages call a rank."""
        return f"rank {rank} ({self.hosts.get(rank, '?')})"

    def fork(self, rank: int, child: Callable[[ControlLine], int]) -> int:
        """Fork rank ``rank``: the child runs ``child(its control line)`` and exits with what it
        returns (1 on an exception). Returns the child's pid."""
        pid, line = fork_with_line(child, [c.sock for c in self.lines.values()]
                                   + self.close_in_child)
        self.pids[rank] = pid
        self.lines[rank] = line
        return pid

    def live_pids(self) -> list[int]:
        """Pids of the children not reaped yet."""
        return [p for p in self.pids.values() if p > 0]

    def broadcast(self, msg: dict) -> None:
        """Send ``msg`` to every live rank."""
        for r, c in self.lines.items():
            if r not in self.dead:
                c.send(msg)

    def gather(self, kind: str, wait_s: float | None, on_message: OnMessage | None = None,
               watch: dict | None = None) -> dict[int, dict]:
        """One message of ``kind`` from every live rank: rank -> message. ``wait_s``: how
        long they may stay silent (None: as long as they live); ``on_message(rank, msg)``
        handles messages of other kinds (a RuntimeError, KeyError or OSError it raises fails the rank
        with its text); ``watch``: socket
        -> handler called when it is readable (False: stop watching it). Raises
        :class:`RankFailure` naming every rank that failed, died or stayed silent."""
        got: dict[int, dict] = {}
        errors: dict[int, str] = {}
        timeout = False
        sel = selectors.DefaultSelector()
        for r, c in self.lines.items():
            if r not in self.dead:
                sel.register(c.sock, selectors.EVENT_READ, r)
        for sock, fn in (watch or {}).items():
            sel.register(sock, selectors.EVENT_READ, fn)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        grace = None  # after a failure, the others get a moment to report theirs
        try:
            while len(got) + len(errors) + len(self.dead) < len(self.lines):
                now = time.monotonic()
                if (deadline is not None and now > deadline) or (grace is not None
                                                                  and now > grace):
                    break
                for key, _ in sel.select(timeout=0.1):
                    if callable(key.data):
                        if not key.data():
                            sel.unregister(key.fileobj)
                        continue
                    r = key.data
                    msgs = self.lines[r].feed()
                    if msgs is None:
                        sel.unregister(key.fileobj)
                        self._died(r, errors)
                        grace = grace or time.monotonic() + self._grace()
                        continue
                    for msg in msgs:
                        if msg["type"] == "error":
                            errors[r] = msg["error"]
                            timeout |= bool(msg.get("timeout", False))
                            grace = grace or time.monotonic() + self._grace()
                        elif msg["type"] == kind:
                            got[r] = msg
                        elif on_message is not None:
                            try:
                                on_message(r, msg)
                            except (RuntimeError, KeyError, OSError) as e:
                                errors[r] = str(e) or repr(e)
                                grace = grace or time.monotonic() + self._grace()
                if self.monitor is not None:
                    self.monitor.sample()
        finally:
            sel.close()
        self.raise_failures(kind, wait_s, got, errors, timeout)
        return got

    def _grace(self) -> float:
        return min(self.timeout_s + 3, 30)

    def _died(self, rank: int, errors: dict[int, str]) -> None:
        """Rank ``rank`` closed its line: reap it and say how it ended."""
        _, status = os.waitpid(self.pids[rank], 0)
        self.pids[rank] = -1
        self.dead[rank] = "" if rank in errors else f"{self.name(rank)} died ({exit_text(status)})"

    def raise_failures(self, kind: str, wait_s: float | None, got: dict, errors: dict,
                       timeout: bool) -> None:
        """Raise :class:`RankFailure` when a rank of this gather failed, died or is silent."""
        missing = [r for r in self.lines if r not in got and r not in errors
                   and r not in self.dead]
        if not (errors or self.dead or missing):
            return
        lines = [d for d in self.dead.values() if d]
        lines += [f"{self.name(r)}: {e}" for r, e in sorted(errors.items())]
        if missing:
            timeout = True
            silent = "" if wait_s is None else f" for {wait_s:.0f} s"
            lines.append(f"ranks {missing} silent{silent} while waiting for '{kind}'")
        raise RankFailure("; ".join(lines), timeout)

    def stop(self, wait_s: float = 2.0) -> None:
        """Tell every rank to exit, wait for them, SIGKILL the ones still alive after
        ``wait_s`` and reap all."""
        for c in self.lines.values():
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
