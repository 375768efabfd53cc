"""The layers of docs/architecture.md, enforced: no import circle, no import of a higher layer.

Read from the source (``ast``), every ``import`` of the package: the module-level ones, which
run when a module is imported, and those inside functions, which run when the function does.
A module imports only its own layer and those below it. An import inside a function may reach
up only where :data:`DEFERRED` says why (a registry whose built-ins defer to their code, a tool
that serves every layer); a new one must be added there with its reason, or the code moved.
(import-linter cannot see ``kernels/`` and ``topologies/``, which install as
``testbed.kernels`` and ``testbed.topologies`` through package-dir mapping.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Lowest first. A module's layer is that of the longest prefix that names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("testbed.kernels",)),
    ("machine", ("testbed", "testbed.lifeline", "testbed.netlock", "testbed.cleanup",
                 "testbed.guardian", "testbed.warm")),
    ("datapath", ("testbed.datapath",)),
    ("topologies", ("testbed.topologies", "testbed.nsserver")),
    ("collectives", ("testbed.collectives",)),
    ("workloads", ("testbed.workloads",)),
    ("pytorch", ("testbed.torch", "testbed.c10d")),
    ("tools", ("testbed.doctor", "testbed.testing", "testbed.switchctl", "testbed.wireshark")),
    ("provider", ("testbed.provider",)),
    ("experiment files", ("testbed.experiment.spec", "testbed.experiment.networks",
                          "testbed.experiment.results", "testbed.experiment.plots")),
    ("launch", ("testbed.launch", "testbed.replay", "testbed.served")),
    ("experiment", ("testbed.experiment",)),
    ("bench", ("testbed.bench",)),
    ("front ends", ("testbed.cli", "testbed.up", "testbed.demo", "testbed.lab",
                    "testbed.experiment.cli", "testbed.provider.ctl")),
]

#: (importer, imported) -> why an import inside a function may reach a higher layer
DEFERRED: dict[tuple[str, str], str] = {
    ("testbed.warm", "testbed.collectives"): "warm compiles every layer's kernels; the network "
    "builder (topologies) calls it before a build, so it sits below what it compiles",
    ("testbed.warm", "testbed.datapath"): "as above: the data path's kernels",
    ("testbed.experiment.runner", "testbed.launch"): "the runner runs [[launch]] jobs with "
    "launch.run_script; launch itself reads experiment files (a layer below both)",
    ("testbed.experiment.runner", "testbed.replay"): "the runner runs [[replay]] entries with "
    "replay.replay_on, as it runs [[launch]] jobs (above)",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] in ("kernels", "topologies"):  # installed as testbed.kernels, .topologies
        parts = ["testbed", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for d in ("testbed", "kernels", "topologies")
           for p in (REPO / d).rglob("*.py")}


def _target(name: str) -> str | None:
    """The package module ``name`` refers to (a module, or the package defining the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported module, whether at module level, line) of every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            nested |= {id(n) for n in ast.walk(node) if n is not node}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            names = [f"{base}.{a.name}" if _target(f"{base}.{a.name}") == f"{base}.{a.name}"
                     else base for a in node.names]
        for n in names:
            t = _target(n) if n.startswith("testbed") else None
            if t and t != module:
                out.append((t, id(node) not in nested, node.lineno))
    return out


def layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def test_every_module_has_a_layer():
    assert all(layer(m) >= 0 for m in MODULES), [m for m in MODULES if layer(m) < 0]


def test_no_import_circle_at_import_time():
    graph = {m: {t for t, top, _ in imports(m) if top} for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(
                    stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_modules_import_only_their_layer_and_below():
    bad = []
    for m in sorted(MODULES):
        for t, top, line in imports(m):
            if layer(t) <= layer(m):
                continue
            if not top and any(m.startswith(a) and t.startswith(b) for a, b in DEFERRED):
                continue
            where = "at import" if top else "inside a function"
            bad.append(f"{MODULES[m].relative_to(REPO)}:{line} ({LAYERS[layer(m)][0]}) imports "
                       f"{t} ({LAYERS[layer(t)][0]}) {where}")
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


@pytest.mark.parametrize("pair", sorted(DEFERRED), ids="->".join)
def test_every_deferred_upward_import_is_still_there(pair):
    """An exception that is no longer needed is removed from DEFERRED."""
    a, b = pair
    assert any(t.startswith(b) and not top for m in MODULES if m.startswith(a)
               for t, top, _ in imports(m)), pair


def test_constants_the_schema_copies_to_stay_light_equal_their_originals():
    """The experiment schema loads without Mininet and Numba, so it keeps copies of two
    constants of the topology layer; they must not drift."""
    from testbed.experiment import spec
    from testbed.topologies import TOPOLOGIES
    from testbed.topologies.pipeline import MAX_TIME_DILATION

    assert spec.MAX_TIME_DILATION == MAX_TIME_DILATION
    assert set(spec.TOPOLOGY_KINDS) == set(TOPOLOGIES)
