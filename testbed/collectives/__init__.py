"""Worker-side collectives (ring, halving-doubling, reduction server, in-network aggregation),
the alpha-beta model and nccl-tests style report rows.

>>> from testbed.collectives import CollectiveSpec, run_collective, REPORT_COLUMNS, model
>>> rows = run_collective(net, CollectiveSpec(op="allreduce", algo="ring", nbytes=8 << 20))
"""

from testbed.collectives import model
from testbed.collectives.report import REPORT_COLUMNS
from testbed.collectives.runner import run_collective
from testbed.collectives.spec import SUPPORTED, CollectiveSpec
from testbed.collectives.transport import CollectiveError, CollectiveTimeout

__all__ = ["CollectiveSpec", "run_collective", "REPORT_COLUMNS", "model", "SUPPORTED",
           "CollectiveError", "CollectiveTimeout"]
