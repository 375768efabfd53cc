"""The PyTorch client on an emulated network: DDP with the testbed hook against plain DDP over
gloo, both across the emulated hosts (needs the ``[torch]`` extra; skipped without it)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from testbed.collectives.testing import leftovers  # noqa: E402
from testbed.torch import TorchJob, run_ddp  # noqa: E402

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def star():
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(3, bw_mbps=100, switch="programmable")) as net:
        yield net


def test_hooked_ddp_equals_gloo_ddp(star):
    """DDP whose buckets go through the testbed's ring, INA and the trimmed exchange: every
    bucket is verified in the run against gloo's allreduce of the same bucket (``verify``),
    so each run is the plain gloo DDP run step for step; the replicas stay identical and the
    accuracies agree. (A separate plain-gloo run would only repeat what ``verify`` checks
    bucket by bucket, at ~15 s of process start-up.)"""
    ring = run_ddp(star, TorchJob(comm="testbed", algo="ring", iterations=40, eval_every=20,
                                  verify=True, job_id=2))
    ina = run_ddp(star, TorchJob(comm="testbed", algo="ina", iterations=40, eval_every=20,
                                 verify=True, job_id=3))
    # no trim stage on this star: the trimmed exchange delivers every packet whole
    trim = run_ddp(star, TorchJob(comm="testbed", algo="trim", iterations=40, eval_every=20,
                                  verify=True, job_id=4))
    for res in (ring, ina, trim):
        assert len({r["digest"] for r in res}) == 1  # DDP keeps the replicas identical
        for r in res:
            assert r["hook_calls"] >= 40 and r["max_rel_diff"] <= 1e-6, r
            assert abs(r["final_accuracy"] - ring[0]["final_accuracy"]) <= 0.01
            assert r["comm_s"] > 0
    assert ring[0]["final_accuracy"] >= 0.9
    assert not leftovers()


def test_bad_torch_job_names_the_field(star):
    with pytest.raises(ValueError, match="TorchJob.comm"):
        run_ddp(star, TorchJob(comm="nccl"))
    with pytest.raises(ValueError, match="TorchJob.compressor"):
        run_ddp(star, TorchJob(algo="ina", compressor="topk"))
    with pytest.raises(ValueError, match="TorchJob.bits"):
        run_ddp(star, TorchJob(algo="trim", bits=3))
