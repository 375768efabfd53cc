"""Faults injected while an experiment's jobs run (the ``faults`` of an experiment file).

:class:`FaultSchedule` is a context manager around one run of a point's jobs. On entry it
fails the links whose fault is at 0 s (so the jobs' routes, INA trees and models already see
the degraded fabric); a thread then fires the others at their times, undilated seconds times
the network's dilation: a link goes down (``TestbedNet.link_down``; back up after ``down_s``),
a switch engine or a host's collective worker (``tbw-<host>``; if it is not running yet, as
soon as it is) is SIGKILLed. On exit the
thread stops and every link it failed comes back up, so the next run starts on the intact
fabric. ``events`` records what happened, when, and what could not be done (a fault never
loses the run's rows: its error is recorded, not raised).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import threading
import time


class FaultSchedule:
    """The faults of one run on ``net`` (a running ``TestbedNet``); see the module docstring."""

    def __init__(self, net, faults: list):
        self.net = net
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.dilation = float(getattr(net, "time_dilation", 1.0) or 1.0)
        self.events: list[dict] = []
        self._failed: set[tuple[str, str]] = set()  # links this schedule took down
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread and the exit both touch the links
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    # -- what each fault does -------------------------------------------------------------
    def _record(self, kind: str, target: str, planned_s: float, fn) -> None:
        t = (time.monotonic() - self._t0) / self.dilation
        event = {"kind": kind, "target": target, "at_s": round(planned_s, 4),
                 "t_s": round(t, 4), "error": None}
        try:
            detail = fn()
            if isinstance(detail, dict):
                event.update({k: detail[k] for k in ("routes_changed", "seconds", "pid")
                              if k in detail})
        except Exception as e:  # noqa: BLE001 - recorded in the rows, never fatal
            event["error"] = f"{type(e).__name__}: {e}"
        self.events.append(event)

    def _link(self, ends: list[str], state: str) -> dict:
        a, b = ends
        with self._lock:
            if state == "down":
                answer = self.net.link_down(a, b)
                self._failed.add((a, b))
            else:
                answer = self.net.link_up(a, b)
                self._failed.discard((a, b))
        return answer

    def _kill_engine(self, node: str) -> dict:
        """SIGKILL the node's engine and wait until it is gone: a kill at the very end of a
        run must leave the next run a dead engine (restarted before it registers), not a
        dying one that still looks alive."""
        sw = self.net.mininet.get(node)
        engine, pid = sw.engine, sw.engine_pid()  # (a restart may replace sw.engine)
        if pid is None:
            raise RuntimeError(f"{node}'s engine is not running")
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.wait(timeout=10)
        return {"pid": pid}

    def _kill_worker(self, rank: int) -> dict:
        """SIGKILL the host's collective worker, at once or as soon as it runs (a pool takes
        a moment to start its ranks) while the run lasts."""
        host = self.net.topo.host_names[rank]
        while True:
            for path in glob.glob("/proc/[0-9]*/comm"):
                try:
                    with open(path) as f:
                        if f.read().strip() != f"tbw-{host}":
                            continue
                    pid = int(path.split("/")[2])
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            continue  # an earlier run's rank its (dead) pool never reaped
                    os.kill(pid, signal.SIGKILL)
                    return {"pid": pid}
                except (OSError, ValueError):
                    continue
            if self._stop.wait(0.02):
                raise RuntimeError(f"no collective worker ran on {host} (tbw-{host}) from "
                                   "the fault's time to the run's end")

    def _fire(self, f, planned_s: float, state: str = "down") -> None:
        if f.link is not None:
            self._record(f"link_{state}", "-".join(f.link), planned_s,
                         lambda: self._link(f.link, state))
        elif f.switch is not None:
            self._record("engine_kill", f.switch, planned_s, lambda: self._kill_engine(f.switch))
        else:
            self._record("worker_kill", self.net.topo.host_names[f.worker], planned_s,
                         lambda: self._kill_worker(f.worker))

    # -- the schedule ------------------------------------------------------------------------
    def _timeline(self) -> list[tuple[float, object, str]]:
        """(undilated time, fault, state) of every action after the start, in time order."""
        out = []
        for f in self.faults:
            if f.at_s > 0 or f.link is None:
                out.append((f.at_s, f, "down"))
            if f.link is not None and f.down_s is not None:
                out.append((f.at_s + f.down_s, f, "up"))
        return sorted(out, key=lambda e: e[0])

    def _run(self, timeline) -> None:
        for at, f, state in timeline:
            if self._stop.wait(max(0.0, self._t0 + at * self.dilation - time.monotonic())):
                return
            self._fire(f, at, state)

    def __enter__(self) -> FaultSchedule:
        self._t0 = time.monotonic()
        for f in self.faults:  # in place before the jobs start
            if f.at_s == 0 and f.link is not None:
                self._fire(f, 0.0)
        timeline = self._timeline()
        self._t0 = time.monotonic()
        if timeline:
            self._thread = threading.Thread(target=self._run, args=(timeline,),
                                            name="faults", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for a, b in sorted(self._failed):  # the next run starts on the intact fabric
            self._record("link_up", f"{a}-{b}", (time.monotonic() - self._t0) / self.dilation,
                         lambda a=a, b=b: self._link([a, b], "up"))
