"""Report rows (nccl-tests convention + model), per-rank inputs, the correctness check, and the
one table renderer of the benchmarks.

Every measured thing reports through :func:`make_row`: collectives, incasts
(``testbed.experiment.incast``) and whatever measures the same quantities next.

Inputs are generated per rank from ``(seed, rank)`` so whoever holds the seed can recompute
them; the check compares every rank's output with the numpy reference computed in float64.

Error bounds (``max_abs_err`` must not exceed them for ``correct``):

* int32, or any broadcast/allgather (pure copies): exact, bound 0.
* float32 host reductions (ring/hd/rs): each output element is a float32 sum of the n
  inputs in some order; the classic bound is ``(n-1) * eps32 * sum_i |x_i|`` per element.
* NIC (the SmartNIC quantises with ATP's fixed factor F = 1e6): ``n * 0.5 / F + 2 eps32 |sum|``.
* INA fixed point (SwitchML): each worker rounds ``x * f`` to an integer, so the sum of
  n values is off by at most ``n * 0.5 / f`` with ``f = (2**31 - 1) / (n * 2**e)`` and ``e``
  the chunk's agreed exponent (2**e >= max|x|); plus the float32 rounding of the result:
  bound ``n * 0.5 / f + eps32 * |sum|`` per element, with ``2**e`` <= 2 * global max|x|.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

import numpy as np

from testbed.collectives import model
from testbed.collectives.algorithms import algorithm
from testbed.collectives.spec import CollectiveSpec, Communication
from testbed.collectives.transport import host_tcp_cc

REPORT_COLUMNS: tuple[str, ...] = (
    "op", "algo", "n", "bytes", "count", "time_s", "algbw", "busbw", "model_s", "fidelity",
    "cpu_bound", "max_abs_err", "correct",
    # context
    "topology", "bw_mbps", "compressor", "error_feedback", "loss", "rep", "seed",
    # the TCP congestion control of the run's TCP connections (None: no TCP connection), and
    # what carried a host algorithm's messages: "tcp" or "uet" (None: in-network)
    "tcp_cc", "transport",
    # diagnostics (testbed.collectives.cpumon): busiest worker/server thread and busiest
    # data-path engine thread (fraction of one core), largest fraction of the run one of
    # those threads waited for a CPU, CPU seconds of workers+servers and of engines, busy
    # fraction of the machine's cores, set-up seconds of the processes and connections, their
    # memory (MB, proportional set size); the largest busy-or-waiting share of one such thread
    # and the reasons for cpu_bound (empty when not); the network's time dilation factor
    # (time_s is the measured time divided by it)
    "cpu_max", "cpu_engine", "cpu_wait", "cpu_s", "engine_cpu_s", "cpu_util", "setup_s",
    "mem_mb", "cpu_demand", "cpu_why", "time_dilation",
    # in-network aggregation (None for host algorithms): the aggregating switches (root
    # first), the fraction of rounds aggregated in the network, rounds the host fallback
    # aggregated, aggregator memory the job held over its switches (bytes), how it held it
    # ('static', 'shared', or 'refused': a switch refused it at admission and the job ran as
    # ring on the hosts, placement.refused = 'ring') and the switch that refused it
    "tree", "in_network_fraction", "host_fallback_chunks", "switch_mem_bytes",
    "placement_mode", "refused_by",
)
#: The in-network columns of a row; a host algorithm's row has None there.
INA_COLUMNS = ("tree", "in_network_fraction", "host_fallback_chunks", "switch_mem_bytes",
               "placement_mode", "refused_by")

EPS32 = float(np.finfo(np.float32).eps)


def rank_input(spec: CollectiveSpec, rank: int, count: int) -> np.ndarray:
    """The input array of ``rank`` (deterministic in ``spec.seed``)."""
    rng = np.random.default_rng([spec.seed, rank])
    if spec.dtype == "int32":
        # small magnitudes so an n-way int32 sum never overflows
        return rng.integers(-(1 << 20), 1 << 20, size=count, dtype=np.int32)
    return rng.standard_normal(count, dtype=np.float32)


def shard_bounds(count: int, n: int) -> np.ndarray:
    """Offsets of n near-equal shards of ``count`` elements (length n+1, like array_split)."""
    q, r = divmod(count, n)
    sizes = np.full(n, q, dtype=np.int64)
    sizes[:r] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def input_count(op: str, count: int, n: int, rank: int) -> int:
    """Elements rank ``rank`` contributes (allgather contributes only its shard)."""
    if op == "allgather":
        b = shard_bounds(count, n)
        return int(b[rank + 1] - b[rank])
    return count


def output_count(op: str, count: int, n: int, rank: int) -> int:
    """Elements rank ``rank`` ends up with (reduce_scatter keeps only its shard)."""
    if op == "reduce_scatter":
        b = shard_bounds(count, n)
        return int(b[rank + 1] - b[rank])
    return count


def expected(spec: CollectiveSpec, inputs: list[np.ndarray], n: int) -> tuple[list, list]:
    """Per-rank expected outputs (float64) and per-element error bounds for ``spec``."""
    op = spec.op
    count = spec.count
    b = shard_bounds(count, n)
    if op == "broadcast":
        ref = inputs[0].astype(np.float64)
        return [ref] * n, [np.zeros(1)] * n
    if op == "allgather":
        ref = np.concatenate(inputs).astype(np.float64)
        return [ref] * n, [np.zeros(1)] * n
    total = np.zeros(count, dtype=np.float64)
    abs_total = np.zeros(count, dtype=np.float64)
    for x in inputs:
        total += x
        if spec.dtype == "float32":
            abs_total += np.abs(x)
    if spec.dtype == "int32":
        bound = np.zeros(1)
    elif spec.algo == "nic":  # ATP fixed factor applied by the SmartNIC
        # here, not at the top: Numba kernels load after the pool made Numba fork-safe
        from testbed.kernels.fixedpoint import ATP_FACTOR

        bound = n * 0.5 / ATP_FACTOR + 2 * EPS32 * np.abs(total) + 1e-30
    elif spec.algo == "ina":
        gmax = max(float(np.max(np.abs(x))) for x in inputs)
        e = np.ceil(np.log2(max(gmax, 1e-30)))
        f = (2.0**31 - 1) / (n * 2.0**e)
        bound = n * 0.5 / f + 2 * EPS32 * np.abs(total) + 1e-30
    else:
        bound = (n - 1) * EPS32 * abs_total + EPS32 * np.abs(total)
    if op == "reduce_scatter":
        outs = [total[b[r]:b[r + 1]] for r in range(n)]
        bounds = [bound if bound.size == 1 else bound[b[r]:b[r + 1]] for r in range(n)]
        return outs, bounds
    return [total] * n, [bound] * n


def check(spec: CollectiveSpec, inputs: list[np.ndarray], outputs: list[np.ndarray],
          n: int, ranks: list[int] | None = None) -> tuple[float, bool]:
    """(max_abs_err over all ranks, correct) of ``outputs`` against the numpy reference.
    ``ranks``: whose outputs ``outputs`` are (default: every rank's, in order; a pool that
    runs some of the ranks checks theirs)."""
    refs, bounds = expected(spec, inputs, n)
    if ranks is not None:
        refs, bounds = [refs[r] for r in ranks], [bounds[r] for r in ranks]
    worst = 0.0
    ok = True
    for out, ref, bound in zip(outputs, refs, bounds, strict=True):
        if out.shape != ref.shape:
            return float("inf"), False
        err = np.abs(out.astype(np.float64) - ref)
        if not np.all(np.isfinite(err)):
            return float("inf"), False
        if err.size:
            worst = max(worst, float(err.max()))
            ok = ok and bool(np.all(err <= bound))
    return worst, ok


@dataclasses.dataclass
class Measured(Communication):
    """What a row describes when the measured thing is not a collective run from a
    :class:`CollectiveSpec`: an incast (``op='incast'``: ``n`` senders each push ``nbytes``
    to one receiver), with the same fields the row takes from a spec."""

    op: str
    nbytes: int
    count: int
    seed: int = 0
    loss: float = 0.0


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` among ``n`` ranks (see
    :func:`testbed.collectives.model.busbw_factor`); an incast's receiver link carries every
    sender's bytes, so its factor is ``n`` (busbw = what crossed that link per second)."""
    return float(n) if op == "incast" else model.busbw_factor(op, n)


def tcp_cc_of(spec: CollectiveSpec | Measured, ina: dict | None = None) -> str | None:
    """The congestion control a run's TCP connections used: the spec's, else the host's
    default; None for a run without TCP (in-network aggregation, an incast of datagrams),
    unless a refused INA job (``ina``: its INA columns) ran as ring on the hosts."""
    if not isinstance(spec, CollectiveSpec):
        return None
    if algorithm(spec.algo).traffic != "tcp" and (ina or {}).get("placement_mode") != "refused":
        return None
    return spec.tcp_cc or host_tcp_cc() or None


def transport_of(spec: CollectiveSpec | Measured, ina: dict | None = None) -> str | None:
    """What carried a run's messages between hosts: the spec's ``transport`` for a host
    algorithm (or a refused INA job run as ring); None in-network or for an incast of
    datagrams."""
    if not isinstance(spec, CollectiveSpec):
        return None
    if algorithm(spec.algo).traffic != "tcp" and (ina or {}).get("placement_mode") != "refused":
        return None
    return spec.transport


def make_row(spec: CollectiveSpec | Measured, *, n: int, time_s: float, model_s: float,
             cpu_bound: bool,
             max_abs_err: float, correct: bool, rep: int, topology: str = "",
             bw_mbps: float = 0.0, cpu_max: float = 0.0, cpu_engine: float = 0.0,
             cpu_wait: float = 0.0, cpu_s: float = 0.0, engine_cpu_s: float = 0.0,
             cpu_util: float = 0.0,
             setup_s: float = 0.0, mem_mb: float = 0.0, cpu_demand: float = 0.0,
             cpu_why: str = "", time_dilation: float = 1.0, ina: dict | None = None) -> dict:
    """One report row with every key of :data:`REPORT_COLUMNS` (bandwidths in Gb/s); ``ina``:
    the :data:`INA_COLUMNS` of an in-network job.

    ``algbw = bytes / time_s``, ``busbw = algbw x`` :func:`busbw_factor`,
    ``fidelity = time_s / model_s``.
    """
    algbw = spec.nbytes * 8 / time_s / 1e9 if time_s > 0 else float("nan")
    row = {
        "op": spec.op, "algo": spec.algo, "n": n, "bytes": spec.nbytes, "count": spec.count,
        "time_s": time_s, "algbw": algbw, "busbw": algbw * busbw_factor(spec.op, n),
        "model_s": model_s, "fidelity": time_s / model_s if model_s > 0 else float("nan"),
        "cpu_bound": bool(cpu_bound), "max_abs_err": max_abs_err, "correct": bool(correct),
        "topology": topology, "bw_mbps": bw_mbps, "compressor": spec.compressor,
        "error_feedback": spec.error_feedback, "loss": spec.loss, "rep": rep,
        "seed": spec.seed, "tcp_cc": tcp_cc_of(spec, ina),
        "transport": transport_of(spec, ina),
        "cpu_max": cpu_max,
        "cpu_engine": cpu_engine,
        "cpu_wait": cpu_wait, "cpu_s": cpu_s, "engine_cpu_s": engine_cpu_s,
        "cpu_util": cpu_util, "setup_s": setup_s,
        "mem_mb": mem_mb, "cpu_demand": cpu_demand, "cpu_why": cpu_why,
        "time_dilation": time_dilation,
        **{k: (ina or {}).get(k) for k in INA_COLUMNS},
    }
    assert tuple(row) == REPORT_COLUMNS
    return row


def _cell(v: object) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 10_000 else f"{v:.4g}"
    return str(v)


def render_table(rows: Sequence[dict], columns: Sequence[str], *, title: str | None = None,
                 headers: Sequence[str] | None = None, notes: Iterable[str] = (),
                 file: TextIO | None = None) -> None:
    """Print ``rows`` as one table of ``columns`` (``headers``: their titles), then ``notes``
    one per line. Numbers keep four significant digits; a missing key prints empty.

    Every benchmark prints through this, so their tables read alike.
    """
    from rich.console import Console  # noqa: PLC0415 - only printing needs rich (start-up)
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col, head in zip(columns, headers or columns, strict=True):
        numeric = all(isinstance(r.get(col), (int, float)) for r in rows if col in r)
        table.add_column(str(head), no_wrap=True, justify="right" if numeric else "left")
    for r in rows:
        table.add_row(*[escape(_cell(r[c])) if c in r else "" for c in columns])
    out = file or sys.stdout
    console = Console(file=out, width=max(120, Console(file=out).width))
    console.print(table)
    for note in notes:
        console.print(escape(str(note)), soft_wrap=True)
