"""DDP training of a small CNN on scikit-learn's 8x8 digits: a script as users write it for
torchrun, nothing testbed-specific. Each rank trains on its shard; rank 0 prints the loss of
every step (``step N loss L``) and the held-out accuracy.

    torchrun --nproc-per-node 2 examples/torch/ddp_digits.py --steps 20
    sudo .venv/bin/testbed launch --hosts 4 examples/torch/ddp_digits.py -- --steps 20
    sudo .venv/bin/testbed launch --hosts 4 --algo ina examples/torch/ddp_digits.py
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from env
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    test_x, test_y = x[-297:], y[-297:]
    x, y = x[:1500][rank::world], y[:1500][rank::world]

    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(args.steps):
        idx = torch.randint(0, len(y), (args.batch,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    if rank == 0:
        print(f"accuracy {acc:.4f}", flush=True)
    # the model's hooks hold the process group: release them first, or the group's gloo
    # threads can be torn down at interpreter exit while still joinable (std::terminate,
    # SIGABRT after the last step; seen over plain gloo as through the testbed backend)
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
