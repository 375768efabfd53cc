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
"""

from __future__ import annotations

import inspect

import numpy as np

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
#: Names accepted by :func:`get_compressor`.
COMPRESSORS: tuple[str, ...] = tuple(_REGISTRY)

__all__ = ["COMPRESSORS", "Compressor", "bench_rows", "compressor_params", "decode_any",
           "get_compressor"]


def compressor_params(name: str) -> dict:
    """The parameters of compressor ``name`` with their defaults."""
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    return {k: p.default for k, p in sig.parameters.items() if k != "self"}


def _lookup(name) -> type[Compressor]:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; allowed: {', '.join(COMPRESSORS)}")
    return _REGISTRY[name]


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
    from ._bench import bench_rows as _rows

    return _rows(elements)
