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


def _rs_lead_trace(lead: int) -> tuple[list[int], bool]:
    """Two workers and three reduction servers in this process over real loopback TCP; server
    0 returns each sum 10 ms late. Returns, for every credit a worker spent beyond its first
    window, how many results it had from that server beyond the slowest unfinished one, and
    whether both workers got the exact sums."""
    import threading
    import time

    import numpy as np

    from testbed.collectives import server
    from testbed.collectives.testing import connected_mesh

    n, m, chunk, window = 2, 3, 256, 2
    count = m * 12 * chunk  # 12 pieces per server
    comms = connected_mesh(41, [loopback_ip()] * (n + m))
    try:
        slow = comms[n]
        real_send = slow.send

        def late_send(peer, arr):
            time.sleep(0.01)
            return real_send(peer, arr)

        slow.send = late_send
        xs = [np.arange(count, dtype=np.int32) * (w + 1) for w in range(n)]
        outs = [np.zeros(count, dtype=np.int32) for _ in range(n)]
        gaps: list[int] = []
        lock = threading.Lock()

        def traced(w):
            comm = comms[w]
            done, sent = [0] * m, [0] * m
            real_recv, real_send_w = comm.recv, comm.send
            pieces = count // m // chunk

            def recv(peer, arr):
                real_recv(peer, arr)
                with lock:
                    done[peer - n] += 1

            def send(peer, arr):
                j = peer - n
                with lock:
                    if sent[j] >= window:
                        gaps.append(done[j] - min(d for d in done if d < pieces))
                    sent[j] += 1
                return real_send_w(peer, arr)

            comm.recv, comm.send = recv, send
            server.worker_allreduce(comm, xs[w], outs[w], n, m, chunk, window, lead)

        ts = [threading.Thread(target=traced, args=(w,)) for w in range(n)]
        ts += [threading.Thread(target=server.serve, args=(comms[n + j], count,
                                np.dtype(np.int32), n, m, j, chunk)) for j in range(m)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        exact = all(np.array_equal(o, xs[0] + xs[1]) for o in outs)
        return gaps, exact
    finally:
        for c in comms:
            c.close()


def test_reduction_server_workers_keep_the_servers_in_lockstep():
    """A worker spends a credit on a server only while it is at most ``lead`` results ahead of
    the slowest unfinished server; without the rule (a lead no run reaches) the fast servers
    run ahead of a slow one, so the check can fail."""
    from testbed.collectives.server import LEAD_PIECES

    gaps, exact = _rs_lead_trace(LEAD_PIECES)
    assert exact and gaps and max(gaps) <= LEAD_PIECES, gaps
    free, exact = _rs_lead_trace(1 << 30)
    assert exact and max(free) > LEAD_PIECES + 2, free


@pytest.mark.parametrize("write", [False, True])
def test_prefault_maps_a_forked_ranks_shared_buffers_before_the_timed_run(write):
    """A forked child touching its shared input/output after :func:`prefault` takes next to
    no page faults; without it, one per page written and one per 16 read (what the timed
    collective used to pay)."""
    import mmap
    import resource

    import numpy as np

    from testbed.collectives.worker import prefault

    pages = 4096
    shm = mmap.mmap(-1, pages * mmap.PAGESIZE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(shm, dtype=np.float32)
    a[:] = 1.0  # the pool writes the inputs before it forks
    r, w = os.pipe()
    faults = {}

    def touch(b):
        if write:
            b[::256] = 2.0
        else:
            b[::256].sum()

    for warm in (False, True):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                if warm:
                    prefault(a, write)
                touch(np.ones(1024, np.float32))  # the code path's own copy-on-write faults
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                touch(a)
                os.write(w, str(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
                         .encode().ljust(16))
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        faults[warm] = int(os.read(r, 16))
    os.close(r)
    os.close(w)
    # reading, the kernel maps up to 16 neighbouring pages per fault (fault-around); writing a
    # shared page takes a fault of its own
    assert faults[False] >= pages / (1 if write else 16) * 0.9, faults
    assert faults[True] <= faults[False] // 8, faults
