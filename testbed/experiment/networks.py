"""The emulated network of an experiment point: its topology and the data-path programs of its
impairments, trimming and codec. Used by the experiment runner, ``testbed up``, ``testbed
launch`` and the provider's command line, which build the network a file describes; and the
network ``testbed up`` keeps running, for those that work beside it (:func:`attach_up`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.datapath.control import RUN_DIR
from testbed.experiment.spec import Experiment, datapath_options, load_point
from testbed.lifeline import start_ticks
from testbed.topologies import TestbedNet, make_topology


def topology_for(point: Experiment):
    """The testbed topology of one experiment point (its seed by default)."""
    kwargs = point.topology.kwargs()
    kwargs.setdefault("seed", point.seed)
    return make_topology(point.topology.kind, **kwargs)


def network_for(point: Experiment) -> TestbedNet:
    """The (not yet started) network of one experiment point: its topology and the data-path
    programs of its impairments, trimming and codec."""
    return TestbedNet(topology_for(point), datapath=datapath_options(point),
                      time_dilation=point.time_dilation, engine_groups=point.engine_groups)


#: Where ``testbed up`` describes the network it runs (pid, experiment, nodes' shell pids).
UP_STATE_PATH = Path(RUN_DIR) / "up.json"


def up_state() -> dict[str, Any] | None:
    """The running ``testbed up``'s state, or None when no network is up (a stale file is
    reported with ``alive: False``)."""
    try:
        state = json.loads(UP_STATE_PATH.read_text())
    except (OSError, ValueError):
        return None
    state["alive"] = start_ticks(int(state.get("pid", 0))) == state.get("start_ticks")
    return state


def running_up(file: str | None = None, what: str = "--attach") -> tuple[str, int, dict]:
    """(experiment file, point, state) of the network ``testbed up`` runs; ``ValueError``
    saying what to do (``what``: the option that asked) when none runs or ``file`` names
    another one."""
    state = up_state()
    if state is None or not state["alive"] or not state.get("ready"):
        raise ValueError(f"{what}: no network is up; start one with 'testbed up FILE "
                         "--detach' first")
    if file is not None and Path(file).resolve() != Path(state["file"]):
        raise ValueError(f"{what}: the network up is of {state['file']}, not {file}; leave "
                         "FILE out or 'testbed down' first")
    return state["file"], int(state.get("point", 0)), state


def attach_up(file: str | None = None, what: str = "--attach"):
    """An :class:`~testbed.topologies.attached.AttachedNet` of the network ``testbed up``
    runs (see :func:`running_up`): its hosts, engines and routes, the links it has down now.
    Close it when done (the network stays)."""
    from testbed.topologies.attached import AttachedNet

    file, point, state = running_up(file, what)
    topo = topology_for(load_point(file, point)[1])
    return AttachedNet(topo, state["pids"], state.get("time_dilation", 1.0),
                       links_down=lambda: (up_state() or {}).get("links_down", []))


def flatten_counters(obj: Any, prefix: str = "") -> dict[str, float]:
    """Nested counters -> ``{"node.port.name": value}`` for the numeric leaves."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_counters(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for k, v in enumerate(obj):
            out.update(flatten_counters(v, f"{prefix}{k}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix[:-1]] = float(obj)
    return out


def port_bytes_by_role(delta: dict[str, float], roles: dict[str, str]) -> dict[str, float]:
    """``port_bytes_<role>``: bytes that crossed the ports of the switches of each role (rx +
    tx, e.g. ``port_bytes_core``: every byte on a core link, counted once), from the
    flattened ``ports.<interface>.{rx,tx}_bytes`` deltas; ``roles``: switch -> role."""
    cols: dict[str, float] = {f"port_bytes_{r}": 0.0 for r in set(roles.values())}
    for path, v in delta.items():
        parts = path.split(".")
        if len(parts) != 3 or parts[0] != "ports" or parts[2] not in ("rx_bytes", "tx_bytes"):
            continue
        role = roles.get(parts[1].rsplit("-", 1)[0])
        if role is not None:
            cols[f"port_bytes_{role}"] += v
    return cols
