"""The runner on real emulated networks: sweeps, tidy results on disk, failures, Ctrl-C, plots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from testbed.experiment import Results, run
from testbed.experiment.checks import assert_all_ok
from testbed.experiment.runner import RunAborted

pytestmark = pytest.mark.mininet

SMALL = "16KiB"


@pytest.fixture(scope="module")
def sweep_results(tmp_path_factory):
    """One small sweep (2 networks x 2 sizes x 2 algorithms) shared by several tests."""
    out = tmp_path_factory.mktemp("sweep") / "res"
    exp = {"name": "sweep", "seed": 7,
           "topology": {"kind": "star", "n_hosts": 2, "bw_mbps": 100, "switch": "bridge"},
           "jobs": [{"algo": "ring", "nbytes": [SMALL, "64KiB"]},
                    {"algo": "hd", "nbytes": [SMALL, "64KiB"]}],
           "sweep": {"topology.n_hosts": [2, 3]}}
    return run(exp, out_dir=out, progress=False, doctor=True)


def test_sweep_gives_one_tidy_row_per_run(sweep_results):
    res = sweep_results
    df = res.df
    assert len(df) == 8 and list(df["run"]) == list(range(8))
    assert_all_ok(res)
    # sweep parameter as a column, in the network it describes
    assert list(df["topology.n_hosts"]) == [2] * 4 + [3] * 4
    assert (df["n"] == df["topology.n_hosts"]).all()
    assert sorted(set(df["bytes"])) == [16384, 65536]
    assert set(df["label"]) == {"ring", "hd"}
    for col in ("time_s", "busbw", "model_s", "fidelity", "max_abs_err", "correct"):
        assert df[col].notna().all(), col
    # busbw follows nccl-tests from the measured time (Gb/s)
    factor = 2 * (df["n"] - 1) / df["n"]
    np.testing.assert_allclose(df["busbw"], df["bytes"] * 8 / df["time_s"] / 1e9 * factor,
                               rtol=1e-6)


def test_results_folder_has_csv_parquet_metadata(sweep_results):
    path = sweep_results.path
    csv = pd.read_csv(path / "results.csv")
    pq = pd.read_parquet(path / "results.parquet")
    assert len(csv) == len(pq) == 8
    assert list(csv["time_s"]) == pytest.approx(list(sweep_results.df["time_s"]))
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["status"] == "completed" and meta["failures"] == []
    assert meta["seed"] == 7 and meta["planned_runs"] == 8
    assert meta["git"]["commit"] and len(meta["git"]["commit"]) == 40
    assert meta["packages"]["numpy"] == np.__version__
    assert meta["machine"]["cpus"] == os.cpu_count()
    assert meta["doctor"] and "unavailable" not in meta["doctor"], meta["doctor"]
    # two networks (n = 2 and n = 3), each described by the topology layer
    assert [len(n["describe"]["hosts"]) for n in meta["networks"]] == [2, 3]
    assert Results.load(path).df.equals(sweep_results.df)


def test_plots_are_written(sweep_results, tmp_path):
    res = sweep_results
    fig = res.plot(x="bytes", y="time_s", out=tmp_path / "t.png")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "ring measured" in labels and "ring model" in labels
    from testbed.experiment.plots import plot_bars, plot_overview

    plot_overview(res.ok, x="n", out=tmp_path / "n.png")
    plot_bars(res.ok, out=tmp_path / "b.png")
    for name in ("t.png", "n.png", "b.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="x='nope' is not a results column"):
        res.plot(x="nope")


def test_each_run_draws_its_fabric_from_its_counters(sweep_results):
    """``fabric/runNNNN.png`` beside ``counters/runNNNN.json``; the bytes drawn on each access
    link are what its switch port counted: at least the allreduce's payload each way."""
    from testbed.experiment.plots import link_traffic

    path = sweep_results.path
    pictures = sorted((path / "fabric").glob("run*.png"))
    assert [p.stem for p in pictures] == [f"run{k:04d}" for k in range(8)]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pictures)
    meta = json.loads((path / "metadata.json").read_text())
    df = sweep_results.df
    for k in (0, 7):  # ring 16 KiB on 2 hosts, hd 64 KiB on 3
        delta = json.loads((path / "counters" / f"run{k:04d}.json").read_text())
        n = int(df.loc[k, "n"])
        describe = next(x["describe"] for x in meta["networks"] if len(x["describe"]["hosts"]) == n)
        access = [t for t in link_traffic(describe, delta) if t["role"] == "access"]
        assert len(access) == n
        payload = df.loc[k, "bytes"] * (n - 1) / n  # what any rank sends at least
        assert all(t["bytes_ab"] >= payload and t["bytes_ba"] >= payload for t in access), \
            (k, access)


def _failing_experiment(stop_on_error: bool) -> dict:
    # The second job drops 45 % of the aggregator's answers (client side) and waits only
    # 2 ms for one, while a retransmission comes after 10 ms: a real time-out inside the
    # collectives layer, after the first run finished (validation cannot foresee it).
    return {"name": "failing", "stop_on_error": stop_on_error,
            "topology": {"kind": "star", "n_hosts": 2, "switch": "programmable"},
            "jobs": [{"algo": "ring", "nbytes": SMALL},
                     {"algo": "ina", "nbytes": SMALL, "timeout_s": 0.002,
                      "options": {"loss": 0.45}},
                     {"algo": "hd", "nbytes": SMALL}]}


def test_failed_run_is_recorded_and_others_kept(tmp_path):
    res = run(_failing_experiment(False), out_dir=tmp_path / "r", progress=False, doctor=False)
    assert list(res.df["status"]) == ["ok", "error", "ok"]
    assert "CollectiveTimeout" in res.df["error"][1]
    assert res.metadata["status"] == "completed_with_errors"
    assert [f["run"] for f in res.failures] == [1]
    assert len(pd.read_csv(tmp_path / "r" / "results.csv")) == 3


def test_stop_on_error_keeps_finished_rows_on_disk(tmp_path):
    with pytest.raises(RunAborted, match="run 1 failed"):
        run(_failing_experiment(True), out_dir=tmp_path / "r", progress=False, doctor=False)
    on_disk = Results.load(tmp_path / "r")
    assert list(on_disk.df["status"]) == ["ok", "error"]
    assert bool(on_disk.df["correct"][0])
    assert on_disk.metadata["status"] == "failed"
    assert on_disk.failures[0]["run"] == 1


def test_ctrl_c_tears_down_and_keeps_rows(tmp_path):
    exp = tmp_path / "long.yaml"
    exp.write_text("name: long\ntopology: {kind: star, n_hosts: 2, switch: bridge}\n"
                   "jobs:\n  - {algo: ring, nbytes: 16KiB, repetitions: 1}\n"
                   "sweep:\n  seed: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]\n")
    out = tmp_path / "res"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", str(exp), "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        rows = []
        while time.monotonic() < deadline and proc.poll() is None:
            rows = list(out.glob("*/rows.jsonl"))
            if rows and len(rows[0].read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert rows, "no row was written in time"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    res = Results.load(rows[0].parent)
    assert res.metadata["status"] == "interrupted"
    assert 2 <= len(res.df) < 16
    assert (res.df["status"] == "ok").all() and res.df["correct"].all()
    from testbed.cleanup import leftovers
    from testbed.netlock import emulation_lock

    with emulation_lock(timeout=300):  # nobody else's network may be up while we look
        left = leftovers()
    assert not any(left.values()), left


def test_incast_trimming_with_pcap_capture(tmp_path):
    exp = {"name": "cap", "seed": 3,
           "topology": {"kind": "incast", "n_senders": 2, "bw_mbps": 100,
                        "switch": "programmable"},
           "trimming": [{"node": "tbs1", "mode": "trim", "rate_mbps": 30,
                         "threshold_bytes": 5000}],
           "capture": {"interfaces": ["tbh1-eth0"]},
           "jobs": [{"op": "incast", "nbytes": "64KiB", "options": {"bits": 4}}]}
    res = run(exp, out_dir=tmp_path / "r", progress=False, doctor=False)
    assert_all_ok(res)
    row = res.df.iloc[0]
    chunks = 2 * (16384 // 256)
    trimmed = round(row["trimmed_frac"] * chunks)
    # (the switch may trim more than the receiver used: a chunk NACKed after a slow idle
    # period under CPU load is sent again and may be trimmed again)
    assert trimmed > 0 and row["dp_trim_trimmed"] >= trimmed
    # one report row like a collective's: the model's rate is the trim stage's drain rate
    assert row["bw_mbps"] == 30 and row["busbw"] == pytest.approx(2 * row["algbw"])
    assert row["fidelity"] == pytest.approx(row["time_s"] / row["model_s"])
    assert row["cpu_max"] > 0 and row["cpu_bound"] in (True, False)
    assert 0 < row["rel_err"] < 1  # trimmed heads: close to, not equal to, the exact sum
    # the receiver's interface saw every chunk; scapy finds the trimmed ones by their flag,
    # exactly as many as the switch's trim stage counted
    assert row["cap_tbh1_eth0_testbed"] >= chunks
    assert row["cap_tbh1_eth0_trimmed"] == row["dp_trim_trimmed"]
    summary = json.loads((tmp_path / "r" / "pcap" / "run0000-tbh1-eth0.json").read_text())
    assert summary["by_type"]["DATA"] >= chunks and summary["dissector"]
