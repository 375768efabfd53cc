"""Emulation testbed for offloading AI collectives to the network.

Layers (each imports only the ones below it)::

    testbed.experiment   declarative experiments, results, plots, pytest plugin
    testbed.collectives  worker-side allreduce & friends, alpha-beta model, reports
    testbed.topologies   Mininet topologies (folder topologies/)
    testbed.datapath     userspace programmable switch / SmartNIC engine
    testbed.kernels      Numba kernels + numpy reference twins (folder kernels/)
"""

__version__ = "0.1.0"

# Every name the testbed gives to a node, interface or process starts with this, so that
# `testbed cleanup` only ever touches what the testbed itself created.
PREFIX = "tb"


def describe_error(e: BaseException) -> str:
    """``Type: message (at file.py:line)`` of an unexpected exception: where it was raised,
    for a report that keeps its rows rather than a traceback."""
    import traceback
    from pathlib import Path

    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
