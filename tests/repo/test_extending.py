"""Plug-ins: compressors, data-path stages and collective algorithms registered by other
distributions' entry points.

Two levels. Registry tests put a throw-away distribution (a ``*.dist-info`` folder and a
module) on ``sys.path``: lookups, experiment validation, and every way a plug-in can be
broken. The examples' tests install ``examples/mycompressor``, ``examples/mystage`` and
``examples/myalgorithm`` into this virtualenv with pip, as a user would, run their own tests,
and run their experiment files with ``testbed run`` on a Mininet star (the compressor in a ring
allreduce, the stage on the aggregating switch, the algorithm in collectives and a training
job); they uninstall what they installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed.datapath.batch import Stage
from testbed.datapath.programs import check_program_name, stage_class, stage_names
from testbed.experiment.spec import ExperimentError, parse_experiment
from testbed.kernels import plugins
from testbed.kernels.compressors import (
    COMPRESSORS,
    compressor_names,
    decode_any,
    get_compressor,
)
from testbed.kernels.plugins import PluginError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PY = sys.executable

GOOD_COMPRESSOR = """
import numpy as np
from testbed.kernels.compressors import Compressor

class Halve(Compressor):
    name = "{name}"

    def __init__(self, factor=0.5):
        super().__init__(factor=factor)

    def _compress(self, x, step):
        return (x * np.float32(self.params["factor"]),), {{"n": int(x.size)}}

    def _decompress(self, payload, ctx):
        return payload[0] / np.float32(self.params["factor"])

    def payload_bytes(self, n):
        return 4 * n
"""


def test_compressor_plugin_everywhere_a_name_is_used(fake_dists):
    fake_dists("tb-halve", "tbplug_halve", GOOD_COMPRESSOR.format(name="halve"),
               "[testbed.compressors]\nhalve = tbplug_halve:Halve\n")
    names = compressor_names()  # built-ins first, then plug-ins (others may be installed)
    assert names[:len(COMPRESSORS)] == COMPRESSORS and "halve" in names[len(COMPRESSORS):]
    c = get_compressor("halve", factor=0.25)
    x = np.arange(8, dtype=np.float32)
    assert np.array_equal(decode_any(c.encode(x)), x)
    with pytest.raises(ValueError, match="has no parameter 'ratio'"):
        get_compressor("halve", ratio=0.1)
    job = {"algo": "ring", "nbytes": 4096, "compressor": "halve"}
    exp = parse_experiment({"topology": {"n_hosts": 2}, "jobs": [job]})
    assert exp.jobs[0].compressor == "halve"
    with pytest.raises(ExperimentError, match=r"jobs\.0\.compressor: unknown compressor "
                                              r"'halv'; allowed: .*thc, .*halve"):
        parse_experiment({"topology": {"n_hosts": 2}, "jobs": [{**job, "compressor": "halv"}]})


def test_summable_plugin_compressor_reduce_scatters_in_its_carrier(fake_dists, tmp_path):
    """A plug-in that says ``summable`` (and its ``carrier``) gets the reduce-scatter path,
    in the models and in a real ring allreduce of the collective pool on loopback."""
    from testbed.collectives import compress
    from testbed.collectives.spec import CollectiveSpec
    from testbed.collectives.testing import loopback_ip

    fake_dists("tb-halves", "tbplug_halves", GOOD_COMPRESSOR.format(name="halves")
               + "\nHalve.summable = True\n",
               "[testbed.compressors]\nhalves = tbplug_halves:Halve\n")
    assert compress.scheme("halves") == "reduce_scatter"
    assert compress.wire_plan("halves", {}, 1000, 3) == ("reduce_scatter", 1000, 4)
    n = 3
    spec = CollectiveSpec(algo="ring", nbytes=4 * 10_007, compressor="halves", timeout_s=30,
                          chunk_bytes=8 << 10)
    spec.validate(n)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()} for i in range(n)]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"spec": spec.to_json(), "n": n, "m": 0, "ranks": ranks}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    p = subprocess.run([PY, "-m", "testbed.collectives.worker", "--job", str(job)], env=env,
                       capture_output=True, text=True, timeout=120)
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["error"] is None, (res["error"], p.stderr[-2000:])
    assert all(rep["correct"] for rep in res["reps"]), res["reps"]


@pytest.mark.parametrize("source, entry, match", [
    ("raise RuntimeError('missing licence key')", "bad = tbplug_bad:Nope",
     r"entry point 'bad = tbplug_bad:Nope' \(group testbed.compressors\) of distribution "
     r"'tb-bad 1.0' failed to load: RuntimeError: missing licence key"),
    ("class Nope:\n    name = 'bad'\n", "bad = tbplug_bad:Nope",
     r"'bad = tbplug_bad:Nope'.*'tb-bad 1.0' gives <class 'tbplug_bad.Nope'>, which is not a "
     r"subclass of testbed.kernels.compressors.base.Compressor"),
    (GOOD_COMPRESSOR.format(name="other"), "bad = tbplug_bad:Halve",
     r"'tb-bad 1.0': the class says name = 'other'; the entry point's name and the "
     r"Compressor's name must be the same"),
    ("", "bad = tbplug_bad:Missing",
     r"'tb-bad 1.0' failed to load: AttributeError"),
])
def test_broken_compressor_plugin_is_named(fake_dists, source, entry, match):
    fake_dists("tb-bad", "tbplug_bad", source, f"[testbed.compressors]\n{entry}\n")
    assert "bad" in compressor_names()  # listing reads metadata only
    with pytest.raises(PluginError, match=match):
        get_compressor("bad")
    get_compressor("topk")  # the built-ins still work
    # an experiment naming it reports the plug-in's error under the job's field
    with pytest.raises(ExperimentError, match=r"jobs\.0\.compressor.*'tb-bad 1.0'"):
        parse_experiment({"topology": {"n_hosts": 2},
                          "jobs": [{"algo": "ring", "nbytes": 4096, "compressor": "bad"}]})


def test_plugin_taking_a_builtin_name_or_registered_twice(fake_dists):
    fake_dists("tb-a", "tbplug_a", GOOD_COMPRESSOR.format(name="dup"),
               "[testbed.compressors]\ndup = tbplug_a:Halve\n")
    fake_dists("tb-b", "tbplug_b", GOOD_COMPRESSOR.format(name="dup"),
               "[testbed.compressors]\ndup = tbplug_b:Halve\n")
    with pytest.raises(PluginError, match=r"name 'dup' is registered twice: by entry point "
                                          r"'dup = tbplug_.:Halve'.*and by.*uninstall one"):
        get_compressor("dup")
    fake_dists("tb-c", "tbplug_c", "", "[testbed.stages]\nforward = tbplug_c:Fwd\n")
    with pytest.raises(PluginError, match=r"'forward = tbplug_c:Fwd' \(group testbed.stages\) "
                                          r"of distribution 'tb-c 1.0' takes the name of a "
                                          r"built-in"):
        check_program_name("forward")  # never silently shadowed, never silently ignored


STAGE_SOURCE = """
from testbed.datapath.batch import Stage

class Nop(Stage):
    name = "{name}"

    def __init__(self, ports):
        self.ports = ports

    def process(self, batch, now_ns):
        pass
"""


def test_stage_plugin_in_program_lists_and_experiments(fake_dists):
    fake_dists("tb-nop", "tbplug_nop", STAGE_SOURCE.format(name="nop"),
               "[testbed.stages]\nnop = tbplug_nop:Nop\n")
    assert "nop" in stage_names()
    cls = stage_class("nop")
    assert issubclass(cls, Stage) and cls.name == "nop"
    topo = {"n_hosts": 2, "switch": "programmable", "params": {"programs": {"tbs1": []}}}
    jobs = [{"algo": "ring", "nbytes": 4096}]
    topo["params"]["programs"]["tbs1"] = ["nop", "forward"]
    parse_experiment({"topology": topo, "jobs": jobs})
    topo["params"]["programs"]["tbs1"] = ["nope", "forward"]
    with pytest.raises(ExperimentError, match=r"topology\.params\.programs\.tbs1: unknown "
                                              r"program 'nope'; known: forward, .*, nop"):
        parse_experiment({"topology": topo, "jobs": jobs})


def test_broken_stage_plugin_is_named(fake_dists):
    fake_dists("tb-st", "tbplug_st", STAGE_SOURCE.format(name="other"),
               "[testbed.stages]\nst = tbplug_st:Nop\nbad = tbplug_st:Stage2\n")
    with pytest.raises(PluginError, match=r"'st = tbplug_st:Nop'.*'tb-st 1.0': the class says "
                                          r"name = 'other'"):
        stage_class("st")
    with pytest.raises(PluginError, match=r"'bad = tbplug_st:Stage2'.*failed to load"):
        stage_class("bad")


ALGORITHM_SOURCE = """
from testbed.collectives.algorithms import PeerAlgorithm
from testbed.collectives import ring

class Star0(PeerAlgorithm):
    name = "{name}"
    ops = {ops}

    def peers(self, rank, n, op):
        return list(range(1, n)) if rank == 0 else [0]
"""


def test_algorithm_plugin_everywhere_an_algorithm_name_is_used(fake_dists):
    from testbed.collectives.algorithms import algorithm, algorithm_names, is_offloaded
    from testbed.collectives.spec import CollectiveSpec
    from testbed.provider.schema import Plan
    from testbed.workloads.spec import TrainingSpec, train_algos

    fake_dists("tb-star0", "tbplug_star0", ALGORITHM_SOURCE.format(name="star0",
                                                                   ops='("allreduce",)'),
               "[testbed.algorithms]\nstar0 = tbplug_star0:Star0\n")
    assert algorithm_names()[:5] == ("ring", "hd", "rs", "ina", "nic")
    assert "star0" in algorithm_names("allreduce", traffic="tcp", trains=True)
    assert "star0" not in algorithm_names("broadcast") and not is_offloaded("star0")
    assert algorithm("star0").peers(0, 3, "allreduce") == [1, 2]
    CollectiveSpec(algo="star0", nbytes=4096).validate(3)
    with pytest.raises(ValueError, match=r"algo='star0' does not implement op='broadcast'"):
        CollectiveSpec(op="broadcast", algo="star0", nbytes=4096).validate(3)
    assert "star0" in train_algos()
    TrainingSpec(algo="star0").validate(3)
    assert Plan(job="j", algo="star0").algo == "star0"
    job = {"algo": "star0", "nbytes": 4096}
    exp = parse_experiment({"topology": {"n_hosts": 3}, "jobs": [job]})
    assert exp.jobs[0].algo == "star0"
    with pytest.raises(ExperimentError, match=r"jobs\.0\.algo: .*'star9' is not a registered "
                                              r"algorithm: one of \('ring', .*'star0'\)"):
        parse_experiment({"topology": {"n_hosts": 3}, "jobs": [{**job, "algo": "star9"}]})
    with pytest.raises(ExperimentError, match=r"training\.0\.algo: .*'rs' is not an algorithm "
                                              r"a training job can use"):
        parse_experiment({"topology": {"n_hosts": 3}, "training": [{"algo": "rs"}]})


@pytest.mark.parametrize("source, entry, match", [
    ("class Nope:\n    name = 'bad'\n", "bad = tbplug_badalg:Nope",
     r"'bad = tbplug_badalg:Nope'.*'tb-badalg 1.0' gives <class 'tbplug_badalg.Nope'>, which "
     r"is not a subclass of testbed.collectives.algorithms.PeerAlgorithm"),
    (ALGORITHM_SOURCE.format(name="other", ops='("allreduce",)'), "bad = tbplug_badalg:Star0",
     r"'tb-badalg 1.0': the class says name = 'other'"),
    (ALGORITHM_SOURCE.format(name="bad", ops='("alltoall",)'), "bad = tbplug_badalg:Star0",
     r"'tb-badalg 1.0': ops \('alltoall',\) must be a non-empty tuple of"),
    ("", "ring = tbplug_badalg:Ring", r"'ring = tbplug_badalg:Ring'.*takes the name of a "
                                      r"built-in"),
])
def test_broken_algorithm_plugin_is_named(fake_dists, source, entry, match):
    from testbed.collectives.algorithms import algorithm
    from testbed.collectives.spec import CollectiveSpec

    fake_dists("tb-badalg", "tbplug_badalg", source, f"[testbed.algorithms]\n{entry}\n")
    name = entry.split(" = ")[0]
    with pytest.raises(PluginError, match=match):
        algorithm(name)
    with pytest.raises(PluginError, match=match):
        CollectiveSpec(algo=name, nbytes=4096).validate(3)


def test_no_list_of_algorithm_names_outside_the_registry():
    """Whether an algorithm is offloaded, and which names exist, is asked of the registry:
    a list like ("ina", "nic") or Literal["ring", "hd", ...] elsewhere would miss plug-ins."""
    found = []
    for path in (ROOT / "testbed").rglob("*.py"):
        text = path.read_text()
        for pattern in ('("ina", "nic")', 'Literal["ring"', '("ring", "hd", "rs", "ina", "nic")'):
            if pattern in text and path.name != "algorithms.py":
                found.append(f"{path.relative_to(ROOT)}: {pattern}")
    assert not found, found


def test_communication_settings_are_declared_once():
    """algo, compressor, compressor_params and error_feedback are Communication's fields: no
    other class in testbed/ declares them (a class may narrow ``algo`` only), and every kind of
    job has them with Communication's defaults, so a setting added there reaches them all."""
    import ast
    import dataclasses

    from testbed.collectives.spec import COMMUNICATION, CollectiveSpec, Communication
    from testbed.experiment.spec import JobSpec, LaunchJob, TrainJob
    from testbed.provider.schema import Plan
    from testbed.torch import TorchJob
    from testbed.workloads.spec import TrainingSpec

    declared = []
    for path in (ROOT / "testbed").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != "Communication":
                declared += [f"{path.relative_to(ROOT)}:{stmt.lineno} {node.name}.{stmt.target.id}"
                             for stmt in node.body if isinstance(stmt, ast.AnnAssign)
                             and isinstance(stmt.target, ast.Name)
                             and stmt.target.id in COMMUNICATION[1:]]
    assert not declared, declared
    base = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(Communication)}
    for cls in (CollectiveSpec, TrainingSpec, TorchJob):
        assert issubclass(cls, Communication)
    for job in (CollectiveSpec(), TrainingSpec(), TorchJob(), JobSpec(), TrainJob(),
                Plan(job="j"), LaunchJob(script="s.py")):
        narrowed = {"algo"} if isinstance(job, LaunchJob) else set()  # unset: plain gloo
        assert {k: getattr(job, k) for k in COMMUNICATION if k not in narrowed} == \
            {k: v for k, v in base.items() if k not in narrowed}, type(job).__name__
    for model in (JobSpec, TrainJob, Plan, LaunchJob):  # the schema documents each field
        assert all(model.model_fields[k].description for k in COMMUNICATION[1:]), model


def test_a_plan_reaches_every_kind_of_job_unchanged():
    """communication_of copies the settings between the kinds of job, whatever they are."""
    from testbed.collectives.spec import CollectiveSpec, communication_label, communication_of
    from testbed.experiment.spec import TrainJob
    from testbed.provider.schema import Plan
    from testbed.torch import TorchJob
    from testbed.workloads.spec import TrainingSpec

    plan = Plan(job="j", algo="ring", compressor="topk", compressor_params={"ratio": 0.1},
                error_feedback=True)
    for job in (CollectiveSpec(**communication_of(plan)), TrainingSpec(**communication_of(plan)),
                TorchJob(**communication_of(plan)), TrainJob(**communication_of(plan))):
        assert communication_of(job) == communication_of(plan)
        assert communication_label(job) == "ring+topk+ef"
        job.compressor_params["ratio"] = 0.5  # a copy: the plan keeps its own
    assert plan.compressor_params == {"ratio": 0.1}
    CollectiveSpec(**communication_of(plan)).validate(4)


# -- the examples, installed with pip ----------------------------------------------------------

EXAMPLE_DISTS = {"testbed-example-compressor": EXAMPLES / "mycompressor",
                 "testbed-example-stage": EXAMPLES / "mystage",
                 "testbed-example-algorithm": EXAMPLES / "myalgorithm"}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def examples_installed():
    """``pip install -e`` both examples into this interpreter's environment (as a user would;
    pip fetches setuptools from the package index to build them), uninstall them afterwards
    unless they were installed before."""
    if not os.access(Path(sys.prefix) / "lib", os.W_OK):
        pytest.skip(f"cannot install into {sys.prefix} (not writable); run as its owner")
    ours = [d for d in EXAMPLE_DISTS if not _installed(d)]
    if ours:
        cmd = [PY, "-m", "pip", "install", "-q", "--no-deps"]
        for d in ours:
            cmd += ["-e", str(EXAMPLE_DISTS[d])]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"pip install of the examples failed:\n{p.stdout}{p.stderr}"
    try:
        yield
    finally:
        if ours:
            subprocess.run([PY, "-m", "pip", "uninstall", "-y", "-q", *ours],
                           capture_output=True, timeout=300)
        plugins.refresh()


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (it sees new installs)."""
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_examples_tests_pass_once_installed(examples_installed):
    p = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(EXAMPLE_DISTS["testbed-example-compressor"] / "tests"),
                        str(EXAMPLE_DISTS["testbed-example-stage"] / "tests"),
                        str(EXAMPLE_DISTS["testbed-example-algorithm"] / "tests")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    p = _python("from testbed.kernels.compressors import compressor_names\n"
                "from testbed.datapath.programs import stage_names\n"
                "from testbed.experiment import load_experiment\n"
                "from testbed.collectives.algorithms import algorithm_names\n"
                "print(compressor_names()[-1], stage_names()[-1], algorithm_names()[-1])\n"
                "load_experiment('examples/mycompressor/ring_absmax8.toml')\n"
                "load_experiment('examples/mystage/msgcount.toml')\n"
                "load_experiment('examples/myalgorithm/bintree.toml')\n"
                "load_experiment('examples/myalgorithm/train_bintree.toml')\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["absmax8", "msgcount", "bintree"]


def _testbed_run(toml: Path, out: Path) -> pd.DataFrame:
    """``testbed run`` in a new process (Ctrl-C on timeout: it tears its network down)."""
    proc = subprocess.Popen([str(Path(PY).parent / "testbed"), "run", str(toml), "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        log, _ = proc.communicate(timeout=120)
        pytest.fail(f"testbed run {toml.name} timed out:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    (folder,) = out.iterdir()
    df = pd.read_csv(folder / "results.csv")
    df.attrs["folder"] = folder
    return df


@pytest.mark.mininet
def test_plugin_compressor_in_a_ring_allreduce(examples_installed, tmp_path):
    df = _testbed_run(EXAMPLES / "mycompressor" / "ring_absmax8.toml", tmp_path)
    assert list(df["status"]) == ["ok", "ok"] and df["correct"].all()
    plain, comp = df.iloc[0], df.iloc[1]
    assert pd.isna(plain["compressor"]) and comp["compressor"] == "absmax8"
    # correct: every worker's result is the sum of the 3 workers' decoded payloads (replayed
    # with the plug-in in the test's process); the error against the raw inputs is absmax8's
    assert plain["max_abs_err"] < 1e-3 < comp["max_abs_err"]


@pytest.mark.mininet
def test_plugin_stage_on_the_aggregating_switch(examples_installed, tmp_path):
    df = _testbed_run(EXAMPLES / "mystage" / "msgcount.toml", tmp_path)
    row = df.iloc[0]
    assert row["status"] == "ok" and row["correct"]

    def col(name: str) -> float:  # counters that did not change have no column
        return float(np.nan_to_num(row.get(f"dp_{name}", 0.0)))

    # msgcount runs before aggregate in the same engine: every contribution the aggregator
    # absorbed was counted as a DATA (or RETRANSMIT) frame first
    contributions = col("aggregate_contributions")
    assert contributions >= row["n"] and contributions % row["n"] == 0
    assert col("msgcount_data") + col("msgcount_retransmit") >= contributions
    assert col("msgcount_result") == 0  # results leave the switch, they are not received
    # the stage runs first, so it counted every frame the engine received, port by port
    deltas = json.loads((df.attrs["folder"] / "counters" / "run0000.json").read_text())
    for port in ("tbs1-eth1", "tbs1-eth2", "tbs1-eth3"):
        rx = deltas.get(f"datapath.tbs1.ports.{port}.rx_packets", 0)
        counted = sum(v for k, v in deltas.items()
                      if k.startswith(f"datapath.tbs1.stages.msgcount.ports.{port}."))
        assert counted == rx > 0, (port, counted, rx)


@pytest.mark.mininet
def test_plugin_algorithm_in_collectives_and_a_training_job(examples_installed, tmp_path):
    df = _testbed_run(EXAMPLES / "myalgorithm" / "bintree.toml", tmp_path / "c")
    assert (df["status"] == "ok").all() and df["correct"].all()  # checked against numpy sums
    tree = df[df["algo"] == "bintree"]
    assert list(tree["bytes"]) == [64 << 10, 1 << 20]
    assert (tree["model_s"] > 0).all()  # the plug-in's flow-model phases gave every row a time
    # the flow model of a star is the alpha-beta model (one switch): the plug-in's two agree
    # (within the ACKs' share of a link, which the flow model counts only where data flows
    # the other way: the tree's phases send one way, the alpha-beta goodput assumes both)
    p = _python("from testbed.collectives import model\n"
                "from testbed.collectives.flowmodel import predict_s\n"
                "from testbed.collectives.spec import CollectiveSpec\n"
                "from testbed.topologies import Star\n"
                "for size in (64 << 10, 1 << 20):\n"
                "    s = CollectiveSpec(algo='bintree', nbytes=size)\n"
                "    f = predict_s(Star(5, bw_mbps=100), s, hop_latency_s=1e-4)\n"
                "    a = model.predict('allreduce', 'bintree', 5, size, 100e6, 2e-4)\n"
                "    print(f / a)\n")
    assert p.returncode == 0, p.stderr
    assert all(abs(float(r) - 1) < 0.03 for r in p.stdout.split()), p.stdout
    df = _testbed_run(EXAMPLES / "myalgorithm" / "train_bintree.toml", tmp_path / "t")
    assert list(df["label"]) == ["ring", "bintree"]
    assert (df["status"] == "ok").all() and df["correct"].all()
    assert (df["iterations"] == 30).all() and (df["final_accuracy"] > 0.5).all()
