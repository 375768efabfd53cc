"""The data-parallel training loop of one worker, and its lockstep numpy twin.

:func:`train_worker` is what every rank of a training job runs inside its emulated host
(``testbed.workloads.pool``): per iteration it draws a batch from its own shard, computes the
gradient (the real computation, padded to the job's emulated compute time), allreduces it
through the testbed's collective (the ``allreduce(step)`` callable the collective layer set up
on fixed buffers: ``grad`` in, ``out`` the sum), averages and applies the update. Every
``eval_every`` iterations (and after the last) it measures accuracy on the held-out split.
Every worker holds the same parameters (same start, same averaged gradient, same update), so
every worker measures the same accuracy and takes the same decision to stop at the target
accuracy: no extra message is needed.

Timestamps are ``CLOCK_MONOTONIC`` (one clock for every process of the machine), so the pool
can line the ranks up: see :func:`testbed.workloads.rows.iteration_rows`. Evaluation is timed
separately and left out of the training time.

:func:`train_reference` is the twin: the same n workers in lockstep in one process with an
exact (float64) sum instead of the network; a job whose collective is exact up to rounding
(ring, halving-doubling, INA's fixed point) follows its accuracy curve.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from testbed.workloads.data import BatchSampler, Dataset
from testbed.workloads.models import Model, make_model, make_optimizer
from testbed.workloads.spec import TrainingSpec

#: Salts of the job's random streams (initialisation is shared; batches are per rank).
SALT_INIT, SALT_BATCH = 0x1417, 0xBA7C


@dataclass
class RankLog:
    """What one worker measured: per iteration the start ``t0``, end of the compute phase
    ``t1`` (= start of the allreduce), end of the allreduce ``t2``, end of the update ``t3``
    (monotonic seconds), its batch loss and the bytes its host sent during the allreduce;
    per evaluation ``(iteration, accuracy, seconds)``; the final parameters' digest; its
    communication's counters (filled in by the caller)."""

    t0: list[float] = field(default_factory=list)
    t1: list[float] = field(default_factory=list)
    t2: list[float] = field(default_factory=list)
    t3: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    tx_bytes: list[int] = field(default_factory=list)
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    digest: str = ""
    #: counters of the worker's communication (e.g. the trimmed exchange's packets)
    comm_stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """Plain dict for the pool's control channel."""
        return dict(self.__dict__)


def build(spec: TrainingSpec, data: Dataset) -> tuple[Model, np.ndarray]:
    """The job's model for ``data`` and its initial parameters (the same on every worker)."""
    model = make_model(spec.model, data.n_features, data.n_classes, hidden=spec.hidden,
                       activation=spec.activation, weight_decay=spec.weight_decay)
    return model, model.init(np.random.default_rng([spec.seed, SALT_INIT]))


def digest(params: np.ndarray) -> str:
    """Short hash of the parameter bytes (replicas must agree bit for bit)."""
    return hashlib.sha1(np.ascontiguousarray(params).tobytes()).hexdigest()[:16]


def eval_due(spec: TrainingSpec, it: int) -> bool:
    """Whether accuracy is measured after iteration ``it`` (0-based): every ``eval_every``
    iterations and after the last one."""
    return (it + 1) % spec.eval_every == 0 or it + 1 == spec.iterations


def train_worker(spec: TrainingSpec, data: Dataset, rank: int, n: int, grad: np.ndarray,
                 out: np.ndarray, allreduce: Callable[[int], None], *,
                 tx_bytes: Callable[[], int] | None = None,
                 after_allreduce: Callable[[int], None] | None = None) -> RankLog:
    """Train worker ``rank`` of ``n``; ``allreduce(it)`` sums every worker's ``grad`` into
    ``out``. ``tx_bytes()``: bytes its host has sent so far (per-iteration wire bytes);
    ``after_allreduce(it)``: called with the sum still in ``out`` (the pool's checks)."""
    model, params = build(spec, data)
    opt = make_optimizer(spec.optimizer, model.n_params, spec.lr, spec.momentum)
    X, y = data.shard(rank, n)
    sampler = BatchSampler(len(y), spec.batch_size,
                           np.random.default_rng([spec.seed, SALT_BATCH, rank]))
    compute_s = spec.compute_ms / 1000.0 * spec.time_dilation
    probe = tx_bytes or (lambda: 0)
    inv_n = np.float32(1.0 / n)
    log = RankLog()
    clock = time.monotonic
    for it in range(spec.iterations):
        t0 = clock()
        idx = sampler.next()
        loss = model.loss_grad(params, X[idx], y[idx], grad)
        pad = compute_s - (clock() - t0)
        if pad > 0:
            time.sleep(pad)
        sent = probe()
        t1 = clock()
        allreduce(it)
        t2 = clock()
        sent = probe() - sent
        if after_allreduce is not None:
            after_allreduce(it)
        out *= inv_n
        opt.step(params, out)
        t3 = clock()
        for k, v in (("t0", t0), ("t1", t1), ("t2", t2), ("t3", t3), ("loss", loss),
                     ("tx_bytes", sent)):
            getattr(log, k).append(v)
        if eval_due(spec, it):
            e0 = clock()
            acc = model.accuracy(params, data.X_test, data.y_test)
            log.evals.append((it, acc, clock() - e0))
            if spec.stop_at_target and acc >= spec.target_accuracy:
                break
    log.digest = digest(params)
    return log


def train_reference(spec: TrainingSpec, data: Dataset, n: int) -> list[tuple[int, float]]:
    """The numpy twin of a job of ``n`` workers: the same batches, updates and evaluations
    with an exact sum of the gradients; returns ``[(iteration, accuracy), ...]``."""
    model, params = build(spec, data)
    opt = make_optimizer(spec.optimizer, model.n_params, spec.lr, spec.momentum)
    shards = [data.shard(r, n) for r in range(n)]
    samplers = [BatchSampler(len(s[1]), spec.batch_size,
                             np.random.default_rng([spec.seed, SALT_BATCH, r]))
                for r, s in enumerate(shards)]
    grad = np.empty(model.n_params, dtype=np.float32)
    curve = []
    for it in range(spec.iterations):
        total = np.zeros(model.n_params, dtype=np.float64)
        for (X, y), s in zip(shards, samplers, strict=True):
            idx = s.next()
            model.loss_grad(params, X[idx], y[idx], grad)
            total += grad
        opt.step(params, (total / n).astype(np.float32))
        if eval_due(spec, it):
            acc = model.accuracy(params, data.X_test, data.y_test)
            curve.append((it, acc))
            if spec.stop_at_target and acc >= spec.target_accuracy:
                break
    return curve
