"""Models and optimisers of the built-in training jobs, in plain numpy.

A model keeps all its parameters in **one flat float32 vector**: the gradient a worker
allreduces is that vector's gradient, one contiguous array, as a framework's gradient bucket
is. Layer weights are views into it (:meth:`Model.views`), so nothing is copied between the
optimiser, the model and the collective.

* :class:`LogReg` - multinomial logistic regression (softmax over ``W x + b``).
* :class:`MLP` - one hidden layer (``relu`` or ``tanh``) and a softmax output.

Both minimise the mean cross-entropy of a batch plus ``weight_decay / 2 * ||W||^2`` over the
weight matrices (not the biases). :meth:`Model.loss_grad` returns the loss and writes the
gradient into a caller's buffer; ``tests/workloads/test_workloads_models.py`` checks every gradient
against central finite differences in float64.

Optimisers (:class:`Sgd` with momentum, :class:`Adam`) update the flat vector in place. Every
worker of a data-parallel job applies the same update to the same parameters with the same
averaged gradient, so the replicas stay bit-identical (the job's pool checks it at the end).
"""

from __future__ import annotations

import math

import numpy as np

MODELS = ("logreg", "mlp")
ACTIVATIONS = ("relu", "tanh")
OPTIMIZERS = ("sgd", "adam")


class Model:
    """A classifier over ``n_features`` inputs and ``n_classes`` outputs with a flat parameter
    vector of :attr:`n_params` elements; see the module docstring."""

    name = "model"

    def __init__(self, n_features: int, n_classes: int, weight_decay: float = 0.0):
        self.n_features = int(n_features)
        self.n_classes = int(n_classes)
        self.weight_decay = float(weight_decay)
        self.shapes: list[tuple[str, tuple[int, ...]]] = self._shapes()
        self.n_params = sum(math.prod(s) for _, s in self.shapes)

    def _shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named views (no copies) of the layers inside ``flat``."""
        if flat.shape != (self.n_params,):
            raise ValueError(f"{self.name}: a parameter vector has {self.n_params} elements, "
                             f"got shape {flat.shape}")
        out, off = {}, 0
        for name, shape in self.shapes:
            size = math.prod(shape)
            out[name] = flat[off:off + size].reshape(shape)
            off += size
        return out

    def init(self, rng: np.random.Generator, dtype=np.float32) -> np.ndarray:
        """Initial parameters: Glorot-uniform weights, zero biases (same ``rng`` seed on every
        worker gives every worker the same start)."""
        flat = np.zeros(self.n_params, dtype=dtype)
        for name, w in self.views(flat).items():
            if name.startswith("W"):
                lim = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
                w[...] = rng.uniform(-lim, lim, size=w.shape)
        return flat

    def logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Scores of every class for the rows of ``X``."""
        raise NotImplementedError

    def predict(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Predicted class of every row of ``X``."""
        return np.argmax(self.logits(params, X), axis=1)

    def accuracy(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Fraction of rows of ``X`` classified as ``y``."""
        return float(np.mean(self.predict(params, X) == y)) if len(y) else float("nan")

    def loss_grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray,
                  grad: np.ndarray) -> float:
        """Mean cross-entropy (+ weight decay) of the batch; its gradient into ``grad``."""
        raise NotImplementedError

    def _decay(self, v: dict, g: dict) -> float:
        """Add weight decay to the weight gradients; return its loss term."""
        if not self.weight_decay:
            return 0.0
        term = 0.0
        for name, w in v.items():
            if name.startswith("W"):
                g[name] += self.weight_decay * w
                term += 0.5 * self.weight_decay * float(np.sum(w.astype(np.float64) ** 2))
        return term


def softmax_xent(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean cross-entropy of the logits ``z`` for labels ``y``, d loss / d z)."""
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(np.mean(np.log(s[:, 0]) - z[rows, y]))
    dz = e / s
    dz[rows, y] -= 1.0
    dz /= len(y)
    return loss, dz


class LogReg(Model):
    """Multinomial logistic regression: ``softmax(X W + b)``."""

    name = "logreg"

    def _shapes(self):
        return [("W", (self.n_features, self.n_classes)), ("b", (self.n_classes,))]

    def logits(self, params, X):
        v = self.views(params)
        return X @ v["W"] + v["b"]

    def loss_grad(self, params, X, y, grad):
        v, g = self.views(params), self.views(grad)
        loss, dz = softmax_xent(X @ v["W"] + v["b"], y)
        g["W"][...] = X.T @ dz
        g["b"][...] = dz.sum(axis=0)
        return loss + self._decay(v, g)


class MLP(Model):
    """One hidden layer of ``hidden`` units (``activation`` relu or tanh), softmax output."""

    name = "mlp"

    def __init__(self, n_features: int, n_classes: int, hidden: int = 64,
                 activation: str = "relu", weight_decay: float = 0.0):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        self.hidden = int(hidden)
        self.activation = activation
        super().__init__(n_features, n_classes, weight_decay)

    def _shapes(self):
        return [("W1", (self.n_features, self.hidden)), ("b1", (self.hidden,)),
                ("W2", (self.hidden, self.n_classes)), ("b2", (self.n_classes,))]

    def _hidden(self, v, X):
        a = X @ v["W1"] + v["b1"]
        return np.maximum(a, 0) if self.activation == "relu" else np.tanh(a)

    def logits(self, params, X):
        v = self.views(params)
        return self._hidden(v, X) @ v["W2"] + v["b2"]

    def loss_grad(self, params, X, y, grad):
        v, g = self.views(params), self.views(grad)
        h = self._hidden(v, X)
        loss, dz = softmax_xent(h @ v["W2"] + v["b2"], y)
        g["W2"][...] = h.T @ dz
        g["b2"][...] = dz.sum(axis=0)
        dh = dz @ v["W2"].T
        if self.activation == "relu":
            dh *= h > 0
        else:
            dh *= 1.0 - h * h
        g["W1"][...] = X.T @ dh
        g["b1"][...] = dh.sum(axis=0)
        return loss + self._decay(v, g)


def make_model(name: str, n_features: int, n_classes: int, *, hidden: int = 64,
               activation: str = "relu", weight_decay: float = 0.0) -> Model:
    """Model ``name`` (one of :data:`MODELS`) for the data's shape."""
    if name == "logreg":
        return LogReg(n_features, n_classes, weight_decay)
    if name == "mlp":
        return MLP(n_features, n_classes, hidden, activation, weight_decay)
    raise ValueError(f"model={name!r} is not one of {MODELS}")


# ----------------------------------------------------------------------------- optimisers


class Sgd:
    """SGD with (heavy-ball) momentum: ``v = m v + g; p -= lr v``."""

    def __init__(self, size: int, lr: float, momentum: float = 0.9):
        self.lr, self.momentum = float(lr), float(momentum)
        self.v = np.zeros(size, dtype=np.float32) if momentum else None

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """Update ``params`` in place with the (averaged) gradient ``grad``."""
        if self.v is None:
            params -= np.float32(self.lr) * grad
            return
        self.v *= np.float32(self.momentum)
        self.v += grad
        params -= np.float32(self.lr) * self.v


class Adam:
    """Adam (Kingma and Ba) with the usual defaults beta1 0.9, beta2 0.999, eps 1e-8."""

    def __init__(self, size: int, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8):
        self.lr, self.b1, self.b2, self.eps = float(lr), beta1, beta2, eps
        self.m = np.zeros(size, dtype=np.float32)
        self.s = np.zeros(size, dtype=np.float32)
        self.t = 0

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """Update ``params`` in place with the (averaged) gradient ``grad``."""
        self.t += 1
        self.m *= np.float32(self.b1)
        self.m += np.float32(1 - self.b1) * grad
        self.s *= np.float32(self.b2)
        self.s += np.float32(1 - self.b2) * grad * grad
        a = self.lr * math.sqrt(1 - self.b2 ** self.t) / (1 - self.b1 ** self.t)
        params -= np.float32(a) * self.m / (np.sqrt(self.s) + np.float32(self.eps))


def make_optimizer(name: str, size: int, lr: float, momentum: float = 0.9):
    """Optimiser ``name`` (one of :data:`OPTIMIZERS`) for ``size`` parameters."""
    if name == "sgd":
        return Sgd(size, lr, momentum)
    if name == "adam":
        return Adam(size, lr)
    raise ValueError(f"optimizer={name!r} is not one of {OPTIMIZERS}")
