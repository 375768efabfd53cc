"""Collective pools forked from a network's warm pool server (testbed.datapath.forks.PoolServer):
on loopback (no network), and under run_collective on an emulated network."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from testbed.collectives.spec import CollectiveSpec
from testbed.collectives.testing import loopback_ip
from testbed.datapath.forks import POOL_START_ENV, ForkServer, PoolServer, start_mode


def _loopback_job(tmp_path: Path, name: str, spec: CollectiveSpec, n: int, **extra) -> Path:
    spec.validate(n)
    ranks = [{"host": f"tbh{i + 1}", "pid": os.getpid(), "ip": loopback_ip()} for i in range(n)]
    job = tmp_path / name / "job.json"
    job.parent.mkdir()
    job.write_text(json.dumps({"spec": spec.to_json(), "n": n, "m": 0, "ranks": ranks, **extra}))
    return job


def _pool(server: PoolServer, job: Path) -> dict:
    with open(job.parent / "pool.log", "wb") as log:
        proc = server.fork(["--job", str(job)], log)
    assert proc.wait(120) == 0, (job.parent / "pool.log").read_text()[-2000:]
    return json.loads((job.parent / "result.json").read_text())


def test_pools_forked_from_one_server_run_collectives_exact(tmp_path):
    """Ring, halving-doubling and a compressed ring, each a pool forked from the same server,
    every output checked against numpy by the pool; the server's log goes when it closes."""
    server = PoolServer(str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        for i, (algo, compressor) in enumerate([("ring", None), ("hd", None), ("ring", "topk")]):
            spec = CollectiveSpec(algo=algo, nbytes=4 * 30_011, compressor=compressor,
                                  timeout_s=30, chunk_bytes=8 << 10, repetitions=2)
            res = _pool(server, _loopback_job(tmp_path, f"j{i}", spec, 3,
                                              pool_server=server.pid))
            assert res["error"] is None, res["error"]
            assert [r["correct"] for r in res["reps"]] == [True, True], (algo, res["reps"])
            assert res["mem_mb"] > 0
        assert server.alive()
    finally:
        server.close()
    assert server.proc.returncode == 0
    assert not (tmp_path / "server.log").exists()


def test_a_forked_pool_sees_a_plugin_added_after_its_server_started(tmp_path, monkeypatch,
                                                                     fake_dists):
    """The server adopts the owner's environment per pool: a PYTHONPATH entry added since it
    started (here holding a compressor plug-in) is on the pool's path and in its registry."""
    server = PoolServer(str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        fake_dists("tb-pooled", "tbplug_pooled", """
            from testbed.kernels.compressors import Compressor

            class Same(Compressor):
                name = "pooled"

                def _compress(self, x, step):
                    return (x.copy(),), {"n": int(x.size)}

                def _decompress(self, payload, ctx):
                    return payload[0]

                def payload_bytes(self, n):
                    return 4 * n
            """, "[testbed.compressors]\npooled = tbplug_pooled:Same\n")
        old = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH",
                           os.pathsep.join(p for p in (str(fake_dists.site), old) if p))
        spec = CollectiveSpec(algo="ring", nbytes=4 * 10_007, compressor="pooled",
                              timeout_s=30, chunk_bytes=8 << 10)
        res = _pool(server, _loopback_job(tmp_path, "j", spec, 2))
        assert res["error"] is None, res["error"]
        assert all(r["correct"] for r in res["reps"]), res["reps"]
    finally:
        server.close()


def test_a_server_that_cannot_start_is_named_with_its_log(tmp_path):
    server = ForkServer("testbed.no_such_module", [], str(tmp_path / "s.log"), "tests")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the tests' fork server did not start \(it exited\)"
                                           r"(.|\n)*No module named"):
        server.wait_ready(timeout=60)
    assert time.monotonic() - t0 < 60 and not server.alive()
    server.close()


def test_pool_start_mode_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv(POOL_START_ENV, "vfork")
    with pytest.raises(ValueError, match=f"{POOL_START_ENV}='vfork': use one of fork, exec"):
        start_mode(POOL_START_ENV)
    monkeypatch.delenv(POOL_START_ENV)
    assert start_mode(POOL_START_ENV) == "fork"


@pytest.mark.mininet
def test_collectives_fork_their_pools_from_the_network_and_survive_its_death(monkeypatch):
    """run_collective forks each pool from the network's pool server (one for all its
    collectives); a killed server is replaced by the next collective, and the server goes
    with the network, log and all."""
    from testbed.collectives import run_collective
    from testbed.collectives.testing import check_rows, leftovers
    from testbed.topologies import Star, TestbedNet

    monkeypatch.delenv(POOL_START_ENV, raising=False)
    with TestbedNet(Star(3, bw_mbps=100, switch="programmable")) as net:
        for algo in ("ina", "ring", "ina"):
            spec = CollectiveSpec(algo=algo, nbytes=4 * 20_011, workers=3, timeout_s=20)
            check_rows(run_collective(net, spec), spec, 3, bw_mbps=100)
        server = net.keep("pools", lambda: pytest.fail("a second pool server was started"))
        assert server.alive()
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait()
        spec = CollectiveSpec(algo="ina", nbytes=4 * 20_011, workers=3, timeout_s=20)
        check_rows(run_collective(net, spec), spec, 3, bw_mbps=100)
        again = net.keep("pools", lambda: pytest.fail("not replaced"))
        assert again is not server and again.alive()
        log = Path(again.log_path)
        assert not leftovers()
    assert again.proc.returncode == 0 and not log.exists()
