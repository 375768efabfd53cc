"""Suite-wide plumbing: root-only tests skip cleanly, and no test leaves testbed objects behind.

* ``@pytest.mark.root_required`` (and ``@pytest.mark.mininet``) tests skip with a reason when
  the suite does not run as root.
* When the session holds root-only tests, a session fixture checks, holding the emulation
  lock, that no ``tb`` interface, namespace, OVS bridge or process is left at the end; if
  something is, it is listed in a failure and then removed. Leftovers of a dead earlier run
  found at the start are removed with a warning, so the end check blames this session only.
"""

from __future__ import annotations

import os
import warnings

import pytest

IS_ROOT = os.geteuid() == 0
ROOT_MARKERS = ("root_required", "mininet")
NOT_ROOT_REASON = "needs root: run the suite as root ('sudo make test') or in the lab VM"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "root_required: needs root (skipped otherwise)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not IS_ROOT and any(item.get_closest_marker(m) for m in ROOT_MARKERS):
        pytest.skip(NOT_ROOT_REASON)


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
