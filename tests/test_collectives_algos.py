"""The host-based algorithms (real processes, real TCP) on the loopback of this namespace.

Fast coverage of every (op, algo) for n = 2..8 and sizes that are not multiples of the
chunk; the same code runs inside Mininet hosts in test_collectives_star.py.
"""

from __future__ import annotations

import os

import pytest

from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import loopback_ip
from testbed.collectives.worker import run_pool


def _run(n: int, m: int = 0, **kw) -> dict:
    spec = CollectiveSpec(timeout_s=10, chunk_bytes=4096, **kw)
    spec.validate(n + m)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()}
             for i in range(n + m)]
    return run_pool({"spec": spec.to_json(), "n": n, "m": m, "ranks": ranks})


CASES = [
    # (op, algo, n, nbytes)
    ("allreduce", "ring", 2, 4 * 1001),
    ("allreduce", "ring", 7, 4 * 30_001),
    ("allreduce", "hd", 2, 4 * 3),
    ("allreduce", "hd", 3, 4 * 30_001),
    ("allreduce", "hd", 6, 4 * 20_003),
    ("allreduce", "hd", 8, 4 * 10_007),
    ("allreduce", "hd", 5, 4 * 70_001),  # rounds of 140 and 70 KB: both meet first
    ("reduce_scatter", "ring", 5, 4 * 10_001),
    ("reduce_scatter", "hd", 4, 4 * 10_001),
    ("allgather", "ring", 3, 4 * 10_001),
    ("allgather", "hd", 8, 4 * 10_001),
    ("broadcast", "ring", 5, 4 * 10_001),
    ("broadcast", "hd", 6, 4 * 10_001),
]


@pytest.mark.parametrize("op, algo, n, nbytes", CASES)
def test_host_algorithms_sum_correctly(op, algo, n, nbytes):
    r = _run(n, op=op, algo=algo, nbytes=nbytes, repetitions=2)
    assert r["error"] is None, r["error"]
    assert len(r["reps"]) == 2
    for rep in r["reps"]:
        assert rep["correct"], rep
        assert rep["time_s"] > 0


@pytest.mark.parametrize("n, m", [(3, 1), (4, 3), (5, 2)])
def test_reduction_server(n, m):
    r = _run(n, m, algo="rs", nbytes=4 * 20_001, servers=m)
    assert r["error"] is None, r["error"]
    assert r["reps"][0]["correct"]


def test_reduction_server_credit_window():
    """Many more pieces per server (4 KiB each) than the credit window holds, so most sends
    wait for a returned sum; int32 makes any misplaced or repeated piece visible."""
    from testbed.collectives.model import rs_window_pieces

    assert rs_window_pieces(4096) < 300_001 * 4 // 2 // 4096
    r = _run(3, 2, algo="rs", nbytes=4 * 300_001, servers=2, dtype="int32", repetitions=2)
    assert r["error"] is None, r["error"]
    assert all(rep["correct"] and rep["max_abs_err"] == 0.0 for rep in r["reps"])


def test_int32_is_exact():
    r = _run(5, op="allreduce", algo="ring", nbytes=4 * 5_003, dtype="int32")
    assert r["error"] is None and r["reps"][0]["correct"]
    assert r["reps"][0]["max_abs_err"] == 0.0


def test_children_are_reaped():
    r = _run(3, op="allreduce", algo="ring", nbytes=4 * 1000)
    for pid in r["pids"].values():
        assert not os.path.exists(f"/proc/{pid}"), f"child {pid} left behind"


@pytest.mark.parametrize("name, params, ef", [
    ("qsgd", {}, False),
    ("randomk", {"ratio": 0.05}, True),
    ("fp16", {}, False),
])
def test_compressed_allreduce(name, params, ef):
    r = _run(4, algo="ring", nbytes=4 * 10_001, compressor=name, compressor_params=params,
             error_feedback=ef, repetitions=2)
    assert r["error"] is None, r["error"]
    for rep in r["reps"]:
        assert rep["correct"], rep
        assert rep["max_abs_err"] > 0  # lossy against the raw sum, exact against the payloads


def test_bad_compressor_is_a_spec_error():
    with pytest.raises(ValueError, match="CollectiveSpec.compressor"):
        CollectiveSpec(compressor="nope").validate(4)
    with pytest.raises(ValueError, match="compressor_params"):
        CollectiveSpec(compressor="topk", compressor_params={"bogus": 1}).validate(4)
    with pytest.raises(ValueError, match="algo='ring'"):
        CollectiveSpec(compressor="qsgd", algo="hd").validate(4)


def test_reduction_server_buffers_are_made_once_and_reused():
    import numpy as np

    from testbed.collectives.server import shard_buffers

    f32 = np.dtype(np.float32)
    bufs = shard_buffers(10_001, f32, 3, 2, 1)  # server 1 of 2: elements 5001..10000
    assert [b.size for b in bufs] == [5000] * 3 and all(b.dtype == f32 for b in bufs)
    assert shard_buffers(10_001, f32, 3, 2, 1, bufs) is bufs
    assert shard_buffers(10_001, f32, 4, 2, 1, bufs) is not bufs  # another worker count
    assert shard_buffers(10_001, np.dtype(np.int32), 3, 2, 1, bufs) is not bufs
