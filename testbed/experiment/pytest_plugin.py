"""pytest plugin for regression experiments (registered through the ``pytest11`` entry point).

Loading it costs nothing: only pytest and the standard library are imported here; pandas,
pydantic, Mininet and the testbed layers are imported when a fixture is used.

Fixtures
--------
``testbed_experiment``
    A callable ``run(experiment, overrides=None, **run_kwargs) -> Results``: runs an
    experiment (object, dict or TOML/YAML path; ``overrides`` maps dotted paths to values,
    e.g. ``{"jobs.0.nbytes": 65536}``) with its results folder under the test's ``tmp_path``.
``testbed_baseline``
    ``testbed_baseline.check(results, name, keys=None, tolerances=None, exact=("correct",))``
    compares results (a :class:`Results` or a DataFrame) against the stored baseline
    ``<test file folder>/baselines/<name>.csv``: one row per run key (label, op, algo, n,
    bytes, ... and sweep columns), ``time_s`` within ±50 % by default, ``correct`` equal.
    ``testbed_baseline.assert_fidelity(results, tol=0.2)`` checks measured/model within ±tol
    for every run that is not ``cpu_bound``. When every run was ``cpu_bound`` nothing could be
    checked, and the test fails saying so (a fidelity check that did not run is not a pass):
    run the experiment dilated (``time_dilation = "auto"``). The terminal summary lists every
    fidelity check of the session: how many runs it judged, how many it left out as
    ``cpu_bound``, at which time dilation.

Recording and updating baselines::

    pytest tests/regression --testbed-update-baselines   # (re)write every baseline used

Without the option a missing baseline fails the test with this instruction; with it the
baseline is written from the current results and the test passes (the test's own asserts
still run). Commit the CSVs under ``baselines/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--testbed-update-baselines`` and ``--testbed-baselines-dir``."""
    group = parser.getgroup("testbed", "collective offload testbed experiments")
    group.addoption("--testbed-update-baselines", action="store_true", default=False,
                    help="record/overwrite the baseline results files used by tests")
    group.addoption("--testbed-baselines-dir", default=None,
                    help="folder of baseline CSVs (default: baselines/ next to each test file)")


def pytest_configure(config: pytest.Config) -> None:
    """Document the ``testbed`` marker (for selecting regression experiments)."""
    config.addinivalue_line("markers",
                            "testbed: a regression experiment run through the testbed plugin")


#: the session's fidelity checks, for the terminal summary: (test id, line)
_FIDELITY_KEY = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """List the session's fidelity checks (judged runs, runs left out as cpu_bound)."""
    lines = config.stash.get(_FIDELITY_KEY, [])
    if not lines:
        return
    terminalreporter.section("testbed fidelity checks")
    for nodeid, line in lines:
        terminalreporter.write_line(f"{nodeid}: {line}")


class Baseline:
    """Compare results with a stored baseline CSV, or record it (``--testbed-update-baselines``)."""

    def __init__(self, folder: Path, update: bool, config: pytest.Config | None = None,
                 nodeid: str = ""):
        self.folder = folder
        self.update = update
        self.written: list[Path] = []
        self._config = config
        self._nodeid = nodeid

    def path(self, name: str) -> Path:
        """Where the baseline ``name`` lives."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"baseline name={name!r} must be a plain file stem, e.g. 'ring_star4'")
        return self.folder / f"{name}.csv"

    def check(self, results: Any, name: str, keys=None, tolerances: dict | None = None,
              exact=("correct",), metrics: list[str] | None = None) -> None:
        """Fail the test listing every difference from baseline ``name`` (or record it)."""
        # on use: loading the plugin (every pytest run) must stay cheap
        from testbed.experiment.checks import compare_to_baseline, write_baseline

        path = self.path(name)
        if self.update:
            cols = metrics or ["time_s", "fidelity", "max_abs_err", "correct"]
            df = getattr(results, "df", results)
            write_baseline(results, path, keys, [c for c in cols if c in df.columns])
            self.written.append(path)
            return
        if not path.exists():
            pytest.fail(f"no baseline {path}; record it with: "
                        f"pytest --testbed-update-baselines {path.parent.parent}", pytrace=False)
        diffs = compare_to_baseline(results, path, keys=keys, tolerances=tolerances, exact=exact)
        if diffs:
            pytest.fail(f"results differ from baseline {path} ({len(diffs)} differences):\n  "
                        + "\n  ".join(diffs)
                        + "\n(if the change is intended: pytest --testbed-update-baselines)",
                        pytrace=False)

    def assert_fidelity(self, results: Any, tol: float = 0.2, **kw) -> None:
        """Measured/model within ``1 ± tol`` for every run that is not cpu_bound; fails the
        test when no run could be judged (all cpu_bound). Recorded for the summary."""
        # on use: loading the plugin (every pytest run) must stay cheap
        from testbed.experiment.checks import assert_fidelity, fidelity_runs

        judged, bound = fidelity_runs(results, kw.get("skip_cpu_bound", True),
                                      kw.get("where"))
        df = getattr(results, "df", results)
        dil = sorted({float(v) for v in df.get("time_dilation", [1.0]) if v == v})
        line = (f"{len(judged)} runs judged within ±{tol:.0%} of the model, {len(bound)} left "
                f"out as cpu_bound, time dilation {', '.join(f'{d:g}' for d in dil)}")
        if len(judged) == 0:
            line = "NOT CHECKED: " + line
        if self._config is not None:
            self._config.stash.setdefault(_FIDELITY_KEY, []).append((self._nodeid, line))
        try:
            assert_fidelity(results, tol=tol, **kw)
        except AssertionError as e:
            pytest.fail(str(e), pytrace=False)

    @staticmethod
    def assert_all_ok(results: Any) -> None:
        """Every run finished and its result is correct."""
        from testbed.experiment.checks import assert_all_ok  # on use: the plugin loads cheaply

        assert_all_ok(results)


@pytest.fixture
def testbed_baseline(request: pytest.FixtureRequest) -> Baseline:
    """A :class:`Baseline` bound to this test's baselines folder."""
    opt = request.config.getoption("--testbed-baselines-dir")
    folder = Path(opt) if opt else Path(request.path).parent / "baselines"
    return Baseline(folder, bool(request.config.getoption("--testbed-update-baselines")),
                    request.config, request.node.nodeid)


@pytest.fixture
def testbed_experiment(tmp_path: Path):
    """``run(experiment, overrides=None, **kw) -> Results`` with results under ``tmp_path``."""
    count = [0]

    def _run(experiment: Any, overrides: dict[str, Any] | None = None, **kw):
        # on use: loading the plugin (every pytest run) must stay cheap
        from testbed.experiment.runner import run
        from testbed.experiment.spec import load_experiment, with_overrides

        exp = load_experiment(experiment)
        if overrides:
            exp = with_overrides(exp, overrides)
        count[0] += 1
        kw.setdefault("progress", False)
        kw.setdefault("doctor", False)
        return run(exp, out_dir=tmp_path / f"results-{count[0]}", **kw)

    return _run
