"""``testbed up FILE`` / ``testbed down``: an emulated network that outlives one command.

``up`` builds the topology of an experiment file, with the data-path programs its impairments,
trimming and codec ask for, and keeps it running: with Mininet's CLI when standard input is a
terminal (``exit`` or Ctrl-D tears it down), otherwise until ``testbed down``, SIGTERM or
Ctrl-C. ``--detach`` starts it in the background and returns once it is ready. The jobs, cross
traffic and captures of the file are not started: the network is there to look at, ping, and
query with ``testbed switch NODE ...`` over the nodes' control sockets.

The ``up`` process holds the emulation lock for the network's whole life, like every other
network: ``testbed run``, the tests and ``testbed cleanup`` wait for it (``cleanup`` names it as
the holder). Its state file ``<run dir>/up.json`` (pid, pid start time, experiment, nodes and
their shells' pids, for ``mnexec -a PID command`` inside a node) lets ``down`` find it; ``down`` sends it SIGTERM and waits until its teardown finished. If the
``up`` process died without tearing down (SIGKILL), ``down`` runs ``testbed cleanup``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testbed.atomic import write_json
from testbed.cleanup import main as cleanup
from testbed.datapath.control import RUN_DIR
from testbed.experiment.networks import UP_STATE_PATH as STATE_PATH
from testbed.experiment.networks import up_state as read_state
from testbed.experiment.spec import load_point
from testbed.lifeline import start_ticks

#: Output of a detached ``up`` (the network's own messages, errors included).
LOG_PATH = Path(RUN_DIR) / "up.log"
#: ``testbed switch NODE restart`` and ``testbed link down|up A B``: the request (JSON) and
#: the answer, exchanged with the ``up`` process, which owns the network (SIGUSR1 says a
#: request is there).
REQUEST_PATH = Path(RUN_DIR) / "up.request"
ANSWER_PATH = Path(RUN_DIR) / "up.answer"
NOT_ROOT = ("testbed {verb} builds and tears down emulated networks and needs root: run "
            "'sudo .venv/bin/testbed {verb} ...' (or use the lab VM)")


class _Down(BaseException):
    """Raised by the SIGTERM handler of a running ``up`` (not an Exception: nothing may
    swallow it, Mininet's CLI included)."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_state(state: dict[str, Any]) -> None:
    STATE_PATH.parent.mkdir(parents=True, exist_ok=True)
    write_json(STATE_PATH, state, indent=1)


def _remove_own_state() -> None:
    state = read_state()
    if state is not None and int(state.get("pid", 0)) == os.getpid():
        STATE_PATH.unlink(missing_ok=True)


def _busy_message(state: dict[str, Any]) -> str:
    return (f"a network is already up: {state.get('name')} from {state.get('file')} "
            f"(pid {state.get('pid')}); 'testbed down' first")


def up(file: str, point: int = 0, cli: bool | None = None, detach: bool = False,
       ready_timeout: float = 900.0) -> int:
    """CLI entry of ``testbed up``: 0 after a clean teardown (or, detached, once ready);
    1 on failure, 2 for a bad file or option, 130 on Ctrl-C."""
    if os.geteuid() != 0:
        _err(NOT_ROOT.format(verb="up"))
        return 1
    try:
        exp, pt = load_point(file, point)
    except ValueError as e:
        _err(str(e))
        return 2
    state = read_state()
    if state is not None and state["alive"]:
        _err(_busy_message(state))
        return 1
    if detach:
        return _detach(file, point, ready_timeout)
    if cli is None:
        cli = sys.stdin.isatty()
    return _serve(file, point, exp, pt, cli)


def _detach(file: str, point: int, ready_timeout: float) -> int:
    """Start ``up`` in its own session (output to LOG_PATH); return once it is ready."""
    LOG_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG_PATH, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "testbed.cli", "up", str(Path(file).resolve()), "--point",
             str(point), "--no-cli"], stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        state = read_state()
        if state and state.get("pid") == proc.pid and state.get("ready"):
            _say(f"up: {state['name']} (pid {proc.pid}, log {LOG_PATH}); "
                 "'testbed down' tears it down")
            return 0
        if proc.poll() is not None:
            _err(f"testbed up failed (exit {proc.returncode}):\n{_tail(LOG_PATH)}")
            return 1
        time.sleep(0.2)
    _err(f"testbed up: not ready after {ready_timeout:.0f} s (pid {proc.pid} keeps trying; "
         f"log {LOG_PATH}); 'testbed down' stops it")
    return 1


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return ""


def _serve(file: str, point: int, exp, pt, cli: bool) -> int:
    """Build the network, keep it until told to stop, tear it down."""
    # here, not at the top: the network layers take about 2 s to import and 'testbed down',
    # which shares this module, needs none of them
    from testbed.experiment.networks import network_for

    try:
        network = network_for(pt)
    except Exception as e:  # bad combination the topology layer found
        _err(f"testbed up: {type(e).__name__}: {e}")
        return 2
    state = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "ready": False,
             "file": str(Path(file).resolve()), "point": point, "name": exp.name,
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_state(state)
    # SIGTERM from `testbed down`: TestbedNet turns it into KeyboardInterrupt while it builds
    # and restores this handler afterwards; once the network runs, ours applies.
    old = signal.signal(signal.SIGTERM, _on_term)
    code = 0
    try:
        with network as net:
            desc = net.describe()
            # node pids let other commands enter a node: `mnexec -a PID cmd`, `nsenter -t PID -n`
            pids = {n.name: n.pid for n in net.mininet.hosts + net.mininet.switches
                    if getattr(n, "pid", None)}
            state.update(ready=True, hosts=desc.get("hosts"), aggregator=net.aggregator,
                         time_dilation=net.time_dilation,
                         programmable=sorted(net.datapath_clients()),
                         programs=desc.get("programs"), pids=pids)
            _write_state(state)
            signal.signal(signal.SIGTERM, _on_term)
            signal.signal(signal.SIGUSR1, lambda _s, _f: _serve_request(net, state))
            _banner(state, cli)
            if cli:
                from mininet.cli import CLI  # only an interactive session needs it

                CLI(net.mininet)
            else:
                while True:
                    signal.pause()
    except _Down:
        pass
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 - reported without a traceback
        _err(f"testbed up: {type(e).__name__}: {e}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        _remove_own_state()
        for p in (REQUEST_PATH, ANSWER_PATH):
            p.unlink(missing_ok=True)
    _say(f"down: {exp.name} torn down")
    return code


def _serve_request(net, state: dict[str, Any]) -> None:
    """Answer a request of :func:`ask` (in this process's main thread)."""
    req: dict = {}
    try:
        req = json.loads(REQUEST_PATH.read_text())
        REQUEST_PATH.unlink(missing_ok=True)
        if req.get("op") == "restart":
            answer = {"node": req["node"], "seconds": round(net.restart_engine(req["node"]), 3)}
            said = f"engine of {req['node']} restarted in {answer['seconds']} s"
        elif req.get("op") == "link":
            change = net.link_down if req["state"] == "down" else net.link_up
            answer = change(req["a"], req["b"])
            state["links_down"] = ["-".join(p) for p in net.links_down]
            _write_state(state)
            said = (f"link {answer['link']} {answer['state']}: {answer['routes_changed']} "
                    f"routes changed in {answer['seconds']} s")
        else:
            raise ValueError(f"unknown request {req.get('op')!r}")
        answer["ok"] = True
    except Exception as e:  # noqa: BLE001 - the requester reports it
        answer = {**req, "ok": False, "error": f"{type(e).__name__}: {e}"}
        said = f"{req.get('op', 'request')} failed: {answer['error']}"
    write_json(ANSWER_PATH, answer)
    _say(f"up: {said}")


def ask(request: dict, timeout: float = 120.0) -> dict:
    """Hand ``request`` to the running ``up`` (which owns the network) and return its answer
    (``ok`` says whether it was done; ``error`` why not). ``RuntimeError`` when no network
    is up or it does not answer in time."""
    state = read_state()
    if state is None or not state["alive"] or not state.get("ready"):
        raise RuntimeError("no network is up ('testbed up FILE' first): only the process "
                           "that runs the network can change it")
    ANSWER_PATH.unlink(missing_ok=True)
    tmp = REQUEST_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(request))
    os.replace(tmp, REQUEST_PATH)
    os.kill(int(state["pid"]), signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while not ANSWER_PATH.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the 'testbed up' process (pid {state['pid']}) did not answer "
                               f"within {timeout:.0f} s")
        time.sleep(0.05)
    answer = json.loads(ANSWER_PATH.read_text())
    ANSWER_PATH.unlink(missing_ok=True)
    return answer


def restart(node: str, timeout: float = 120.0) -> dict:
    """Ask the running ``up`` to start ``node``'s engine again (``testbed switch NODE
    restart``); its answer: ``{"node", "ok", "seconds"}`` or ``{"ok": False, "error"}``."""
    state = read_state()
    if state is not None and state.get("ready") and \
            node not in (state.get("programmable") or []):
        raise RuntimeError(f"{node!r} is not a programmable node of the network up "
                           f"(programmable: {state.get('programmable')})")
    return ask({"op": "restart", "node": node}, timeout)


def link(a: str, b: str, state: str, timeout: float = 120.0) -> dict:
    """Ask the running ``up`` to take the link between ``a`` and ``b`` down or bring it up
    again (``testbed link down|up A B``); its answer: ``TestbedNet.link_down``'s dict with
    ``ok``, or ``{"ok": False, "error"}``."""
    if state not in ("down", "up"):
        raise ValueError(f"link state must be 'down' or 'up', got {state!r}")
    return ask({"op": "link", "a": a, "b": b, "state": state}, timeout)


def _on_term(signum, frame) -> None:
    raise _Down(signum)


def _banner(state: dict[str, Any], cli: bool) -> None:
    nodes = state.get("programmable") or []
    _say(f"up: {state['name']}: hosts {', '.join(state.get('hosts') or [])}; programmable "
         f"{', '.join(nodes) or 'none'}; aggregator "
         f"{(state.get('aggregator') or {}).get('switch', 'none')}")
    if nodes:
        _say(f"  testbed switch {nodes[0]} counters | config | jobs | trace")
    _say("  'exit' (or Ctrl-D) tears it down" if cli else "  'testbed down' tears it down")


def down(timeout: float = 120.0) -> int:
    """CLI entry of ``testbed down``: stop the running ``up`` and wait for its teardown."""
    if os.geteuid() != 0:
        _err(NOT_ROOT.format(verb="down"))
        return 1
    state = read_state()
    if state is None:
        _say("no network is up")
        return 0
    pid = int(state["pid"])
    if not state["alive"]:
        STATE_PATH.unlink(missing_ok=True)
        _say(f"the 'testbed up' process of {state.get('name')} (pid {pid}) is gone; "
             "removing what it left behind")

        return cleanup()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while start_ticks(pid) == state["start_ticks"]:
        if time.monotonic() > deadline:
            _err(f"testbed down: pid {pid} still tearing down after {timeout:.0f} s; if it is "
                 "stuck, 'testbed cleanup' waits for the lock and removes what is left")
            return 1
        time.sleep(0.1)
    LOG_PATH.unlink(missing_ok=True)  # a detached network's messages: the network is gone
    _say(f"down: {state.get('name')} (pid {pid}) torn down")
    return 0
