"""Training jobs whose gradients cross the emulated network.

A job (:class:`TrainingSpec`) is a numpy model (logistic regression or an MLP) on a built-in
data set (scikit-learn's digits, or a synthetic one of any size), an optimiser, a batch size,
iterations and/or a target accuracy, an emulated compute time, and a communication config.
Each worker runs in its emulated host, computes its shard's gradient, allreduces it with the
testbed's collectives over the emulated network and applies the update.

>>> from testbed.workloads import TrainingSpec, run_training, run_trace
>>> res = run_training(net, TrainingSpec(model="mlp", algo="ina", iterations=200))
>>> res.summary["final_accuracy"], res.summary["jct_s"]

See ``docs/architecture.md`` ("Training jobs") for the process design.
"""

from testbed.workloads.runner import TrainingError, TrainingResult, run_trace, run_training
from testbed.workloads.spec import TrainingSpec

__all__ = ["TrainingSpec", "TrainingResult", "TrainingError", "run_training", "run_trace"]
