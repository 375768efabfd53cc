"""The ``testbed`` backend's allreduce of the dtypes and reductions its algorithms do not sum
as float32: the ring of the job's hosts in the tensor's own dtype (``testbed.c10d``), checked
against torch's fold of the same inputs (its twin), on real TCP connections over the loopback
(needs the ``[torch]`` extra; no root, no network)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")

from testbed.c10d import _BITS, _RING_COMBINE, _combiner  # noqa: E402
from testbed.collectives import ring  # noqa: E402
from testbed.collectives.testing import connected_mesh, loopback_ip, run_ranks  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def _inputs(dtype, op: str, n: int, size: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    if op == "product":  # small factors: no overflow in any dtype, exact in every order
        return [torch.randint(-2, 3, (size,), generator=g).to(dtype) for _ in range(n)]
    return [(torch.randn(size, generator=g) * 50).to(dtype) for _ in range(n)]


def _ring_allreduce(inputs: list, dtype, op: str, job: int, chunk: int,
                    collective: str = "allreduce") -> list:
    """Every rank's result of the ring in ``dtype`` (a thread per rank, as ranks run):
    ``collective`` allreduce, reduce_scatter (a rank's shard) or allgather (of the inputs)."""
    n = len(inputs)
    comms = connected_mesh(job, [loopback_ip()] * n)
    outs = [None] * n
    bits = _BITS.get(dtype)

    def numpy(t):
        return (t.view(bits) if bits is not None else t).numpy()

    def rank(r: int, comm) -> None:
        flat = inputs[r].clone()
        if collective == "allreduce":
            ring.allreduce_inplace(comm, numpy(flat), n, chunk,
                                   _combiner(_RING_COMBINE[op], dtype))
            outs[r] = flat
        elif collective == "reduce_scatter":
            out = torch.empty(flat.numel() // n, dtype=dtype)
            ring.reduce_scatter(comm, numpy(flat), numpy(out), n, chunk,
                                _combiner(_RING_COMBINE[op], dtype))
            outs[r] = out
        else:
            out = torch.empty(flat.numel() * n, dtype=dtype)
            ring.allgather(comm, numpy(flat), numpy(out), n, chunk)
            outs[r] = out

    try:
        run_ranks(comms, rank)
    finally:
        for c in comms:
            c.close()
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op", ["max", "min", "product", "sum"])
def test_ring_in_a_tensors_own_dtype_matches_its_twin(dtype, op):
    """Maxima, minima and products of small factors are exact in any dtype and any order;
    sums are exact for integers, and for floats the ring's hop-by-hop rounding in the dtype
    stays within its unit roundoff per hop of torch's own float64 sum. Every rank gets the
    same answer."""
    n, size = 3, 10_007  # not a multiple of the ranks or the piece: ragged shards
    inputs = _inputs(dtype, op, n, size, seed=17)
    outs = _ring_allreduce(inputs, dtype, op, job=31, chunk=1000)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # bitwise: every rank
    assert outs[0].dtype == dtype
    fold = {"max": torch.maximum, "min": torch.minimum, "product": torch.mul}.get(op)
    if fold is not None or not dtype.is_floating_point:
        want = inputs[0].clone()
        for x in inputs[1:]:
            want = (fold or torch.add)(want, x)
        assert torch.equal(outs[0], want)
        return
    exact = sum(x.double() for x in inputs)
    eps = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    bound = n * eps * sum(x.double().abs() for x in inputs)  # one rounding per hop and result
    assert ((outs[0].double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sharded_collectives_in_a_tensors_own_dtype_match_their_twins(dtype):
    """reduce_scatter_tensor's and all_gather_into_tensor's ring in the tensor's dtype: each
    rank's shard of the maxima (exact in any dtype), and every rank's input gathered in rank
    order, bitwise."""
    n, shard = 3, 3_001
    inputs = _inputs(dtype, "max", n, n * shard, seed=23)
    want = torch.maximum(torch.maximum(inputs[0], inputs[1]), inputs[2])
    outs = _ring_allreduce(inputs, dtype, "max", job=33, chunk=500,
                           collective="reduce_scatter")
    for r, out in enumerate(outs):
        assert torch.equal(out, want[r * shard:(r + 1) * shard])
    parts = [x[:shard].clone() for x in inputs]
    outs = _ring_allreduce(parts, dtype, "max", job=35, chunk=500, collective="allgather")
    for out in outs:
        assert torch.equal(out, torch.cat(parts))


def test_a_launched_rank_keeps_torch_on_one_thread_after_the_testbed_kernels_load(tmp_path):
    """A launched rank's environment gives OpenMP one thread, as torchrun does for several
    ranks on a machine; Numba's OpenMP pool, started when the testbed's kernels load, sets the
    thread count of the OpenMP runtime torch shares, so it must get one too (with two, every
    torch operation of a rank ran on two spinning threads: 10-40 ms tensor copies)."""
    import subprocess
    import sys

    from testbed.launch import _rank_env

    job = {"ranks": [{"ip": "10.0.0.1", "intf": "tbh1-eth0", "host": "tbh1"}],
           "torch": {"job_id": 1}, "t0": 0.0}
    env = _rank_env(job, 0, tmp_path, True)
    code = "import torch, testbed.c10d; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"
