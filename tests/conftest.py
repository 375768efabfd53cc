"""Suite-wide plumbing: root-only tests skip cleanly, and no test leaves testbed objects behind.

* The folders mirror the code (``tests/kernels`` tests ``kernels/``, ...); every test carries
  its folder's name as a marker (``pytest -m datapath``). ``@pytest.mark.root_required`` (and
  ``@pytest.mark.mininet``) mark the network tests, which need root and skip with a reason
  without it; the rest are unit tests (``make test-unit`` runs them in parallel, ``make
  test-network`` the network tests one at a time).
* When the session holds root-only tests, a session fixture checks, holding the emulation
  lock, that no ``tb`` interface, namespace, OVS bridge or process is left at the end; if
  something is, it is listed in a failure and then removed. Leftovers of a dead earlier run
  found at the start are removed with a warning, so the end check blames this session only.
* Root-only tests run after the others, and while the others run a background process
  compiles every Numba kernel (``testbed.warm``) on the CPU they leave idle: on a fresh
  checkout that is 2-3 CPU-minutes the first emulated networks would otherwise pay. The first
  root-only test, and every ``quiet_cpu`` test (which needs an otherwise idle machine), waits
  for it to finish; it is never left running after the session. A plain test that shares a
  module-scoped fixture with root-only tests of its module runs with them, so that fixture is
  built once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest

IS_ROOT = os.geteuid() == 0
ROOT_MARKERS = ("root_required", "mininet")
NOT_ROOT_REASON = "needs root: run the suite as root ('sudo make test') or in the lab VM"
WARM_WAIT_S = 240  # a cold compile of every kernel takes 1-3 minutes on 2 loaded cores
_warm: dict = {}  # the background kernel compile: "proc", "log"
TESTS = Path(__file__).resolve().parent
#: one marker per folder of tests/, named after it
FOLDERS = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "root_required: needs root (skipped otherwise)")
    config.addinivalue_line("markers", "quiet_cpu: needs an otherwise idle CPU (runs after "
                            "the background kernel compile)")
    for folder in FOLDERS:
        config.addinivalue_line("markers", f"{folder}: the tests in tests/{folder}/")


def _root_only(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in ROOT_MARKERS)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test with its folder, as it is collected (before ``-m`` selects)."""
    path = Path(str(item.path)).resolve()
    if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in FOLDERS:
        item.add_marker(path.relative_to(TESTS).parts[0])


@pytest.hookimpl(trylast=True)  # after -m/-k deselected: warm only for the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order: plain tests, then ``quiet_cpu`` ones, then root-only ones (each group in file
    order); start the kernel compile when plain tests can run beside it."""
    if not IS_ROOT:
        return
    rank = {id(i): 2 if _root_only(i) else 1 if i.get_closest_marker("quiet_cpu") else 0
            for i in items}
    # a plain test sharing a module-scoped fixture with root-only tests of its module runs
    # with them: split apart, the fixture (a network, a pip install) would be built twice
    shared = _module_fixtures([i for i in items if rank[id(i)] == 2])
    for i in items:
        if rank[id(i)] < 2 and _module_fixtures([i]).get(i.module.__name__, set()) & \
                shared.get(i.module.__name__, set()):
            rank[id(i)] = 2
    items.sort(key=lambda i: rank[id(i)])  # stable: file order within each group
    # the compile serves the network tests; an xdist worker (make test-unit) has none
    if any(r == 0 for r in rank.values()) and any(r == 2 for r in rank.values()) \
            and not os.environ.get("PYTEST_XDIST_WORKER"):
        log = tempfile.NamedTemporaryFile("w+", prefix="tb-warm-", suffix=".log", delete=False)
        _warm["log"] = log
        _warm["proc"] = subprocess.Popen([sys.executable, "-m", "testbed.warm", "--quiet"],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)


def _module_fixtures(items: list[pytest.Item]) -> dict[str, set[str]]:
    """Module name -> the module-scoped fixtures its ``items`` use."""
    out: dict[str, set[str]] = {}
    for i in items:
        info = getattr(i, "_fixtureinfo", None)
        if info is None or getattr(i, "module", None) is None:
            continue
        out.setdefault(i.module.__name__, set()).update(
            name for name, defs in info.name2fixturedefs.items()
            if defs and defs[-1].scope == "module")
    return out


def _wait_for_warm(timeout: float, report: bool = True) -> None:
    proc = _warm.pop("proc", None)
    if proc is None:
        return
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = f"killed after {timeout:.0f} s"
    log = _warm.pop("log")
    log.seek(0)
    out = log.read()
    log.close()
    os.unlink(log.name)
    if code != 0 and report:  # the tests compile what they need themselves: slower, not wrong
        warnings.warn(f"background kernel compile (testbed warm) failed ({code}):\n{out}",
                      stacklevel=1)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not IS_ROOT and _root_only(item):
        pytest.skip(NOT_ROOT_REASON)
    if _root_only(item) or item.get_closest_marker("quiet_cpu"):
        _wait_for_warm(WARM_WAIT_S)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # only when no test waited for it (e.g. -x stopped early): stop it, leave nothing behind
    _wait_for_warm(0.0, report=False)


def _describe(left: dict[str, list[str]]) -> str:
    return "\n".join(f"  {kind}: {item}" for kind, items in left.items() for item in items)


@pytest.fixture(scope="session", autouse=True)
def _tb_no_leftovers(request: pytest.FixtureRequest):
    """Fail the session loudly if testbed objects survive it (then remove them)."""
    wanted = IS_ROOT and any(item.get_closest_marker(m) for item in request.session.items
                             for m in ROOT_MARKERS)
    if not wanted:
        yield
        return
    from testbed.cleanup import cleanup, leftovers
    from testbed.netlock import EmulationBusy, emulation_lock

    try:
        # Short wait: this runs inside the first test's timeout.
        with emulation_lock(timeout=60):
            stale = leftovers()
            if any(stale.values()):
                cleanup()
                warnings.warn("removed testbed leftovers of an earlier run before the session:\n"
                              + _describe(stale), stacklevel=1)
    except EmulationBusy as exc:
        warnings.warn(f"could not check for stale testbed objects: {exc}", stacklevel=1)
    yield
    try:
        with emulation_lock(timeout=240):
            left = leftovers()
            if any(left.values()):
                result = cleanup()
                pytest.fail("this test session left testbed objects behind (now removed"
                            + (f"; could not remove: {result['errors']}" if result["errors"]
                               else "") + "):\n" + _describe(left), pytrace=False)
    except EmulationBusy as exc:
        warnings.warn(f"could not check for testbed leftovers at the end: {exc}", stacklevel=1)


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    """``add(dist, module, module_source, entry_points_txt)``: a distribution on sys.path (in
    ``add.site``), seen by the registries (their cached scan is refreshed before and after the
    test)."""
    from testbed.kernels import plugins

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    plugins.refresh()

    def add(dist: str, module: str, source: str, entry_points: str) -> None:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
        plugins.refresh()

    add.site = site
    yield add
    for mod in [m for m in sys.modules if m.startswith("tbplug_")]:
        del sys.modules[mod]
    monkeypatch.undo()
    plugins.refresh()
