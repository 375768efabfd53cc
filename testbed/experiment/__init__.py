"""Declarative experiments, results, plots and the pytest plugin.

``from testbed.experiment import Experiment, load_experiment, run`` - see
:mod:`testbed.experiment.spec` for the schema and :mod:`testbed.experiment.runner` for what a
run does. Heavy imports (pandas, Mininet, the collectives) happen only when they are used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Experiment", "ExperimentError", "Results", "load_experiment", "run",
           "with_overrides", "expand_sweep"]


def __getattr__(name: str) -> Any:
    # Lazy: `import testbed.experiment` (e.g. by the pytest plugin) must stay cheap.
    if name in ("Experiment", "ExperimentError", "load_experiment", "with_overrides",
                "expand_sweep", "parse_experiment"):
        from testbed.experiment import spec

        return getattr(spec, name)
    if name == "Results":
        from testbed.experiment.results import Results

        return Results
    if name == "run":
        from testbed.experiment.runner import run

        return run
    raise AttributeError(f"module 'testbed.experiment' has no attribute {name!r}")
