"""Worker-side collectives (ring, halving-doubling, reduction server, in-network aggregation),
the alpha-beta model and nccl-tests style report rows.

>>> from testbed.collectives import CollectiveSpec, run_collective, REPORT_COLUMNS, model
>>> rows = run_collective(net, CollectiveSpec(op="allreduce", algo="ring", nbytes=8 << 20))
"""

import importlib

#: What ``from testbed.collectives import X`` gives, and from where: loaded on first use, so
#: that a schema importing ``testbed.collectives.spec`` or ``.algorithms`` does not pull in
#: the runner (and with it Mininet).
_EXPORTS = {
    "CollectiveSpec": "testbed.collectives.spec",
    "run_collective": "testbed.collectives.runner",
    "REPORT_COLUMNS": "testbed.collectives.report",
    "CollectiveError": "testbed.collectives.transport",
    "CollectiveTimeout": "testbed.collectives.transport",
    "algorithm": "testbed.collectives.algorithms",
    "algorithm_names": "testbed.collectives.algorithms",
}

__all__ = [*_EXPORTS, "model"]


def __getattr__(name: str):
    if name == "model":
        return importlib.import_module("testbed.collectives.model")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'testbed.collectives' has no attribute {name!r}")
