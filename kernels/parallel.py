"""When the kernels run in parallel, and the decorator that gives a kernel both forms.

A kernel decorated with :func:`kernel` is compiled twice, serially and with ``prange``
(``parallel=True``), and a small ``@njit`` dispatcher picks the parallel form from
:data:`PAR_MIN` elements of work. Below it the serial form runs: a parallel region costs tens
of microseconds on an idle machine and up to tens of milliseconds on a loaded 2-core one
(measured with the OpenMP layer), which would dominate the per-packet calls of the data path.

Kernels that split a tensor into whole chunks themselves (``fixedpoint``'s ``*_par``) use
:func:`block_range` over :data:`PAR_BLOCKS` blocks.
"""

from __future__ import annotations

import inspect
import types as pytypes

import numba
import numpy as np
from numba import njit

#: Work (elements) from which a :func:`kernel` runs its parallel (prange) form.
PAR_MIN = 1 << 20

#: Blocks a block-parallel kernel splits a tensor into (a constant: reading the thread count
#: inside a kernel would stop Numba from caching it).
PAR_BLOCKS = 16

# Start Numba's parallel thread pool now. A cache-loaded serial @njit function that calls a
# prange kernel does not launch the pool itself, and the first parallel call then segfaults
# (numba 0.68 with the OpenMP layer); compiling in-process hides this.
numba.get_num_threads()


def kernel(size: str):
    """Decorator: compile ``fn`` as a serial and a parallel (prange) Numba kernel and return
    an ``@njit(cache=True)`` dispatcher with the same signature that runs the parallel one
    when the expression ``size`` (over the arguments, e.g. ``"x.size"``) is >= PAR_MIN.

    The result is callable from Python and from other ``@njit`` code; ``fn.serial`` and
    ``fn.parallel`` expose both forms (tests compare them).
    """

    def deco(fn):
        ser = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                                   fn.__defaults__, fn.__closure__)
        ser.__qualname__ = fn.__qualname__ + "_serial"
        ser.__module__ = fn.__module__
        ser_jit = njit(cache=True)(ser)
        par_jit = njit(cache=True, parallel=True)(fn)
        args = ", ".join(inspect.signature(fn).parameters)
        lines = "\n" * (fn.__code__.co_firstlineno - 1)  # keep a distinct, real source line
        src = (f"{lines}def {fn.__name__}({args}):\n"
               f"    if {size} >= _PAR_MIN:\n"
               f"        return _par({args})\n"
               f"    return _ser({args})\n")
        ns = {"_par": par_jit, "_ser": ser_jit, "_PAR_MIN": PAR_MIN, "np": np}
        exec(compile(src, fn.__code__.co_filename, "exec"), ns)
        wrapper = ns[fn.__name__]
        wrapper.__doc__ = fn.__doc__
        wrapper.__module__ = fn.__module__
        wrapper.__qualname__ = fn.__qualname__ + "_dispatch"
        disp = njit(cache=True)(wrapper)
        disp.serial = ser_jit
        disp.parallel = par_jit
        return disp

    return deco


@njit(cache=True, inline="always")
def block_range(b, nblocks, nch, chunk, length):
    """Chunk range ``[c0, c1)`` and element range ``[lo, hi)`` of block ``b`` of ``nblocks``
    when ``length`` elements in ``nch`` chunks of ``chunk`` are split into blocks of whole
    chunks (``chunk`` = 1 splits elements)."""
    per = (nch + nblocks - 1) // nblocks
    c0 = min(b * per, nch)
    c1 = min(c0 + per, nch)
    return c0, c1, min(c0 * chunk, length), min(c1 * chunk, length)
