"""`testbed demo` (the embedded default experiment) and `testbed run FILE` end to end."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.mininet


def test_demo_runs_and_reports(tmp_path):
    code = ("from testbed.experiment.demo import main; "
            f"raise SystemExit(main(nbytes=256_000, out={str(tmp_path)!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=280, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out
    for word in ("ring", "ina", "model s", "meas/model", "ring/INA time"):
        assert word in out, word
    (folder,) = tmp_path.glob("demo-*")
    assert (folder / "demo.png").read_bytes()[:4] == b"\x89PNG"
    df = pd.read_csv(folder / "results.csv")
    assert len(df) == 3 and df["correct"].all() and (df["bytes"] == 256_000).all()
    assert df["model_s"].gt(0).all()


def test_cli_run_writes_results_and_plots(tmp_path):
    exp = tmp_path / "e.toml"
    exp.write_text('name = "cli"\n[topology]\nn_hosts = 2\nswitch = "bridge"\n'
                   '[[jobs]]\nalgo = "ring"\nnbytes = ["16KiB", "32KiB"]\n')
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(exp), "--out",
                        str(tmp_path / "res")], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    (folder,) = (tmp_path / "res").glob("cli-*")
    assert f"results: {folder}" in r.stdout
    for name in ("results.csv", "results.parquet", "metadata.json", "rows.jsonl",
                 "overview_vs_bytes.png", "time_by_label.png"):
        assert (folder / name).exists(), name
