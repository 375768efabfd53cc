"""``testbed bench torch``: the ``testbed`` process-group backend against gloo, on the same
emulated fabric, with an unmodified script (:mod:`testbed.bench.torch_probe`) launched
by ``testbed launch``.

* **overhead**: seconds per 8-byte ``all_reduce`` through the backend (the testbed's ring)
  against gloo's, on a star of 2 (target: at most 2x gloo's);
* **ddp**: seconds per DDP step with ``MIB`` MiB of gradient on a programmable star of
  ``n`` hosts at 100 Mb/s, gloo against the backend with in-network aggregation; the measured
  ratio beside the ratio the flow model predicts (each step's compute, measured, plus the
  model's allreduce of the same buckets: the ring for gloo, INA for the backend; target:
  within 10 %, and the machine's cores below saturation over the steps: ``cpu_bound``
  otherwise). Under ``--time-dilation F`` the ranks compute at full speed while their
  collectives take F times their undilated time, and the model's ratio counts them so;
* **launch**: from the launch to the first collective, and the largest resident memory of
  a rank.

A 2-core machine running 8 PyTorch ranks and a switch measures its CPU more than the links:
the notes say so; compare ratios from one run only. Rows carry the CPU model.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time

from testbed.bench.protocol import Outcome, parse_dilation
from testbed.collectives.cpumon import UTIL_SATURATED, core_times
from testbed.kernels.benchutil import cpu_description

PROBE = "testbed.bench.torch_probe"
FULL = {"overhead_hosts": 2, "calls": 300, "ddp_hosts": 8, "mib": 4.0, "steps": 10}
QUICK = {"overhead_hosts": 2, "calls": 60, "ddp_hosts": 3, "mib": 1.0, "steps": 4}
#: what the issue's targets ask
MAX_OVERHEAD_RATIO = 2.0
MODEL_RATIO_TOLERANCE = 0.10


class _CoreSampler:
    """The machine's cores sampled every ``every_s`` in a thread, so that the utilisation of
    a window known only afterwards (a probe's DDP steps, not its ranks' start-up) can be
    read."""

    def __init__(self, every_s: float = 0.2):
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while True:
            busy_total = core_times().values()
            self.samples.append((time.time(), sum(b for b, _ in busy_total),
                                 sum(t for _, t in busy_total)))
            if self._stop.wait(every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def util(self, t0: float, t1: float) -> float | None:
        """Busy fraction of the cores between the first sample at or after ``t0`` and the
        last at or before ``t1`` (None: fewer than two samples in the window)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def _probe(hosts: int, algo: str | None, args: list[str], topology: dict, dilation,
           log) -> tuple[dict, object]:
    """The probe's RESULT (with ``cpu_util``: the machine's cores over its DDP steps)."""
    from testbed.launch import launch

    lines: list[str] = []
    cores = _CoreSampler()
    try:
        done = launch(PROBE, args, hosts=hosts, algo=algo, topology=topology,
                      time_dilation=dilation, echo=lines.append, module=True)
    finally:
        cores.stop()
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed ({algo or 'gloo'} on {hosts} hosts): "
                           + " | ".join(done.failures))
    found = [json.loads(m.group(1)) for line in lines
             if (m := re.fullmatch(r"\[0\]:RESULT (\{.*\})", line))]
    if not found:
        raise RuntimeError(f"the probe printed no RESULT line: {lines[-5:]}")
    found[0]["cpu_util"] = cores.util(found[0]["steps_from"], found[0]["steps_to"])
    print(f"bench torch: {algo or 'gloo'} on {hosts} hosts: {found[0]}", file=log)
    return found[0], done


def _model_ring_s(done, spec_bytes: list[int], hosts: int) -> float:
    """The flow model's time of gloo's ring allreduce of buckets ``spec_bytes`` on the
    launched network (its ``launch.json`` description)."""
    from testbed.collectives import flowmodel
    from testbed.collectives.spec import CollectiveSpec

    meta = json.loads((done.folder / "launch.json").read_text())
    desc, dilation = meta["describe"], float(meta["time_dilation"])
    workers = desc["hosts"][:hosts] if isinstance(desc.get("hosts"), list) else None
    return sum(flowmodel.predict(desc, CollectiveSpec(algo="ring", nbytes=b),
                                 workers=workers, time_dilation=dilation).time_s
               for b in spec_bytes)


def run(quick: bool = False, time_dilation: float | str | None = None,
        log=sys.stderr) -> tuple[list[dict], dict]:
    """(rows, notes) of the benchmark (see the module docstring)."""
    p = QUICK if quick else FULL
    cpu = cpu_description()
    rows: list[dict] = []
    star = {"switch": "bridge"}
    args = ["--calls", str(p["calls"]), "--mib", "0.01", "--steps", "1"]
    base, _ = _probe(p["overhead_hosts"], None, args, star, None, log)
    ours, _ = _probe(p["overhead_hosts"], "ring", args, star, None, log)
    ratio = ours["call_s"] / base["call_s"]
    rows.append({"test": "overhead", "case": "8 B all_reduce: testbed ring vs gloo",
                 "n": p["overhead_hosts"], "measured_s": ours["call_s"],
                 "anchor_s": base["call_s"], "anchor": "gloo", "ratio": ratio,
                 "target": f"<= {MAX_OVERHEAD_RATIO:g}",
                 "met": ratio <= MAX_OVERHEAD_RATIO, "cpu": cpu})
    fabric = {"switch": "programmable", "bw_mbps": 100.0}
    args = ["--calls", "5", "--mib", str(p["mib"]), "--steps", str(p["steps"])]
    n = p["ddp_hosts"]
    gloo, _ = _probe(n, None, args, fabric, time_dilation, log)
    ina, done = _probe(n, "ina", args, fabric, time_dilation, log)
    buckets = [r for r in done.trace if r["rank"] == 0 and r["path"] == "testbed:ina"
               and r["bytes"] >= 1024]
    per_step = buckets[-max(1, len(buckets) // (p["steps"] + 2)):]  # the last step's buckets
    model_ina = sum(r["model_s"] for r in per_step)
    model_ring = _model_ring_s(done, [r["bytes"] for r in per_step], n)
    # The ranks' compute runs at full speed and their collectives f times slower: the steps
    # (wall clock) hold the compute plus f times the undilated collective times
    f = float(json.loads((done.folder / "launch.json").read_text())["time_dilation"])
    compute = max(ina["step_s"] - f * sum(r["time_s"] for r in per_step), 0.0)
    model_ratio = (compute + f * model_ina) / (compute + f * model_ring)
    measured_ratio = ina["step_s"] / gloo["step_s"]
    utils = [r["cpu_util"] for r in (gloo, ina) if r["cpu_util"] is not None]
    cpu_bound = any(u >= UTIL_SATURATED for u in utils)
    rows.append({"test": "ddp", "case": f"DDP step, {p['mib']:g} MiB: INA vs gloo", "n": n,
                 "measured_s": ina["step_s"], "anchor_s": gloo["step_s"], "anchor": "gloo",
                 "ratio": measured_ratio, "model_ratio": model_ratio,
                 "target": f"ratio within {MODEL_RATIO_TOLERANCE:.0%} of model_ratio, "
                           "not cpu_bound",
                 "met": abs(measured_ratio / model_ratio - 1) <= MODEL_RATIO_TOLERANCE
                 and not cpu_bound,
                 "cpu_util_gloo": gloo["cpu_util"], "cpu_util_ina": ina["cpu_util"],
                 "cpu_bound": cpu_bound, "grad_bytes": ina["grad_bytes"], "cpu": cpu})
    for name, res in (("gloo", gloo), ("ina", ina)):
        rows.append({"test": "launch", "case": f"{n} ranks ({name}): launch to first "
                     "collective", "n": n, "measured_s": res["to_first_collective_s"],
                     "max_rss_mib": res["max_rss_mib"], "cpu": cpu})
    notes = {"quick": quick, "params": p, "cpu": cpu,
             "caution": "every rank is a PyTorch process on this machine's cores: on a small "
                        "machine the DDP rows measure its CPU as much as the links (dilate "
                        "time with --time-dilation); compare ratios from one run only"}
    return rows, notes


def measure(emit, quick: bool, time_dilation: str | None) -> Outcome:
    """``testbed bench torch`` (:mod:`testbed.bench.protocol`); a probe that fails raises."""
    rows, notes = run(quick=quick, time_dilation=parse_dilation(time_dilation))
    return Outcome(rows, notes)
