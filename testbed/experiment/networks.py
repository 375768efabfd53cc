"""The emulated network of an experiment point: its topology and the data-path programs of its
impairments, trimming and codec. Used by the experiment runner, ``testbed up``, ``testbed
launch`` and the provider's command line, which build the network a file describes."""

from __future__ import annotations

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
                 ports=None if t.ports is None else tuple(t.ports))
        for t in point.trimming)
    nic_codec = None
    if point.codec is not None:
        nic_codec = {"codec": point.codec.codec, **point.codec.settings}
    elif point.topology.smartnic and any(j.algo == "nic" and j.op != "incast"
                                         for j in point.jobs):
        nic_codec = {"codec": "fixed32"}
    return DatapathOptions(impairments=impairments, trimming=trimming, nic_codec=nic_codec,
                           aggregate=point.topology.aggregate_settings())
