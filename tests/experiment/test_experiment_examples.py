"""The example experiment files in experiments/ run end to end at small sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.experiment import load_experiment, run
from testbed.experiment.checks import assert_all_ok
from testbed.experiment.spec import (
    Experiment,
    experiment_kind,
    parse_experiment,
    read_experiment_file,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "experiments"
SMALL = 32 << 10


def shrink(exp: Experiment) -> Experiment:
    """The same experiment with tiny messages, one repetition and at most 3 hosts."""
    data = exp.model_dump()
    for job in data["jobs"]:
        job["nbytes"] = SMALL
        job["repetitions"] = 1
    for job in data["training"]:  # a few iterations of a small model, starts 0.2 s apart
        job.update(iterations=4, eval_every=2, hidden=min(job["hidden"], 32),
                   start_s=min(job["start_s"], 0.2 * job["start_s"]))
    for path, values in list(data["sweep"].items()):
        if path.endswith("nbytes"):
            data["sweep"][path] = [SMALL]
        elif path.endswith("n_hosts"):
            data["sweep"][path] = [v for v in values if v <= 3] or [2]
        else:  # two sweep points say as much as more here
            data["sweep"][path] = values[:2]
    topo = data["topology"]
    for key in ("n_hosts", "n_senders"):
        if topo.get(key) and not data["training"]:  # training jobs name their hosts
            topo[key] = min(topo[key], 3)
    if topo.get("kind") == "fat_tree" and not data["training"]:
        topo["k"] = 2  # 5 switches and 2 hosts: the same tiers, a fifth of the start-up
    data["settle_s"] = min(data["settle_s"], 0.5)
    return parse_experiment(data, "shrunk example")


@pytest.mark.mininet
@pytest.mark.parametrize("path", [  # co-operation traces: run by test_provider_cooperation
    p for p in sorted(EXAMPLES.glob("*.toml")) + sorted(EXAMPLES.glob("*.yaml"))
    if experiment_kind(read_experiment_file(p)) != "cooperation"], ids=lambda p: p.stem)
def test_example_runs_small(path, tmp_path):
    exp = shrink(load_experiment(path))
    res = run(exp, out_dir=tmp_path / "res", progress=False, doctor=False)
    assert_all_ok(res)
    points = len(exp.points())
    runs = (sum(len(j.sizes()) for j in exp.jobs) + len(exp.training)) * points
    assert len(res.df) == runs
    for col in exp.sweep:
        assert col in res.df.columns
    if exp.trimming:
        assert res.df.filter(like="dp_trim_").notna().any().any(), "trim stage counters missing"
    for k in range(len(exp.cross_traffic)):
        # the iperf3 flow ran through every run and loaded its source's link
        assert res.df[f"xt{k}_running"].all()
        assert (res.df[f"xt{k}_mbps"] > 0.2 * exp.topology.bw_mbps).all(), res.df[f"xt{k}_mbps"]
    if exp.codec is not None:
        nic = res.df[res.df["algo"] == "nic"]
        assert (nic["dp_nic_codec_encoded"] > 0).all() and (nic["dp_nic_codec_decoded"] > 0).all()
    if exp.impairments:
        assert res.df.filter(like="dp_impair_seen").sum().sum() > 0, "impair stage saw nothing"
    if exp.capture is not None:
        for iface in exp.capture.interfaces:
            tag = iface.replace("-", "_")
            assert (res.df[f"cap_{tag}_testbed"] > 0).all(), f"no testbed packet on {iface}"
            assert len(list((res.path / "pcap").glob(f"run*-{iface}.pcap"))) == len(res.df)
