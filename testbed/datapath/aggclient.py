"""Frame builders for tests and benchmarks that talk to the aggregate program directly.

The real INA worker is :mod:`testbed.collectives.ina`; these helpers craft single frames
(including invalid ones) from the one wire table and the one Eth/IPv4/UDP builder.
"""

from __future__ import annotations

import numpy as np

from testbed.kernels.reference.packets import udp_frame
from testbed.kernels.wire import Codec, pack_header

__all__ = ["header_bytes", "udp_frame", "worker_input"]


def worker_input(seed: int, job: int, worker: int, length: int, n_workers: int) -> np.ndarray:
    """The int32 vector worker ``worker`` of ``job`` contributes (no overflow for n workers)."""
    rng = np.random.default_rng([seed, job, worker])
    lim = (2**31 - 1) // max(1, n_workers)
    return rng.integers(-lim, lim, size=length, dtype=np.int64).astype(np.int32)


def header_bytes(msg_type: int, job: int, worker: int, slot: int, sset: int, n_workers: int,
                 elem_count: int, chunk_offset: int, exponent: int = 0,
                 codec: int = int(Codec.INT32), flags: int = 0, seq: int | None = None) -> bytes:
    """The testbed header with these fields; ``seq`` (the round) defaults to ``sset``, the
    first two rounds of a job registered with ``seq0 = 0``."""
    return pack_header(msg_type=msg_type, job_id=job, worker_id=worker, slot=slot,
                       slot_set=sset, n_workers=n_workers, elem_count=elem_count,
                       chunk_offset=chunk_offset, exponent=exponent, codec=codec, flags=flags,
                       seq=sset if seq is None else seq)
