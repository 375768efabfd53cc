"""Argument checks shared by the kernels' Python wrappers and the data-path stages.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong kind of object) whose message
names the argument and says what to pass instead. The Numba kernels themselves do not check:
their wrappers do, once per call, before any work.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from testbed.kernels.reductions import all_finite


def check_number(name: str, lo: float, hi: float, *, integer: bool = False,
                 lo_open: bool = False) -> Callable[[object], int | float]:
    """A validator for a numeric setting ``name`` in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``): ``check_number("rate", 0, 1)(v)`` returns ``v`` as a float (an int with
    ``integer``) or raises ValueError naming ``name``. Booleans, NaN and inf are refused.

    A validator rather than a direct check, so that per-port settings can apply one check to
    each of their values (``testbed.datapath.trim.per_port``).
    """
    ok_type = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    kind = "an integer" if integer else "a number"
    left = "(" if lo_open else "["

    def check(value):
        if isinstance(value, bool) or not isinstance(value, ok_type):
            raise ValueError(f"{name}: must be {kind} in {left}{lo}, {hi}], got {value!r}")
        v = int(value) if integer else float(value)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise ValueError(f"{name}: must be {kind} in {left}{lo}, {hi}], got {value!r}")
        return v

    return check


def check_step(step) -> int:
    """``step`` (the index of a training step, which selects a random stream) as a
    non-negative int, or ValueError."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def check_vector(x, name: str = "x") -> np.ndarray:
    """Return ``x`` as a contiguous 1-D float32 array of finite values, or raise ValueError."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a numpy array (1-D float32), got {type(x).__name__}; "
                         f"use np.asarray({name}, dtype=np.float32)")
    if x.dtype != np.float32:
        raise ValueError(f"{name} must have dtype float32, got {x.dtype}; "
                         f"convert with {name}.astype(np.float32)")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}; flatten it with {name}.ravel()")
    x = np.ascontiguousarray(x)
    if x.size and not all_finite(x):
        raise ValueError(f"{name} contains NaN or inf; compressors need finite values "
                         "(check the gradient or the loss scaling first)")
    return x


def check_array(name: str, a, dtype) -> None:
    """``a`` must be a contiguous 1-D numpy array of ``dtype`` (TypeError for the wrong kind
    or dtype, ValueError for the wrong shape or layout)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}; "
                        f"convert with {name}.astype(np.{np.dtype(dtype).name})")
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be contiguous; pass np.ascontiguousarray({name})")


def check_finite(name: str, x: np.ndarray, what: str) -> None:
    """ValueError naming the first NaN/inf element of ``x``; ``what`` says who needs finite
    values and what to do (e.g. "fixed-point aggregation needs finite values")."""
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}: element {i} is {x.flat[i]}; {what}")
