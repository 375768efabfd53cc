"""Plots keep the user's matplotlib backend (figures show in notebooks), the command line writes
PNGs headless, and results land under one root whatever the working directory, with the whole
environment recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd

from testbed.experiment.results import (
    RESULTS_ENV,
    Results,
    ResultsStore,
    environment_freeze,
    results_root,
)

REPO = Path(__file__).resolve().parents[2]


def _frame() -> pd.DataFrame:
    """A small results table shaped like the runner's (two labels, two sizes, two reps)."""
    rows = []
    for label, speed in (("ring", 1.0), ("ina", 2.0)):
        for nbytes in (1 << 16, 1 << 20):
            for rep in range(2):
                t = nbytes / 1e7 / speed * (1 + 0.05 * rep)
                rows.append({"run": len(rows), "label": label, "status": "ok", "n": 4,
                             "bytes": nbytes, "time_s": t, "model_s": nbytes / 1.1e7 / speed,
                             "busbw": nbytes * 8 / t / 1e9 * 1.5, "rep": rep})
    return pd.DataFrame(rows)


NOTEBOOK_CELLS = [
    "%matplotlib inline\nimport matplotlib\nBACKEND = matplotlib.get_backend()\n"
    "import pandas as pd\nimport matplotlib.pyplot as plt\n"
    "from testbed.experiment.plots import plot_bars, plot_metric, plot_overview\n"
    "from testbed.experiment.results import Results\n"
    "df = pd.read_json({path!r}, lines=True)",
    "plot_bars(df, y='time_s', title='bars');",
    "fig, axes = plt.subplots(1, 2, figsize=(10, 4))\n"
    "plot_metric(df, x='bytes', y='time_s', ax=axes[0])\n"
    "axes[1].plot([1, 2, 3]);",
    "plot_overview(df, x='bytes');",
    "Results(df).plot(x='bytes', y='busbw');",
    "import matplotlib\nassert matplotlib.get_backend() == BACKEND, (BACKEND, "
    "matplotlib.get_backend())\nprint('backend', BACKEND)",
]


def test_notebook_with_inline_backend_shows_every_figure(tmp_path):
    """Each plotting cell of a notebook run with ``%matplotlib inline`` has its figure in its
    outputs: the plotting functions neither switch the backend nor close the user's figures."""
    from nbclient import NotebookClient

    data = tmp_path / "rows.jsonl"
    _frame().to_json(data, orient="records", lines=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.replace("{path!r}", repr(str(data))))
                for c in NOTEBOOK_CELLS]
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    pngs = [sum("image/png" in o.get("data", {}) for o in c.outputs) for c in nb.cells]
    assert pngs[1:5] == [1, 1, 1, 1], f"figures per plotting cell: {pngs[1:5]}"
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "backend inline" in text, text


def test_library_keeps_a_script_backend_and_still_writes_png(tmp_path):
    """Outside IPython too, a plot call leaves the backend the script chose."""
    code = ("import matplotlib; matplotlib.use('svg')\n"
            "import pandas as pd\n"
            "from testbed.experiment.plots import plot_bars\n"
            f"df = pd.read_json({str(tmp_path / 'rows.jsonl')!r}, lines=True)\n"
            f"plot_bars(df, out={str(tmp_path / 'b.png')!r})\n"
            "print(matplotlib.get_backend())\n")
    _frame().to_json(tmp_path / "rows.jsonl", orient="records", lines=True)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "svg"
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_plots_are_headless(tmp_path):
    """``write_plots`` (what ``testbed run`` calls) selects Agg and writes every PNG without a
    display, closing its figures."""
    store = ResultsStore(tmp_path / "r", {"name": "t"})
    for row in _frame().to_dict("records"):
        store.append(row)
    code = ("import matplotlib.pyplot as plt\n"
            "from testbed.experiment.cli import write_plots\n"
            "from testbed.experiment.results import Results\n"
            f"paths = write_plots(Results.load({str(tmp_path / 'r')!r}))\n"
            "import matplotlib\n"
            "print(matplotlib.get_backend(), len(plt.get_fignums()), "
            "' '.join(p.name for p in paths))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    backend, open_figs, *names = r.stdout.split()
    assert backend.lower() == "agg" and open_figs == "0"
    assert names == ["overview_vs_bytes.png", "time_by_label.png"]
    for n in names:
        assert (tmp_path / "r" / n).read_bytes()[:4] == b"\x89PNG"


def test_ratio_plot_leaves_out_rows_without_a_ratio(tmp_path):
    from testbed.experiment.plots import plot_ratios

    df = pd.DataFrame({"case": ["a", "b", "note"], "ratio": [0.5, 4.0, None]})
    fig = plot_ratios(df, label="case", out=tmp_path / "r.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert ax.get_xscale() == "log"
    # bars start at the anchor (1) and end at the ratio
    assert sorted(round(p.get_x() + p.get_width(), 6) for p in ax.patches) == [0.5, 4.0]


def test_results_root_env_and_checkout_default(monkeypatch, tmp_path):
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    assert results_root() == REPO / "results"  # the source checkout this suite runs from
    monkeypatch.chdir(tmp_path)  # the working directory does not matter
    assert results_root() == REPO / "results"
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert results_root() == tmp_path / "elsewhere"
    monkeypatch.setenv(RESULTS_ENV, "~/tb-res")
    assert results_root() == Path.home() / "tb-res"


def test_results_root_of_an_installed_copy_is_in_home(tmp_path):
    """A copy of the package outside a checkout (as a wheel installs it) uses ~/testbed-results."""
    import shutil

    shutil.copytree(REPO / "testbed", tmp_path / "site" / "testbed",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != RESULTS_ENV}
    env["PYTHONPATH"] = str(tmp_path / "site")
    env["HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-c", "import testbed.experiment.results as r; "
                        "print(r.__file__); print(r.results_root())"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    where, root = r.stdout.split()
    assert where.startswith(str(tmp_path / "site"))
    assert root == str(tmp_path / "home" / "testbed-results")


def test_every_results_folder_records_the_environment(tmp_path):
    store = ResultsStore(tmp_path / "r", {"name": "t"})
    store.append({"run": 0, "status": "ok"})
    meta = json.loads((tmp_path / "r" / "metadata.json").read_text())
    env = meta["environment"]
    assert env == environment_freeze() and env == sorted(env, key=str.lower)
    import numpy

    assert f"numpy=={numpy.__version__}" in env
    ours = [e for e in env if e.startswith("collective-offload-testbed==")]
    assert ours and f"(editable: {REPO}" in ours[0]
    r = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                       capture_output=True, text=True, timeout=120)
    frozen = {line.split("==")[0].lower() for line in r.stdout.splitlines() if "==" in line}
    assert frozen <= {e.split("==")[0].lower() for e in env}, "pip freeze lists more"
    assert Results.load(tmp_path / "r").metadata["environment"] == env


def test_progress_lines_say_the_time_left(capsys):
    """Outside a terminal (logs, notebooks) each finished run prints a line with the runs
    done, the time spent and the time left at the mean pace so far."""
    from testbed.experiment.runner import _duration, progress_reporter

    with progress_reporter(True, 4, "sweep") as advance:
        for _ in range(2):
            time.sleep(0.05)
            advance("ok")
    first, second = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\[sweep 1/4 +0\.\d s, ~0 s left\] ok", first), first
    assert second.startswith("[sweep 2/4 ") and second.endswith(" left] ok")
    assert (_duration(42), _duration(600), _duration(7200)) == ("42 s", "10 min", "2.0 h")


def test_parquet_holds_nested_and_mixed_columns_and_a_failure_leaves_no_temporary(tmp_path):
    """An empty dict (a struct arrow cannot write), nested values and a column mixing types
    reach results.parquet as JSON text; a value arrow cannot write at all leaves rows.jsonl
    and results.csv whole, the error in the metadata, and no half-written file."""
    store = ResultsStore(tmp_path / "r", {"name": "t"})
    store.append({"run": 0, "status": "ok", "params": {}, "trees": [["a", "b"]], "x": 1.5})
    store.append({"run": 1, "status": "ok", "params": {"k": 2}, "trees": None, "x": "auto"})
    pq = pd.read_parquet(tmp_path / "r" / "results.parquet")
    assert [json.loads(v) for v in pq["params"]] == [{}, {"k": 2}]
    assert json.loads(pq["trees"][0]) == [["a", "b"]] and pd.isna(pq["trees"][1])
    assert [json.loads(v) for v in pq["x"]] == [1.5, "auto"]
    assert "parquet_error" not in store.metadata

    bad = ResultsStore(tmp_path / "bad", {"name": "t"})
    bad.append({"run": 0, "status": "ok", "thing": object()})
    assert sorted(p.name for p in (tmp_path / "bad").iterdir()) == [
        "metadata.json", "results.csv", "rows.jsonl"]
    assert "parquet_error" in bad.metadata
