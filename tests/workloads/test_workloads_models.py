"""The training jobs' numpy parts, no network: gradients against finite differences, data
shards and batches, the job spec's errors, the per-iteration rows' arithmetic, and the training
loop against its lockstep twin."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.workloads import TrainingSpec
from testbed.workloads.data import BatchSampler, load_dataset
from testbed.workloads.loop import RankLog, train_reference, train_worker
from testbed.workloads.models import Adam, Sgd, make_model
from testbed.workloads.rows import ITERATION_COLUMNS, iteration_rows, summary_row


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=3)


def _finite_differences(model, params, X, y, eps=1e-6):
    g = np.empty_like(params)
    for i in range(params.size):
        p1, p2 = params.copy(), params.copy()
        p1[i] += eps
        p2[i] -= eps
        tmp = np.empty_like(params)
        g[i] = (model.loss_grad(p1, X, y, tmp) - model.loss_grad(p2, X, y, tmp)) / (2 * eps)
    return g


@pytest.mark.parametrize("name, kw", [
    ("logreg", {}),
    ("logreg", {"weight_decay": 0.1}),
    ("mlp", {"activation": "tanh"}),
    ("mlp", {"activation": "relu", "weight_decay": 0.05}),
])
def test_gradients_match_finite_differences(name, kw):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((7, 5))
    y = rng.integers(0, 3, 7)
    model = make_model(name, 5, 3, hidden=4, **kw)
    params = model.init(rng, dtype=np.float64)
    params += 0.1 * rng.standard_normal(params.size)  # biases away from 0, relu off its kink
    grad = np.empty_like(params)
    model.loss_grad(params, X, y, grad)
    fd = _finite_differences(model, params, X, y)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)


def test_parameters_are_one_flat_vector_the_layers_view():
    m = make_model("mlp", 64, 10, hidden=32)
    p = m.init(np.random.default_rng(0))
    assert p.dtype == np.float32 and p.size == m.n_params == 64 * 32 + 32 + 32 * 10 + 10
    v = m.views(p)
    v["b2"][:] = 7.0
    assert np.all(p[-10:] == 7.0)  # a view, not a copy
    with pytest.raises(ValueError, match="4810 elements"):
        make_model("mlp", 64, 10).views(np.zeros(3, np.float32))


def test_optimisers_descend():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((64, 8)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    for opt_cls, lr in ((Sgd, 0.5), (Adam, 0.05)):
        m = make_model("logreg", 8, 2)
        p = m.init(rng)
        g = np.empty_like(p)
        opt = opt_cls(p.size, lr)
        first = m.loss_grad(p, X, y, g)
        for _ in range(50):
            m.loss_grad(p, X, y, g)
            opt.step(p, g)
        assert m.loss_grad(p, X, y, g) < 0.5 * first


def test_data_sets_split_standardise_and_shard(digits):
    d = digits
    assert d.X_train.shape[1] == 64 and d.n_classes == 10
    assert len(d.y_train) + len(d.y_test) == 1797 and len(d.y_test) == round(0.2 * 1797)
    assert abs(float(d.X_train.mean())) < 1e-3
    shards = [d.shard(r, 3) for r in range(3)]
    assert sum(len(s[1]) for s in shards) == len(d.y_train)
    np.testing.assert_array_equal(np.concatenate([s[0] for s in shards]), d.X_train)
    syn = load_dataset("synthetic", samples=500, features=20, classes=4, seed=2)
    assert syn.X_train.shape == (400, 20) and set(np.unique(syn.y_train)) <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="dataset='mnist'"):
        load_dataset("mnist")


def test_digits_file_is_what_sklearn_loads():
    from sklearn.datasets import load_digits as sk

    from testbed.workloads.data import load_digits

    X, y = load_digits()
    Xs, ys = sk(return_X_y=True)
    np.testing.assert_array_equal(X, Xs)
    np.testing.assert_array_equal(y, ys)


def test_batches_cover_an_epoch_without_replacement():
    s = BatchSampler(10, 3, np.random.default_rng(0))
    seen = np.concatenate([s.next() for _ in range(3)])
    assert len(set(seen.tolist())) == 9 and s.epoch == 0
    s.next()
    assert s.epoch == 1
    with pytest.raises(ValueError, match="batch_size=11"):
        BatchSampler(10, 11, np.random.default_rng(0))


@pytest.mark.parametrize("kw, field", [
    ({"model": "cnn"}, "model"),
    ({"target_accuracy": 1.5}, "target_accuracy"),
    ({"batch_size": 400}, "batch_size"),
    ({"algo": "rs"}, "algo"),
    ({"hosts": [0, 9]}, "hosts"),
    ({"hosts": [1, 1]}, "hosts"),
    ({"lr": 0.0}, "lr"),
    ({"stop_at_target": True}, "stop_at_target"),
    ({"algo": "ina", "compressor": "topk"}, "compressor"),
    ({"dataset": "synthetic", "features": 2, "classes": 9}, "classes"),
    ({"time_dilation": 0.5}, "time_dilation"),
    ({"workers": 5}, "workers"),
    ({"workers": 1 << 40}, "workers"),  # refused before a list of that many ranks is made
])
def test_bad_specs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"TrainingSpec\.{field}\b"):
        TrainingSpec(**kw).validate(4)


def test_spec_gradient_is_the_models_parameters():
    s = TrainingSpec(model="mlp", hidden=32)
    assert s.n_params() == 64 * 32 + 32 + 32 * 10 + 10
    c = s.collective()
    assert c.nbytes == 4 * s.n_params() and c.op == "allreduce" and c.algo == "ring"
    assert s.host_indices(6) == list(range(6))
    assert TrainingSpec(hosts=[4, 2, 5], workers=2).host_indices(6) == [4, 2]
    assert TrainingSpec(algo="ina", compressor="thc").label() == "ina+thc"


def _log(starts, compute, comm, evals=()):
    """A worker's log: iterations starting at ``starts``, computing ``compute`` s, returning
    from the allreduce ``comm`` s after its start."""
    log = RankLog()
    for t, c, m in zip(starts, compute, comm, strict=True):
        log.t0.append(t)
        log.t1.append(t + c)
        log.t2.append(t + m)
        log.t3.append(t + m)
        log.loss.append(1.0)
        log.tx_bytes.append(100)
    log.evals = list(evals)
    return log.to_json()


def test_rows_line_workers_up_and_leave_evaluation_out():
    spec = TrainingSpec(iterations=3, target_accuracy=0.5, time_dilation=2.0)
    # worker 1 computes 0.2 s longer in iteration 0; both evaluate after iteration 1 (worker
    # 0 for 0.5 s, worker 1 for 0.1 s), so worker 1 starts iteration 2 0.4 s earlier
    a = _log([0.0, 1.0, 2.5], [0.1, 0.1, 0.1], [1.0, 1.0, 1.0], evals=[(1, 0.6, 0.5)])
    b = _log([0.0, 1.0, 2.1], [0.3, 0.1, 0.1], [1.0, 1.0, 1.4], evals=[(1, 0.6, 0.1)])
    rows = iteration_rows(spec, [a, b])
    assert [tuple(r) for r in rows] == [ITERATION_COLUMNS] * 3
    # times are halved (dilation 2); the 0.5 s evaluation pause is not training time
    assert [r["time_s"] for r in rows] == pytest.approx([0.5, 1.0, 1.5])
    assert rows[0]["wait_s"] == pytest.approx(0.2 / 2 / 2)  # worker 0 waited 0.2 s
    assert rows[0]["comm_s"] == pytest.approx(0.7 / 2)
    assert rows[2]["wait_s"] == pytest.approx(0.0)  # both started right after evaluating
    assert rows[1]["accuracy"] == 0.6 and rows[0]["accuracy"] is None
    assert rows[0]["bytes_on_wire"] == 200
    s = summary_row(spec, rows)
    assert s["tta_s"] == pytest.approx(1.0) and s["final_accuracy"] == 0.6
    assert s["jct_s"] == pytest.approx(1.5) and s["iterations"] == 3


def test_worker_loop_with_an_exact_sum_follows_its_twin(digits):
    """A worker alone (its allreduce the identity) is the lockstep twin with n = 1, bit for
    bit; a job that stops at its target accuracy stops at the first evaluation reaching it."""
    spec = TrainingSpec(iterations=30, eval_every=10, seed=4)
    curve = train_reference(spec, digits, 1)
    p = spec.n_params()
    grad, out = np.zeros(p, np.float32), np.zeros(p, np.float32)

    def alone(it):
        out[:] = grad

    log = train_worker(spec, digits, 0, 1, grad, out, alone)
    assert [(it, acc) for it, acc, _ in log.evals] == curve
    assert curve[-1][1] > 0.85
    stop = TrainingSpec(iterations=30, eval_every=5, target_accuracy=0.5, stop_at_target=True)
    assert len(train_reference(stop, digits, 2)) < 6
