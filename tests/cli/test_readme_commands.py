"""Every command the README shows runs: its ``--help`` always, ``make bench``'s quick form too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from testbed.cli import app
from testbed.kernels.wire import HEADER_OFFSET

REPO = Path(__file__).resolve().parents[2]


def cli_commands() -> list[tuple[str, ...]]:
    """Every command of the command line, as the words that call it (groups' commands too;
    ``switch`` takes its node before the verb)."""
    def name(c) -> str:  # typer names a command after its function unless told otherwise
        return c.name or c.callback.__name__.replace("_", "-")

    paths: list[tuple[str, ...]] = [(name(c),) for c in app.registered_commands]
    for group in app.registered_groups:
        prefix = (group.name, "tbs1") if group.name == "switch" else (group.name,)
        paths += [(*prefix, name(c)) for c in group.typer_instance.registered_commands]
    return sorted(paths)


def readme_table() -> dict[str, list[str]]:
    """The README's command table: first word after ``testbed`` -> the command cells."""
    cells = re.findall(r"^\| `testbed ([^`]+)` \|", (REPO / "README.md").read_text(), re.M)
    out: dict[str, list[str]] = {}
    for cell in cells:
        out.setdefault(cell.split()[0], []).append(cell.replace("\\|", "|"))
    return out


@pytest.mark.parametrize("path", cli_commands(), ids=" ".join)
def test_the_readme_table_shows_every_command(path):
    cells = readme_table().get(path[0], [])
    words = {w for cell in cells for token in cell.split() for w in token.split("|")}
    assert cells and path[-1] in words, f"README's command table does not show {path}"


@pytest.mark.parametrize("path", cli_commands(), ids=" ".join)
def test_every_readme_command_answers_help(path):
    r = CliRunner().invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage" in r.output


def check_bench_rows(rows: list[dict], notes: dict) -> None:
    """A quick run of the real benchmark (its ``--quick`` options, run by ``testbed bench all
    --quick``): every program row has every anchor measured in the same
    run, positive rates, and ratio == kpps / anchor_kpps."""
    programs = {r["program"] for r in rows}
    assert programs == {"forward", "aggregate"}
    anchors = {r["anchor"] for r in rows}
    assert {"linux-bridge", "python-naive", "engine-mmsg"} <= anchors
    assert "ovs-userspace" in anchors or "skipped" in str(notes.get("ovs-userspace"))
    for r in rows:
        assert set(r) == {"program", "packet_bytes", "kpps", "gbps", "anchor", "anchor_kpps",
                          "ratio"}
        assert r["packet_bytes"] == HEADER_OFFSET + 28 + 64
        assert r["kpps"] > 0 and r["anchor_kpps"] > 0
        assert r["ratio"] == pytest.approx(r["kpps"] / r["anchor_kpps"], rel=0.01)
    size = HEADER_OFFSET + 28 + 64
    for v in ("forward", "engine-mmsg"):  # what the generator offered, what the engine cost
        n = notes[f"{v}/{size}B"]
        assert n["offered_kpps"] > 0 and n["engine_us_per_pkt"] > 0 and n["gen_us_per_pkt"] > 0
    # aggregate: the rate is a trial that lost nothing (every contribution came back)
    agg = notes[f"aggregate/{size}B"]["trials"]
    best = max((t for t in agg if t["ok"]), key=lambda t: t["sent_kpps"])
    assert best["results"] >= best["contributions"] > 0
    assert next(r["kpps"] for r in rows if r["program"] == "aggregate") == best["sent_kpps"]


@pytest.mark.mininet  # the benchmarks build networks: one at a time, on a quiet machine
def test_bench_all_quick_runs_benchmarks_in_turn_and_stores_each(tmp_path):
    """``testbed bench all --quick --only ...`` (``make bench``'s quick form, on the
    benchmarks quick enough for a test): each measured against its anchor in the same run,
    one JSON line per row and a summary per benchmark, each stored under --out."""
    names = ["kernels", "datapath", "collectives", "ina-cost"]
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "bench", "all", "--quick", "--json",
                        "--only", ",".join(names), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=900, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stored = {d.name.removeprefix("bench-").rsplit("-", 2)[0] for d in tmp_path.iterdir()}
    assert stored == set(names), stored
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    summaries = [x for x in lines if x.get("summary")]
    assert [s["bench"] for s in summaries] == names
    assert all(s["status"] == 0 and s["notes"]["quick"] for s in summaries), summaries
    rows = {n: [x for x in lines if x["bench"] == n and not x.get("summary")] for n in names}
    assert all(len(rows[s["bench"]]) == s["rows"] > 0 for s in summaries)
    assert [row for row in rows["kernels"] if row.get("ratio")]
    datapath = [{k: v for k, v in row.items() if k != "bench"} for row in rows["datapath"]]
    check_bench_rows(datapath, summaries[1]["notes"])
    assert {row["algo"] for row in rows["collectives"]} == {"ring", "hd", "rs", "ina"}
    assert all(row["correct"] for row in rows["collectives"])
