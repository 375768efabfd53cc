"""The emulated network of an experiment point: its topology and the data-path programs of its
impairments, trimming and codec. Used by the experiment runner, ``testbed up``, ``testbed
launch`` and the provider's command line, which build the network a file describes."""

from __future__ import annotations

from typing import Any

from testbed.experiment.spec import Experiment
from testbed.topologies import TestbedNet, make_topology
from testbed.topologies.pipeline import DatapathOptions, Impairment, Trimming


def topology_for(point: Experiment):
    """The testbed topology of one experiment point (its seed by default)."""
    kwargs = point.topology.kwargs()
    kwargs.setdefault("seed", point.seed)
    return make_topology(point.topology.kind, **kwargs)


def network_for(point: Experiment) -> TestbedNet:
    """The (not yet started) network of one experiment point: its topology and the data-path
    programs of its impairments, trimming and codec."""
    return TestbedNet(topology_for(point), datapath=datapath_options(point),
                      time_dilation=point.time_dilation)


def datapath_options(point: Experiment) -> DatapathOptions:
    """The data-path conditions of ``point`` as the pipeline composer takes them.

    Impairment percentages become probabilities and an impairment without a seed takes the
    experiment's. SmartNICs run the ``nic_codec`` stage when the experiment sets a codec, or
    in fixed-point mode when a job uses ``algo = "nic"`` (the SmartNIC-offloaded INA; without
    SmartNICs that job fails on its own and the others run).
    """
    impairments = tuple(
        Impairment(node=i.node, direction=i.direction,
                   ports=None if i.ports is None else tuple(i.ports),
                   loss=i.loss_pct / 100.0, dup=i.dup_pct / 100.0,
                   reorder=i.reorder_pct / 100.0, delay_ms=i.delay_ms, jitter_ms=i.jitter_ms,
                   filter=i.filter, seed=point.seed if i.seed is None else i.seed)
        for i in point.impairments)
    trimming = tuple(
        Trimming(node=t.node, mode=t.mode, rate_mbps=t.rate_mbps,
                 threshold_bytes=t.threshold_bytes, queue_slots=t.queue_slots,
                 ports=None if t.ports is None else tuple(t.ports), trim_bytes=t.trim_bytes,
                 threshold_bdp=t.threshold_bdp, rtt_us=t.rtt_us)
        for t in point.trimming)
    nic_codec = None
    if point.codec is not None:
        nic_codec = {"codec": point.codec.codec, **point.codec.settings}
    elif point.topology.smartnic and any(j.algo == "nic" and j.op != "incast"
                                         for j in point.jobs):
        nic_codec = {"codec": "fixed32"}
    return DatapathOptions(impairments=impairments, trimming=trimming, nic_codec=nic_codec,
                           aggregate=point.topology.aggregate_settings())


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
