"""Gradient compressors (GRACE style) with Numba kernels and a registry.

>>> from testbed.kernels.compressors import get_compressor
>>> c = get_compressor("topk", ratio=0.01)
>>> payload, ctx = c.compress(x, step)          # tuple of arrays, small dict
>>> x_hat = c.decompress(payload, ctx)
>>> data = c.encode(x, step); x_hat = c.decode(data)   # self-describing bytes, no pickle

Every compressor lives in its own module with module-level ``@njit(cache=True)`` kernels
(callable from other Numba code, e.g. the SmartNIC codec stage) and a numpy twin in
``testbed.kernels.reference.compressors``. Error feedback is separate:
``testbed.kernels.memory``.

Other distributions add compressors through the entry-point group ``testbed.compressors``
(``name = "module:Class"``, a :class:`Compressor` subclass whose ``name`` is the entry point's
name; see docs/extending.md): :func:`get_compressor`, :func:`decode_any` and
:func:`compressor_names` know them as well as the built-ins in :data:`COMPRESSORS`.
"""

from __future__ import annotations

import inspect

import numpy as np

from testbed.kernels.plugins import COMPRESSORS_GROUP, PluginError, plugins

from .base import Compressor, decode_payload
from .bf16 import Bf16Compressor
from .dgc import DgcCompressor
from .efsignsgd import EfsignsgdCompressor
from .fp16 import Fp16Compressor
from .natural import NaturalCompressor
from .none import NoneCompressor
from .onebit import OnebitCompressor
from .powersgd import PowersgdCompressor
from .qsgd import QsgdCompressor
from .randomk import RandomkCompressor
from .signsgd import SignsgdCompressor
from .signum import SignumCompressor
from .terngrad import TerngradCompressor
from .thc import ThcCompressor
from .threshold import ThresholdCompressor
from .topk import TopkCompressor

_CLASSES = (NoneCompressor, Fp16Compressor, Bf16Compressor, TopkCompressor, RandomkCompressor,
            ThresholdCompressor, DgcCompressor, QsgdCompressor, TerngradCompressor,
            SignsgdCompressor, EfsignsgdCompressor, SignumCompressor, OnebitCompressor,
            NaturalCompressor, PowersgdCompressor, ThcCompressor)
_REGISTRY: dict[str, type[Compressor]] = {c.name: c for c in _CLASSES}
#: The built-in compressors (plug-ins come on top: :func:`compressor_names`).
COMPRESSORS: tuple[str, ...] = tuple(_REGISTRY)

__all__ = ["COMPRESSORS", "Compressor", "PluginError", "bench_rows", "compressor_class",
           "compressor_names",
           "compressor_params", "decode_any", "get_compressor"]


def compressor_names() -> tuple[str, ...]:
    """Names :func:`get_compressor` accepts: the built-ins, then the plug-ins' (sorted).

    Reads the plug-ins' metadata only (nothing is imported); :class:`PluginError` when a
    plug-in's name is taken twice.
    """
    return COMPRESSORS + tuple(sorted(plugins(COMPRESSORS_GROUP, _REGISTRY)))


def compressor_params(name: str) -> dict:
    """The parameters of compressor ``name`` with their defaults."""
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    return {k: p.default for k, p in sig.parameters.items() if k != "self"}


def _lookup(name) -> type[Compressor]:
    found = plugins(COMPRESSORS_GROUP, _REGISTRY)  # raises on a plug-in that takes a built-in
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    if not isinstance(name, str) or name not in found:
        raise ValueError(f"unknown compressor {name!r}; allowed: "
                         f"{', '.join(COMPRESSORS + tuple(sorted(found)))}")
    plugin = found[name]
    cls = plugin.load(Compressor)
    if cls.name != name:  # encode() writes cls.name, decode_any() looks it up
        raise PluginError(f"{plugin.describe()}: the class says name = {cls.name!r}; the entry "
                          "point's name and the Compressor's name must be the same")
    return cls


def compressor_class(name: str) -> type[Compressor]:
    """The class of compressor ``name``, built-in or plug-in (ValueError on unknown ones)."""
    return _lookup(name)


def get_compressor(name: str, **params) -> Compressor:
    """A new compressor ``name`` configured with ``params`` (ValueError on unknown ones)."""
    cls = _lookup(name)
    allowed = compressor_params(name)
    bad = sorted(set(params) - set(allowed))
    if bad:
        listed = ", ".join(f"{k}={v!r}" for k, v in allowed.items()) or "none"
        raise ValueError(f"compressor {name!r} has no parameter {', '.join(map(repr, bad))}; "
                         f"allowed (with defaults): {listed}")
    return cls(**params)


def decode_any(data: bytes) -> np.ndarray:
    """Decode bytes from any compressor's ``encode`` (it names itself and its parameters).

    Stateful compressors decode statelessly (signum, powersgd need no state to decode).
    """
    name, params, ctx, payload = decode_payload(data)
    return get_compressor(name, **params).decompress(payload, ctx)


def bench_rows(elements: int) -> list[dict]:
    """Benchmark rows (``testbed.kernels.benchutil.row``) for the compressor kernels."""
    from ._bench import bench_rows as _rows  # benchmark code loads only for a benchmark

    return _rows(elements)
