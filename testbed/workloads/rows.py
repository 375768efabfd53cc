"""A training job's rows: one per iteration and one summary, from every worker's timestamps.

Every worker logs, per iteration, when it started, when its compute phase ended (its
allreduce began), when the allreduce returned and when the update was applied
(:class:`testbed.workloads.loop.RankLog`, ``CLOCK_MONOTONIC``, one clock for all processes of
the machine). Evaluation time is taken out first (:func:`_shifted`). Then, per iteration i:

* ``time_s``: end of iteration i (the last worker's update) since the job's first iteration
  began: the training clock (time-to-accuracy reads it);
* ``iter_s``: that end minus the previous iteration's end;
* ``compute_s``: the workers' mean compute phase (real gradient + emulated padding);
* ``wait_s``: the workers' mean wait in the allreduce for the last worker to arrive
  (the last arrival minus their own);
* ``comm_s``: the last worker's return from the allreduce minus the last arrival: the
  communication itself;
* ``bytes_on_wire``: bytes the job's hosts sent during the allreduce (their interfaces'
  counters, so headers, ACKs and retransmissions count; a frame still in a host's queue when
  its allreduce returned, such as a ring's last segment, counts in the next iteration);
* ``loss``: the workers' mean batch loss; ``accuracy``: held-out accuracy when measured
  after this iteration, else None.

Every time is divided by the job's ``time_dilation`` (the emulation ran that much slower).
The summary row: ``final_accuracy``, ``target_accuracy``, ``tta_s`` (``time_s`` of the first
evaluation at or above the target; None when not reached), ``iterations``, ``jct_s`` (training
time of the whole job), ``comm_fraction`` (share of ``jct_s`` spent communicating once the
last worker had joined the allreduce: the sum of ``comm_s``; waits for slower workers are
``wait_s``), the means of the per-iteration columns, and the run's checks.
"""

from __future__ import annotations

import math

import numpy as np

from testbed.workloads.spec import TrainingSpec

#: Columns of a per-iteration row (after the job's label columns).
ITERATION_COLUMNS = ("iteration", "time_s", "iter_s", "compute_s", "comm_s", "wait_s",
                     "bytes_on_wire", "loss", "accuracy")
#: Columns of a summary row.
SUMMARY_COLUMNS = ("final_accuracy", "target_accuracy", "tta_s", "iterations", "jct_s",
                   "comm_fraction", "iter_s", "compute_s", "comm_s", "wait_s",
                   "bytes_per_iter", "model_comm_s")


def _shifted(logs: list[dict], k: int) -> dict[str, np.ndarray]:
    """Every worker's timestamps (ranks x iterations) with the evaluations taken out.

    The workers evaluate after the same iterations; the slowest one's evaluation is a pause
    of the whole job (the others wait for it in the next allreduce), so from the end of that
    next allreduce on every timestamp moves back by that pause. The start and compute phase
    of the iteration right after an evaluation move back by the worker's own evaluation only
    (it started as soon as it had evaluated)."""
    evals = [{it: secs for it, _acc, secs in log["evals"]} for log in logs]
    pause = np.zeros(k)  # pause[i]: job-level pause before iteration i
    for it in {it for ev in evals for it in ev}:
        if it + 1 < k:
            pause[it + 1] = max(ev.get(it, 0.0) for ev in evals)
    before = np.cumsum(pause)  # shift of every timestamp of iteration i ...
    out = {t: np.stack([np.asarray(log[t][:k], dtype=np.float64) - before for log in logs])
           for t in ("t0", "t1", "t2", "t3")}
    for r, ev in enumerate(evals):  # ... but the start right after an evaluation
        for it, secs in ev.items():
            if it + 1 < k:
                for t in ("t0", "t1"):
                    out[t][r, it + 1] += pause[it + 1] - secs
    return out


def collective_trace(spec: TrainingSpec, logs: list[dict]) -> list[dict]:
    """Every worker's gradient allreduces as ``testbed.c10d`` traces a launched job's
    collectives (``rank, op, dtype, bytes, path, start_s, end_s``; seconds undilated, on the
    job's clock, evaluations taken out), so one writer turns both into a Chakra trace
    (``testbed.workloads.chakra.export``): the gaps between them are the iterations' compute and
    updates. Empty for ``algo="trim"``, whose incast of trimmed packets is no collective a
    trace can name."""
    if spec.algo == "trim" or not logs:
        return []
    k = min(len(log["t0"]) for log in logs)
    ts = _shifted(logs, k)
    f = float(spec.time_dilation)
    start = float(ts["t0"][:, 0].min()) if k else 0.0
    nbytes = 4 * spec.n_params()
    return [{"rank": r, "op": "allreduce", "dtype": "float32", "bytes": nbytes,
             "path": f"testbed:{spec.algo}", "start_s": (ts["t1"][r, i] - start) / f,
             "end_s": (ts["t2"][r, i] - start) / f}
            for r in range(len(logs)) for i in range(k)]


def iteration_rows(spec: TrainingSpec, logs: list[dict]) -> list[dict]:
    """Per-iteration rows (keys :data:`ITERATION_COLUMNS`) from every rank's log."""
    k = min(len(log["t0"]) for log in logs)
    ts = _shifted(logs, k)
    t0, t1, t2, t3 = ts["t0"], ts["t1"], ts["t2"], ts["t3"]
    f = float(spec.time_dilation)
    start = float(t0[:, 0].min()) if k else 0.0
    ends = t3.max(axis=0)
    last_in = t1.max(axis=0)
    accs = {it: acc for it, acc, _ in logs[0]["evals"]}
    loss = np.mean([log["loss"][:k] for log in logs], axis=0)
    tx = np.sum([log["tx_bytes"][:k] for log in logs], axis=0)
    rows = []
    prev = start
    for i in range(k):
        rows.append({
            "iteration": i,
            "time_s": float(ends[i] - start) / f,
            "iter_s": float(ends[i] - prev) / f,
            "compute_s": float(np.mean(t1[:, i] - t0[:, i])) / f,
            "comm_s": float(t2[:, i].max() - last_in[i]) / f,
            "wait_s": float(np.mean(last_in[i] - t1[:, i])) / f,
            "bytes_on_wire": int(tx[i]),
            "loss": float(loss[i]),
            "accuracy": accs.get(i),
        })
        prev = ends[i]
    return rows


def summary_row(spec: TrainingSpec, rows: list[dict]) -> dict:
    """The job's summary (keys :data:`SUMMARY_COLUMNS`) from its per-iteration rows."""
    evals = [(r["time_s"], r["accuracy"]) for r in rows if r["accuracy"] is not None]
    tta = None
    if spec.target_accuracy is not None:
        tta = next((t for t, a in evals if a >= spec.target_accuracy), None)
    jct = rows[-1]["time_s"] if rows else float("nan")
    comm = sum(r["comm_s"] for r in rows)

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in rows])) if rows else float("nan")

    return {
        "final_accuracy": evals[-1][1] if evals else None,
        "target_accuracy": spec.target_accuracy,
        "tta_s": tta,
        "iterations": len(rows),
        "jct_s": jct,
        "comm_fraction": comm / jct if jct and math.isfinite(jct) else float("nan"),
        "iter_s": mean("iter_s"),
        "compute_s": mean("compute_s"),
        "comm_s": mean("comm_s"),
        "wait_s": mean("wait_s"),
        "bytes_per_iter": mean("bytes_on_wire"),
        "model_comm_s": None,
    }
