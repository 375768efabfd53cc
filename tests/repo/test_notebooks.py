"""Every notebook is committed without outputs and executes (as root) producing its plots."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
#: notebook -> (extra parameters for CI, minimum number of PNG figures it must produce)
CASES = {
    "00_quickstart": ({"SIZES": [16 << 10, 32 << 10], "NBYTES": 32 << 10, "N_HOSTS": 3}, 1),
    "01_allreduce_vs_model": ({"N_HOSTS_LIST": [2, 3], "SIZES": [16 << 10, 64 << 10],
                               "ALGOS": ["ring", "ina"]}, 4),
    "02_in_network_aggregation": ({"NBYTES": 64 << 10, "LOSS_PCTS": [0.0, 2.0],
                                   "N_HOSTS": 3}, 1),
    "03_trimming_incast": ({"NBYTES": 64 << 10, "BITS": [1], "N_SENDERS": 2,
                            "RATE_MBPS": 30, "UET_SENDERS": 4, "UET_REPS": 1,
                            "UET_TIME_DILATION": 8}, 2),
    "04_compression": ({"NBYTES": 64 << 10, "N_HOSTS": 3, "COMPRESSORS": ["none", "fp16"],
                        "ERROR_FEEDBACK": [False, True]}, 1),
    "05_multitenant_offload": ({"TREE_TOPOLOGY": {"kind": "leaf_spine", "leaves": 2,
                                                  "spines": 1, "hosts_per_leaf": 2,
                                                  "bw_mbps": 20, "switch": "programmable"},
                                "TREE_NBYTES": 128 << 10, "HOSTS_PER_LEAF": 2,
                                "TENANT_NBYTES": 128 << 10, "TIME_DILATION": 1}, 2),
    "06_training_over_the_fabric": ({"N_HOSTS": 3, "HIDDEN": 32, "ITERATIONS": 6,
                                     "CONFIGS": ["ring", "ina"], "TRACE_ITERATIONS": 6,
                                     "TRACE_STARTS": [0.0, 0.3]}, 3),
    "07_tenant_provider_cooperation": ({"POLICIES": ["tenant_only", "cooperative"],
                                        "ITERATIONS": 4, "REPEATS": 1,
                                        "RUN_NO_HELP": False}, 1),
    "08_your_own_pytorch_script": ({"HOSTS": 2, "STEPS": 4, "ALGOS": [None, "ina"],
                                    "AUTO_STEPS": 20}, 3),
}


def _books() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_every_notebook_is_covered_and_stripped():
    names = [p.stem for p in _books()]
    assert names == sorted(CASES), "notebooks and CASES disagree"
    for path in _books():
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
        assert sum(c.cell_type == "markdown" for c in nb.cells) >= 3, f"{path.name}: prose"
        for c in nb.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None, \
                    f"{path.name}: commit notebooks without outputs (strip them)"


def _inject(nb, params: dict) -> None:
    """Papermill-style: a cell right after the parameters cell overrides them. A first cell
    selects the inline backend, as a user's ``%matplotlib inline`` does: the figures must
    survive it (the testbed's plots never switch the backend)."""
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    src = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(src)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(idx + 1, cell)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%matplotlib inline"))


@pytest.mark.mininet
@pytest.mark.parametrize("name", sorted(CASES))
def test_notebook_executes_and_plots(name, tmp_path):
    from nbclient import NotebookClient

    path = NOTEBOOKS / f"{name}.ipynb"
    if not path.exists():
        pytest.fail(f"{path} is missing")
    params, min_png = CASES[name]
    nb = nbformat.read(path, as_version=4)
    _inject(nb, {**params, "RESULTS_DIR": str(tmp_path / "results")})
    client = NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    pngs = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if "image/png" in o.get("data", {}))
    assert pngs >= min_png, f"{name}: {pngs} figures shown, expected >= {min_png}"
    saved = list((tmp_path / "results").glob("*/*.png"))
    assert saved, f"{name}: no plot written to the results folder"
