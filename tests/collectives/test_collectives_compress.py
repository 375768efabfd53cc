"""Compressed ring allreduce at the sizes where the compressors run their parallel kernels
(>= 2**20 elements), and the runner's teardown on Ctrl-C.

Regression: every rank of a compressed allreduce of >= 4 MiB float32 died with SIGTERM,
because Numba's GNU OpenMP layer kills a forked child at its first parallel region
(see ``testbed.collectives.worker.fork_safe_numba``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import loopback_ip
from testbed.kernels.parallel import PAR_MIN

COUNT = PAR_MIN + 1  # one element past the switch to the parallel kernels


def _pool(tmp_path, spec: CollectiveSpec, n: int) -> dict:
    """Run the pool exactly as run_collective does (``python -m ...worker --job``) on the
    loopback of this namespace; return its result.json."""
    spec.validate(n)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()}
             for i in range(n)]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"spec": spec.to_json(), "n": n, "m": 0, "ranks": ranks}))
    p = subprocess.run([sys.executable, "-m", "testbed.collectives.worker", "--job", str(job)],
                       capture_output=True, text=True, timeout=120)
    res = tmp_path / "result.json"
    assert res.exists(), p.stdout + p.stderr
    return json.loads(res.read_text())


@pytest.mark.parametrize("name, ef", [("fp16", False), ("qsgd", True)])
def test_compressed_allreduce_past_parallel_threshold(tmp_path, name, ef):
    spec = CollectiveSpec(op="allreduce", algo="ring", nbytes=4 * COUNT, compressor=name,
                          error_feedback=ef, timeout_s=30, repetitions=2)
    r = _pool(tmp_path, spec, 2)
    assert r["error"] is None, r["error"]  # was: "rank 0 (tbh1) died (signal SIGTERM)"
    assert len(r["reps"]) == 2
    for rep in r["reps"]:
        assert rep["correct"], rep


def test_in_process_pool_refuses_parallel_kernels_after_gnu_openmp():
    """A process that already started GNU OpenMP cannot fork ranks that run parallel kernels:
    run_pool says so (naming the parameter and the way out) instead of losing every rank."""
    code = textwrap.dedent(f"""
        import os
        import numba
        import testbed.kernels.compressors  # starts Numba's thread pool (default layer)
        from numba.np.ufunc import omppool
        from testbed.collectives.spec import CollectiveSpec
        from testbed.collectives.worker import fork_safe_numba, run_pool
        if numba.threading_layer() != "omp" or omppool.openmp_vendor != "GNU":
            assert fork_safe_numba()
            print("SAFE-LAYER", numba.threading_layer())
            raise SystemExit(0)
        assert not fork_safe_numba()
        spec = CollectiveSpec(nbytes=4 * {COUNT}, compressor="fp16", timeout_s=10)
        ranks = [{{"host": f"tbh{{i}}", "pid": os.getpid(), "ip": "127.0.0.1"}}
                 for i in (1, 2)]
        try:
            run_pool({{"spec": spec.to_json(), "n": 2, "m": 0, "ranks": ranks}})
        except ValueError as e:
            print("REFUSED", e)
    """)
    env = dict(os.environ)
    env.pop("NUMBA_THREADING_LAYER", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    if "SAFE-LAYER" in p.stdout:
        pytest.skip(f"Numba's default layer here is fork-safe ({p.stdout.strip()})")
    assert "REFUSED" in p.stdout and "compressor='fp16'" in p.stdout, p.stdout + p.stderr
    assert "NUMBA_THREADING_LAYER" in p.stdout


def test_teardown_keeps_ctrl_c_when_the_pool_is_gone(tmp_path):
    """Ctrl-C after the pool's process group vanished: KeyboardInterrupt, not
    ProcessLookupError from killpg, and the job folder is removed."""
    from testbed.collectives.runner import _stop_pool
    from testbed.collectives.spec import CollectiveSpec

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()  # reaped: its process group no longer exists
    jobdir = tmp_path / "coll-x"
    jobdir.mkdir()
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        except BaseException:
            _stop_pool(proc, str(jobdir), None, CollectiveSpec(), None)
            raise
    assert not jobdir.exists()


@pytest.mark.mininet
def test_compressed_allreduce_on_star_past_parallel_threshold():
    from testbed.collectives import run_collective
    from testbed.collectives.testing import check_rows, leftovers
    from testbed.topologies import Star, TestbedNet

    spec = CollectiveSpec(op="allreduce", algo="ring", nbytes=4 * COUNT, compressor="fp16",
                          timeout_s=30, repetitions=1)
    with TestbedNet(Star(n_hosts=3, bw_mbps=1000)) as net:
        rows = run_collective(net, spec)
    check_rows(rows, spec, 3, bw_mbps=1000)
    assert rows[0]["max_abs_err"] > 0  # fp16 is lossy against the raw sum
    assert not leftovers()


# ------------------------------------------------ summable payloads reduced in their wire type


def test_summable_compressors_reduce_scatter_the_others_allgather():
    from testbed.collectives import compress
    from testbed.kernels.compressors import COMPRESSORS, get_compressor

    for name in COMPRESSORS:
        kind = compress.scheme(name)
        assert kind == ("reduce_scatter" if get_compressor(name).summable else "allgather"), name
    assert compress.carrier_itemsize("thc", {}, 4) == 1  # 4 * 8 fits int8
    assert compress.carrier_itemsize("thc", {"granularity": 64}, 8) == 2


@pytest.mark.parametrize("name, params, ef, n", [
    ("bf16", {}, False, 3),
    ("thc", {}, True, 3),
    ("thc", {"granularity": 254}, False, 2),  # the levels' sum needs int16 on the ring
    ("randomk", {"ratio": 0.1}, True, 4),
    ("none", {}, False, 3),
])
def test_summable_ring_allreduce_is_exact_against_its_contributions(tmp_path, name, params,
                                                                    ef, n):
    spec = CollectiveSpec(op="allreduce", algo="ring", nbytes=4 * 30_011, compressor=name,
                          compressor_params=params, error_feedback=ef, timeout_s=30,
                          repetitions=2, chunk_bytes=8 << 10)
    r = _pool(tmp_path, spec, n)
    assert r["error"] is None, r["error"]
    assert all(rep["correct"] for rep in r["reps"]), r["reps"]


def test_check_contributions_catches_a_wrong_sum():
    import numpy as np

    from testbed.collectives import compress

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    for name in ("fp16", "bf16", "thc", "topk"):
        spec = CollectiveSpec(compressor=name, nbytes=4000)
        replicas = [compress.make(spec) for _ in range(3)]
        decs = compress.contributions(replicas, xs, step=0)
        total = np.sum(decs, axis=0, dtype=np.float64).astype(np.float32)
        assert compress.check_contributions(replicas[0][0], decs, xs, [total])[1], name
        wrong = total.copy()
        wrong[17] += 0.05 * max(1.0, abs(float(total[17])))
        assert not compress.check_contributions(replicas[0][0], decs, xs, [wrong])[1], name
