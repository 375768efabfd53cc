"""``testbed launch``: unmodified PyTorch scripts (``examples/torch``) on the emulated hosts,
over plain gloo and through the ``testbed`` backend (needs the ``[torch]`` extra)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from testbed.launch import launch  # noqa: E402

pytestmark = pytest.mark.mininet

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "torch"


def _run(tmp_path, script: str, args=(), **kw):
    lines: list[str] = []
    done = launch(SCRIPTS / script if "/" not in script else script, list(args),
                  out=tmp_path, echo=lines.append, **kw)
    return done, lines


def _losses(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines
            if (m := re.fullmatch(r"\[0\]:step \d+ loss (\S+)", line))]


def _scripted_plans(traces, wanted: list[tuple[int, str]]):
    """A ``plans`` source that, once rank 0's trace (``traces``: a glob's paths) holds the
    first ``wanted`` entry's number of calls, returns that entry's algorithm (then the next)."""
    from testbed.launch import backend_settings

    def plans():
        calls = sum(len(p.read_text().splitlines()) for p in traces())
        if wanted and calls >= wanted[0][0]:
            return backend_settings(wanted.pop(0)[1], None, None, False, 1)
        return None
    return plans


def test_collective_loop_over_the_uet_transport(tmp_path):
    """--transport uet: the same script's float32 sums go through the ring over the UET-like
    transport and check out; more than one rank per host is refused before anything runs."""
    done, lines = _run(tmp_path, "allreduce_loop.py", hosts=2, algo="ring", transport="uet")
    assert done.returncode == 0, done.failures
    assert sorted(x for x in lines if x.endswith((": ok", ": FAILED"))) == \
        [f"[{r}]:rank {r}: ok" for r in range(2)]
    assert any(r["path"] == "testbed:ring" for r in done.trace)
    with pytest.raises(ValueError, match="one rank per host"):
        launch(SCRIPTS / "allreduce_loop.py", [], hosts=2, nproc_per_host=2, algo="ring",
               transport="uet", out=tmp_path)


def test_collective_loop_through_the_testbed_backend(tmp_path):
    """float32 sums go through the testbed's ring, the rest through gloo; the script checks
    every result itself against the numbers it must be (exit status 1 otherwise). What it ran
    is written as a Chakra trace, which replays the same collectives in the same order."""
    done, lines = _run(tmp_path, "allreduce_loop.py", hosts=3, algo="ring",
                       chakra_out=tmp_path / "et")
    assert done.returncode == 0 and done.returncodes == [0, 0, 0], done.failures
    assert sorted(x for x in lines if x.endswith((": ok", ": FAILED"))) == \
        [f"[{r}]:rank {r}: ok" for r in range(3)]
    paths = {(row["op"], row["dtype"], row["path"]) for row in done.trace}
    # every dtype's sums, maxima, minima and products on the testbed's ring, none on gloo
    dtypes = {"float32", "float16", "bfloat16", "int32", "int64"}
    assert {p[1] for p in paths if p[:1] == ("allreduce",) and p[2] == "testbed:ring"} == dtypes
    assert not [p for p in paths if p[0] == "allreduce" and p[2] == "gloo"]
    for op in ("reduce_scatter", "allgather"):  # the tensor forms, in every dtype
        assert {p[1] for p in paths if p[0] == op and p[2] == "testbed:ring"} == dtypes, op
    assert {"broadcast", "allgather", "all_to_all", "barrier"} <= {p[0] for p in paths}
    # all-to-alls of every dtype on the testbed's TCP connections, priced by the flow model
    a2a = [r for r in done.trace if r["op"] == "all_to_all"]
    assert {r["dtype"] for r in a2a if r["path"] == "testbed:pairwise"} == dtypes
    assert all(r["path"] == "testbed:pairwise" and r["model_s"] > 0 for r in a2a)
    ring = [r for r in done.trace if r["path"] == "testbed:ring" and r["dtype"] == "float32"
            and r["op"] == "allreduce"
            and r["bytes"] != 4 * 70_001]
    assert {r["bytes"] for r in ring} == {4, 20, 4000, 4 * 65_537, 4 * 262_144}
    assert all(r["end_s"] >= r["start_s"] and r["time_s"] >= 0 for r in done.trace)
    assert all(r["model_s"] > 0 for r in ring)  # the flow model of each, on this network
    assert all(r["model_s"] is None for r in done.trace if r["path"] == "gloo")
    for name in ("trace.csv", "trace.json", "launch.json"):
        assert (done.folder / name).exists(), name
    events = json.loads((done.folder / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1, 2}  # a track per rank
    # the export: the ranks' collectives in their order, replayed on a fresh network
    pytest.importorskip("chakra", reason="the [traces] extra is not installed")
    from testbed.replay import replay
    from testbed.workloads.chakra import load_trace

    assert done.chakra == [tmp_path / "et" / f"allreduce_loop.{r}.et" for r in range(3)]
    ops = {"allreduce": "all_reduce", "allgather": "all_gather", "all_to_all": "all_to_all",
           "broadcast": "broadcast", "barrier": "barrier", "reduce_scatter": "reduce_scatter"}
    ran = [(ops[r["op"]], r["bytes"] * (3 if r["op"] == "allgather" else 1))
           for r in done.trace if r["rank"] == 0]
    graph = load_trace(tmp_path / "et" / "allreduce_loop")
    assert [(x.op, x.bytes) for x in graph[0] if x.kind == "coll"] == ran
    res = replay(tmp_path / "et" / "allreduce_loop", algo="ring", out=tmp_path / "re",
                 echo=lambda line: None)
    assert res.launched.returncode == 0, res.launched.failures
    assert [(c["op"], c["bytes"]) for c in res.collectives] == ran


def test_collective_loop_through_in_network_aggregation_names_each_fallback(tmp_path):
    """INA sums float32 in the switch, and float16 / bfloat16 as float32 (rounded once);
    maxima, minima, products and integer sums go to gloo, each such call named in the trace
    with why. The script checks every answer itself."""
    done, lines = _run(tmp_path, "allreduce_loop.py", hosts=3, algo="ina",
                       topology={"switch": "programmable"})
    assert done.returncode == 0, done.failures + lines[-20:]
    rows = [r for r in done.trace if r["op"] == "allreduce" and r["rank"] == 0]
    ina = {r["dtype"] for r in rows if r["path"] == "testbed:ina"}
    assert ina == {"float32", "float16", "bfloat16"}
    assert all("summed as float32" in r["note"] for r in rows
               if r["path"] == "testbed:ina" and r["dtype"] != "float32")
    gloo = [r for r in rows if r["path"] == "gloo"]
    assert {r["dtype"] for r in gloo} == {"float32", "float16", "bfloat16", "int32", "int64"}
    assert all(r["note"].startswith("ina sums in the network: ") for r in gloo), gloo[:3]
    assert any(r["note"].startswith("ina sums in the network: max of bfloat16") for r in gloo)
    sharded = [r for r in done.trace if r["op"] in ("reduce_scatter", "allgather")
               and r["dtype"] == "float16" and r["rank"] == 0]
    assert sharded and all(r["path"] == "gloo" and r["note"] for r in sharded)
    # all-to-alls on the testbed's own TCP connections beside the switch's aggregation
    a2a = [r for r in done.trace if r["op"] == "all_to_all" and r["rank"] == 0]
    assert a2a and all(r["path"] == "testbed:pairwise" and r["model_s"] > 0 for r in a2a)


def test_ddp_script_unmodified_over_gloo_ring_and_a_provider_planned_ina(tmp_path):
    """The same DDP script: plain gloo (the baseline), then with its buckets through the
    testbed's ring (exact: the same losses), then as the provider plans them for a tenant
    whose hints say exact: INA on the star's switch (fixed point: close losses), then on the
    ring re-planned to INA and back while it trains (the same losses as gloo's)."""
    runs = {}
    wanted = [(40, "ina"), (100, "ring")]  # (rank 0's calls so far, new algo)
    plans = _scripted_plans(lambda: (tmp_path / "replanned").glob("launch-*/trace0.jsonl"),
                            wanted)

    for name, algo in ((None, None), ("ring", "ring"), ("auto", "auto"),
                       ("replanned", "ring")):
        hints = {"tolerance": "exact", "collective_bytes": 300_000} if algo == "auto" else None
        steps = "200" if name in (None, "replanned") else "8"
        done, lines = _run(tmp_path / str(name), "ddp_digits.py", ["--steps", steps],
                           hosts=3, algo=algo, topology={"switch": "programmable"},
                           hints=hints, plans=plans if name == "replanned" else None)
        assert done.returncode == 0, done.failures
        runs[name] = (_losses(lines), done.trace)
        if algo == "auto":
            plan = done.plan
            assert (plan["algo"], plan["compressor"], plan["tree"]) == ("ina", None, ["tbs1"])
            assert json.loads((done.folder / "launch.json").read_text())["plan"] == plan
        if name == "replanned":
            assert re.fullmatch(r"ina from collective \d+ -> ring from collective \d+",
                                done.replans or ""), done.replans
    base, trace = runs[None]
    assert len(base) == 200 and trace == []  # plain gloo: no testbed collective
    runs["ina"] = runs.pop("auto")
    for name, tol in (("ring", 1e-5), ("ina", 1e-3), ("replanned", 1e-3)):
        losses, trace = runs[name]
        assert losses == pytest.approx(base[:len(losses)], abs=tol), (name, losses, base)
        paths = {"ring": ["testbed:ring"], "ina": ["testbed:ina"],
                 "replanned": ["testbed:ring", "testbed:ina"]}[name]
        for path in paths:  # every step's gradient, on every rank
            assert len([r for r in trace if r["path"] == path]) >= 3 * 8, (name, path)


def test_fsdp_script_shards_through_the_testbed_ring(tmp_path):
    """An unmodified FSDP script (fully_shard): its parameter all-gathers and gradient
    reduce-scatters run through the testbed's ring, each priced by the flow model; the losses
    are plain gloo's."""
    runs = {}
    for algo in (None, "ring"):
        done, lines = _run(tmp_path / str(algo), "fsdp_digits.py", ["--steps", "5"], hosts=3,
                           algo=algo)
        assert done.returncode == 0, done.failures
        runs[algo] = (_losses(lines), done.trace)
    base, losses, trace = runs[None][0], *runs["ring"]
    assert len(base) == 5 and losses == pytest.approx(base, abs=1e-4), (losses, base)
    ours = [r for r in trace if r["path"] == "testbed:ring"]
    assert {"reduce_scatter", "allgather"} <= {r["op"] for r in ours}
    assert all(r["model_s"] > 0 for r in ours)


def test_a_failing_rank_is_named_and_the_others_stopped(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import time\nimport torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n    raise SystemExit(7)\ntime.sleep(300)\n")
    t0 = time.monotonic()
    done, _ = _run(tmp_path, str(script), hosts=3)
    assert time.monotonic() - t0 < 120  # not the sleeping ranks' 300 s
    assert done.returncode == 7 and done.failed_ranks == [1]
    assert "rank 1 (tbh2) failed with exit status 7" in done.failures[0]
    assert done.returncodes[0] != 0 and done.returncodes[2] != 0  # stopped


def test_several_ranks_per_host(tmp_path):
    """--nproc-per-host 2 on 2 hosts: 4 ranks, consecutive ones on one host with torchrun's
    local and group ranks; their float32 sums cross the testbed's ring exactly."""
    script = tmp_path / "local.py"
    script.write_text(
        "import os\nimport torch\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nr, n = dist.get_rank(), dist.get_world_size()\n"
        "t = torch.arange(1000, dtype=torch.float32) * (r + 1)\ndist.all_reduce(t)\n"
        "want = torch.arange(1000, dtype=torch.float32) * (n * (n + 1) // 2)\n"
        "env = [os.environ[k] for k in ('LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', "
        "'GROUP_WORLD_SIZE')]\n"
        "print('rank', r, 'of', n, *env, 'ok' if torch.equal(t, want) else 'FAILED')\n"
        "dist.destroy_process_group()\n")
    done, lines = _run(tmp_path, str(script), hosts=2, nproc_per_host=2, algo="ring")
    assert done.returncode == 0 and done.returncodes == [0] * 4, done.failures
    assert sorted(x.split(":", 1)[1] for x in lines if x.endswith(("ok", "FAILED"))) == \
        [f"rank {r} of 4 {r % 2} 2 {r // 2} 2 ok" for r in range(4)]
    meta = json.loads((done.folder / "launch.json").read_text())
    assert meta["hosts"] == ["tbh1", "tbh1", "tbh2", "tbh2"] and meta["nproc_per_host"] == 2
    ring = [r for r in done.trace if r["path"] == "testbed:ring"]
    assert sorted(r["rank"] for r in ring) == [0, 1, 2, 3]
    assert all(r["model_s"] is None for r in ring)  # the model places one rank per host


def test_bad_options_are_named_before_anything_is_built(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        launch(tmp_path / "missing.py", out=tmp_path)
    (tmp_path / "typo.py").write_text("import torch\nfor step in range(3)\n    pass\n")
    with pytest.raises(ValueError, match=r"typo\.py does not compile \(line 2\)"):
        launch(tmp_path / "typo.py", out=tmp_path)
    (tmp_path / "s.py").write_text("")
    with pytest.raises(ValueError, match="n_hosts"):
        launch(tmp_path / "s.py", hosts=3, topology={"n_hosts": 0}, out=tmp_path)
    with pytest.raises(ValueError, match="hints: tolerance"):
        launch(tmp_path / "s.py", algo="auto", hints={"tolerance": "sloppy"}, out=tmp_path)
    with pytest.raises(ValueError, match="policy 'generous' is not one of"):
        launch(tmp_path / "s.py", algo="auto", policy="generous", out=tmp_path)
    with pytest.raises(ValueError, match="hints are for algo 'auto'"):
        launch(tmp_path / "s.py", algo="ring", hints={"tolerance": "exact"}, out=tmp_path)
    with pytest.raises(ValueError, match="nproc_per_host=2 with algo 'ina'.*one worker per host"):
        launch(tmp_path / "s.py", algo="ina", nproc_per_host=2, out=tmp_path)
    with pytest.raises(ValueError, match="nproc_per_host=0 must be an integer >= 1"):
        launch(tmp_path / "s.py", nproc_per_host=0, out=tmp_path)


def test_launch_jobs_of_an_experiment_file(tmp_path):
    """``[[launch]]`` in an experiment: the same script over gloo and through the testbed's
    ring as the provider plans it (bridges only: nothing to offload to) on one built network,
    a row each, the trace of each under the results folder (the example file
    ``examples/torch/ddp_sweep.toml`` adds INA; the test above covers it)."""
    from testbed.experiment import run

    script = SCRIPTS / "ddp_digits.py"
    exp = {"name": "launch-sweep", "topology": {"kind": "star", "n_hosts": 3,
                                                "switch": "bridge"},
           "launch": [{"script": str(script), "args": ["--steps", "4"]},
                      {"script": str(script), "args": ["--steps", "4"], "algo": "auto",
                       "hints": {"tolerance": "exact"}}]}
    res = run(exp, out_dir=tmp_path / "r", progress=False, doctor=False)
    df = res.df
    assert list(df["label"]) == ["ddp_digits:gloo", "ddp_digits:auto"]
    assert (df["status"] == "ok").all() and df["correct"].all(), df["error"].tolist()
    assert list(df["algo"]) == ["gloo", "ring"] and df["planned_by"].iloc[1] == "cooperative"
    assert df["replans"].isna().all()  # bridges: nothing for the provider to move it to
    assert (df["returncode"] == 0).all() and (df["time_s"] > 0).all()
    gloo, ring = df.iloc[0], df.iloc[1]
    assert gloo["offloaded_collectives"] == 0
    assert ring["offloaded_collectives"] >= 4 and ring["comm_s"] > 0
    assert ring["model_comm_s"] > 0  # the flow model of every bucket, on this network
    trace = tmp_path / "r" / "launch" / "run0001"
    assert (trace / "trace.csv").exists() and (trace / "trace.json").exists()
    assert json.loads((trace / "launch.json").read_text())["plan"]["algo"] == "ring"


SUBGROUPS = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
pair = dist.new_group([0, 1])  # inherits the world's backend (the testbed's, under --algo)
other = dist.new_group([2, 3])
mine = pair if rank < 2 else other
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x, group=mine)
want = 3.0 if rank < 2 else 7.0
y = torch.full((1000,), float(rank + 1))
dist.all_reduce(y)  # the world: through the testbed's algorithm
ok = bool((x == want).all()) and bool((y == n * (n + 1) / 2).all())
print(f"rank {rank}: {'ok' if ok else 'FAILED'}", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
"""


def test_subgroups_of_the_testbed_backend_run_on_gloo_and_stay_exact(tmp_path):
    """A subgroup made with new_group (inheriting the testbed backend) sums among its own
    ranks over gloo; the world's allreduce still goes through the testbed's ring."""
    script = tmp_path / "subgroups.py"
    script.write_text(SUBGROUPS)
    done, lines = _run(tmp_path, str(script), hosts=4, algo="ring")
    assert done.returncode == 0, done.failures
    assert sorted(x for x in lines if x.endswith((": ok", ": FAILED"))) == \
        [f"[{r}]:rank {r}: ok" for r in range(4)]
    paths = {(row["op"], row["bytes"], row["path"]) for row in done.trace}
    assert ("allreduce", 4000, "testbed:ring") in paths and ("allreduce", 4000, "gloo") in paths


def test_a_running_job_moves_to_each_new_plan_at_the_same_collective_on_every_rank(tmp_path):
    """A job re-planned three times while it runs (ring -> ina -> hd -> ina, as a provider
    would re-plan it): every rank switches at the same collective, each call runs the plan
    in force (its path and its model), every sum stays right, and the launch records the
    plans it applied."""
    script = SCRIPTS / "steps_loop.py"
    wanted = [(8, "ina"), (20, "hd"), (32, "ina")]  # (rank 0's calls so far, new algo)
    plans = _scripted_plans(lambda: tmp_path.glob("launch-steps_loop*/trace0.jsonl"), wanted)

    done, lines = _run(tmp_path, str(script), ["30"], hosts=4, algo="ring", plans=plans,
                       topology={"switch": "programmable"})
    assert done.returncode == 0, done.failures
    assert sorted(x for x in lines if x.endswith((": ok", "]"))) == \
        [f"[{r}]:rank {r}: ok" for r in range(4)]
    assert not wanted
    meta = json.loads((done.folder / "launch.json").read_text())
    assert [p["algo"] for p in meta["plans"]] == ["ring", "ina", "hd", "ina"]
    assert meta["plan_errors"] == []
    calls = [p["from_call"] for p in meta["plans"]]
    assert calls == sorted(calls) and calls[0] == 1 and len(set(calls)) == 4
    # each plan's switch registration went once every rank had left it, the last at the end
    released = [p["released_s"] for p in meta["plans"]]
    assert released[:3] == sorted(released[:3]) and released[2] < released[3]
    assert not list(done.folder.glob("switch*")) and not list(done.folder.glob("ack*"))
    # every rank ran each of its collectives under the same plan, each plan in turn
    by_rank = {r: [(row["op"], row["plan"]) for row in done.trace if row["rank"] == r]
               for r in range(4)}
    assert all(by_rank[r] == by_rank[0] for r in range(4)), by_rank
    order = [p for _, p in by_rank[0]]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}
    algo = {0: "ring", 1: "ina", 2: "hd", 3: "ina"}
    for row in done.trace:
        if row["op"] == "allreduce":
            assert row["path"] == f"testbed:{algo[row['plan']]}", row
            assert row["model_s"] is not None


def test_a_provider_planned_job_that_states_no_bytes_gets_them_derived_from_its_iterations(
        tmp_path):
    """``algo="auto"`` with only a tolerance: the launcher finds the job's iteration in its
    first collectives (an allreduce of 200,000 B and an all-to-all per step) and gives the
    provider those bytes and times; whatever it plans then reaches the running job."""
    script = SCRIPTS / "steps_loop.py"
    done, lines = _run(tmp_path, str(script), ["25"], hosts=4, algo="auto",
                       hints={"tolerance": "exact"})
    assert done.returncode == 0, done.failures
    assert done.hints["collective_bytes"] == 200_000 and done.hints["tolerance"] == "exact"
    assert 0 < done.hints["compute_s"] < done.hints["iteration_s"]
    meta = json.loads((done.folder / "launch.json").read_text())
    assert meta["hints_planned"] == done.hints and meta["provider_log"]
    # with no bytes stated nothing pays for switch memory: the ring; with 200,000 B every
    # step INA does, and the job moves to it while it runs
    assert [p["algo"] for p in meta["plans"]] == ["ring", "ina"] == \
        [c["new"]["algo"] for c in meta["provider_log"]]
    assert meta["provider_log"][1]["reason"].startswith("hints derived from the job's first")
    switch = meta["plans"][1]["from_call"]
    for r in done.trace:
        if r["op"] == "allreduce":
            assert r["path"] == f"testbed:{'ina' if r['plan'] else 'ring'}"
    assert min(r["seq"] for r in done.trace if r["plan"] == 1) >= switch
