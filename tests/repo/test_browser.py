"""``testbed lab`` in a real browser: Debian's Chromium, driven by Selenium through Debian's
chromedriver (no browser or driver download), opens notebook 00, runs it through the UI (Run >
Run All Cells), and finds its plots and the live fabric view rendered. Screenshots stay in the
test's folder (``tmp_path``; the report names them). Nothing is left behind: the lab server,
its kernel, the browser and its driver are gone at the end (checked in ``/proc``), the notebook
file is unchanged (autosave is off), its results went to the test's folder."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.mininet  # the notebook builds networks: root

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "00_quickstart.ipynb"
#: JupyterLab settings for the test's profile: every cell in the page (no windowing), no
#: autosave (the committed notebook stays as it is), no news fetched
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}
RUN_TIMEOUT_S = 420  # the notebook waits for the emulation lock like any network test


def _why_not() -> str:
    """Why this machine cannot run the test ('' when it can)."""
    missing = [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed: Debian packages chromium and "
                "chromium-driver (.ci/setup.sh installs them)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed: the [test] extra"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _procs() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every process now."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            rest = stat[stat.rindex(")") + 2:].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out[int(pid)] = (int(rest[1]), rest[0], cmd)
    return out


def _ours(roots: list[int], marker: str) -> set[int]:
    """``roots``, their descendants, and any process whose command line holds ``marker``."""
    procs = _procs()
    found = {p for p, (_, _, cmd) in procs.items() if marker in cmd}
    todo = [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += [p for p, (ppid, _, _) in procs.items() if ppid == pid and p not in found]
    return found


def _alive(pids: set[int]) -> list[str]:
    procs = _procs()
    return [f"{p} {procs[p][2][:120]}" for p in sorted(pids)
            if p in procs and procs[p][1] != "Z"]


def _wait_for_server(url: str, proc, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"testbed lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    pytest.fail(f"testbed lab did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _lab_env(tmp: Path) -> dict:
    settings = tmp / "lab-settings"
    for plugin, values in SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = {**os.environ, "TESTBED_RESULTS": str(tmp / "results"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime")}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


#: the input prompt of every code cell: "[3]:", "[*]:" (running or queued) or "[ ]:"
PROMPTS_JS = """return [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(p => p.textContent.trim());"""
ERRORS_JS = """return [...document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.textContent).filter(t => /Error|Traceback/.test(t));"""
#: rendered images in the outputs: (class, natural width) of each
IMAGES_JS = """return [...document.querySelectorAll('.jp-OutputArea-output img')]
    .map(i => [i.className, i.naturalWidth]);"""


#: the notebook is on the page and its kernel is up and idle
READY_JS = """const i = document.querySelector('.jp-Notebook-ExecutionIndicator');
return document.querySelectorAll('.jp-Notebook .jp-CodeCell').length > 0
    && !!i && i.getAttribute('data-status') === 'idle';"""


def _run_all(driver, timeout: float = 120) -> None:
    """Run > Run All Cells, through the menu bar as a user does, once the notebook and its
    kernel are ready (a menu opened before the application settles closes again: retried)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while not driver.execute_script(READY_JS):
        if time.monotonic() > deadline:
            pytest.fail("the notebook or its kernel did not come up in JupyterLab")
        time.sleep(0.5)
    # (a label's mnemonic letter may be an element of its own: compare the whole text)
    menu = "//div[contains(@class,'lm-MenuBar-itemLabel') and normalize-space(.)='Run']"
    item = "//div[contains(@class,'lm-Menu-itemLabel') and normalize-space(.)='Run All Cells']"
    while time.monotonic() < deadline:
        with contextlib.suppress(WebDriverException):
            driver.find_element(By.XPATH, menu).click()
            time.sleep(0.5)
            found = [e for e in driver.find_elements(By.XPATH, item) if e.is_displayed()]
            if found:
                found[0].click()
                return
        time.sleep(1.0)
    pytest.fail("Run > Run All Cells could not be clicked")


def _started(prompts: list[str]) -> bool:
    return any(re.match(r"\[(\d+|\*)\]", p) for p in prompts)


def _run_and_wait(driver, timeout: float) -> list[str]:
    """Run All, then the prompts once every code cell ran (or the run stopped at an error).
    A Run All that started nothing within half a minute (given while the kernel connection
    settled) is given again."""
    deadline = time.monotonic() + timeout
    prompts: list[str] = []
    for _attempt in range(3):
        _run_all(driver)
        given = time.monotonic()
        while time.monotonic() - given < 30 and not _started(prompts):
            time.sleep(1.0)
            prompts = driver.execute_script(PROMPTS_JS)
        if _started(prompts):
            break
    while _started(prompts) and time.monotonic() < deadline:
        if all(re.match(r"\[\d+\]", p) for p in prompts):
            return prompts
        if not any(p.startswith("[*]") for p in prompts):
            return prompts  # stopped: an error left the later cells unrun
        time.sleep(1.0)
        prompts = driver.execute_script(PROMPTS_JS)
    return prompts


@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_lab_runs_notebook_00_in_chromium(tmp_path, record_property):
    why = _why_not()
    if why:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.common.exceptions import SessionNotCreatedException
    from selenium.webdriver.chrome.service import Service

    port, token = _free_port(), secrets.token_hex(16)
    before = NOTEBOOK.read_bytes()
    checkpoints = NOTEBOOK.parent / ".ipynb_checkpoints"
    had_checkpoints = checkpoints.exists()
    log = tmp_path / "lab.log"
    lab = subprocess.Popen(
        [sys.executable, "-m", "testbed.cli", "lab", "--port", str(port), "--ip", "127.0.0.1"],
        env={**_lab_env(tmp_path), "TESTBED_LAB_TOKEN": token}, stdout=log.open("w"),
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    profile = tmp_path / "chromium-profile"
    driver = None
    ours: set[int] = set()
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", lab, log)
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1400,1000", "--no-first-run",
                    f"--user-data-dir={profile}"):
            options.add_argument(arg)
        try:
            driver = webdriver.Chrome(
                service=Service(shutil.which("chromedriver"),
                                log_output=str(tmp_path / "chromedriver.log")),
                options=options)
        except SessionNotCreatedException as e:  # installed, but it cannot start here
            pytest.skip(f"Chromium cannot run here: {str(e.msg).splitlines()[0]}")
        driver.get(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK.name}?token={token}")
        prompts = _run_and_wait(driver, RUN_TIMEOUT_S)
        ours = _ours([lab.pid, driver.service.process.pid], str(profile))
        shot = tmp_path / "lab-00_quickstart.png"
        live = driver.execute_script(
            "const i = document.querySelector('img.tb-fabric-view');"
            "if (i) i.scrollIntoView({block: 'center'}); return !!i;")
        driver.save_screenshot(str(shot))
        record_property("screenshot", str(shot))
        print(f"screenshot: {shot}")
        errors = driver.execute_script(ERRORS_JS)
        assert prompts and all(re.match(r"\[\d+\]", p) for p in prompts), \
            f"the notebook did not run to its end: prompts {prompts}; errors: {errors}"
        images = driver.execute_script(IMAGES_JS)
        plots = [w for cls, w in images if "tb-fabric-view" not in cls and w > 0]
        views = [w for cls, w in images if "tb-fabric-view" in cls and w > 0]
        assert live and views, f"the live view did not render: images {images}"
        assert len(plots) >= 2, f"the notebook's plots did not render: images {images}"
        text = driver.find_element("css selector", ".jp-Notebook").text
        updates = re.search(r"(\d+) updates of the view", text)
        assert updates and int(updates.group(1)) >= 2, "the live view was not updated"
        assert list((tmp_path / "results").glob("quickstart-*/results.csv"))
    finally:
        if driver is not None:
            ours |= _ours([driver.service.process.pid], str(profile))
            with contextlib.suppress(Exception):
                driver.quit()
        ours |= _ours([lab.pid], str(profile))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGTERM)  # the server shuts its kernel down
        try:
            lab.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait(10)
        deadline = time.monotonic() + 20
        while _alive(ours) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _alive(ours)
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.split()[0]), signal.SIGKILL)
        if not had_checkpoints:
            shutil.rmtree(checkpoints, ignore_errors=True)
        changed = NOTEBOOK.read_bytes() != before
        if changed:
            NOTEBOOK.write_bytes(before)
    assert not left, "processes left behind:\n" + "\n".join(left)
    assert not changed, "the lab saved the committed notebook (now restored)"
