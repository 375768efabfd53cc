"""The script ``testbed bench torch`` launches on every rank (``testbed.launch``), written as a
user's torchrun script is: it times ``CALLS`` 8-byte allreduces, then ``STEPS`` DDP steps of
a linear model with ``MIB`` MiB of float32 parameters, and rank 0 prints one line
``RESULT {json}``: the seconds per call and per step (medians), from the launch's start
(``TESTBED_LAUNCH_T0``, wall clock) to the process group's first collective, and the largest
resident memory of any rank (MiB)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--mib", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(2)  # 8 bytes
    dist.all_reduce(x)
    first = time.time()
    for _ in range(10):  # warm-up: connections, allocations
        dist.all_reduce(x)
    dist.barrier()
    calls = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        calls.append(time.perf_counter() - t0)
    width = max(8, int((args.mib * (1 << 20) / 4) ** 0.5))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(width, width, bias=False), bucket_cap_mb=args.mib + 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, width)
    steps = []
    steps_from = time.time()
    for _ in range(args.steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
    steps_to = time.time()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        t_launch = float(os.environ.get("TESTBED_LAUNCH_T0", "nan"))
        print("RESULT " + json.dumps({
            "call_s": statistics.median(calls), "step_s": statistics.median(steps[2:]),
            "grad_bytes": width * width * 4, "to_first_collective_s": first - t_launch,
            "max_rss_mib": float(rss[0]), "steps_from": steps_from,
            "steps_to": steps_to}), flush=True)
    # DDP's reducer holds the process group: release it first, or the group's gloo threads
    # can be torn down at interpreter exit while still joinable (std::terminate, SIGABRT)
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
