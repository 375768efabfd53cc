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


def at_once(fn, n: int, name: str, on_interrupt=None) -> None:
    """``fn(0)`` .. ``fn(n - 1)`` at the same time, a thread each, until every one returned;
    one alone runs in this thread, where a Ctrl-C reaches it. A Ctrl-C while waiting is raised
    at once, or, with ``on_interrupt``, after calling it and waiting for every thread (it
    stops what they run, so nothing is torn down under them)."""
    import threading

    if n == 1:
        fn(0)
        return
    threads = [threading.Thread(target=fn, args=(k,), name=f"{name}-{k}") for k in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        if on_interrupt is None:
            raise
        on_interrupt()
        for t in threads:
            t.join()
        raise
