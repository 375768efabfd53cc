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

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.mininet
def test_make_bench_quick_runs_every_benchmark_of_bench_all(tmp_path):
    """``testbed bench all --quick`` (``make bench``'s quick form): kernels, the data path and
    the collectives, each measured against its anchor in the same run, stored under --out."""
    from test_datapath_bench import check_bench_rows  # the data-path bench's own checks
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "bench", "all", "--quick", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                       cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stored = {d.name.split("-")[1] for d in tmp_path.iterdir()}
    assert stored == {"kernels", "datapath", "collectives"}, stored
    docs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 3, r.stdout[-2000:]
    kernels, datapath, collectives = docs
    assert [row for row in kernels["rows"] if row.get("ratio")], kernels
    check_bench_rows(datapath["rows"], datapath["notes"])
    collectives = collectives["rows"]
    assert {row["algo"] for row in collectives} == {"ring", "hd", "rs", "ina"}
    assert all(row["correct"] for row in collectives)
