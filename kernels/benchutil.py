"""Timing helpers shared by the kernel benchmarks (one row format for every kernel)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``repeat`` calls of ``fn`` after ``warmup`` calls (JIT compile, caches)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def row(kernel: str, elements: int, seconds: float, bytes_moved: int, anchor: str,
        anchor_seconds: float, anchor_bytes_moved: int) -> dict:
    """One benchmark row. ``bytes_moved`` counts bytes read plus bytes written.

    ``ratio`` = kernel GB/s over anchor GB/s (higher is better for the kernel).
    """
    gbps = bytes_moved / seconds / 1e9
    anchor_gbps = anchor_bytes_moved / anchor_seconds / 1e9
    return {
        "kernel": kernel,
        "elements": elements,
        "gbps": round(gbps, 3),
        "anchor": anchor,
        "anchor_gbps": round(anchor_gbps, 3),
        "ratio": round(gbps / anchor_gbps, 3),
    }
