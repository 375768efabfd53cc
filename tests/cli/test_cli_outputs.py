"""Where the command line puts what it measured: ``testbed bench ... --out DIR`` keeps rows,
metadata and a plot like an experiment; ``testbed run`` writes under the results root from any
working directory and says how many runs failed (exit 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from testbed.experiment.results import RESULTS_ENV, Results

TB = [sys.executable, "-m", "testbed.cli"]


def test_bench_out_stores_rows_metadata_and_plot(tmp_path):
    # one row group keeps it short: what is checked here is the storing, not the kernels
    r = subprocess.run([*TB, "bench", "kernels", "--elements", "4096", "--only", "elementwise",
                        "--json", "--out", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    *printed, summary = [json.loads(line) for line in r.stdout.splitlines()]
    assert summary["summary"] and summary["status"] == 0 and summary["rows"] == len(printed)
    assert all(p["bench"] == "kernels" for p in printed)
    (folder,) = (tmp_path / "b").glob("bench-kernels-*")
    assert f"results: {folder}" in r.stderr
    res = Results.load(folder)
    assert len(res.df) == len(printed) > 10
    assert {p["kernel"].split(".")[0] for p in printed} == {"fixedpoint", "atp"}
    assert list(res.df["kernel"]) == [p["kernel"] for p in printed]
    assert len(pd.read_csv(folder / "results.csv")) == len(printed)
    meta = res.metadata
    assert meta["bench"] == "kernels" and meta["status"] == "completed"
    assert meta["notes"]["elements"] == 4096 and meta["notes"]["only"] == ["elementwise"]
    assert meta["notes"]["options"] == {"elements": 4096, "only": "elementwise"}
    assert meta["machine"]["cpu_model"] and meta["git"]["commit"]
    assert any(e.startswith("numba==") for e in meta["environment"])
    assert meta["plots"] == ["bench_kernels.png"]
    assert (folder / "bench_kernels.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.mininet
def test_run_writes_under_results_root_and_counts_failures(tmp_path):
    exp = tmp_path / "e.toml"
    # the second job times out for real: 45 % of the aggregator's answers are dropped at
    # the worker and it waits 2 ms for one, while a retransmission takes 10 ms
    exp.write_text('name = "counted"\n[topology]\nn_hosts = 2\nswitch = "programmable"\n'
                   '[[jobs]]\nalgo = "ring"\nnbytes = "16KiB"\n'
                   '[[jobs]]\nalgo = "ina"\nnbytes = "16KiB"\ntimeout_s = 0.002\n'
                   'options = {loss = 0.45}\n')
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {**os.environ, RESULTS_ENV: str(tmp_path / "root")}
    r = subprocess.run([*TB, "run", str(exp)], capture_output=True, text=True, timeout=300,
                       cwd=elsewhere, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 of 2 runs failed" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    (folder,) = (tmp_path / "root").glob("counted-*")
    assert not list(elsewhere.iterdir()), "nothing is written to the working directory"
    res = Results.load(folder)
    assert list(res.df["status"]) == ["ok", "error"]
    assert res.metadata["status"] == "completed_with_errors"
    assert (folder / "time_by_label.png").exists()
