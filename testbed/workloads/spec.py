"""What a training job is asked to do (:class:`TrainingSpec`) and its validation.

A job is a model, a data set, an optimiser, a batch size, a number of iterations and/or a
target accuracy, an emulated compute time, and a communication config (algorithm, compressor
and its parameters, error feedback, INA window and loss, ...), on a set of hosts, from a start
time (traces). Every bad field raises ``ValueError`` naming the field, the value and what is
allowed, before any process or packet is created; :meth:`TrainingSpec.validate` also runs the
collectives' own validation of the gradient allreduce (:meth:`TrainingSpec.collective`).

The checks of the communication config (:func:`check_communication`, :func:`check_collective`)
and of integer fields (:func:`check_int`) serve every kind of training job, this one and the
PyTorch client's ``testbed.torch.TorchJob``; their messages name the job's class and field.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from testbed.collectives.algorithms import algorithm_names
from testbed.collectives.spec import (
    CollectiveSpec,
    Communication,
    FieldError,
    communication_label,
    communication_of,
)
from testbed.collectives.trimmed import BITS as TRIM_BITS
from testbed.workloads.data import DATASETS
from testbed.workloads.models import ACTIVATIONS, MODELS, OPTIMIZERS, make_model

#: The gradient exchange of training jobs that is no collective algorithm: an incast of
#: trimmable packets to rank 0 and a broadcast of the sum (``testbed.collectives.trimmed``).
TRIM = "trim"


def train_algos() -> tuple[str, ...]:
    """Algorithms a training job can allreduce its gradients with: every registered one that
    ``trains`` (ring, hd, ina, nic and plug-ins; not the reduction server, whose processes
    serve a fixed number of collectives, which a job that stops at a target accuracy does not
    know in advance), and :data:`TRIM`."""
    return algorithm_names("allreduce", trains=True) + (TRIM,)


#: Sizes of the digits data set (sklearn's load_digits): features, classes, rows.
DIGITS_SHAPE = (64, 10, 1797)


@dataclasses.dataclass
class TrainingSpec(Communication):
    """One data-parallel training job.

    Model and data: ``model`` (:data:`~testbed.workloads.models.MODELS`), ``hidden`` units
    and ``activation`` of the MLP, ``dataset`` (:data:`~testbed.workloads.data.DATASETS`;
    ``samples``/``features``/``classes`` size the synthetic one), ``test_fraction`` held out.
    Optimisation: ``optimizer``, ``lr``, ``momentum`` (sgd), ``weight_decay``, per-worker
    ``batch_size``, at most ``iterations`` steps, evaluation every ``eval_every`` steps;
    ``target_accuracy`` (optional) defines time-to-accuracy and, with
    ``stop_at_target``, ends the job when reached. ``compute_ms``: emulated compute time of
    one iteration (the real gradient computation runs; the iteration's compute phase is
    padded to this much, times ``time_dilation``). Communication: ``algo``
    (:func:`train_algos`), ``compressor``/``compressor_params``/``error_feedback``,
    ``window``/``loss`` (INA), ``bits`` (head bits per element) and ``idle_ms`` (silence before
    a NACK) of ``algo="trim"`` (with ``transport="uet"`` its gather NACKs a trimmed packet and
    waits for it whole, as Ultra Ethernet does, instead of adding its head), ``chunk_bytes`` (TCP), ``timeout_s``. Placement: ``workers``
    (count, default every host of ``hosts`` or of the net), ``hosts`` (host indices of the net,
    default the first ``workers``), ``start_s`` (seconds after the trace starts), ``job_id``
    (ports, switch partition). ``seed``: data split, initialisation, batches, compressors.
    ``placement`` (algo ina/nic): the aggregation tree, slots and memory mode of the gradient
    allreduce (``CollectiveSpec.placement``; a provider's plan sets it).
    """

    name: str | None = None
    model: str = "mlp"
    hidden: int = 64
    activation: str = "relu"
    dataset: str = "digits"
    samples: int = 10_000
    features: int = 64
    classes: int = 10
    test_fraction: float = 0.2
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    iterations: int = 200
    eval_every: int = 10
    target_accuracy: float | None = None
    stop_at_target: bool = False
    compute_ms: float = 0.0
    time_dilation: float = 1.0
    window: int = 64
    loss: float = 0.0
    bits: int = 1
    idle_ms: float = 20.0
    chunk_bytes: int = 256 << 10
    timeout_s: float = 30.0
    workers: int | None = None
    hosts: list[int] | None = None
    start_s: float = 0.0
    job_id: int = 1
    seed: int = 0
    placement: dict = dataclasses.field(default_factory=dict)

    def label(self) -> str:
        """Name in tables and plots: ``name``, else algo[+compressor][+ef]."""
        return self.name or communication_label(self)

    def data_shape(self) -> tuple[int, int, int]:
        """(features, classes, rows) of the data set, without loading it."""
        if self.dataset == "digits":
            return DIGITS_SHAPE
        return self.features, self.classes, self.samples

    def n_params(self) -> int:
        """Parameters of the model = float32 elements of the gradient each step allreduces."""
        f, c, _ = self.data_shape()
        return make_model(self.model, f, c, hidden=self.hidden,
                          activation=self.activation).n_params

    def host_indices(self, n_hosts: int) -> list[int]:
        """Indices (into the net's hosts) of the job's workers, in rank order."""
        if self.hosts is not None:
            return list(self.hosts[:self.workers] if self.workers else self.hosts)
        return list(range(self.workers if self.workers else n_hosts))

    def collective(self) -> CollectiveSpec:
        """The allreduce of one step's gradient; for ``algo="trim"`` the broadcast of the sum
        that follows the incast."""
        if self.algo == "trim":
            return CollectiveSpec(op="broadcast", algo="ring", nbytes=4 * self.n_params(),
                                  chunk_bytes=self.chunk_bytes, timeout_s=self.timeout_s,
                                  seed=self.seed, job_id=self.job_id)
        return CollectiveSpec(op="allreduce", nbytes=4 * self.n_params(),
                              **communication_of(self), window=self.window,
                              chunk_bytes=self.chunk_bytes, loss=self.loss,
                              timeout_s=self.timeout_s, seed=self.seed, repetitions=1,
                              job_id=self.job_id, workers=None,
                              placement=dict(self.placement))

    def validate(self, n_hosts: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field; ``n_hosts`` = hosts of the net."""
        _choice(self, "model", MODELS)
        _choice(self, "activation", ACTIVATIONS)
        _choice(self, "dataset", DATASETS)
        _choice(self, "optimizer", OPTIMIZERS)
        check_communication(self)
        check_int(self, "hidden", 1)
        check_int(self, "batch_size", 1)
        check_int(self, "iterations", 1)
        check_int(self, "eval_every", 1)
        check_int(self, "samples", 20)
        check_int(self, "features", 2)
        check_int(self, "classes", 2)
        check_int(self, "job_id", 0)
        check_int(self, "seed", 0)
        _num(self, "lr", 0.0, 10.0, lo_open=True)
        _num(self, "momentum", 0.0, 1.0, hi_open=True)
        _num(self, "weight_decay", 0.0, 1.0)
        _num(self, "test_fraction", 0.0, 0.9, lo_open=True)
        _num(self, "compute_ms", 0.0, 3.6e6)
        _num(self, "time_dilation", 1.0, 1e4)
        _num(self, "start_s", 0.0, 86400.0)
        _num(self, "idle_ms", 0.1, 10_000.0)
        if self.algo == "trim" and self.loss:
            raise FieldError("loss", f"TrainingSpec.loss={self.loss}: client-side loss is emulated for "
                             "algo 'ina'/'nic'; impair the switch's ports for 'trim'")
        if self.target_accuracy is not None:
            _num(self, "target_accuracy", 0.0, 1.0, lo_open=True)
        elif self.stop_at_target:
            raise FieldError("stop_at_target", "TrainingSpec.stop_at_target=True needs a target_accuracy")
        if self.dataset == "synthetic" and self.classes > 2 ** (max(2, self.features // 2)):
            raise FieldError("classes", f"TrainingSpec.classes={self.classes}: the synthetic data set "
                             f"cannot separate that many classes with {self.features} features")
        if self.hosts is not None:
            if not isinstance(self.hosts, list | tuple) or not self.hosts or any(
                    isinstance(h, bool) or not isinstance(h, int | np.integer) or h < 0
                    for h in self.hosts):
                raise FieldError("hosts", f"TrainingSpec.hosts={self.hosts!r} must be a non-empty list "
                                 "of host indices (0-based)")
            if len(set(self.hosts)) != len(self.hosts):
                raise FieldError("hosts", f"TrainingSpec.hosts={self.hosts!r} names a host twice")
        if self.workers is not None:
            check_int(self, "workers", 2)
            if self.hosts is not None and self.workers > len(self.hosts):
                raise FieldError("workers", f"TrainingSpec.workers={self.workers} exceeds the "
                                 f"{len(self.hosts)} hosts listed in hosts")
        if n_hosts is not None:
            if self.hosts is None and self.workers is not None and self.workers > n_hosts:
                raise FieldError("workers", f"TrainingSpec.workers={self.workers:,} exceeds the "
                                 f"{n_hosts} hosts of the network")
            idx = self.host_indices(n_hosts)
            bad = [h for h in idx if h >= n_hosts]
            if bad:
                raise FieldError("hosts", f"TrainingSpec.hosts: {bad} out of range; the net has "
                                 f"{n_hosts} hosts (0..{n_hosts - 1})")
            n = len(idx)
            if n < 2:
                raise FieldError("workers", f"TrainingSpec.workers: a data-parallel job needs at least 2 "
                                 f"workers, got {n}")
            rows = self.data_shape()[2]
            shard = (rows - int(round(rows * self.test_fraction))) // n
            if self.batch_size > shard:
                raise FieldError("batch_size", f"TrainingSpec.batch_size={self.batch_size} is larger than a "
                                 f"worker's shard ({shard} training rows with {n} workers); "
                                 "lower batch_size, use fewer workers or more samples")
        check_collective(self, len(self.host_indices(n_hosts)) if n_hosts is not None else None)

    def to_json(self) -> dict:
        """Plain dict (JSON-serialisable) of the fields."""
        return dataclasses.asdict(self)


def check_communication(job) -> None:
    """``ValueError`` when ``job``'s gradient exchange is not one a training job can run:
    ``algo`` not in :func:`train_algos`, ``bits`` not a trim head width, or a compressor on
    ``algo="trim"`` (which encodes the gradient in the trimming layout itself)."""
    cls = type(job).__name__
    if job.algo not in train_algos():
        raise FieldError("algo", f"{cls}.algo={job.algo!r} is not one of {train_algos()} "
                         "(the reduction server 'rs' serves a fixed number of collectives)")
    if job.bits not in TRIM_BITS:
        raise FieldError("bits", f"{cls}.bits={job.bits!r}: head bits per element must be one of "
                         f"{TRIM_BITS}")
    if job.algo == "trim" and job.compressor is not None:
        raise FieldError("compressor", f"{cls}.compressor={job.compressor!r}: algo 'trim' encodes the "
                         "gradient in the trimming layout; remove compressor")


def check_collective(job, n: int | None) -> None:
    """The collectives' own validation of ``job.collective()`` for ``n`` workers, its errors
    naming ``job``'s field (``TrainingSpec.window``, not ``CollectiveSpec.window``)."""
    try:
        job.collective().validate(n)
    except ValueError as e:
        raise FieldError(getattr(e, "field", ""),
                         str(e).replace("CollectiveSpec.", f"{type(job).__name__}.")) from None


def check_int(job, name: str, lo: int) -> None:
    """``ValueError`` unless ``job.<name>`` is an integer (not a bool) of at least ``lo``."""
    v = getattr(job, name)
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
        raise FieldError(name, f"{type(job).__name__}.{name}={v!r} must be an integer >= {lo}")


def _choice(spec: TrainingSpec, name: str, allowed: tuple[str, ...]) -> None:
    v = getattr(spec, name)
    if v not in allowed:
        raise FieldError(name, f"TrainingSpec.{name}={v!r} is not one of {allowed}")


def _num(spec: TrainingSpec, name: str, lo: float, hi: float, lo_open: bool = False,
         hi_open: bool = False) -> None:
    v = getattr(spec, name)
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise FieldError(name, f"TrainingSpec.{name}={v!r} must be a number in {lb}{lo}, {hi}{hb}")
