"""Regenerate the README's pictures under docs/images/ (``sudo make docs-images``).

* ``architecture.svg``: drawn by ``architecture.py`` (no root, a second);
* ``demo_table.svg``, ``demo_plot.png``: ``testbed demo`` runs (root, a few minutes), its
  table as the terminal shows it (rich's SVG export) and its plot;
* ``notebook_<name>.png``: every notebook in ``notebooks/`` runs with its own parameters
  (root, several minutes) and one of its figures is kept (:data:`FIGURE`);
* ``fabric_run.png``: the fabric picture an experiment stores per run (``fabric/runNNNN.png``),
  of a small INA tree allreduce on a leaf-spine (:data:`FABRIC_EXPERIMENT`; root, a minute).

``--only architecture|demo|notebooks|fabric`` makes one kind (``--notebook NAME``: one notebook). The pictures show what the machine that
made them measured (the demo's table says whether a run was CPU-bound): regenerate them on an
idle machine before committing them.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NOTEBOOKS = ROOT / "notebooks"
#: Which figure (index among a notebook's PNG outputs) the gallery shows; default 0.
FIGURE = {"01_allreduce_vs_model": 1,  # its first figure is the model alone
          "05_multitenant_offload": 1}  # the tenants (the first: trees)
#: Terminal width the demo's table is rendered at.
WIDTH = 100
#: The experiment whose first run's fabric picture the README shows.
FABRIC_EXPERIMENT = {
    "name": "fabric-picture",
    "topology": {"kind": "leaf_spine", "leaves": 2, "spines": 2, "hosts_per_leaf": 3,
                 "bw_mbps": 50, "switch": "programmable"},
    "jobs": [{"name": "ina-tree", "algo": "ina", "nbytes": "4MiB",
              "placement": {"tree": "auto"}}]}


def demo(out_dir: Path = HERE) -> list[Path]:
    """Run ``testbed demo``; write its table as SVG and copy its plot."""
    testbed = Path(sys.executable).with_name("testbed")
    with tempfile.TemporaryDirectory(prefix="tb-docs-") as tmp:
        env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": str(WIDTH), "TERM": "xterm-256color"}
        p = subprocess.run([str(testbed), "demo", "--out", tmp], capture_output=True, text=True,
                           env=env, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"testbed demo failed ({p.returncode}):\n{p.stdout}{p.stderr}")
        (plot,) = Path(tmp).glob("demo-*/demo.png")
        return demo_pictures(p.stdout, plot, out_dir)


def demo_pictures(output: str, plot: Path, out_dir: Path = HERE) -> list[Path]:
    """``demo_table.svg`` from the demo's terminal ``output`` (with its colour codes) and
    ``demo_plot.png`` from its ``plot``."""
    from rich.console import Console
    from rich.text import Text

    # keep the table and the verdict; drop progress lines and local paths
    lines = [ln for ln in output.splitlines()
             if not re.match(r"^(\x1b\[[0-9;]*m)*(\[demo |plot: |results: )", ln)]
    con = Console(record=True, width=WIDTH, file=io.StringIO(), force_terminal=True)
    con.print(Text.from_ansi("\n".join(lines).strip("\n")))
    table = out_dir / "demo_table.svg"
    con.save_svg(str(table), title="sudo make demo")
    shutil.copyfile(plot, out_dir / "demo_plot.png")
    return [table, out_dir / "demo_plot.png"]


def notebook_figure(path: Path, out: Path, results: Path) -> Path:
    """Execute notebook ``path`` (inline plots, results under ``results``) and write its
    chosen figure to ``out``."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(idx + 1, nbformat.v4.new_code_cell(f"RESULTS_DIR = {str(results)!r}"))
    nb.cells.insert(0, nbformat.v4.new_code_cell("%matplotlib inline"))
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(results)}}).execute()
    pngs = [o["data"]["image/png"] for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if "image/png" in o.get("data", {})]
    k = FIGURE.get(path.stem, 0)
    if k >= len(pngs):
        raise SystemExit(f"{path.name} showed {len(pngs)} figures; FIGURE asks for #{k}")
    out.write_bytes(base64.b64decode(pngs[k]))
    return out


def notebooks(out_dir: Path = HERE, names: list[str] | None = None) -> list[Path]:
    """One figure of every notebook (or of those named), as ``notebook_<name>.png``."""
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    unknown = sorted(set(names or []) - {p.stem for p in paths})
    if unknown:
        raise SystemExit(f"no notebook {unknown}; notebooks: {[p.stem for p in paths]}")
    made = []
    with tempfile.TemporaryDirectory(prefix="tb-docs-") as tmp:
        for path in [p for p in paths if not names or p.stem in names]:
            print(f"running {path.name} ...", flush=True)
            made.append(notebook_figure(path, out_dir / f"notebook_{path.stem}.png", Path(tmp)))
    return made


def fabric(out_dir: Path = HERE) -> list[Path]:
    """Run :data:`FABRIC_EXPERIMENT` and keep the fabric picture of its first run."""
    from testbed.experiment.runner import run

    with tempfile.TemporaryDirectory(prefix="tb-docs-") as tmp:
        res = run(FABRIC_EXPERIMENT, out_dir=Path(tmp) / "out", progress=False, doctor=False)
        pictures = sorted((Path(tmp) / "out" / "fabric").glob("run*.png"))
        if not pictures:
            raise SystemExit(f"the experiment stored no fabric picture ({res.metadata})")
        shutil.copyfile(pictures[0], out_dir / "fabric_run.png")
    return [out_dir / "fabric_run.png"]


def main(argv: list[str] | None = None) -> None:
    """Command line: make every picture, or ``--only`` one kind."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("architecture", "demo", "notebooks", "fabric"))
    ap.add_argument("--notebook", action="append", metavar="NAME",
                    help="with --only notebooks: this notebook only (repeatable), e.g. 02_in_network_aggregation")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import architecture

    makers = {"architecture": lambda: [architecture.main()], "demo": demo,
              "notebooks": lambda: notebooks(names=args.notebook), "fabric": fabric}
    for name, make in makers.items():
        if args.only in (None, name):
            for path in make():
                print(f"wrote {path.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    main()
