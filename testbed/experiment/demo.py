"""The embedded default experiment behind ``testbed demo`` / ``make demo``.

A star of 4 workers with 100 Mb/s links around one programmable switch; an 8 MB allreduce by
ring, by in-network aggregation (INA), and with compression; a table of measured time next to
the α-β model's prediction, and a PNG plot in the results folder. In-network aggregation
should beat the ring: each worker sends and receives the array once instead of 2(n−1)/n
times.

A run flagged ``cpu_bound`` measured the machine's CPU rather than the network (its reasons
are in the ``cpu_why`` column): the demo then says so and suggests time dilation
(``testbed demo --time-dilation auto``), which runs the network slower and reports
undilated times.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from testbed.collectives import CollectiveSpec
from testbed.experiment.plots import plot_bars
from testbed.experiment.runner import run
from testbed.netlock import EmulationBusy

NOT_ROOT_HELP = (
    "testbed demo builds an emulated network and needs root: run 'sudo make demo' "
    "(or 'sudo .venv/bin/testbed demo'), or use the lab VM: 'vagrant up && vagrant ssh', "
    "then 'cd /vagrant && sudo make demo'."
)

#: INA with a compressor when the collectives layer supports it, else compressed ring.
_COMPRESSED_CANDIDATES = (("ina", "thc"), ("ina", "fp16"), ("ring", "fp16"))


def compressed_job(n_hosts: int, nbytes: int) -> dict[str, Any]:
    """The demo's third job: the first (algo, compressor) the collectives layer accepts."""
    for algo, comp in _COMPRESSED_CANDIDATES:
        try:
            CollectiveSpec(op="allreduce", algo=algo, nbytes=nbytes,
                           compressor=comp).validate(n_hosts)
        except ValueError:
            continue
        return {"name": f"{algo}+{comp}", "algo": algo, "nbytes": nbytes, "compressor": comp}
    raise RuntimeError("no compressed allreduce is available in testbed.collectives")


def demo_experiment(nbytes: int = 8_000_000, n_hosts: int = 4, bw_mbps: float = 100.0,
                    repetitions: int = 1, time_dilation: float | str = 1.0) -> dict[str, Any]:
    """The demo as an experiment dict (also a template for your own)."""
    jobs = [{"name": "ring", "algo": "ring", "nbytes": nbytes},
            {"name": "ina", "algo": "ina", "nbytes": nbytes},
            compressed_job(n_hosts, nbytes)]
    for j in jobs:
        j["repetitions"] = repetitions
    return {"name": "demo",
            "description": f"allreduce of {nbytes} B on a star of {n_hosts} workers at "
                           f"{bw_mbps:g} Mb/s: ring vs INA vs compression",
            "topology": {"kind": "star", "n_hosts": n_hosts, "bw_mbps": bw_mbps,
                         "switch": "programmable"},
            "time_dilation": time_dilation,
            "jobs": jobs}


def render(res) -> dict[str, Any]:
    """Print the demo's table and verdict; return the figures it is based on."""
    con = Console(width=max(Console().width, 100))
    df = res.ok
    if len(df) == 0:
        for f in res.failures:
            con.print(f"[red]run {f.get('run')} ({f.get('label')}) failed:[/] {f.get('error')}")
        return {"labels": []}
    means = df.groupby("label", sort=False)[["time_s", "model_s", "busbw", "max_abs_err"]].mean()
    correct = df.groupby("label", sort=False)["correct"].all()
    cpu = df.groupby("label", sort=False)["cpu_bound"].any()
    table = Table(title=res.metadata.get("description", "demo"))
    for col in ("job", "time s", "model s", "meas/model", "busbw Gb/s", "max err", "correct",
                "cpu_bound"):
        table.add_column(col, justify="right", no_wrap=True)
    for label, r in means.iterrows():
        table.add_row(label, f"{r.time_s:.3f}", f"{r.model_s:.3f}", f"{r.time_s / r.model_s:.2f}",
                      f"{r.busbw:.4f}", f"{r.max_abs_err:.2e}",
                      "[green]yes[/]" if correct[label] else "[red]NO[/]",
                      "yes" if cpu[label] else "no")
    con.print(table)
    out: dict[str, Any] = {"labels": list(means.index)}
    if {"ring", "ina"} <= set(means.index):
        speedup = means.loc["ring", "time_s"] / means.loc["ina", "time_s"]
        model_speedup = means.loc["ring", "model_s"] / means.loc["ina", "model_s"]
        out.update(speedup=speedup, model_speedup=model_speedup)
        verdict = "[green]INA beats ring[/]" if speedup > 1 else "[red]INA did not beat ring[/]"
        con.print(f"{verdict}: ring/INA time = {speedup:.2f}x measured, "
                  f"{model_speedup:.2f}x predicted by the α-β model")
    out.update(_cpu_verdict(con, df))
    for f in res.failures:
        con.print(f"[red]run {f.get('run')} ({f.get('label')}) failed:[/] {f.get('error')}")
    return out


def _cpu_verdict(con, df) -> dict[str, Any]:
    """Say which runs the CPU, not the network, paced (and what to do), and at which time
    dilation the runs were made."""
    dilation = float(df["time_dilation"].max()) if "time_dilation" in df.columns else 1.0
    if dilation > 1:
        con.print(f"time dilation {dilation:g}: the links ran at 1/{dilation:g} of their rate "
                  "and every time above is reported undilated")
    bound = df[df["cpu_bound"].astype(bool)]
    if len(bound) == 0:
        return {"cpu_bound": 0, "time_dilation": dilation}
    why = [w for w in bound.get("cpu_why", []) if isinstance(w, str) and w]
    labels = ", ".join(dict.fromkeys(bound["label"]))
    hint = ("run it dilated: testbed demo --time-dilation auto (the network runs slower, "
            "times are reported undilated)" if dilation == 1 else
            "a larger factor may help: testbed demo --time-dilation auto, or a busy machine "
            "may be the cause (other processes' load does not shrink with dilation)")
    con.print(f"[yellow]{len(bound)} of {len(df)} runs were cpu_bound[/] ({labels}): this "
              "machine's CPU, not the emulated network, set their pace"
              + (f" ({why[0]})" if why else "") + f", so their model ratios do not measure "
              f"the network; {hint}", highlight=False)
    return {"cpu_bound": len(bound), "time_dilation": dilation}


def run_demo(nbytes: int = 8_000_000, n_hosts: int = 4, out: str | Path | None = None,
             repetitions: int = 1, progress: bool = True, time_dilation: float | str = 1.0):
    """Run the demo experiment; returns ``(Results, plot path)``."""
    res = run(demo_experiment(nbytes, n_hosts, repetitions=repetitions,
                              time_dilation=time_dilation),
              progress=progress, results_root=out)
    png = Path(res.path) / "demo.png"
    if len(res.ok):
        plot_bars(res.ok, y="time_s", out=png,
                  title=f"allreduce {nbytes / 1e6:g} MB, {n_hosts} workers: measured vs model")
    return res, png


def main(nbytes: int = 8_000_000, n_hosts: int = 4, out: str | Path | None = None,
         time_dilation: float | str = 1.0) -> int:
    """CLI entry (``testbed demo``): 0 when every run finished with a correct result."""
    err = Console(stderr=True)
    if os.geteuid() != 0:
        err.print(f"[red]{NOT_ROOT_HELP}[/red]")
        return 1

    try:
        res, png = run_demo(nbytes, n_hosts, out, time_dilation=time_dilation)
    except EmulationBusy as exc:
        err.print(f"[red]testbed demo:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return 130
    except Exception as exc:  # a failed experiment is reported, not dumped as a traceback
        err.print(f"[red]testbed demo failed:[/red] {type(exc).__name__}: {exc}")
        return 1
    render(res)
    if png.exists():
        print(f"plot: {png}")
    print(f"results: {res.path}")
    ok = len(res.ok) == len(res.df) and bool(res.df["correct"].all())
    return 0 if ok else 1
