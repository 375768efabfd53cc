"""Experiment schema: loading TOML/YAML, readable errors naming the bad field, sweep expansion."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.experiment.cooperation import CooperationExperiment
from testbed.experiment.runner import load_any
from testbed.experiment.spec import (
    Experiment,
    ExperimentError,
    expand_sweep,
    load_experiment,
    load_point,
    parse_experiment,
    with_overrides,
)
from testbed.topologies import netem_available

REPO = Path(__file__).resolve().parents[2]


def _problems(data: dict) -> list[str]:
    with pytest.raises(ExperimentError) as ei:
        parse_experiment(data)
    return ei.value.problems


def test_bad_literal_names_field_and_allowed_values():
    probs = _problems({"jobs": [{"algo": "rnig"}]})
    assert len(probs) == 1
    assert probs[0].startswith("jobs.0.algo:")
    for allowed in ("'ring'", "'hd'", "'rs'", "'ina'", "'nic'"):
        assert allowed in probs[0]
    assert "'rnig'" in probs[0]


def test_unknown_field_lists_allowed_fields():
    probs = _problems({"topology": {"kind": "star", "n_host": 4}, "jobs": [{}]})
    assert probs[0].startswith("topology.n_host: unknown field")
    assert "n_hosts" in probs[0] and "bw_mbps" in probs[0]


def test_field_of_other_kind_rejected():
    probs = _problems({"topology": {"kind": "fat_tree", "n_hosts": 4}, "jobs": [{}]})
    assert "n_hosts" in probs[0] and "fat_tree takes k" in probs[0]


def test_several_problems_reported_together():
    probs = _problems({"topology": {"bw_mbps": -5}, "jobs": [{"nbytes": "8XB", "op": "sum"}],
                       "impairments": [{"node": "s1"}]})
    paths = [p.split(":")[0] for p in probs]
    assert paths == ["topology.bw_mbps", "jobs.0.op", "jobs.0.nbytes", "impairments.0.node"]


def test_missing_jobs():
    assert _problems({"name": "x"}) == [
        "(top level): give at least one job ([[jobs]]), training job ([[training]]), "
        "launched script ([[launch]]) or trace ([[replay]])"]


def test_sizes_with_units():
    exp = parse_experiment({"jobs": [{"nbytes": ["64KiB", "1MB", 4096]}]})
    assert exp.jobs[0].sizes() == [65536, 1_000_000, 4096]


def test_sweep_expansion_is_cartesian_and_validated():
    exp = parse_experiment({
        "topology": {"n_hosts": 4},
        "jobs": [{"algo": "ring", "nbytes": 1024}, {"algo": "ina", "nbytes": 1024}],
        "sweep": {"jobs.0.nbytes": [1024, 4096, 16384], "topology.n_hosts": [2, 3]},
    })
    points = expand_sweep(exp)
    assert len(points) == 6
    seen = {(p["jobs.0.nbytes"], p["topology.n_hosts"]) for p, _ in points}
    assert seen == {(b, n) for b in (1024, 4096, 16384) for n in (2, 3)}
    for params, point in points:
        assert point.sweep == {}
        assert point.jobs[0].sizes() == [params["jobs.0.nbytes"]]
        assert point.topology.n_hosts == params["topology.n_hosts"]
        assert point.jobs[1].sizes() == [1024]  # untouched


def test_sweep_bad_path_and_bad_value():
    probs = _problems({"jobs": [{}], "sweep": {"topology.nhosts": [2]}})
    assert probs[0].startswith("sweep:") and "'nhosts'" in probs[0] and "n_hosts" in probs[0]
    probs = _problems({"jobs": [{}], "sweep": {"jobs.3.algo": ["ring"]}})
    assert "index below 1" in probs[0]
    with pytest.raises(ExperimentError) as ei:
        parse_experiment({"jobs": [{}], "sweep": {"jobs.0.algo": ["ring", "hdd"]}})
    assert "jobs.0.algo='hdd'" in str(ei.value) and "'hd'" in ei.value.problems[0]


def test_overrides():
    exp = parse_experiment({"jobs": [{"nbytes": "8MiB"}]})
    small = with_overrides(exp, {"jobs.0.nbytes": 4096, "topology.n_hosts": 2})
    assert small.jobs[0].sizes() == [4096] and small.topology.n_hosts == 2
    assert exp.jobs[0].sizes() == [8 << 20]
    with pytest.raises(ExperimentError, match="unknown field 'nbyte'"):
        with_overrides(exp, {"jobs.0.nbyte": 1})


def test_toml_and_yaml_files_load_the_same(tmp_path):
    toml = tmp_path / "e.toml"
    toml.write_text('name = "t"\n[topology]\nn_hosts = 3\n[[jobs]]\nalgo = "hd"\n'
                    'nbytes = "4KiB"\n[sweep]\n"jobs.0.algo" = ["hd", "ring"]\n')
    yaml = tmp_path / "e.yaml"
    yaml.write_text("name: t\ntopology: {n_hosts: 3}\njobs:\n  - {algo: hd, nbytes: 4KiB}\n"
                    "sweep:\n  jobs.0.algo: [hd, ring]\n")
    assert load_experiment(toml) == load_experiment(yaml)


def test_file_errors(tmp_path):
    with pytest.raises(ExperimentError, match="file not found"):
        load_experiment(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ExperimentError, match="not valid TOML"):
        load_experiment(bad)
    txt = tmp_path / "e.json"
    txt.write_text("{}")
    with pytest.raises(ExperimentError, match="unknown file type"):
        load_experiment(txt)


def test_example_files_are_valid():
    files = sorted((REPO / "experiments").glob("*.toml")) + sorted(
        (REPO / "experiments").glob("*.yaml"))
    assert files, "experiments/ has no example files"
    for f in files:
        exp = load_any(f)
        if isinstance(exp, CooperationExperiment):  # a trace run once per policy
            assert exp.kind == "cooperation" and exp.jobs
            with pytest.raises(ExperimentError, match="a 'cooperation' experiment has a schema"):
                load_experiment(f)
            continue
        assert isinstance(exp, Experiment)
        assert expand_sweep(exp)


def test_cli_reports_bad_file_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntopology: {kind: ring}\njobs:\n  - {algo: ina, repetitions: 0}\n")
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(bad), "--out",
                        str(tmp_path / "res")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "topology.kind" in r.stderr and "'leaf_spine'" in r.stderr
    assert "jobs.0.repetitions" in r.stderr and "greater than or equal to 1" in r.stderr
    assert not (tmp_path / "res").exists()


def test_job_options_are_checked_against_the_layers():
    probs = _problems({"jobs": [{"options": {"windw": 3}}]})
    assert probs[0].startswith("jobs.0: options ['windw']") and "window" in probs[0]
    probs = _problems({"jobs": [{"op": "incast", "options": {"bits": 3}}]})
    assert "options.bits=3" in probs[0] and "1, 2, 4 or 8" in probs[0]
    probs = _problems({"jobs": [{"compressor": "zip"}]})
    assert probs[0].startswith("jobs.0.compressor: unknown compressor 'zip'; allowed:")
    assert "qsgd" in probs[0]


def test_a_job_on_some_hosts_is_checked_with_its_own_worker_count():
    """hd's allgather needs a power of two workers: a job on 6 of a fat-tree's 16 hosts is
    refused before anything runs (it was checked as 16 workers and failed at its run)."""
    topo = {"kind": "fat_tree", "k": 4, "switch": "programmable"}
    probs = _problems({"topology": topo, "jobs": [
        {"algo": "hd", "op": "allgather", "nbytes": 4, "hosts": [1, 2, 3, 6, 9, 10]}]})
    assert probs == ["jobs.0.algo: algo='hd' for op='allgather' needs a power of two "
                     "workers, got 6; use algo='ring'"]
    parse_experiment({"topology": topo, "jobs": [
        {"algo": "hd", "op": "allgather", "nbytes": 4, "hosts": [1, 2, 3, 6]}]})


def test_datapath_options_order_stages_and_set_port_rates():
    from testbed.experiment.networks import datapath_options
    from testbed.topologies import TopologyError, make_topology
    from testbed.topologies.pipeline import compose

    exp = parse_experiment({
        "topology": {"kind": "incast", "n_senders": 2, "bw_mbps": 100},
        "impairments": [{"node": "tbs1", "loss_pct": 5, "ports": [1]},
                        {"node": "tbs1", "delay_ms": 2, "direction": "egress"}],
        "trimming": [{"node": "tbs1", "rate_mbps": 40, "threshold_bytes": 9000,
                      "ports": [0]}],
        "jobs": [{"op": "incast"}]})
    topo = make_topology("incast", n_senders=2, bw_mbps=100, switch="programmable")
    progs = compose(topo, datapath_options(exp))
    names = [n for n, _ in progs["tbs1"]]
    assert names == ["impair_ingress", "aggregate", "forward", "impair", "trim"]
    imp = progs["tbs1"][0][1]
    assert imp["loss"] == {"tbs1-eth2": 0.05} and imp["seed"] == exp.seed
    trim = progs["tbs1"][-1][1]
    assert trim["rate_mbps"] == {"tbs1-eth1": 40, "tbs1-eth2": 100.0, "tbs1-eth3": 100.0}
    assert trim["threshold_bytes"]["tbs1-eth1"] == 9000
    assert trim["threshold_bytes"]["tbs1-eth2"] > 1e9
    with pytest.raises(TopologyError, match="not a programmable node"):
        compose(make_topology("incast", n_senders=2, switch="bridge"), datapath_options(exp))


def test_datapath_options_codec_and_nic_jobs():
    from testbed.experiment.networks import datapath_options

    base = {"topology": {"smartnic": True}, "jobs": [{"algo": "ring"}]}
    assert datapath_options(parse_experiment(base)).nic_codec is None
    nic = datapath_options(parse_experiment({**base, "jobs": [{"algo": "nic"}]}))
    assert nic.nic_codec == {"codec": "fixed32"}
    fp16 = datapath_options(parse_experiment({**base, "codec": {"codec": "fp16"},
                                              "jobs": [{"algo": "nic"}]}))
    assert fp16.nic_codec == {"codec": "fp16"}
    with pytest.raises(ExperimentError, match="SmartNIC"):  # caught before anything runs
        parse_experiment({"jobs": [{"algo": "nic"}, {"algo": "ring"}]})


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 1 << 22).map(lambda e: 4 * e), min_size=1, max_size=4,
                      unique=True),
       ns=st.lists(st.integers(2, 32), min_size=1, max_size=3, unique=True),
       algos=st.lists(st.sampled_from(["ring", "hd", "rs", "ina", "nic"]), min_size=1,
                      max_size=3, unique=True))
def test_sweep_expansion_property(sizes, ns, algos):
    # every point runnable: whole float32 sizes, 2..32 hosts, SmartNICs with their codec
    exp = parse_experiment({"topology": {"smartnic": True}, "codec": {"codec": "fixed32"},
                            "jobs": [{}], "sweep": {"jobs.0.nbytes": sizes,
                                                    "topology.n_hosts": ns,
                                                    "jobs.0.algo": algos}})
    points = expand_sweep(exp)
    assert len(points) == len(sizes) * len(ns) * len(algos)
    combos = {(p["jobs.0.nbytes"], p["topology.n_hosts"], p["jobs.0.algo"]) for p, _ in points}
    assert combos == {(b, n, a) for b in sizes for n in ns for a in algos}
    for params, point in points:
        assert (point.jobs[0].sizes(), point.topology.n_hosts, point.jobs[0].algo) == (
            [params["jobs.0.nbytes"]], params["topology.n_hosts"], params["jobs.0.algo"])


# -- combinations that cannot run: found before anything is built, all at once ------------------

def test_ina_without_a_programmable_switch_names_the_job_field():
    probs = _problems({"topology": {"switch": "bridge", "n_hosts": 4},
                       "jobs": [{"algo": "ring"}, {"algo": "ina"}]})
    assert len(probs) == 1 and probs[0].startswith("jobs.1.algo: 'ina'")
    assert "topology.switch = 'programmable'" in probs[0]
    probs = _problems({"topology": {"aggregator": "none"}, "jobs": [{"algo": "nic"}]})
    assert any(p.startswith("jobs.0.algo:") and "aggregator is 'none'" in p for p in probs)


def test_odd_fat_tree_k_is_reported_with_the_other_problems():
    probs = _problems({"topology": {"kind": "fat_tree", "k": 3, "switch": "bridge"},
                       "jobs": [{"algo": "ina"}, {"algo": "rnig"}, {"nbytes": 6}]})
    paths = sorted(p.split(":")[0] for p in probs)
    assert paths == ["jobs.0.algo", "jobs.1.algo", "jobs.2.nbytes", "topology.k"], probs
    assert any("even" in p for p in probs if p.startswith("topology.k"))


def test_smartnic_options_need_smartnics():
    probs = _problems({"topology": {"n_hosts": 3, "smartnic": [0]}, "jobs": [{"algo": "nic"}]})
    assert any("tbh2, tbh3 have none" in p for p in probs)
    assert not any("codec" in p for p in probs)  # nic jobs get the fixed32 codec themselves
    probs = _problems({"topology": {"switch": "bridge"}, "codec": {"codec": "fp16"},
                       "jobs": [{}]})
    assert probs == [p for p in probs if p.startswith("codec:")] and len(probs) == 1
    assert parse_experiment({"topology": {"smartnic": True, "n_hosts": 2},
                             "codec": {"codec": "fixed32"}, "jobs": [{"algo": "nic"}]})


def test_sizes_hosts_nodes_ports_and_interfaces_must_exist():
    probs = _problems({
        "topology": {"n_hosts": 2},
        "jobs": [{"nbytes": ["4KiB", "10B"]}, {"options": {"workers": 5}},
                 {"op": "allgather", "algo": "hd", "options": {"workers": 2}},
                 {"algo": "rs", "servers": 3}],
        "impairments": [{"node": "tbs7"}],
        "trimming": [{"node": "tbs1", "ports": [1, 2, "tbs1-eth9"]}],
        "cross_traffic": [{"src": 0, "dst": 2}],
        "capture": {"interfaces": ["tbh1-eth0", "tbs1-eth3"]}})
    got = {p.split(":")[0]: p for p in probs}
    assert set(got) == {"jobs.0.nbytes", "jobs.1.options.workers", "jobs.3.servers",
                        "impairments.0.node", "trimming.0.ports", "cross_traffic.0.dst",
                        "capture.interfaces.1"}, probs
    assert "[2, 'tbs1-eth9']" in got["trimming.0.ports"]
    assert "0..1" in got["cross_traffic.0.dst"]
    probs = _problems({"topology": {"switch": "bridge"}, "jobs": [{}],
                       "impairments": [{"node": "tbs1", "loss_pct": 1}]})
    assert probs[0].startswith("impairments.0.node: 'tbs1' is not a programmable node")


@pytest.mark.skipif(netem_available(), reason="netem present: the topology's loss goes on the "
                    "links, not in the switches' stages")
def test_a_data_path_the_composer_refuses_is_refused_before_anything_runs():
    """The topology's loss runs in the switch's stages with every impairment of the same
    direction: one that filters other traffic cannot share them, at the sweep points where
    the topology is lossy; an impairment that can is combined, not refused."""
    lossy = {"topology": {"switch": "programmable", "loss_pct": 1.0}, "jobs": [{}],
             "impairments": [{"node": "tbs1", "direction": "egress", "filter": "testbed",
                              "dup_pct": 2.0}]}
    probs = _problems(lossy)
    assert len(probs) == 1 and probs[0].startswith("data path: impairments on 'tbs1' (egress)")
    assert "filter different traffic (['all', 'testbed'])" in probs[0]
    probs = _problems({**lossy, "sweep": {"topology.loss_pct": [0.0, 1.0]}})
    assert len(probs) == 1 and "(at sweep point topology.loss_pct=1.0)" in probs[0]
    mixed = {**lossy, "impairments": [{"node": "tbs1", "dup_pct": 2.0, "reorder_pct": 5.0}]}
    assert parse_experiment(mixed).impairments[0].dup_pct == 2.0


def test_problem_at_some_sweep_points_names_them():
    probs = _problems({"jobs": [{"algo": "ina"}],
                       "sweep": {"topology.switch": ["programmable", "bridge"],
                                 "topology.n_hosts": [2, 4]}})
    assert len(probs) == 1 and probs[0].startswith("jobs.0.algo:")
    assert "(at sweep point topology.switch='bridge', topology.n_hosts=2 and 1 more)" in probs[0]
    # a problem of every point is reported once, without a point
    probs = _problems({"topology": {"switch": "bridge"}, "jobs": [{"algo": "ina"}],
                       "sweep": {"topology.n_hosts": [2, 4]}})
    assert len(probs) == 1 and "sweep point" not in probs[0]


def test_experiment_objects_are_checked_too(tmp_path):
    exp = Experiment.model_validate({"topology": {"switch": "bridge"},
                                     "jobs": [{"algo": "ina"}]})
    with pytest.raises(ExperimentError, match="jobs.0.algo"):
        load_experiment(exp)
    exp = parse_experiment({"jobs": [{"algo": "ina"}]})
    with pytest.raises(ExperimentError, match="jobs.0.algo: 'ina'"):
        with_overrides(exp, {"topology.switch": "bridge"})


def test_cli_reports_every_combination_problem_and_builds_nothing(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[topology]\nkind = "fat_tree"\nk = 3\nswitch = "bridge"\n'
                   '[[jobs]]\nalgo = "ina"\n[[jobs]]\nalgo = "ring"\nnbytes = "6B"\n')
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(bad), "--out",
                        str(tmp_path / "res")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    for field in ("topology.k", "jobs.0.algo", "jobs.1.nbytes"):
        assert field in r.stderr, field
    assert "3 problems; nothing was run" in r.stderr
    assert not (tmp_path / "res").exists()


def test_launch_jobs_are_checked_against_the_topology():
    """``[[launch]]``: the script must exist, its ranks fit the hosts, an offloaded algorithm
    needs an aggregator, and only algorithms that allreduce gradients are accepted."""
    probs = _problems({"topology": {"n_hosts": 2, "switch": "bridge"},
                       "launch": [{"script": "nope.py", "hosts": 3, "algo": "ina"}]})
    assert [p.split(":")[0] for p in probs] == ["launch.0.script", "launch.0.hosts",
                                                "launch.0.algo"]
    probs = _problems({"topology": {"n_hosts": 2},
                       "launch": [{"script": "examples/torch/ddp_digits.py", "algo": "rs"}]})
    assert probs and "not an algorithm that allreduces gradients" in probs[0]
    probs = _problems({"topology": {"n_hosts": 2, "switch": "programmable"},
                       "launch": [{"script": "examples/torch/ddp_digits.py", "algo": "ina",
                                   "nproc_per_host": 2}]})
    assert probs and probs[0].startswith("launch.0: ") and "one worker per host" in probs[0]
    exp = load_experiment(Path(__file__).resolve().parents[2] / "examples/torch/ddp_sweep.toml")
    assert [j.label() for j in exp.launch] == ["ddp_digits:gloo", "ddp_digits:ring",
                                               "ddp_digits:ina"]


def test_a_collective_error_carries_its_field_across_processes():
    import pickle

    from testbed.collectives.spec import CollectiveSpec, FieldError

    with pytest.raises(FieldError) as info:
        CollectiveSpec(algo="ring", nbytes=4096, timeout_s=-1).validate(4)
    e = pickle.loads(pickle.dumps(info.value))
    assert (e.field, e.job, str(e)) == ("timeout_s", None, str(info.value))
    problems = _problems({"topology": {"n_hosts": 4},
                          "jobs": [{"algo": "ring", "timeout_s": -1}]})
    assert any(p.startswith("jobs.0.timeout_s: ") for p in problems), problems


def test_a_file_declares_its_kind_and_an_unknown_one_is_named():
    assert load_any({"kind": "collectives", "jobs": [{"algo": "ring"}]}).kind == "collectives"
    with pytest.raises(ExperimentError) as info:
        load_any({"kind": "sweepstakes"})
    assert info.value.problems == ["kind: 'sweepstakes' is not an experiment kind; allowed: "
                                   "collectives, cooperation"]


# -- fuzzed experiment files: every refusal says why, nothing else escapes ----------------------

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 40),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                 st.sampled_from(["ring", "ina", "hd", "rs", "nic", "auto", "trim", "topk",
                                  "thc", "star", "leaf_spine", "fat_tree", "8MiB", "static",
                                  "shared", "programmable", "bridge", "tbs1", "tbh1"]),
                 st.lists(st.integers(-1, 9), max_size=4))
_FIELDS = {
    "topology": ["kind", "n_hosts", "bw_mbps", "switch", "leaves", "spines", "hosts_per_leaf",
                 "k", "delay_ms", "loss_pct", "aggregator", "switch_memory", "smartnic"],
    "jobs": ["op", "algo", "nbytes", "compressor", "compressor_params", "error_feedback",
             "servers", "repetitions", "hosts", "placement", "options", "timeout_s"],
    "training": ["algo", "iterations", "hidden", "batch_size", "compressor", "workers",
                 "hosts", "target_accuracy", "options", "chakra_out", "start_s"],
    "launch": ["script", "hosts", "algo", "nproc_per_host", "hints", "policy", "compressor"],
    "replay": ["trace", "name", "arrival_s", "algo", "hints", "policy", "comm_groups", "scale",
               "timeout_s"],
    "impairments": ["node", "ports", "loss_pct", "dup_pct", "reorder_pct", "delay_ms"],
}


@st.composite
def _fuzzed_experiment(draw) -> dict:
    data: dict = {}
    topo = {k: draw(_ANY) for k in draw(st.lists(st.sampled_from(_FIELDS["topology"]),
                                                   max_size=4, unique=True))}
    if draw(st.booleans()):
        topo["kind"] = draw(st.sampled_from(["star", "leaf_spine", "fat_tree", "dumbbell"]))
    data["topology"] = topo
    for section in ("jobs", "training", "launch", "replay", "impairments"):
        data[section] = [{k: draw(_ANY) for k in draw(st.lists(
            st.sampled_from(_FIELDS[section]), max_size=4, unique=True))}
            for _ in range(draw(st.integers(0, 2)))]
    for key in draw(st.lists(st.sampled_from(["seed", "time_dilation", "concurrent", "trace",
                                              "settle_s", "sweep", "name", "bogus"]),
                             max_size=3, unique=True)):
        data[key] = draw(_ANY)
    return data


@settings(max_examples=150, deadline=None)
@given(data=_fuzzed_experiment())
def test_fuzzed_experiments_are_accepted_or_refused_naming_fields(data):
    """Random experiment files (known fields with values of any type, unknown fields): the
    schema accepts one or raises ExperimentError with one readable line per problem, each
    naming where in the file; no other exception escapes the loader."""
    try:
        parse_experiment(data)
    except ExperimentError as e:
        assert e.problems and all(isinstance(p, str) and p.strip() for p in e.problems)
        assert all(":" in p for p in e.problems), e.problems


def test_engine_groups_reach_the_network_and_keep_switch_faults_apart():
    from testbed.experiment.networks import network_for

    topo = {"kind": "leaf_spine", "leaves": 2, "spines": 2, "hosts_per_leaf": 1,
            "switch": "programmable"}
    exp = parse_experiment({"topology": topo, "jobs": [{}], "engine_groups": 1})
    assert exp.network_key() != parse_experiment({"topology": topo, "jobs": [{}]}).network_key()
    net = network_for(exp)  # built, not started: the groups are planned
    assert net.engine_groups == [["tbl1", "tbl2", "tbsp1", "tbsp2"]]
    assert len(net.memory_links) == 4
    assert network_for(parse_experiment({"topology": topo, "jobs": [{}]})).engine_groups == []
    assert _problems({"topology": topo, "jobs": [{}], "engine_groups": 0})[0].startswith(
        "engine_groups:")
    probs = _problems({"topology": topo, "jobs": [{}], "engine_groups": 1,
                       "faults": [{"at_s": 0.5, "switch": "tbl1"}]})
    assert "faults kill the engines of ['tbl1']" in probs[0] and "leave engine_groups out" \
        in probs[0]


def test_an_ina_job_of_more_than_32_workers_takes_a_tree_checked_before_anything_runs():
    """An experiment's INA job of more workers than one switch's 32-bit bitmap is accepted
    with placement tree 'auto' (each leaf aggregates its own hosts), refused without it, and
    refused when one switch would still aggregate more than 32 of them, naming that switch."""
    def data(hosts_per_leaf: int, placement: dict | None) -> dict:
        job = {"algo": "ina", "nbytes": "1MiB", **({"placement": placement} if placement else {})}
        return {"topology": {"kind": "leaf_spine", "leaves": 2, "spines": 2,
                             "hosts_per_leaf": hosts_per_leaf, "switch": "programmable"},
                "jobs": [job, {"algo": "ring"}]}

    exp = parse_experiment(data(20, {"tree": "auto"}))
    assert exp.jobs[0].placement.tree == "auto" and exp.topology.hosts_per_leaf == 20
    probs = _problems(data(20, None))
    assert any("workers=40" in p and "tree='auto'" in p for p in probs), probs
    probs = _problems(data(33, {"tree": "auto"}))
    assert len(probs) == 1 and probs[0].startswith("jobs.0.placement.tree: tbl"), probs
    assert "33 members" in probs[0] and "sit directly below it" in probs[0], probs
    # the job's own hosts: 32 of the 33 below each leaf fit
    ok = data(33, {"tree": "auto"})
    ok["jobs"][0]["hosts"] = [r for r in range(66) if r not in (0, 33)]
    assert parse_experiment(ok).jobs[0].hosts[:2] == [1, 2]


def test_a_file_read_for_its_network_may_hold_no_job(tmp_path):
    """``testbed up``, ``testbed launch -e`` and ``provider serve`` use a file's network only:
    a topology alone is enough there (with its sweep's points), while ``testbed run`` still
    asks for work."""
    path = tmp_path / "net.toml"
    path.write_text('name = "net"\n[topology]\nkind = "leaf_spine"\nleaves = 2\nspines = 2\n'
                    'hosts_per_leaf = 2\nswitch = "programmable"\n'
                    '[sweep]\n"topology.bw_mbps" = [10, 40]\n')
    exp, point = load_point(path, 1)
    assert exp.jobs == [] and point.topology.kind == "leaf_spine"
    assert point.topology.bw_mbps == 40
    with pytest.raises(ExperimentError, match="give at least one job"):
        load_experiment(path)
    with pytest.raises(ValueError, match=r"topology.leaves"):  # its fields are still checked
        bad = tmp_path / "bad.toml"
        bad.write_text(path.read_text().replace("leaves = 2", "leaves = 0"))
        load_point(bad, 0)
