"""A hand-written collective loop, as users write one for torchrun: every rank all-reduces
tensors of several sizes and dtypes (sums, maxima, minima, products), reduce-scatters and
all-gathers tensors of every dtype, then broadcasts, all-gathers a list and all-to-alls, and
checks every result against what the numbers must be (exit
status 1 on a wrong one).

    sudo .venv/bin/testbed launch --hosts 3 --algo ring examples/torch/allreduce_loop.py
"""

import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for it, n in enumerate([1, 1000, 65_537, 262_144]):
        for dtype in (torch.float32, torch.int64, torch.float16, torch.bfloat16, torch.int32):
            g = torch.Generator().manual_seed(1000 * it + 7)
            inputs = [(torch.randn(n, generator=g) * 8).to(dtype) for _ in range(world)]
            expect = sum(t.double() for t in inputs)
            t = inputs[rank].clone()
            dist.all_reduce(t)
            tol = {torch.float32: 1e-4, torch.int64: 0.0, torch.float16: 0.05,
                   torch.bfloat16: 0.05, torch.int32: 0.0}[dtype]
            err = (t.double() - expect).abs().max().item()
            if err > tol * (1 + expect.abs().max().item()):
                wrong.append(f"all_reduce {dtype} n={n}: error {err}")
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if not torch.equal(t, torch.arange(5, dtype=torch.float32) * world):
        wrong.append(f"all_reduce MAX: {t}")
    # maxima, minima and products of small factors are exact in any dtype and order
    folds = {dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
             dist.ReduceOp.PRODUCT: torch.mul}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for op, fold in folds.items():
            g = torch.Generator().manual_seed(31)
            inputs = [torch.randint(-2, 3, (70_001,), generator=g).to(dtype)
                      if op == dist.ReduceOp.PRODUCT else
                      (torch.randn(70_001, generator=g) * 50).to(dtype) for _ in range(world)]
            expect = inputs[0]
            for x in inputs[1:]:
                expect = fold(expect, x)
            t = inputs[rank].clone()
            dist.all_reduce(t, op=op)
            if not torch.equal(t, expect):
                wrong.append(f"all_reduce {op} {dtype}: {(t != expect).sum().item()} differ")
    # the tensor forms FSDP uses, in every dtype (small integers: exact in each)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        whole = (torch.arange(world * 6) + rank).to(dtype)
        mine = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(mine, whole)
        want = sum(torch.arange(world * 6) + r for r in range(world))[rank * 6:(rank + 1) * 6]
        if not torch.equal(mine, want.to(dtype)):
            wrong.append(f"reduce_scatter_tensor {dtype}: {mine}")
        gathered = torch.empty(world * 3, dtype=dtype)
        dist.all_gather_into_tensor(gathered, torch.full((3,), rank, dtype=dtype))
        if not torch.equal(gathered, torch.arange(world).repeat_interleave(3).to(dtype)):
            wrong.append(f"all_gather_into_tensor {dtype}: {gathered}")
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=world - 1)
    if not torch.equal(b, torch.full((4,), float(world - 1))):
        wrong.append(f"broadcast: {b}")
    parts = [torch.empty(3) for _ in range(world)]
    dist.all_gather(parts, torch.full((3,), float(rank)))
    if any(not torch.equal(p, torch.full((3,), float(r))) for r, p in enumerate(parts)):
        wrong.append(f"all_gather: {parts}")
    # all-to-alls of small and large parts (MoE's dispatch), in every dtype: part j of
    # rank r holds 100 * r + j (modulo 128: exact in each)
    for part in (1, 20_000):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
            send = ((torch.arange(world).repeat_interleave(part) + 100 * rank) % 128).to(dtype)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
            want = ((torch.arange(world).repeat_interleave(part) * 100 + rank) % 128).to(dtype)
            if not torch.equal(recv, want):
                wrong.append(f"all_to_all_single {dtype} part={part}: "
                             f"{(recv != want).sum().item()} differ")
    dist.barrier()
    dist.destroy_process_group()
    for w in wrong:
        print(f"WRONG {w}", flush=True)
    print(f"rank {rank}: {'ok' if not wrong else 'FAILED'}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
