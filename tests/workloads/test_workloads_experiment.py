"""Training jobs in experiment files: validation, the runner's rows and iterations file,
``testbed run --json`` and the example experiments (shrunk)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from testbed.collectives.testing import leftovers

pytestmark = pytest.mark.mininet


def test_experiment_file_with_training_prints_json_rows(tmp_path):
    from testbed.experiment.cli import run_file
    from testbed.experiment.train import load_iterations

    path = tmp_path / "t.toml"
    path.write_text("""
name = "t"
[topology]
kind = "star"
n_hosts = 3
switch = "programmable"
[[training]]
algo = "ina"
iterations = 8
eval_every = 4
target_accuracy = 0.3
[[training]]
name = "bad"
hosts = [0, 1]
batch_size = 100000
""")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_file(str(path), tmp_path / "res", progress=False, json_out=True)
    assert code == 2  # the batch larger than a shard is refused before anything runs
    path.write_text(path.read_text().replace("batch_size = 100000", "start_s = 0.2\n"
                                             "iterations = 6"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_file(str(path), tmp_path / "res", progress=False, json_out=True)
    assert code == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["label"] for r in rows] == ["ina", "bad"]
    assert all(r["op"] == "train" and r["status"] == "ok" and r["correct"] for r in rows)
    assert rows[0]["tta_s"] is not None and rows[0]["iterations"] == 8
    folder = next((tmp_path / "res").iterdir())
    iters = load_iterations(folder)
    assert sorted(iters.groupby("run").size().tolist()) == [6, 8]
    assert (folder / "accuracy_vs_time.png").exists()
    assert not leftovers()
