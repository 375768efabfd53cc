"""Timing helpers shared by the kernel benchmarks (one row format for every kernel)."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from functools import cache

from llvmlite import binding as llvm


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


def paired(kernel: Callable[[], object], anchor: Callable[[], object],
           rounds: int = 9) -> tuple[float, float]:
    """Best times of ``kernel`` and ``anchor`` measured alternately (after one warm-up call
    each), so both see the same load on a shared machine."""
    kernel()
    anchor()
    tk = ta = float("inf")
    for _ in range(rounds):
        tk = min(tk, best_seconds(kernel, repeat=1, warmup=0))
        ta = min(ta, best_seconds(anchor, repeat=1, warmup=0))
    return tk, ta


@cache
def cpu_description() -> str:
    """The CPU the kernels ran on: model name, LLVM's name for it, and its widest vectors
    (a kernel's speed depends on both; the benchmarks print this with every table)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    features = llvm.get_host_cpu_features()
    widest = ("AVX-512" if features.get("avx512f") else "AVX2" if features.get("avx2")
              else "NEON" if platform.machine() in ("aarch64", "arm64") else "SSE/other")
    return f"{model} ({llvm.get_host_cpu_name()}, {widest})"


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
