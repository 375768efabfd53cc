"""The benchmark protocol: every benchmark is one declaration, with a command that takes
--quick, --json and --out, and one runner that records the CPU, prints rows and a summary,
keeps what was measured when a run fails part-way and says why a machine cannot run it."""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

from testbed.bench import CATALOG, Benchmark, Option, Outcome, resolve_options, run_benchmark
from testbed.cli import app
from testbed.experiment.results import Results


@pytest.mark.parametrize("name", list(CATALOG))
def test_every_benchmark_has_its_command_and_a_measuring_function_that_takes_its_options(name):
    bench = CATALOG[name]
    r = CliRunner().invoke(app, ["bench", name, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for flag in ("--quick", "--json", "--out", *(o.flag for o in bench.options)):
        assert flag in r.output, (name, flag)
    params = list(inspect.signature(bench.measure_fn()).parameters)
    assert params[:2] == ["emit", "quick"], (name, params)
    assert params[2:] == [o.name for o in bench.options], (name, params)
    assert all(o.kind in (int, float, str, bool) for o in bench.options), name


def test_options_default_then_quick_then_given():
    bench = CATALOG["capacity"]
    assert resolve_options(bench, {}, False)["workers"] == "2,4,8,16"
    quick = resolve_options(bench, {}, True)
    assert quick["workers"] == "2,4" and quick["mib"] == 1 and quick["io"] == "ring"
    assert resolve_options(bench, {"workers": "8", "mib": None}, True) | {} == quick | {
        "workers": "8"}
    with pytest.raises(ValueError, match="no option nope"):
        resolve_options(bench, {"nope": 1}, False)


@pytest.mark.quiet_cpu  # after the background compile: ina-cost's kernels load, not compile
def test_json_rows_then_a_summary_with_the_cpu(capsys):
    assert run_benchmark("ina-cost", quick=True, json_out=True) == 0
    *rows, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all(r["bench"] == "ina-cost" and r["ns_per_packet"] > 0 for r in rows)
    assert summary["summary"] and summary["status"] == 0 and summary["rows"] == len(rows)
    assert summary["notes"]["cpu"] and summary["notes"]["options"] == {"reps": 1}


def _half_done(emit, quick, rows):
    """A benchmark that measures ``rows`` rows, then fails."""
    for k in range(rows):
        emit({"case": f"c{k}", "time_s": 0.1 * (k + 1)})
    raise RuntimeError("the fabric went away")


def _fine(emit, quick):
    """A benchmark that measures one row and succeeds."""
    emit({"case": "c0", "time_s": 0.1, "quick": quick})
    return Outcome([{"case": "c0"}])


def _unusable() -> str:
    return "it needs a machine we do not have"


@pytest.fixture
def extra_benchmarks(monkeypatch):
    monkeypatch.setitem(CATALOG, "half", Benchmark(
        "half", "measures two rows, then fails", f"{__name__}:_half_done", needs_root=False,
        options=(Option("rows", 2, "rows before the failure"),), case=("case",)))
    monkeypatch.setitem(CATALOG, "fine", Benchmark(
        "fine", "measures one row", f"{__name__}:_fine", needs_root=False, case=("case",)))
    monkeypatch.setitem(CATALOG, "nowhere", Benchmark(
        "nowhere", "cannot run here", f"{__name__}:_half_done", needs_root=False,
        check=f"{__name__}:_unusable"))
    monkeypatch.setitem(CATALOG, "extra", Benchmark(
        "extra", "needs a module that is not installed", f"{__name__}:_half_done",
        needs_root=False, requires=("no_such_module_for_testbed",)))


def test_a_failing_benchmark_keeps_its_rows_and_exits_1(extra_benchmarks, tmp_path, capsys):
    assert run_benchmark("half", json_out=True, out=tmp_path) == 1
    captured = capsys.readouterr()
    *rows, summary = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["case"] for r in rows] == ["c0", "c1"]
    assert summary["status"] == 1 and "the fabric went away" in summary["notes"]["error"]
    assert "2 rows measured before" in captured.err
    (folder,) = tmp_path.glob("bench-half-*")
    res = Results.load(folder)
    assert list(res.df["case"]) == ["c0", "c1"]
    assert res.metadata["status"] == "failed" and "fabric" in res.metadata["error"]
    assert (folder / "bench_half.png").exists()


def test_a_benchmark_this_machine_cannot_run_says_why(extra_benchmarks, capsys):
    assert run_benchmark("nowhere") == 2
    assert "cannot run here: it needs a machine we do not have" in capsys.readouterr().err
    assert run_benchmark("extra", json_out=True) == 2
    out, err = capsys.readouterr()
    assert "no_such_module_for_testbed" in err
    assert json.loads(out)["skipped"].startswith("needs no_such_module_for_testbed")


def test_bench_all_runs_the_chosen_ones_and_skips_what_cannot_run(extra_benchmarks):
    # (real benchmarks through `bench all`: tests/cli/test_readme_commands.py)
    r = CliRunner().invoke(app, ["bench", "all", "--quick", "--json", "--only",
                                 "fine,nowhere"])
    assert r.exit_code == 0, r.output  # a benchmark that cannot run here does not fail all
    summaries = [json.loads(x) for x in r.stdout.splitlines() if '"summary"' in x]
    assert [(s["bench"], s["status"]) for s in summaries] == [("fine", 0), ("nowhere", 2)]
    r = CliRunner().invoke(app, ["bench", "all", "--only", "fine,half"])
    assert r.exit_code == 1, r.output
    r = CliRunner().invoke(app, ["bench", "all", "--only", "kernelz"])
    assert r.exit_code == 2 and "unknown benchmark kernelz" in r.output


def test_outcome_defaults():
    assert Outcome([]).ok and Outcome([]).targets == {} and Outcome([]).notes == {}
