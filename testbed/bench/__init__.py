"""Benchmarks behind one protocol: ``testbed bench NAME [options] [--quick] [--json] [--out DIR]``.

A benchmark is one :class:`Benchmark` declaration in :data:`CATALOG` (its name, one line of
help, its options with their defaults and ``--quick`` values, the columns of its table and the
function that measures); the command line makes one command per declaration, and
``testbed bench all`` runs them in turn. What every benchmark shares lives in
:func:`run_benchmark`: the options ``--quick`` sets, the CPU recorded with the rows, the JSON
lines or table, the targets, the results folder of ``--out`` (kept even when the benchmark
fails part-way) and the exit status (0 every row correct, 1 a row wrong or a run failed,
2 bad options or a machine that cannot run it).

Importing this package is cheap (no Mininet, no Numba): the measuring modules
(:mod:`testbed.bench.kernels` wraps :mod:`testbed.kernels.bench`, the others are
``testbed.bench.<name>``) are imported when their benchmark runs.
"""

from testbed.bench.protocol import (
    CATALOG,
    Benchmark,
    Option,
    Outcome,
    benchmark,
    benchmark_names,
    resolve_options,
    run_benchmark,
)

__all__ = ["CATALOG", "Benchmark", "Option", "Outcome", "benchmark", "benchmark_names",
           "resolve_options", "run_benchmark"]
