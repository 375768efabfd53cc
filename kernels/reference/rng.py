"""Plain numpy twins of :mod:`testbed.kernels.rng` (same streams, bit for bit).

``stream_key`` is plain Python in the kernel module already; it is shared, not twinned.
"""

from __future__ import annotations

import numpy as np

from testbed.kernels.rng import INV24, stream_key  # noqa: F401  (stream_key: shared, pure Python)

_M32 = np.uint64(0xFFFFFFFF)


def hash_u32(i, key) -> np.ndarray:
    """Twin of ``rng.hash_u32`` over index arrays (``key`` a scalar or an array that
    broadcasts with ``i``); uint64 results < 2**32."""
    h = ((np.asarray(i).astype(np.uint64) & _M32) * np.uint64(0x9E3779B1)
         + (np.asarray(key).astype(np.uint64) & _M32)) & _M32
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x7FEB352D)) & _M32
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x846CA68B)) & _M32
    h ^= h >> np.uint64(16)
    return h


def uniform32(i, key) -> np.ndarray:
    """Twin of ``rng.uniform32``: float32 in [0, 1) with 24 bits."""
    return (hash_u32(i, key) >> np.uint64(8)).astype(np.float32) * np.float32(INV24)


def uniform(i, key) -> np.ndarray:
    """Twin of ``rng.uniform``: the same draw as float64."""
    return uniform32(i, key).astype(np.float64)


def draw16(i, key) -> np.ndarray:
    """Twin of ``rng.draw16`` over an index array: int64 in [0, 2**16)."""
    i = np.asarray(i).astype(np.int64)
    h = hash_u32(((i >> 4) << 3) | (i & 7), key).astype(np.int64)
    return (h >> (((i >> 3) & 1) << 4)) & 0xFFFF


def mix64(z: np.ndarray) -> np.ndarray:
    """Twin of ``rng.mix64`` over a uint64 array (wrap-around)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def counter_key(seed: int, hi) -> np.ndarray:
    """Twin of ``rng.counter_key`` over an array of high words."""
    with np.errstate(over="ignore"):
        z = (np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF)
             + (np.asarray(hi).astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    return mix64(z) & _M32


def uniform01(seed: int, counter) -> np.ndarray:
    """Twin of ``rng.uniform01`` over an array of counters (int64 or uint64)."""
    c = np.asarray(counter).astype(np.uint64)
    return uniform(c & _M32, counter_key(seed, c >> np.uint64(32)))
