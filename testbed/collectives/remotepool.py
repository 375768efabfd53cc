"""Another server's pool of a collective: ``python -m testbed.collectives.remotepool``.

On a cluster network (docs/cluster.md) a rank can only enter its host's network namespace on
the server that holds the host. The coordinator (the local pool, :mod:`.worker`) starts this
module on every other server holding ranks of the job, as a session on the network's ssh
connection; the session's stdin/stdout is the control line between the two pools (JSON lines,
:class:`~testbed.collectives.rankgroup.ControlLine`; the coordinator's side is
:class:`~testbed.collectives.rankgroup.RemotePool`). This pool uses the collective pool's own
steps (buffers from the seed, kernels, fork, checks), so a rank runs the same code wherever
its host is.
"""

from __future__ import annotations

import contextlib
import os
import sys

from testbed.collectives.rankgroup import ControlLine, RankGroup
from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.worker import (
    check_outputs,
    clear_outputs,
    fork_ranks,
    load_kernels,
    numba_fork_safety,
    pss_mb,
    rank_buffers,
    set_process_name,
)


class _Stdio:
    """The ssh session's stdin and stdout as the socket of a :class:`ControlLine` (the remote
    pool's line to its coordinator)."""

    def __init__(self, rfd: int, wfd: int):
        self.rfd, self.wfd = rfd, wfd

    def fileno(self) -> int:
        return self.rfd

    def recv(self, size: int) -> bytes:
        return os.read(self.rfd, size)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view):]

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            with contextlib.suppress(OSError):
                os.close(fd)


class _Stopped(Exception):
    """The coordinator said ``exit`` (or went away) while this pool waited for its ranks."""


def _from_coordinator(line: ControlLine, kind: str) -> dict | None:
    """The coordinator's next message, which must be ``kind``; None when it says ``exit``."""
    msg = line.recv()
    if msg["type"] == "exit":
        return None
    if msg["type"] != kind:
        raise RuntimeError(f"the coordinator sent {msg['type']!r} where {kind!r} was due")
    return msg


def _coordinator_watch(line: ControlLine):
    """While this pool gathers its ranks: stop when the coordinator says ``exit`` or its line
    closes (it failed, or the ssh session ended)."""
    def on_readable() -> bool:
        msgs = line.feed()
        if msgs is None or any(m["type"] == "exit" for m in msgs):
            raise _Stopped
        return True

    return {line.sock: on_readable}


def serve_remote(line: ControlLine) -> int:
    """The pool on another server (``python -m testbed.collectives.remotepool``, started by
    the coordinator over ssh, ``line`` its session's stdin/stdout).

    The coordinator's first message is the job and the ranks this server holds. The pool
    generates every input from the seed, forks its ranks (they enter their hosts' namespaces
    through this server's /proc), relays the protocol (``port`` and ``ready`` up, tagged by
    rank; ``addrs``, ``go``, ``exit`` down), and per repetition checks its ranks' outputs
    against the numpy reference and reports the verdict (``checked``) before their ``done``,
    each with ``elapsed``, the rank's time from its ``go`` on this server's clock. A failure
    of its ranks is one ``error`` message naming them; when the coordinator's line closes it
    stops its ranks and exits."""
    first = line.recv()
    job, mine = first["job"], [int(r) for r in first["ranks"]]
    set_process_name("tbp-" + str(first.get("server", "")))
    spec = CollectiveSpec(**job["spec"])
    fork_safe = numba_fork_safety(spec)  # before anything below loads the kernels
    n = job["n"]
    ins, outs = rank_buffers(spec, n)
    replicas = load_kernels(spec, fork_safe, n)
    job["_pool_pid"] = os.getpid()
    group = RankGroup({r: job["ranks"][r]["host"] for r in mine}, spec.timeout_s)
    group.close_in_child.append(line.sock)
    fork_ranks(group, job, spec, mine, ins, outs)
    workers = [r for r in mine if r < n]
    watch = _coordinator_watch(line)
    try:
        line.send({"type": "pool", "pid": os.getpid(), "pids": group.pids})
        for r, msg in group.gather("port", spec.timeout_s + 30, watch=watch).items():
            line.send({**msg, "rank": r})
        addrs = _from_coordinator(line, "addrs")
        if addrs is None:
            return 0
        group.broadcast(addrs)
        ready = group.gather("ready", spec.timeout_s + 30, watch=watch)
        line.send({"type": "mem", "mem_mb": sum(pss_mb(p) for p in
                                                [os.getpid(), *group.live_pids()])})
        for r, msg in ready.items():
            line.send({**msg, "rank": r})
        while (go := _from_coordinator(line, "go")) is not None:
            clear_outputs([outs[r] for r in workers], spec)
            group.broadcast(go)
            done = group.gather("done", spec.timeout_s + 5, watch=watch)
            err, ok = check_outputs(spec, replicas, ins, outs, go["rep"], workers)
            line.send({"type": "checked", "rep": go["rep"], "max_abs_err": err, "correct": ok})
            for r, msg in done.items():
                line.send({"type": "done", "rank": r, "elapsed": msg["t_end"] - msg["t_start"]})
    except RuntimeError as e:  # RankFailure: the coordinator fails the run with it
        with contextlib.suppress(OSError):
            line.send({"type": "error", "error": str(e),
                       "timeout": bool(getattr(e, "timeout", False))})
    except (_Stopped, EOFError, OSError):
        pass  # the coordinator ended the run (or is gone): stop the ranks
    finally:
        group.stop()
    return 0


def main() -> int:
    """Entry point: serve the coordinator on this session's stdin/stdout. The command line's
    other arguments are ``testbed-node=<host>`` tags for ``testbed cleanup``."""
    # the line gets the session's stdio; stray prints go to stderr, not into the protocol
    line = ControlLine(_Stdio(os.dup(0), os.dup(1)))
    os.dup2(2, 1)
    return serve_remote(line)


if __name__ == "__main__":
    sys.exit(main())
