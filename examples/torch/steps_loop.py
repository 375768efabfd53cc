"""A training-step loop as users write one for torchrun: every step all-reduces a gradient-sized
tensor (50,000 float32) and all-to-alls a few values (an MoE layer's shape), checking both
against what they must be (exit status 1 on a wrong one). Its argument: the number of steps.
The launcher's tests move it between plans while it runs.

    sudo .venv/bin/testbed launch --hosts 4 --algo auto --tolerance exact \
        examples/torch/steps_loop.py -- 25
"""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
wrong = []
for step in range(int(sys.argv[1])):
    g = torch.Generator().manual_seed(step)
    inputs = [torch.randint(-1000, 1000, (50_000,), generator=g).float() for _ in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    err = (t - sum(inputs)).abs().max().item()
    if err > 1e-3:
        wrong.append(f"step {step}: all_reduce off by {err}")
    parts = torch.arange(world * 4, dtype=torch.float32) + 100 * rank
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts)
    want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 100 * r
                      for r in range(world)])
    if not torch.equal(out, want):
        wrong.append(f"step {step}: all_to_all {out.tolist()}")
    time.sleep(0.03)
print(f"rank {rank}: " + ("ok" if not wrong else "FAILED " + "; ".join(wrong[:3])))
dist.destroy_process_group()
sys.exit(1 if wrong else 0)
