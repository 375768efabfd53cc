"""Declarative experiments: the schema, file loading, readable errors and sweep expansion.

An experiment is one object (pydantic v2, unknown fields rejected) that can be written as a
TOML or YAML file or built in Python::

    name = "ring-vs-ina"
    [topology]
    kind = "star"
    n_hosts = 4
    bw_mbps = 100
    [[jobs]]
    algo = "ring"
    nbytes = "8MiB"
    [[jobs]]
    algo = "ina"
    nbytes = "8MiB"
    [sweep]
    "topology.n_hosts" = [2, 4]

``sweep`` maps dotted field paths to lists of values; the runs are the cartesian product.
Every expanded point is validated again, so a bad sweep value is reported under its path.

``time_dilation`` (a factor f from 1 to 64, or ``"auto"``) runs the network f times slower
and reports undilated times, so a machine whose CPU cannot keep up with the emulated links
still measures the network (``testbed.collectives.dilation``); ``"auto"`` calibrates the
smallest factor that keeps the runs below CPU saturation, once per network.
``engine_groups = n`` serves the programmable switches with n engine processes, the links
between a process's switches in memory: a multi-switch fabric then needs less dilation
(``testbed.datapath.group``).

The checks that need a lower layer (collective options, compressor and stage names, the
topology, training traces) import it where they use it: the schema alone loads in about 0.2 s,
the layers with Numba kernels take over a second more, and readers of experiment files (the
pytest plugin, notebooks, ``testbed run`` on an invalid file) should not wait for them.

Why one module this long: it is the experiment file format, one pydantic schema whose cross-
field checks (jobs against the topology, sweeps against fields, plug-in names) need every model
in view.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from testbed.collectives.algorithms import algorithm_names, check_nproc_per_host, is_offloaded
from testbed.collectives.spec import (
    communication_label,
    communication_model,
    communication_of,
)

if TYPE_CHECKING:
    from testbed.topologies.pipeline import DatapathOptions

#: Largest time dilation factor (``testbed.topologies.pipeline.MAX_TIME_DILATION``, not
#: imported: the schema loads without the topology layer)
MAX_TIME_DILATION = 64.0
TOPOLOGY_KINDS = ("star", "leaf_spine", "fat_tree", "dumbbell", "incast")

# Which of TopologySpec's optional fields each kind accepts (the rest go through `params`).
_KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "star": ("n_hosts",),
    "leaf_spine": ("leaves", "spines", "hosts_per_leaf", "oversubscription", "uplink_mbps"),
    "fat_tree": ("k",),
    "dumbbell": ("n_left", "n_right", "bottleneck_mbps"),
    "incast": ("n_senders", "receiver_mbps"),
}
_ALL_KIND_FIELDS = tuple(sorted({f for v in _KIND_FIELDS.values() for f in v}))


class ExperimentError(ValueError):
    """An experiment file or object is malformed; ``problems`` lists one line per bad field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid experiment {source}:\n{lines}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TopologySpec(_Strict):
    """The emulated network: a kind from ``testbed.topologies`` and its options."""

    kind: Literal["star", "leaf_spine", "fat_tree", "dumbbell", "incast"] = "star"
    bw_mbps: float = Field(100.0, gt=0, le=100_000, description="per-link bandwidth (HTB)")
    switch: Literal["programmable", "bridge"] = Field(
        "programmable", description="programmable switches run the data path (needed for ina)")
    smartnic: bool | list[int] = Field(False, description="SmartNIC node in front of hosts")
    aggregator: str = Field("auto", description="switch hosting the aggregator, 'auto' or 'none'")
    delay_ms: float | None = Field(None, ge=0, description="per-link delay")
    loss_pct: float | None = Field(None, ge=0, le=100, description="per-link loss")
    queue_ms: float | None = Field(
        None, gt=0, le=10_000, description="every shaped link's queue in ms at its rate "
                                           "(default: the kernel's 1000 packets)")
    # kind-specific sizes (only the ones of the chosen kind may be set)
    n_hosts: int | None = Field(None, ge=1, le=64)
    leaves: int | None = Field(None, ge=1)
    spines: int | None = Field(None, ge=1)
    hosts_per_leaf: int | None = Field(None, ge=1)
    oversubscription: float | None = Field(None, gt=0)
    uplink_mbps: float | None = Field(None, gt=0)
    k: int | None = Field(None, ge=2)
    n_left: int | None = Field(None, ge=1)
    n_right: int | None = Field(None, ge=1)
    bottleneck_mbps: float | None = Field(None, gt=0)
    n_senders: int | None = Field(None, ge=1)
    receiver_mbps: float | None = Field(None, gt=0)
    switch_memory: ByteSize | None = Field(
        None, description="aggregator memory of every programmable switch (default 16 MiB)")
    shared_pool: ByteSize | None = Field(
        None, description="the part of switch_memory that is the shared pool of jobs in "
                          "placement mode 'shared' (default a quarter)")
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="further keyword options for make_topology")

    @model_validator(mode="after")
    def _pool_fits(self) -> TopologySpec:
        if self.switch_memory is not None and not 1 <= int(self.switch_memory) <= 4 << 30:
            raise ValueError(f"switch_memory ({int(self.switch_memory)} B) must be 1 B to "
                             "4 GiB (a switch without static memory: give it less than one "
                             "INA job's slots, e.g. '1KiB')")
        if self.shared_pool is not None and int(self.shared_pool) > int(
                self.switch_memory if self.switch_memory is not None else 16 << 20):
            raise ValueError(f"shared_pool ({int(self.shared_pool)} B) exceeds switch_memory")
        return self

    def aggregate_settings(self) -> dict[str, int] | None:
        """Settings of every switch's ``aggregate`` stage (memory), None for the defaults."""
        out = {}
        if self.switch_memory is not None:
            out["memory_bytes"] = int(self.switch_memory)
        if self.shared_pool is not None:
            out["pool_bytes"] = int(self.shared_pool)
        return out or None

    @model_validator(mode="after")
    def _fields_fit_kind(self) -> TopologySpec:
        allowed = _KIND_FIELDS[self.kind]
        for name in _ALL_KIND_FIELDS:
            if name not in allowed and getattr(self, name) is not None:
                raise ValueError(
                    f"field '{name}' does not apply to kind '{self.kind}'; "
                    f"{self.kind} takes {', '.join(allowed)}")
        return self

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``testbed.topologies.make_topology(kind, **kwargs)``."""
        out = self.model_dump(exclude={"kind", "params", "switch_memory", "shared_pool"},
                              exclude_none=True)
        if out.get("smartnic") is False:
            out.pop("smartnic")
        if out.get("aggregator") == "none":
            out["aggregator"] = None
        out.update(self.params)
        return out


class Placement(_Strict):
    """Where an in-network job aggregates (``algo`` ina/nic): its tree of switches, how it
    holds switch memory, and its slots per switch."""

    tree: Literal["single", "auto"] | list[str] = Field(
        "single", description="'single': the topology's aggregator; 'auto': the lowest common "
                              "ancestor tree of the job's workers; or switch names, root first")
    mode: Literal["static", "shared"] = Field(
        "static", description="'static': reserved slots or refused at admission; 'shared': "
                              "the switch's best-effort pool, overflow to a host aggregator")
    slots: int | None = Field(None, ge=1, le=4096, description="default: the job's window")
    refused: Literal["fail", "ring"] = Field(
        "fail", description="a switch refuses the job at admission: 'fail' (an error row) or "
                            "'ring' (run it on the hosts, placement_mode 'refused')")
    engine_death: Literal["restart", "fail"] = Field(
        "restart", description="a switch engine dies mid-collective: 'restart' (started "
                               "again, the collective rerun, exact) or 'fail' (an error row "
                               "naming it)")
    link_failure: Literal["replan", "fail"] = Field(
        "replan", description="a link the job's tree rides fails mid-collective: 'replan' "
                              "(the collective rerun on a tree around it, exact) or 'fail' "
                              "(an error row naming its ports)")

    @field_validator("tree")
    @classmethod
    def _tree_names(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("give at least one switch (the root first)")
        return v

    def as_dict(self) -> dict[str, Any]:
        """The ``CollectiveSpec.placement`` dict."""
        return self.model_dump(exclude_none=True)


def _compressor_name(v: str | None) -> str | None:
    """A job's compressor: None for none, else a registered name (ValueError otherwise)."""
    if v in (None, "", "none"):
        return None
    names = _compressor_names()
    if v not in names:
        raise ValueError(f"unknown compressor {v!r}; allowed: {', '.join(names)}")
    return v


class _Communication(communication_model(_Strict)):
    """A job's communication settings (``testbed.collectives.spec.Communication``), its
    compressor checked by name here, before any lower layer loads."""

    @field_validator("compressor")
    @classmethod
    def _known_compressor(cls, v: str | None) -> str | None:
        return _compressor_name(v)


class JobSpec(_Communication):
    """One collective: operation, algorithm, size(s), compression and repetitions."""

    name: str | None = Field(None, description="label in tables and plots (default: algo)")
    op: Literal["allreduce", "reduce_scatter", "allgather", "broadcast", "incast"] = Field(
        "allreduce", description="a collective, or 'incast': trimmable gradients pushed from "
                                 "every host to rank 0 (testbed.experiment.incast)")
    nbytes: ByteSize | list[ByteSize] = Field(
        ByteSize(1 << 20), description="message size: bytes or '8MiB'; a list runs each size")
    dtype: Literal["float32"] = "float32"
    servers: int = Field(1, ge=1, description="reduction servers (algo 'rs')")
    repetitions: int = Field(1, ge=1, le=1000)
    seed: int | None = Field(None, description="default: the experiment's seed")
    timeout_s: float = Field(60.0, gt=0)
    hosts: list[int] | None = Field(None, description="host ranks of the job's workers "
                                                      "(default: the first hosts)")
    placement: Placement | None = Field(None, description="in-network placement (ina, nic)")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="further CollectiveSpec fields (e.g. window)")

    @field_validator("algo")
    @classmethod
    def _registered_algo(cls, v: str) -> str:
        if v not in algorithm_names():
            raise ValueError(f"{v!r} is not a registered algorithm: one of {algorithm_names()}")
        return v

    @model_validator(mode="after")
    def _placement_needs_ina(self) -> JobSpec:
        if self.placement is not None and not is_offloaded(self.algo):
            raise ValueError(f"placement applies to algo 'ina' or 'nic', not {self.algo!r}")
        if self.hosts is not None and (len(set(self.hosts)) != len(self.hosts)
                                       or min(self.hosts, default=0) < 0 or not self.hosts):
            raise ValueError(f"hosts={self.hosts!r} must be distinct host ranks >= 0")
        return self

    @field_validator("nbytes")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        for s in v if isinstance(v, list) else [v]:
            if int(s) < 4:
                raise ValueError("message size must be at least 4 bytes (one float32)")
            if int(s) % 4:
                raise ValueError(f"message size {int(s)} B is not a whole number of float32 "
                                 "elements (a multiple of 4 bytes)")
        if isinstance(v, list) and not v:
            raise ValueError("give at least one size")
        return v

    @model_validator(mode="after")
    def _options_known(self) -> JobSpec:
        if self.op != "incast":
            allowed = _collective_options()
            unknown = sorted(set(self.options) - set(allowed))
            if unknown:
                raise ValueError(f"options {unknown} are not CollectiveSpec fields; allowed "
                                 f"options: {', '.join(allowed)}")
        return self

    @model_validator(mode="after")
    def _incast_options(self) -> JobSpec:
        if self.op == "incast":
            unknown = sorted(set(self.options) - {"bits", "idle_ms"})
            if unknown:
                raise ValueError(f"options {unknown} do not apply to op 'incast'; it takes "
                                 "bits (1, 2, 4, 8) and idle_ms")
            if self.options.get("bits", 1) not in (1, 2, 4, 8):
                raise ValueError(f"options.bits={self.options['bits']!r}: head bits per "
                                 "element must be 1, 2, 4 or 8")
            if self.compressor is not None:
                raise ValueError("op 'incast' encodes with the trimming layout; remove "
                                 "compressor")
        return self

    def sizes(self) -> list[int]:
        """The message sizes of this job in bytes."""
        return [int(s) for s in (self.nbytes if isinstance(self.nbytes, list) else [self.nbytes])]

    def label(self) -> str:
        """Name shown in tables and plots."""
        if self.name:
            return self.name
        if self.op == "incast":
            return f"incast-trim{self.options.get('bits', 1)}"
        return (self.algo + (f"+{self.compressor}" if self.compressor else "")
                + (f"@{self.transport}" if self.transport != "tcp" else ""))


class Impairment(_Strict):
    """Seeded loss/duplication/reordering/delay on a programmable node's ports.

    Runs as the data path's ``impair`` stage (the kernel here has no netem). ``ports``: port
    indices or names (e.g. ``"tbs1-eth1"``) of the node; default all.
    """

    node: str = Field(..., pattern=r"^tb", description="programmable node, e.g. 'tbs1'")
    ports: list[int | str] | None = Field(None, description="port indices/names; default all")
    direction: Literal["ingress", "egress"] = "ingress"
    loss_pct: float = Field(0.0, ge=0, le=100)
    dup_pct: float = Field(0.0, ge=0, le=100)
    reorder_pct: float = Field(0.0, ge=0, le=100)
    delay_ms: float = Field(0.0, ge=0)
    jitter_ms: float = Field(0.0, ge=0)
    filter: Literal["all", "testbed"] = Field("all", description="impair only testbed frames?")
    seed: int | None = None


class Trimming(_Strict):
    """Egress queue drained at ``rate_mbps`` with packet trimming (or drop-tail) on a node.

    Runs as the data path's ``trim`` stage on every port of ``node``; ``ports`` (indices or
    names) get ``rate_mbps`` and the threshold, the other ports drain at the link rate.
    """

    node: str = Field(..., pattern=r"^(tb|\*$)", description="a programmable node, or * for "
                      "every programmable switch without an entry of its own")
    mode: Literal["trim", "drop_tail", "uet"] = Field(
        "trim", description="trim: cut to the HotNets head; drop_tail; uet: Ultra Ethernet "
        "trimming (DSCP classes, cut to trim_bytes, NACKed by the uet transport)")
    rate_mbps: float | None = Field(None, gt=0, description="queue drain rate; default link bw")
    threshold_bytes: int = Field(30_000, ge=0)
    threshold_bdp: float | None = Field(None, gt=0, description="threshold in bandwidth-delay "
                                        "products of rtt_us (instead of threshold_bytes)")
    rtt_us: float | None = Field(None, gt=0, description="the plane's base RTT (µs)")
    trim_bytes: int | None = Field(None, ge=74, le=1514, description="uet: frame bytes a cut "
                                   "packet keeps")
    queue_slots: int = Field(256, ge=1, le=65536, description="queue capacity in packets")
    ports: list[int | str] | None = None


class Codec(_Strict):
    """SmartNIC codec applied by the ``nic_codec`` stage of every SmartNIC node."""

    codec: Literal["fp16", "bf16", "fixed32"] = "fp16"
    settings: dict[str, Any] = Field(default_factory=dict)


class CrossTraffic(_Strict):
    """An iperf3 flow between two hosts (rank indices, 0-based) running during every run."""

    src: int = Field(..., ge=0)
    dst: int = Field(..., ge=0)
    protocol: Literal["tcp", "udp"] = "tcp"
    bw_mbps: float | None = Field(None, gt=0, description="udp target rate / tcp cap")

    @model_validator(mode="after")
    def _distinct(self) -> CrossTraffic:
        if self.src == self.dst:
            raise ValueError("src and dst must be different hosts")
        return self


class Fault(_Strict):
    """A fault injected ``at_s`` seconds (undilated) after each run of the point's jobs
    starts; exactly one of ``link``, ``switch`` and ``worker``. A link fault at 0 s is in
    place before the jobs start (their routes, trees and model see the degraded fabric)."""

    at_s: float = Field(0.0, ge=0, description="when, from the start of each run (s)")
    link: list[str] | str | None = Field(
        None, description="the link that fails: ['tbl1', 'tbsp1'] or 'tbl1-tbsp1'")
    down_s: float | None = Field(None, gt=0, description="link: back up after this long "
                                                          "(default: for the rest of the run)")
    switch: str | None = Field(None, pattern=r"^tb", description="a programmable node whose "
                                                                 "engine is SIGKILLed")
    worker: int | None = Field(None, ge=0, description="host rank whose collective worker "
                                                       "(tbw-<host>) is SIGKILLed (as soon "
                                                       "as it runs, if later)")

    @field_validator("link")
    @classmethod
    def _two_ends(cls, v):
        if v is None:
            return v
        ends = v.split("-") if isinstance(v, str) else list(v)
        if len(ends) != 2 or not all(isinstance(e, str) and e.startswith("tb") for e in ends):
            raise ValueError(f"a link is its two node names, ['tbl1', 'tbsp1'] or "
                             f"'tbl1-tbsp1'; got {v!r}")
        return ends

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in ("link", "switch", "worker") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a fault is exactly one of link, switch or worker; got "
                             f"{given or 'none'}")
        if self.down_s is not None and self.link is None:
            raise ValueError("down_s is for link faults (a killed engine is restarted by the "
                             "collective's placement.engine_death)")
        return self

    @property
    def until_s(self) -> float:
        """When a link fault ends (infinity: at the run's end)."""
        return self.at_s + self.down_s if self.down_s is not None else float("inf")

    @property
    def kind(self) -> str:
        """``link``, ``switch`` or ``worker``."""
        return next(k for k in ("link", "switch", "worker") if getattr(self, k) is not None)


class Capture(_Strict):
    """tcpdump on chosen interfaces during each run; pcaps are summarised with scapy."""

    interfaces: list[str] = Field(..., min_length=1, description="e.g. ['tbh1-eth0']")
    snaplen: int = Field(128, ge=64, le=65535)
    max_packets: int = Field(200_000, ge=1)


class TrainJob(_Communication):
    """A training job (``testbed.workloads.TrainingSpec``): a numpy model on a built-in data set
    whose gradients are allreduced over the emulated network every iteration.

    Runs alone after the collective jobs, one job after the other, or, with the experiment's
    ``trace = true``, all at once, each from its ``start_s`` on its own ``hosts`` (a trace).
    Each job gives one summary row (``op = "train"``) and per-iteration rows
    (``iterations.jsonl`` in the results folder)."""

    name: str | None = Field(None, description="label in tables and plots (default: algo)")
    model: Literal["logreg", "mlp"] = "mlp"
    hidden: int = Field(64, ge=1, description="hidden units of the MLP")
    activation: Literal["relu", "tanh"] = "relu"
    dataset: Literal["digits", "synthetic"] = "digits"
    samples: int = Field(10_000, ge=20, description="rows of the synthetic data set")
    features: int = Field(64, ge=2, description="columns of the synthetic data set")
    classes: int = Field(10, ge=2, description="classes of the synthetic data set")
    test_fraction: float = Field(0.2, gt=0, le=0.9)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0, le=10)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    batch_size: int = Field(32, ge=1, description="per worker")
    iterations: int = Field(200, ge=1, description="at most this many steps")
    eval_every: int = Field(10, ge=1, description="held-out accuracy every this many steps")
    target_accuracy: float | None = Field(None, description="defines time-to-accuracy")
    stop_at_target: bool = Field(False, description="end the job at the target accuracy")
    compute_ms: float = Field(0.0, ge=0, description="emulated compute time per iteration")
    time_dilation: float = Field(1.0, ge=1, description="emulation slow-down factor")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="window, loss (INA), bits, idle_ms (trim), "
                                                "chunk_bytes (TCP)")
    timeout_s: float = Field(30.0, gt=0)
    workers: int | None = Field(None, ge=2, description="default: every host of hosts / net")
    hosts: list[int] | None = Field(None, description="host indices (0-based) of the workers")
    start_s: float = Field(0.0, ge=0, description="start after the trace began (trace)")
    job_id: int | None = Field(None, ge=0, le=0xFFFF, description="default: 1 + its index")
    seed: int | None = Field(None, description="default: the experiment's seed")
    chakra_out: str | None = Field(None, description="a folder: the job's gradient "
                                   "allreduces and the compute between them are written "
                                   "there as a Chakra trace, <label>-run<NNNN>.<rank>.et, "
                                   "that testbed replay runs (needs the [traces] extra)")

    @field_validator("algo")
    @classmethod
    def _training_algo(cls, v: str) -> str:
        from testbed.workloads.spec import train_algos  # on use (module docstring)

        if v not in train_algos():
            raise ValueError(f"{v!r} is not an algorithm a training job can use: one of "
                             f"{train_algos()}")
        return v

    @field_validator("target_accuracy")
    @classmethod
    def _fraction(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v <= 1.0:
            raise ValueError(f"target accuracy {v} is not a fraction in (0, 1]")
        return v

    @model_validator(mode="after")
    def _options_known(self) -> TrainJob:
        unknown = sorted(set(self.options) - set(TRAIN_OPTIONS))
        if unknown:
            raise ValueError(f"options {unknown} do not apply to training jobs; allowed "
                             f"options: {', '.join(TRAIN_OPTIONS)}")
        return self

    def label(self) -> str:
        """Name shown in tables and plots."""
        return self.name or communication_label(self)

    def training_spec(self, index: int, seed: int):
        """The ``testbed.workloads.TrainingSpec`` of this job (``index`` in ``training``,
        ``seed`` the experiment's)."""
        from testbed.workloads.spec import TrainingSpec  # on use (module docstring)

        data = self.model_dump(exclude={"options", "job_id", "seed", "chakra_out"})
        return TrainingSpec(**data, **self.options,
                            job_id=1 + index if self.job_id is None else self.job_id,
                            seed=seed if self.seed is None else self.seed)


def _allreducing_algo(v: str | None) -> str | None:
    """A launched or replayed job's algorithm: one that allreduces gradients, or 'auto'."""
    if v is not None and v != "auto" and v not in algorithm_names("allreduce", trains=True):
        raise ValueError(f"{v!r} is not an algorithm that allreduces gradients: one of "
                         f"{algorithm_names('allreduce', trains=True)}, or 'auto'")
    return v


def _checked_hints(v: dict[str, Any]) -> dict[str, Any]:
    from testbed.provider.schema import check_hints  # on use (module docstring)

    check_hints(v)  # a bad hint is an error naming it
    return v


def _known_policy(v: str) -> str:
    from testbed.provider.policies import POLICIES  # on use (module docstring)

    if v not in POLICIES:
        raise ValueError(f"{v!r} is not a policy: one of {sorted(POLICIES)}")
    return v


class LaunchJob(_Communication):
    """A PyTorch script run unmodified on the emulated hosts (``testbed launch``): plain gloo
    (``algo`` unset, the baseline) or through the ``testbed`` backend with ``algo``."""

    name: str | None = Field(None, description="label in tables (default: the script's name "
                                               "and the algorithm)")
    script: str = Field(description="path of the script (relative: to the working directory)")
    args: list[str] = Field(default_factory=list, description="the script's arguments")
    hosts: int | None = Field(None, ge=1, description="the first N hosts run the ranks "
                                                      "(default: every host)")
    nproc_per_host: int = Field(1, ge=1, description="ranks on each host (plain gloo or a "
                                                     "TCP algorithm)")
    algo: str | None = Field(None, description="the testbed algorithm of its float32 "
                                               "allreduces (default: plain gloo; auto: the "
                                               "provider plans it from hints)")
    hints: dict[str, Any] = Field(default_factory=dict, description="with algo 'auto': what "
                                  "the tenant tells the provider (tolerance, error_budget, "
                                  "collective_bytes, priority, ...)")
    policy: str = Field("cooperative", description="with algo 'auto': the provider's policy")
    timeout_s: float = Field(600.0, gt=0, description="stop the job after this long")

    @property
    def op(self) -> str:
        return "launch"

    _algo = field_validator("algo")(lambda v: _allreducing_algo(v))
    _hints = field_validator("hints")(lambda v: _checked_hints(v))
    _policy = field_validator("policy")(lambda v: _known_policy(v))

    @model_validator(mode="after")
    def _ranks_per_host(self) -> LaunchJob:
        check_nproc_per_host(self.nproc_per_host, self.algo)
        return self

    @model_validator(mode="after")
    def _auto_alone(self) -> LaunchJob:
        if self.algo == "auto" and (self.compressor or self.error_feedback):
            raise ValueError("algo 'auto': the provider chooses the compressor; give hints "
                             "(tolerance, error_budget) instead")
        if self.hints and self.algo != "auto":
            raise ValueError("hints are for algo 'auto' (the provider plans with them)")
        return self

    def label(self) -> str:
        """Name shown in tables and plots."""
        if self.name:
            return self.name
        return (f"{Path(self.script).stem}:{self.algo or 'gloo'}"
                + (f"+{self.compressor}" if self.compressor else ""))


class ReplayJob(_Strict):
    """A Chakra execution trace replayed on the point's network (``testbed replay``). Every
    ``[[replay]]`` of a point runs in one run, as tenants of the fabric: each on hosts of its
    own (the first trace's ranks on the first hosts, the next ones after them), each from its
    ``arrival_s``; with ``algo = "auto"`` each is admitted to one provider at its arrival."""

    name: str | None = Field(None, description="label in tables (default: the trace's file "
                                               "name)")
    trace: str = Field(description="the trace's prefix: files <trace>.<rank>.et (a relative "
                                   "path is taken from the working directory)")
    arrival_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                             description="when it starts (undilated seconds after the run's "
                                         "start)")
    algo: str | None = Field(None, description="the testbed algorithm of its world float32 "
                                               "allreduces (default: plain gloo; auto: the "
                                               "provider plans it from hints)")
    hints: dict[str, Any] = Field(default_factory=dict, description="with algo 'auto': what "
                                  "the tenant tells the provider, over what its trace shows "
                                  "(collective bytes, compute time)")
    policy: str = Field("cooperative", description="with algo 'auto': the provider's policy "
                                                   "(one provider: every tenant's the same)")
    comm_groups: str | dict[str, list[int]] | None = Field(
        None, description="communicator groups: ASTRA-sim's --comm-group-configuration JSON "
                          "file, or a table name -> ranks")
    scale: float = Field(1.0, ge=0, allow_inf_nan=False,
                         description="factor on the trace's compute durations")
    timeout_s: float = Field(600.0, gt=0, description="stop the replay after this long")

    @property
    def op(self) -> str:
        return "replay"

    _algo = field_validator("algo")(lambda v: _allreducing_algo(v))
    _hints = field_validator("hints")(lambda v: _checked_hints(v))
    _policy = field_validator("policy")(lambda v: _known_policy(v))

    @model_validator(mode="after")
    def _hints_for_auto(self) -> ReplayJob:
        if self.hints and self.algo != "auto":
            raise ValueError("hints are for algo 'auto' (the provider plans with them)")
        return self

    def label(self) -> str:
        """Name shown in tables and plots."""
        return self.name or Path(self.trace).name


#: Communication settings a training job may set through ``options``.
TRAIN_OPTIONS = ("window", "loss", "chunk_bytes", "bits", "idle_ms")


class Experiment(_Strict):
    """A whole experiment: network, jobs, conditions, sweep; see the module docstring."""

    kind: Literal["collectives"] = "collectives"
    name: str = Field("experiment", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    seed: int = 0
    topology: TopologySpec = Field(default_factory=TopologySpec)
    jobs: list[JobSpec] = Field(default_factory=list)
    training: list[TrainJob] = Field(default_factory=list)
    launch: list[LaunchJob] = Field(default_factory=list)
    replay: list[ReplayJob] = Field(default_factory=list, description="Chakra traces "
                                    "replayed together, as tenants of the fabric")
    trace: bool = Field(False, description="run the training jobs at once, each from its "
                                           "start_s on its own hosts")
    impairments: list[Impairment] = Field(default_factory=list)
    trimming: list[Trimming] = Field(default_factory=list)
    codec: Codec | None = None
    cross_traffic: list[CrossTraffic] = Field(default_factory=list)
    capture: Capture | None = None
    faults: list[Fault] = Field(default_factory=list, description="links, switch engines or "
                                "workers that fail during each run of the jobs")
    settle_s: float = Field(0.0, ge=0, description="pause after cross traffic starts")
    concurrent: bool = Field(False, description="run the jobs of a point at the same time "
                                                "(tenants of one fabric), each on its hosts")
    stop_on_error: bool = Field(False, description="stop at the first failed run")
    time_dilation: float | Literal["auto"] = Field(
        1.0, description="run the network this many times slower (links at bw / f, delays "
                         "and timeouts times f) and report undilated times; 'auto': the "
                         "smallest factor that keeps the CPU unsaturated")
    engine_groups: int | None = Field(
        None, ge=1, description="engine processes serving the programmable switches, the "
                                "links between a process's switches in memory (default: "
                                "one per switch; see TestbedNet's engine_groups)")
    sweep: dict[str, list[Any]] = Field(default_factory=dict)

    @field_validator("time_dilation", mode="before")
    @classmethod
    def _dilation(cls, v: Any) -> Any:
        if v == "auto":
            return v
        ok = isinstance(v, int | float) and not isinstance(v, bool) and \
            1 <= v <= MAX_TIME_DILATION
        if not ok:
            raise ValueError(f"got {v!r}; give a factor from 1 (real time) to "
                             f"{MAX_TIME_DILATION:g}, or 'auto' (calibrated: the smallest "
                             "factor that keeps the CPU unsaturated)")
        return v

    @field_validator("sweep")
    @classmethod
    def _sweep_paths(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in v.items():
            if path.split(".")[0] == "sweep":
                raise ValueError(f"{path!r}: cannot sweep over the sweep itself")
            if not isinstance(values, list) or not values:
                raise ValueError(f"{path!r}: give a non-empty list of values")
        return v

    @model_validator(mode="after")
    def _has_work(self, info: ValidationInfo) -> Experiment:
        if not (info.context or {}).get("need_work", True):  # a file read for its network
            return self
        if not self.jobs and not self.training and not self.launch and not self.replay:
            raise ValueError("give at least one job ([[jobs]]), training job ([[training]]), "
                             "launched script ([[launch]]) or trace ([[replay]])")
        return self

    @model_validator(mode="after")
    def _groups_keep_switch_faults_apart(self) -> Experiment:
        killed = [f.switch for f in self.faults if f.switch is not None]
        if self.engine_groups is not None and killed:
            raise ValueError(f"faults kill the engines of {killed}, but engine_groups puts "
                             "switches in shared processes (killing one kills its group, "
                             "and none restarts alone): leave engine_groups out to kill "
                             "one switch")
        return self

    @model_validator(mode="after")
    def _sweep_points_valid(self) -> Experiment:
        # Resolving each path against the model now reports a typo before anything runs.
        data = self.model_dump(exclude={"sweep"})
        for path in self.sweep:
            _check_path(data, path)
        return self

    @model_validator(mode="after")
    def _concurrent_jobs(self) -> Experiment:
        if not self.concurrent:
            return self
        for k, job in enumerate(self.jobs):
            if len(job.sizes()) != 1:
                raise ValueError(f"jobs.{k}: concurrent jobs run once per point: give one "
                                 "nbytes (sweep over sizes instead)")
            if job.op == "incast":
                raise ValueError(f"jobs.{k}: op 'incast' cannot run concurrently")
        ids = [j.options.get("job_id", k + 1) for k, j in enumerate(self.jobs)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"concurrent jobs need distinct options.job_id, got {ids}")
        return self

    def points(self) -> list[tuple[dict[str, Any], Experiment]]:
        """Expand the sweep: ``[(sweep values by path, experiment without sweep), ...]``."""
        return expand_sweep(self)

    def network_key(self) -> str:
        """Everything that shapes the network; equal keys may share one built network."""
        return json.dumps(self.model_dump(
            mode="json", include={"topology", "impairments", "trimming", "codec",
                                  "cross_traffic", "capture", "time_dilation",
                                  "engine_groups"}),
            sort_keys=True)


# -- sweeps -----------------------------------------------------------------------------------

def _check_path(data: Any, path: str) -> None:
    node = data
    for part in path.split("."):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"sweep path {path!r}: {part!r} is not an index "
                                 f"below {len(node)}")
            node = node[int(part)]
        elif isinstance(node, dict):
            if part not in node:
                raise ValueError(f"sweep path {path!r}: unknown field {part!r}; allowed: "
                                 f"{', '.join(sorted(node))}")
            node = node[part]
        else:
            raise ValueError(f"sweep path {path!r}: {part!r} goes below a plain value")


def _set_path(data: Any, path: str, value: Any) -> None:
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _point_context(exp: Experiment) -> dict[str, bool]:
    """The validation context of ``exp``'s sweep points: a point holds the experiment's work,
    so an experiment accepted without any (a file read for its network) has points without."""
    return {"need_work": bool(exp.jobs or exp.training or exp.launch or exp.replay)}


def expand_sweep(exp: Experiment) -> list[tuple[dict[str, Any], Experiment]]:
    """Cartesian product of ``exp.sweep``; each point validated (errors name the path)."""
    ctx = _point_context(exp)
    base = exp.model_dump(exclude={"sweep"})
    if not exp.sweep:
        return [({}, Experiment.model_validate(base, context=ctx))]
    paths = list(exp.sweep)
    out = []
    for combo in itertools.product(*(exp.sweep[p] for p in paths)):
        data = copy.deepcopy(base)
        for p, v in zip(paths, combo, strict=True):
            _set_path(data, p, v)
        try:
            point = Experiment.model_validate(data, context=ctx)
        except ValidationError as e:
            values = ", ".join(f"{p}={v!r}" for p, v in zip(paths, combo, strict=True))
            raise ExperimentError(f"sweep point ({values})", format_errors(e)) from None
        out.append((dict(zip(paths, combo, strict=True)), point))
    return out


def with_overrides(exp: Experiment, overrides: dict[str, Any]) -> Experiment:
    """A copy of ``exp`` with dotted-path fields replaced (e.g. ``{"jobs.0.nbytes": 4096}``).

    Unlike a sweep, an override may replace a whole list or sub-object (``"jobs"``).
    """
    data = exp.model_dump()
    for path, value in overrides.items():
        try:
            _check_path(data, path)
        except ValueError as e:
            raise ExperimentError("override", [str(e).replace("sweep path", "path")]) from None
        _set_path(data, path, value)
    return parse_experiment(data, "with overrides")


# -- loading and error formatting -------------------------------------------------------------

def load_experiment(source: str | Path | dict | Experiment) -> Experiment:
    """An :class:`Experiment` from a TOML/YAML path, a dict, or an Experiment (returned as is).

    Raises :class:`ExperimentError` listing each bad field by dotted path with allowed values,
    and each combination of fields that cannot run (see :func:`combination_problems`).
    """
    if isinstance(source, Experiment):
        problems = combination_problems(source)
        if problems:
            raise ExperimentError("object", problems)
        return source
    if isinstance(source, dict):
        return parse_experiment(source, "object")
    return parse_experiment(read_experiment_file(source), str(source))


#: What an experiment file's top-level ``kind`` declares (default ``collectives``); the one
#: runner, :func:`testbed.experiment.run`, runs each kind.
EXPERIMENT_KINDS = {
    "collectives": "collective jobs, training jobs, launched scripts and replayed traces on "
                   "one network per sweep point (this module's Experiment)",
    "cooperation": "tenants' training jobs arriving over time, admitted and planned by the "
                   "provider, the trace run once per policy "
                   "(testbed.experiment.cooperation.CooperationExperiment)",
}


def experiment_kind(data: dict, source: str = "object") -> str:
    """The ``kind`` the experiment ``data`` declares (:class:`ExperimentError` naming the kinds
    there are when it is not one)."""
    kind = data.get("kind", "collectives")
    if kind not in EXPERIMENT_KINDS:
        raise ExperimentError(source, [f"kind: {kind!r} is not an experiment kind; allowed: "
                                       f"{', '.join(EXPERIMENT_KINDS)}"])
    return kind


def read_experiment_file(source: str | Path) -> dict:
    """The mapping in a TOML or YAML experiment file (:class:`ExperimentError` when it is
    missing, of another type or not valid)."""
    path = Path(source)
    if not path.is_file():
        raise ExperimentError(str(path), ["file not found (give a .toml, .yaml or .yml file)"])
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise ExperimentError(str(path), [f"unknown file type {suffix!r}; use .toml, "
                                              ".yaml or .yml"])
    except tomllib.TOMLDecodeError as e:
        raise ExperimentError(str(path), [f"not valid TOML: {e}"]) from None
    except yaml.YAMLError as e:
        raise ExperimentError(str(path), [f"not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ExperimentError(str(path), ["the file must hold a mapping of experiment fields"])
    return data


def load_point(file: str | Path, point: int) -> tuple[Experiment, Experiment]:
    """The experiment in ``file`` and its sweep point ``point`` (0-based), for the commands
    that build one point's network (``testbed up``, ``testbed provider serve``); a
    ``ValueError`` lists the file's problems, or the points there are."""
    try:  # a file of a topology alone is enough here: no job runs
        exp = parse_experiment(read_experiment_file(file), str(file), need_work=False)
    except ExperimentError as e:
        raise ValueError("\n".join([f"invalid experiment {e.source}:",
                                    *(f"  - {p}" for p in e.problems)])) from None
    points = expand_sweep(exp)
    if not 0 <= point < len(points):
        raise ValueError(f"--point {point}: {file} has {len(points)} sweep point(s), "
                         f"0..{len(points) - 1}")
    return exp, points[point][1]


def parse_experiment(data: dict, source: str = "object", need_work: bool = True) -> Experiment:
    """Validate a plain dict into an :class:`Experiment` (readable :class:`ExperimentError`
    listing every problem: bad fields, and combinations that cannot run at any sweep point).
    ``need_work=False``: a file read only for its network may hold no job."""
    kind = experiment_kind(data, source)
    if kind != "collectives":
        raise ExperimentError(source, [f"kind: a {kind!r} experiment has a schema of its own "
                                       "(testbed run and testbed.experiment.run take every "
                                       "kind)"])
    try:
        exp = Experiment.model_validate(data, context={"need_work": need_work})
    except ValidationError as e:
        problems = format_errors(e)
        # the parts that are valid on their own are still checked against each other
        problems += [p for p in _partial_problems(data) if p not in problems]
        raise ExperimentError(source, problems) from None
    problems = combination_problems(exp)  # every sweep point, before anything runs
    if problems:
        raise ExperimentError(source, problems)
    return exp


def format_errors(err: ValidationError) -> list[str]:
    """One readable line per pydantic error: dotted field path, problem, allowed values."""
    lines: list[str] = []
    seen: set[str] = set()
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        # pydantic appends the union member / validator name to the path; drop those parts.
        loc = [p for p in loc if not re.match(r"^(list\[|function-|ByteSize|int|float|bool|"
                                              r"str|dict\[|none|is-instance)", p)]
        path = ".".join(loc) or "(top level)"
        typ = e["type"]
        if path in seen:  # a union reports each member; the first says enough
            continue
        seen.add(path)
        if typ == "extra_forbidden":
            allowed = _allowed_fields(loc[:-1])
            msg = f"unknown field; allowed fields here: {', '.join(allowed)}"
        elif typ == "literal_error":
            msg = f"got {e.get('input')!r}; allowed values: {e['ctx']['expected']}"
        elif typ == "missing":
            msg = "required field is missing"
        elif typ == "value_error":
            msg = str(e["ctx"]["error"]) if "ctx" in e else e["msg"]
            if not loc and msg.startswith("sweep path"):
                path, msg = "sweep", msg[len("sweep path "):]
        else:
            msg = f"{e['msg']} (got {e.get('input')!r})"
        line = f"{path}: {msg}"
        if line not in lines:
            lines.append(line)
    return lines


def _allowed_fields(loc: list[str]) -> list[str]:
    model: Any = Experiment
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return sorted(model.model_fields)


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _collective_options() -> list[str]:
    """CollectiveSpec fields a job may set through ``options``."""
    from testbed.collectives.spec import CollectiveSpec  # on use (module docstring)

    own = set(JobSpec.model_fields) | {"nbytes", "op", "algo"}
    return sorted(f.name for f in dataclasses.fields(CollectiveSpec) if f.name not in own)


def _compressor_names() -> list[str]:
    """The compressor registry's names, built-ins and plug-ins; a broken plug-in registry
    raises its ``PluginError`` (a ValueError)."""
    from testbed.kernels.compressors import compressor_names  # on use (module docstring)

    return list(compressor_names())


def _program_problems(tspec: TopologySpec) -> list[str]:
    """Unknown stage names in ``topology.params.programs`` (built-in or plug-in names, or
    ``module:Class``), found before any network is built."""
    programs = tspec.params.get("programs")
    if not isinstance(programs, dict):
        return []  # the topology layer reports a programs value that is not a dict
    from testbed.datapath.programs import normalize_programs  # on use (module docstring)

    problems = []
    for node, progs in programs.items():
        try:
            normalize_programs(progs)
        except ValueError as e:
            problems.append(f"topology.params.programs.{node}: {e}")
    return problems


# -- combinations that cannot run ----------------------------------------------------------------

#: Largest INA message: the header's ``chunk_offset`` counts float32 elements in 32 bits.
MAX_INA_BYTES = 4 * (1 << 32)


def combination_problems(exp: Experiment) -> list[str]:
    """Every problem of ``exp`` that single fields do not show, at every sweep point.

    Builds each point's topology description (no network) and checks the jobs, impairments,
    trimming, codec, cross traffic and capture against it: INA or NIC offload without an
    aggregator on a programmable switch, NIC offload without SmartNICs or their codec, nodes
    and ports that do not exist or are not programmable, host indices out of range, message
    sizes the collectives reject, and what the topology layer rejects (e.g. the sizes of a
    leaf-spine). A problem found at only some sweep points names them.
    """
    if not exp.sweep:
        return _point_problems(exp, {})
    base = exp.model_dump(exclude={"sweep"})
    paths = list(exp.sweep)
    found: dict[str, list[str]] = {}
    combos = list(itertools.product(*(exp.sweep[p] for p in paths)))
    cache: dict[str, Any] = {}
    ctx = _point_context(exp)
    for combo in combos:
        data = copy.deepcopy(base)
        for p, v in zip(paths, combo, strict=True):
            _set_path(data, p, v)
        try:
            problems = _point_problems(Experiment.model_validate(data, context=ctx), cache)
        except ValidationError as e:
            problems = format_errors(e)
        where = ", ".join(f"{p}={v!r}" for p, v in zip(paths, combo, strict=True))
        for prob in problems:
            found.setdefault(prob, []).append(where)
    out = []
    for prob, points in found.items():
        if len(points) == len(combos):
            out.append(prob)
        else:
            more = f" and {len(points) - 1} more" if len(points) > 1 else ""
            out.append(f"{prob} (at sweep point {points[0]}{more})")
    return out


def _point_problems(point: Experiment, cache: dict[str, Any]) -> list[str]:
    key = json.dumps(point.topology.model_dump(mode="json"), sort_keys=True) + str(point.seed)
    if key not in cache:
        cache[key] = _build_topology(point.topology, point.seed)
    topo, problems = cache[key]
    found = list(problems) + _checks(topo, point.topology, list(point.jobs), point.impairments,
                                     point.trimming, point.codec, point.cross_traffic,
                                     point.capture)
    if topo is not None and not found:
        found += _pipeline_problems(point, topo)
    return found + training_problems(point, topo) + launch_problems(point, topo) \
        + replay_problems(point, topo) + fault_problems(point.faults, topo, point)


def _pipeline_problems(point: Experiment, topo) -> list[str]:
    """What the pipeline composer refuses in the point's data path (two sources of one stage,
    impairments that filter different traffic in one direction...), before any network."""
    if not (point.impairments or point.trimming or point.codec):
        return []  # nothing beyond the topology, whose own problems are checked above
    from testbed.topologies import TopologyError  # on use (module docstring)
    from testbed.topologies.pipeline import compose

    try:
        compose(topo, datapath_options(point))
    except TopologyError as e:
        return [f"data path: {e}"]
    return []


def _partial_problems(data: Any) -> list[str]:
    """Combination checks among the parts of an invalid experiment that are valid alone."""
    if not isinstance(data, dict) or data.get("sweep"):
        return []  # sweep points are checked once the experiment itself is valid

    def part(model, value):
        try:
            return model.model_validate(value)
        except (ValidationError, TypeError, ValueError):
            return None

    def parts(model, key):
        values = data.get(key)
        return [part(model, v) for v in values] if isinstance(values, list) else []

    seed = data.get("seed", 0)
    topology = part(TopologySpec, data.get("topology", {}))
    if topology is None or isinstance(seed, bool) or not isinstance(seed, int):
        return []
    topo, problems = _build_topology(topology, seed)
    training = [t for t in parts(TrainJob, "training") if t]
    trace = data.get("trace", False) is True
    problems += training_problems(SimpleNamespace(topology=topology, seed=seed,
                                                  training=training, trace=trace), topo)
    codec = part(Codec, data["codec"]) if data.get("codec") is not None else None
    capture = part(Capture, data["capture"]) if data.get("capture") is not None else None
    problems += fault_problems([f for f in parts(Fault, "faults") if f], topo,
                               SimpleNamespace(jobs=[j for j in parts(JobSpec, "jobs") if j],
                                               training=training, launch=[]))
    return problems + _checks(topo, topology, parts(JobSpec, "jobs"),
                              [p for p in parts(Impairment, "impairments") if p],
                              [p for p in parts(Trimming, "trimming") if p], codec,
                              [p for p in parts(CrossTraffic, "cross_traffic") if p], capture)


def fault_problems(faults: list[Fault], topo, point) -> list[str]:
    """What is wrong with ``faults`` on topology ``topo`` for ``point``'s jobs: a link that is
    not one, or whose loss cuts a host off; a switch without an engine; a worker rank out of
    range; faults where only collective jobs take them."""
    if not faults or topo is None:
        return []
    from testbed.topologies import routing  # on use (module docstring)

    problems = []
    if getattr(point, "training", None) or getattr(point, "launch", None) \
            or getattr(point, "replay", None):
        problems.append("faults: only collective jobs ([[jobs]]) run with faults; move the "
                        "training, launched or replayed jobs to their own experiment")
    for i, f in enumerate(faults):
        if f.link is not None:
            try:
                routing.links_between(topo, *f.link)
            except ValueError as e:
                problems.append(f"faults.{i}.link: {e}")
                continue
            # the link faults down when this one goes down (itself included)
            down = [g.link for g in faults if g.link is not None and g.at_s <= f.at_s < g.until_s]
            lost = routing.unreachable_hosts(routing.without_links(topo, down))
            if lost:
                also = [f"faults.{k}" for k, g in enumerate(faults)
                        if g is not f and g.link is not None and g.link in down]
                problems.append(f"faults.{i}.link: {'-'.join(f.link)} going down would cut "
                                f"{lost} off from the other hosts"
                                f"{' (with ' + ', '.join(also) + ' down then)' if also else ''}"
                                "; fail a link that has a path around it (a multipath "
                                "fabric's)")
        elif f.switch is not None and f.switch not in topo.programmable:
            problems.append(f"faults.{i}.switch: {f.switch!r} runs no engine; programmable "
                            f"nodes: {sorted(topo.programmable) or 'none'}")
        elif f.worker is not None and f.worker >= topo.n_hosts:
            problems.append(f"faults.{i}.worker: host rank {f.worker} is out of range; the "
                            f"topology has {topo.n_hosts} hosts (0..{topo.n_hosts - 1})")
    return problems


def _build_topology(spec: TopologySpec, seed: int) -> tuple[Any, list[str]]:
    """(topology description, problems) for ``spec``."""
    from testbed.topologies import TopologyError, make_topology  # on use (module docstring)

    kwargs = spec.kwargs()
    kwargs.setdefault("seed", seed)
    try:
        return make_topology(spec.kind, **kwargs), []
    except (TopologyError, ValueError, TypeError) as e:
        msg = str(e)
        first = re.match(r"\w+", msg)
        field = first.group(0) if first and first.group(0) in TopologySpec.model_fields else ""
        return None, [f"topology{'.' + field if field else ''}: {msg}"]


def datapath_options(point: Experiment) -> DatapathOptions:
    """The data-path conditions of ``point`` as the pipeline composer takes them.

    Impairment percentages become probabilities and an impairment without a seed takes the
    experiment's. SmartNICs run the ``nic_codec`` stage when the experiment sets a codec, or
    in fixed-point mode when a job uses ``algo = "nic"`` (the SmartNIC-offloaded INA; without
    SmartNICs that job fails on its own and the others run).
    """
    from testbed.topologies.pipeline import DatapathOptions, Impairment, Trimming  # on use

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


def _checks(topo, tspec: TopologySpec, jobs: list, impairments: list, trimming: list,
            codec, cross_traffic: list, capture) -> list[str]:
    problems = [p for i, job in enumerate(jobs) if job is not None
                for p in [_aggregator_problem(f"jobs.{i}", job, tspec, topo)] if p]
    problems += _program_problems(tspec)
    if topo is None:  # the topology itself is wrong (reported): only what needs no graph
        return problems
    for i, job in enumerate(jobs):
        if job is not None:
            problems += _job_problems(f"jobs.{i}", job, topo, codec)
    for what, items in (("impairments", impairments), ("trimming", trimming)):
        for i, item in enumerate(items):
            if what == "trimming" and item.node == "*":  # every switch: the pipeline checks it
                continue
            problems += _node_problems(f"{what}.{i}", item.node, item.ports, topo)
    if codec is not None and not topo.nic_of:
        problems.append("codec: the SmartNIC codec runs on SmartNIC nodes and this topology has "
                        "none; set topology.smartnic = true (or a list of host ranks), or "
                        "remove codec")
    n = topo.n_hosts
    for i, ct in enumerate(cross_traffic):
        for end in ("src", "dst"):
            if getattr(ct, end) >= n:
                problems.append(f"cross_traffic.{i}.{end}: host index {getattr(ct, end)} is out "
                                f"of range; the topology has {n} hosts (0..{n - 1})")
    if capture is not None:
        ifaces = [f"{node}-eth{p}" for node in topo.nodes() for p in topo.ports.get(node, {})]
        for k, iface in enumerate(capture.interfaces):
            if iface not in ifaces:
                problems.append(f"capture.interfaces.{k}: {iface!r} is not an interface of "
                                f"this topology; interfaces: {', '.join(sorted(ifaces)[:12])}"
                                f"{' ...' if len(ifaces) > 12 else ''}")
    return problems


def _aggregator_problem(path: str, job: JobSpec, tspec: TopologySpec, topo) -> str | None:
    """INA/NIC offload needs the aggregator on a programmable switch (None: it has one, or
    more than 32 hosts keep it off, which the collectives' own check reports)."""
    if getattr(job, "op", None) == "incast" or not is_offloaded(job.algo):
        return None
    tree = job.placement.tree if getattr(job, "placement", None) is not None else "single"
    if tspec.switch == "bridge":
        why = "topology.switch is 'bridge'; set topology.switch = 'programmable'"
    elif tspec.aggregator == "none":
        why = "topology.aggregator is 'none'; set it to 'auto' or a programmable switch"
    elif topo is not None and topo.aggregator_switch is None and tree == "single":
        why = (f"'auto' found no one programmable switch on every worker's path in this "
               f"{tspec.kind}; name one in topology.aggregator, or give the job "
               "placement.tree = 'auto' (a tree: each switch aggregates at most 32 members)")
    else:
        return None
    return (f"{path}.algo: {job.algo!r} aggregates in a programmable switch, but this "
            f"topology has no aggregator: {why}")


def _job_problems(path: str, job: JobSpec, topo, codec) -> list[str]:
    problems: list[str] = []
    n = topo.n_hosts
    if job.op == "incast":
        if n < 2:
            problems.append(f"{path}.op: incast needs at least 2 hosts (a receiver and a "
                            f"sender); the topology has {n}")
        return problems
    if job.algo == "nic":
        workers = topo.host_names[:min(int(job.options.get("workers") or n), n)]
        bare = [h for h in workers if h not in topo.nic_of]
        if bare:
            problems.append(f"{path}.algo: 'nic' converts on each worker's SmartNIC, but "
                            f"{', '.join(bare)} have none; set topology.smartnic = true")
        if max(job.sizes()) > MAX_INA_BYTES:
            problems.append(f"{path}.nbytes: in-network aggregation addresses at most 2^32 "
                            f"float32 elements per message ({MAX_INA_BYTES} B)")
    elif job.algo == "ina" and max(job.sizes()) > MAX_INA_BYTES:
        problems.append(f"{path}.nbytes: in-network aggregation addresses at most 2^32 float32 "
                        f"elements per message ({MAX_INA_BYTES} B)")
    if job.algo == "rs":
        w = int(job.options.get("workers") or n)
        if w + job.servers > n and job.servers > w:
            problems.append(f"{path}.servers: {job.servers} reduction servers do not fit: "
                            f"{n} hosts hold {w} workers, so servers share worker hosts and "
                            f"need servers <= workers; add hosts or lower servers")
    for err in _collective_problems(job, n):
        line = _collective_field(path, job, err)
        if line not in problems:
            problems.append(line)
    if not problems:
        problems += _tree_problems(path, job, topo)
    return problems


def _tree_problems(path: str, job: JobSpec, topo) -> list[str]:
    """The aggregation tree an offloaded job's placement asks for, planned on the topology
    now: a tree no switch can hold (a leaf with more workers under it than one switch takes,
    a switch no worker's path crosses) is named before anything runs, not when the job
    starts."""
    from testbed.collectives.ports import ina_worker_port  # on use (module docstring)
    from testbed.topologies import TopologyError, aggtree  # on use (module docstring)

    tree = job.placement.tree if job.placement is not None else None
    if not is_offloaded(job.algo) or tree in (None, "single") or job.op == "incast":
        return []
    n = topo.n_hosts
    ranks = list(job.hosts) if job.hosts else list(range(min(int(job.options.get("workers")
                                                                  or n), n)))
    try:
        aggtree.plan(topo, ranks, ina_worker_port(int(job.options.get("job_id", 0))), tree)
    except TopologyError as e:
        return [f"{path}.placement.tree: {str(e).removeprefix('tree: ')}"]
    return []


def _collective_problems(job: JobSpec, n_hosts: int) -> list[ValueError]:
    """What the collectives layer's own validation says about each size of ``job``."""
    from testbed.collectives.spec import CollectiveSpec  # on use (module docstring)

    out: list[ValueError] = []
    for size in job.sizes():
        try:
            CollectiveSpec(op=job.op, nbytes=size, dtype=job.dtype,
                           **communication_of(job), servers=job.servers,
                           **({"placement": job.placement.as_dict()}
                              if getattr(job, "placement", None) is not None else {}),
                           timeout_s=job.timeout_s, seed=job.seed or 0,
                           repetitions=job.repetitions,
                           hosts=list(job.hosts) if job.hosts else None,
                           **job.options).validate(n_hosts)
        except (ValueError, TypeError) as e:
            if str(e) not in map(str, out):
                out.append(e if isinstance(e, ValueError) else ValueError(str(e)))
    return out


def _collective_field(path: str, job, e: Exception) -> str:
    """The collectives' (or the workloads') validation error ``e`` under the field of ``job``
    (a JobSpec or TrainJob) it is about (``e.field`` of a FieldError)."""
    field = getattr(e, "field", "")
    msg = getattr(e, "reason", str(e))
    if field in type(job).model_fields:
        where = f"{path}.{field}"
    elif field in job.options:
        where = f"{path}.options.{field}"
    elif field == "workers":  # not set: every host works, so the topology's size is at fault
        where = f"{path}.algo" if is_offloaded(job.algo) else "topology"
    else:
        where = path
    for owner in ("CollectiveSpec.", "TrainingSpec."):
        msg = msg.replace(owner, "")
    if where.endswith(f".{field}") and msg.startswith(f"{field}: "):  # not "hosts: hosts: .."
        msg = msg[len(field) + 2:]
    return f"{where}: {msg}"


def _node_problems(path: str, node: str, ports: list | None, topo) -> list[str]:
    programmable = sorted(topo.programmable)
    if node not in topo.nodes():
        return [f"{path}.node: {node!r} is not a node of this topology; programmable nodes: "
                f"{', '.join(programmable) or 'none'}"]
    if node not in topo.programmable:
        return [f"{path}.node: {node!r} is not a programmable node (programmable: "
                f"{', '.join(programmable) or 'none'}); set topology.switch = 'programmable'"]
    own = sorted(topo.ports.get(node, {}))
    names = [f"{node}-eth{p}" for p in own]
    bad = [p for p in ports or [] if not (p in names if isinstance(p, str)
                                          else 0 <= p < len(own))]
    if bad:
        return [f"{path}.ports: {bad} are not ports of {node}; give indices 0..{len(own) - 1} "
                f"or names {', '.join(names)}"]
    return []


def launch_problems(point, topo) -> list[str]:
    """What the launched scripts of ``point`` cannot do on ``topo``: a script that is not
    there, more ranks than hosts, an offload without an aggregator."""
    problems: list[str] = []
    for i, job in enumerate(point.launch):
        if not Path(job.script).is_file():
            problems.append(f"launch.{i}.script: {job.script!r} is not a file (a relative path "
                            "is taken from the working directory)")
        if topo is not None and job.hosts is not None and job.hosts > topo.n_hosts:
            problems.append(f"launch.{i}.hosts: {job.hosts} hosts, but the topology has "
                            f"{topo.n_hosts}")
        if job.algo is not None:
            problem = _aggregator_problem(f"launch.{i}", job, point.topology, topo)
            if problem:
                problems.append(problem)
    return problems


def replay_problems(point, topo) -> list[str]:
    """What the replayed traces of ``point`` cannot do on ``topo``: a trace that cannot be
    replayed (the format's own checks, naming file and node), two tenants of one name, more
    ranks in all than hosts, an offload without an aggregator, tenants asking one provider for
    different policies."""
    if not point.replay:
        return []
    from testbed.workloads.chakra import TraceError, load_trace, read_groups  # on use

    problems: list[str] = []
    ranks = 0
    names: dict[str, int] = {}
    for i, job in enumerate(point.replay):
        if job.label() in names:
            problems.append(f"replay.{i}.name: {job.label()!r} is also replay."
                            f"{names[job.label()]}'s name; give each trace a name")
        names.setdefault(job.label(), i)
        try:
            groups = read_groups(job.comm_groups) if isinstance(job.comm_groups, str) \
                else job.comm_groups
        except (OSError, ValueError) as e:
            problems.append(f"replay.{i}.comm_groups: {e}")
            continue
        try:
            ranks += len(load_trace(job.trace, groups))
        except (OSError, TraceError) as e:
            problems.append(f"replay.{i}.trace: {e}")
        if job.algo is not None and job.algo != "auto":
            problem = _aggregator_problem(f"replay.{i}", job, point.topology, topo)
            if problem:
                problems.append(problem)
    if topo is not None and ranks > topo.n_hosts:
        problems.append(f"replay: the traces have {ranks} ranks in all (a rank per host), but "
                        f"the topology has {topo.n_hosts} hosts")
    policies = {job.policy for job in point.replay if job.algo == "auto"}
    if len(policies) > 1:
        problems.append(f"replay: tenants with algo 'auto' ask one provider for policies "
                        f"{sorted(policies)}; give them one policy")
    return problems


def training_problems(point, topo) -> list[str]:
    """What the training jobs of ``point`` cannot do on ``topo`` (a topology description, or
    None when the topology itself is wrong): an offload without an aggregator, what the
    workloads' own validation says (host indices, a batch larger than a worker's shard, the
    gradient allreduce's settings), and, in a trace, hosts or job ids two jobs share."""
    problems: list[str] = []
    specs = []
    for i, job in enumerate(point.training):
        problem = _aggregator_problem(f"training.{i}", job, point.topology, topo)
        if problem:
            problems.append(problem)
        try:
            spec = job.training_spec(i, point.seed)
            spec.validate(topo.n_hosts if topo is not None else None)
        except (ValueError, TypeError) as e:
            problems.append(_collective_field(f"training.{i}", job, e))
            continue
        specs.append(spec)
    if point.trace and topo is not None and len(specs) == len(point.training):
        from testbed.workloads.runner import check_trace  # on use (module docstring)

        try:
            check_trace(specs, topo.n_hosts)
        except ValueError as e:
            i = getattr(e, "job", None) or 0
            problems.append(_collective_field(f"training.{i}", point.training[i], e))
    return problems
