"""Results of an experiment: an incremental on-disk store and the tidy in-memory view.

Results folders are created under the *results root* (:func:`results_root`): the folder named
by the environment variable ``TESTBED_RESULTS`` when set, otherwise ``results/`` of the source
checkout the testbed runs from (an editable install, as ``make setup`` makes), otherwise
``~/testbed-results``. The command line, the demo and notebooks started anywhere therefore
write to the same place.

A results folder ``<results root>/<name>-<timestamp>/`` holds

* ``rows.jsonl`` - one JSON object per finished run, appended and fsync-ed as soon as the run
  ends (the crash-safe source of truth),
* ``results.csv`` and ``results.parquet`` - the same rows as a table, rewritten after every run,
* ``metadata.json`` - provenance (git revision, package versions, the full list of installed
  distributions like ``pip freeze``, machine and CPU model, seed, doctor summary, topology
  descriptions, the experiment itself) and status (running / completed / failed /
  interrupted / stopped) with the recorded failures,
* plots (``*.png``) and pcaps when asked for.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from importlib import metadata as md
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.table import Table

from testbed.collectives import REPORT_COLUMNS
from testbed.doctor import run_checks
from testbed.experiment.plots import plot_metric

#: Environment variable that names the results root (see :func:`results_root`).
RESULTS_ENV = "TESTBED_RESULTS"
#: Results root when the testbed is not imported from a source checkout.
HOME_RESULTS = "~/testbed-results"

#: Columns the runner adds in front of the collectives' report columns.
RUN_COLUMNS = ("run", "point", "job", "label", "status", "error")

_PACKAGES = ("collective-offload-testbed", "numpy", "numba", "scapy", "mininet", "pandas",
             "pyarrow", "pydantic", "matplotlib")


def results_root() -> Path:
    """The folder under which results folders are created, whatever the working directory.

    ``$TESTBED_RESULTS`` when set (``~`` expanded, made absolute); else ``<checkout>/results``
    when the package is imported from a source checkout (git-ignored there, and in the lab VM
    the checkout is the folder shared with the host, so results show up on the laptop); else
    ``~/testbed-results`` (an installed wheel has no checkout, and site-packages is no place
    for data).
    """
    env = os.environ.get(RESULTS_ENV, "").strip()
    if env:
        return Path(env).expanduser().absolute()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "testbed").is_dir():
        return checkout / "results"
    return Path(HOME_RESULTS).expanduser()


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def unique_folder(root: str | Path, name: str) -> Path:
    """``<root>/<name>-<UTC timestamp>``, with a ``-1``, ``-2`` ... suffix if it exists."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{name}-{stamp}"
    path, i = base, 1
    while path.exists():
        path = Path(f"{base}-{i}")
        i += 1
    return path


def _json_default(o: Any) -> Any:
    # numpy scalars / arrays and paths end up in rows and metadata.
    if hasattr(o, "item") and callable(o.item):
        try:
            return o.item()
        except (ValueError, TypeError):
            pass
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def strict_json(v: Any) -> Any:
    """``v`` with NaN and infinities as ``None`` (in nested dicts, lists and tuples too):
    strict JSON, as ``jq`` and other readers want."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [strict_json(x) for x in v]
    return v


def _jsonl(row: dict[str, Any]) -> str:
    return json.dumps(row, default=_json_default) + "\n"


class ResultsStore:
    """Writes rows and metadata to a results folder as they arrive."""

    def __init__(self, out_dir: str | Path, metadata: dict[str, Any]):
        self.path = Path(out_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        # A results folder holds one experiment: re-running into it starts it over.
        for name in ("rows.jsonl", "results.csv", "results.parquet", "metadata.json"):
            (self.path / name).unlink(missing_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.metadata = dict(metadata)
        self.metadata.setdefault("status", "running")
        self.metadata.setdefault("failures", [])
        self.metadata.setdefault("started", _now())
        # Every results folder records its whole environment, whoever wrote it.
        self.metadata.setdefault("environment", environment_freeze())
        self.write_metadata()

    def append(self, row: dict[str, Any]) -> None:
        """Persist one finished run before returning (jsonl fsync + table rewrite)."""
        self.rows.append(row)
        with open(self.path / "rows.jsonl", "a") as f:
            f.write(_jsonl(row))
            f.flush()
            os.fsync(f.fileno())
        if row.get("status") == "error":
            self.metadata["failures"].append(
                {k: row.get(k) for k in ("run", "point", "job", "label", "error")})
            self.write_metadata()
        self._write_tables()

    def sort_rows(self, key: str = "run") -> None:
        """Put the rows (and the recorded failures) in the order of ``key``, on disk too.

        For rows that arrive out of order, e.g. the sweep points of a distributed run, each
        from the machine that finished it first; the sort is stable.
        """
        def order(r: dict[str, Any]) -> tuple:
            return (r.get(key) is None, r.get(key) or 0)

        self.rows.sort(key=order)
        self.metadata["failures"].sort(key=order)
        tmp = self.path / "rows.jsonl.tmp"
        with open(tmp, "w") as f:
            f.writelines(_jsonl(row) for row in self.rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / "rows.jsonl")
        self._write_tables()
        self.write_metadata()

    def _write_tables(self) -> None:
        df = rows_to_frame(self.rows)
        tmp = self.path / "results.csv.tmp"
        df.to_csv(tmp, index=False)
        os.replace(tmp, self.path / "results.csv")
        tmp = self.path / "results.parquet.tmp"
        try:
            parquet_frame(df).to_parquet(tmp, index=False)
            os.replace(tmp, self.path / "results.parquet")
        except Exception as e:  # noqa: BLE001 - no pyarrow, a type arrow cannot write:
            # rows.jsonl and results.csv hold every row; parquet is a convenience
            tmp.unlink(missing_ok=True)
            self.metadata["parquet_error"] = f"{type(e).__name__}: {e}"

    def write_metadata(self) -> None:
        """Rewrite metadata.json atomically."""
        tmp = self.path / "metadata.json.tmp"
        tmp.write_text(json.dumps(self.metadata, indent=2, default=_json_default))
        os.replace(tmp, self.path / "metadata.json")

    def finish(self, status: str, error: str | None = None) -> None:
        """Record the final status (completed / failed / interrupted / stopped)."""
        self.metadata["status"] = status
        self.metadata["finished"] = _now()
        if error:
            self.metadata["error"] = error
        self.write_metadata()


def parquet_frame(df):
    """``df`` as parquet can hold it: a column of nested values (dicts, lists: an empty
    dict is a struct arrow cannot write) or of mixed types holds them as JSON text."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype != object:
            continue
        kinds = {type(v) for v in out[col] if v is not None and not (isinstance(v, float)
                                                                     and v != v)}
        if len(kinds) > 1 or kinds & {dict, list, tuple}:
            out[col] = [None if v is None else json.dumps(v, default=_json_default)
                        for v in out[col]]
    return out


def rows_to_frame(rows: list[dict[str, Any]]):
    """A DataFrame with the run columns first, then report columns, then the rest."""
    df = pd.DataFrame(rows)
    order = [c for c in (*RUN_COLUMNS, *REPORT_COLUMNS) if c in df.columns]
    order += [c for c in df.columns if c not in order]
    return df[order] if len(df.columns) else df


@dataclass
class Results:
    """What :func:`testbed.experiment.run` returns: a tidy table plus provenance.

    ``df`` has one row per run (report columns + sweep parameters + status/error);
    ``metadata`` is what ``metadata.json`` holds; ``path`` the results folder (or None).
    """

    df: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @classmethod
    def load(cls, path: str | Path) -> Results:
        """Read a results folder written by the runner (also a partial one)."""
        path = Path(path)
        rows = []
        jl = path / "rows.jsonl"
        if jl.exists():
            rows = [json.loads(line) for line in jl.read_text().splitlines() if line.strip()]
        meta = {}
        if (path / "metadata.json").exists():
            meta = json.loads((path / "metadata.json").read_text())
        return cls(rows_to_frame(rows), meta, path)

    def records(self) -> list[dict[str, Any]]:
        """The rows as recorded (``rows.jsonl``: each with its own keys and types), or the
        table's rows when there is no folder."""
        jl = self.path / "rows.jsonl" if self.path is not None else None
        if jl is not None and jl.exists():
            return [json.loads(line) for line in jl.read_text().splitlines() if line.strip()]
        return self.df.to_dict("records")

    @property
    def ok(self):
        """Only the runs that finished without error."""
        if "status" not in self.df.columns:
            return self.df
        return self.df[self.df["status"] == "ok"]

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The failed runs as recorded in the metadata."""
        return list(self.metadata.get("failures", []))

    def summary(self, columns: list[str] | None = None):
        """The main columns of the finished runs (a DataFrame that prints well)."""
        cols = columns or ["label", "n", "bytes", "time_s", "model_s", "fidelity",
                           "busbw", "max_abs_err", "correct", "cpu_bound"]
        extra = list(self.metadata.get("sweep_columns", []))
        cols = [c for c in [*extra, *cols] if c in self.df.columns]
        return self.ok[cols].reset_index(drop=True)

    def print_table(self, title: str | None = None) -> None:
        """Print the summary as a rich table."""

        df = self.summary()
        console = Console()
        if not console.is_terminal:  # logs and pipes: do not squeeze the columns to 80
            console = Console(width=160)
        table = Table(title=title or self.metadata.get("name"))
        cells = [[_fmt(v) for v in r] for _, r in df.iterrows()]
        for i, c in enumerate(df.columns):
            head = _SHORT.get(str(c), str(c))
            width = max([len(head)] + [len(row[i]) for row in cells])
            table.add_column(head, justify="right", no_wrap=True, min_width=width)
        for row in cells:
            table.add_row(*row)
        console.print(table)
        for f in self.failures:
            console.print(f"[red]run {f.get('run')} ({f.get('label')}) failed:[/] "
                            f"{f.get('error')}")

    def plot(self, x: str = "bytes", y: str = "time_s", out: str | Path | None = None, **kw):
        """Measured ``y`` vs ``x`` per label with the model beside it (see plots.plot_metric)."""

        if out is None and self.path is not None:
            out = self.path / f"{y}_vs_{x}.png"
        return plot_metric(self.ok, x=x, y=y, out=out, **kw)


_SHORT = {"time_s": "time s", "model_s": "model s", "fidelity": "meas/model",
          "max_abs_err": "max err", "correct": "ok", "cpu_bound": "cpu"}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}"
    if type(v).__name__ in ("bool", "bool_"):
        return "yes" if v else "no"
    return str(v)


# -- provenance -------------------------------------------------------------------------------

def git_revision(repo: str | Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the source tree the testbed is imported from."""
    repo = Path(repo) if repo else Path(__file__).resolve().parents[2]
    out: dict[str, Any] = {"commit": None, "dirty": None}
    try:
        out["commit"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                       capture_output=True, text=True, timeout=10,
                                       check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=10, check=True).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape results."""

    out: dict[str, str | None] = {}
    for p in _PACKAGES:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    out["python"] = platform.python_version()
    return out


def environment_freeze() -> list[str]:
    """Every installed distribution as ``name==version`` (sorted, like ``pip freeze``).

    Editable installs say where their source is (``name==version (editable: path)``), so a
    results folder tells exactly which code and libraries produced it.
    """

    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata.get("Name")
        if not name:
            continue
        line = f"{name}=={dist.version}"
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            direct = {}
        if direct.get("dir_info", {}).get("editable"):
            line += f" (editable: {direct.get('url', '').removeprefix('file://')})"
        # one line per name: with the checkout on sys.path (python -m pytest, python -c in
        # it) setuptools' egg-info there is a second copy of the editable install
        if len(line) > len(out.get(name.lower(), "")):
            out[name.lower()] = line
    return sorted(out.values(), key=str.lower)


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (benchmarks compare runs by it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    """Host name, kernel, CPUs and their model, memory and load at the start of the run."""
    info: dict[str, Any] = {"hostname": platform.node(), "kernel": platform.release(),
                            "machine": platform.machine(), "cpus": os.cpu_count(),
                            "cpu_model": cpu_model()}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return info


def doctor_summary() -> dict[str, Any]:
    """``testbed.doctor.run_checks()`` reduced to name -> status (or why it is unavailable)."""
    t0 = time.monotonic()
    try:

        checks = run_checks()
    except Exception as e:  # the doctor is provenance, never a reason to fail a run
        return {"unavailable": f"{type(e).__name__}: {e}"}
    out = {c.get("name", "?"): c.get("status") for c in checks}
    out["_seconds"] = round(time.monotonic() - t0, 2)
    return out
