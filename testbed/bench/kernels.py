"""``testbed bench kernels``: :mod:`testbed.kernels.bench` (Numba kernels against numpy
anchors) behind the benchmark protocol."""

from __future__ import annotations

from testbed.bench.protocol import Outcome


def measure(emit, quick: bool, elements: int, only: str) -> Outcome:
    """Every row group (or those in ``only``, comma-separated) for ``elements`` floats."""
    from testbed.kernels.bench import rows

    groups = tuple(g.strip() for g in only.split(",") if g.strip()) or None
    measured = rows(elements, groups)
    notes = {"elements": elements} | ({"only": list(groups)} if groups else {})
    unmeasured = {r["kernel"]: r.get("note", "no measurement") for r in measured
                  if r.get("gbps") is None}
    if unmeasured:
        notes["not_measured"] = unmeasured
    return Outcome(measured, notes)
