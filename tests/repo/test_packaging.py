"""Packaging: declared dependencies match what the code imports, one Python version everywhere,
license and citation files present and consistent, and the installed environment is sound."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

#: Declared test dependencies that are used as tools rather than imported, and why.
TEST_TOOLS = {
    "ruff": "`make test` lints first",
    "pytest-xdist": "`make test-unit` runs the unit tests on every core",
    "pytest-timeout": "the `timeout` setting in [tool.pytest.ini_options]",
    "ipykernel": "the python3 kernel the notebook tests execute notebooks in",
    "ipywidgets": "notebook 00's live fabric view, in the kernel the notebook tests run",
}
#: Declared lab dependencies: started as programs, never imported by the package.
LAB_TOOLS = {"jupyterlab": "`testbed lab` runs jupyter-lab", "ipykernel": "notebook kernel"}
#: Package modules loaded only by the program they plug into (which is then installed), or
#: that exist for an optional extra (which installs the distribution they import).
PLUGINS = {"pytest": {"testbed/experiment/pytest_plugin.py"},
           "torch": {"testbed/torch.py", "testbed/c10d.py", "testbed/launch.py", "testbed/replay.py",
                     "testbed/bench/torch_probe.py"},
           "distributed": {"testbed/experiment/distributed.py"},
           "dask": {"testbed/experiment/distributed.py"},
           "mlc-chakra": {"testbed/workloads/chakra.py"},
           "protobuf": {"testbed/workloads/chakra.py"},
           "ipywidgets": {"testbed/experiment/live.py"}}
#: Distributions of PLUGINS installed by an extra named otherwise (default: the same name).
EXTRA_OF = {"dask": "distributed", "mlc-chakra": "traces", "protobuf": "traces",
            "ipywidgets": "lab"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(reqs: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


def _imports(folders: list[str]) -> dict[str, set[str]]:
    """Top-level module imported -> files importing it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                for m in mods:
                    found.setdefault(m.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return found


def _third_party(imports: dict[str, set[str]], local: set[str]) -> dict[str, set[str]]:
    """Distribution (normalised) -> files, for every import that is not stdlib or ours."""
    dists = md.packages_distributions()
    out: dict[str, set[str]] = {}
    for mod, files in imports.items():
        if mod in sys.stdlib_module_names or mod in local or mod == "__future__":
            continue
        assert mod in dists, f"{mod} (imported by {sorted(files)}) is not installed"
        for d in dists[mod]:
            out.setdefault(_norm(d), set()).update(files)
    return out


def test_package_imports_are_declared():
    runtime = _names(PROJECT["dependencies"])
    used = _third_party(_imports(["testbed", "kernels", "topologies"]), {"testbed"})
    missing = {d: sorted(f)[:3] for d, f in used.items()
               if d not in runtime and not f <= PLUGINS.get(d, set())}
    assert not missing, f"imported by the package but not in [project].dependencies: {missing}"
    unused = runtime - set(used) - {"pyarrow"}  # pyarrow: pandas' parquet engine (results)
    assert not unused, f"declared but never imported by the package: {sorted(unused)}"


def test_test_imports_are_declared_and_test_extras_used():
    runtime = _names(PROJECT["dependencies"])
    test = _names(PROJECT["optional-dependencies"]["test"])
    local = {"testbed"} | {p.stem for p in (REPO / "tests").rglob("*.py")}
    used = _third_party(_imports(["tests"]), local)
    missing = {d: sorted(f)[:3] for d, f in used.items() if d not in runtime | test}
    assert not missing, f"imported by tests/ but declared nowhere: {missing}"
    idle = test - set(used) - set(TEST_TOOLS)
    assert not idle, f"[test] extras neither imported by tests/ nor a listed tool: {idle}"


def test_optional_modules_import_what_their_extra_installs():
    extras = PROJECT["optional-dependencies"]
    for dist in set(PLUGINS) - {"pytest"}:
        extra = EXTRA_OF.get(dist, dist)
        assert dist in _names(extras.get(extra, [])), f"no [{extra}] extra declares {dist}"


def test_lab_extra_holds_the_notebook_stack_not_the_runtime():
    lab = _names(PROJECT["optional-dependencies"]["lab"])
    assert lab == set(LAB_TOOLS) | {d for d, e in EXTRA_OF.items() if e == "lab"}
    assert not lab & _names(PROJECT["dependencies"]), "JupyterLab is not a runtime dependency"


def test_one_python_version_everywhere():
    want = re.fullmatch(r">=3\.(\d+)", PROJECT["requires-python"])
    assert want, PROJECT["requires-python"]
    minor = int(want.group(1))
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py3{minor}"
    readme = (REPO / "README.md").read_text()
    assert f"Python ≥ 3.{minor}" in readme
    others = re.findall(r"Python ≥ 3\.(\d+)", readme)
    assert set(others) == {str(minor)}, f"README names Python 3.{others}"
    assert sys.version_info >= (3, minor)


def test_license_and_citation():
    assert PROJECT["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    assert PROJECT["license-files"] == ["LICENSE"]
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    for key in ("message", "title", "authors", "type"):
        assert cff.get(key), f"CITATION.cff lacks {key}"
    assert cff["version"] == PROJECT["version"], "CITATION.cff version != pyproject version"
    assert cff["license"] == PROJECT["license"]


def test_numba_is_pinned_to_one_tested_series():
    pin = next(r for r in PROJECT["dependencies"] if _norm(r).startswith("numba"))
    m = re.fullmatch(r"numba>=0\.(\d+),<0\.(\d+)", pin.replace(" ", ""))
    assert m and int(m.group(2)) == int(m.group(1)) + 1, f"numba pin {pin!r}: one series"
    installed = md.version("numba").split(".")
    assert int(installed[1]) == int(m.group(1)), f"numba {md.version('numba')} outside {pin}"


def test_pip_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_test_folder_selects_its_tests_by_marker():
    """``pytest -m <folder>`` (the README's way to run one part) selects that folder's tests,
    all of them and only them: the folder marker is given before ``-m`` selects."""
    def collected(*args: str) -> set[str]:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                            "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                           cwd=REPO, timeout=300)
        return {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}

    by_marker = collected("-m", "provider", "tests/provider", "tests/bench")
    assert by_marker and by_marker == collected("tests/provider"), by_marker
