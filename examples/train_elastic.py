"""An elastic gloo job for multi-node tests and demos; runs unchanged under torchrun.

Every attempt initialises the process group from the environment, checks
``WORLD_SIZE`` against the group, all-reduces each rank's ``rank + 1`` and
checks the sum, and appends one JSON line per rank to ``--out`` (when given)
so a test can see who ran with which world. Options:

* ``--crash-rank R --crash-at N``: rank R raises when TORCHELASTIC_RESTART_COUNT == N;
* ``--hold FILE``: keep all-reducing until FILE exists (so a test can change
  the membership while the job runs), then finish.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=0)
    parser.add_argument("--hold", type=Path)
    parser.add_argument("--hold-limit", type=float, default=300.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if world != int(os.environ["WORLD_SIZE"]):
        raise RuntimeError(f"group world {world} != WORLD_SIZE {os.environ['WORLD_SIZE']}")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    if value.item() != expected:
        raise RuntimeError(f"all_reduce gave {value.item()}, expected {expected}")
    note = {
        "rank": rank,
        "world": world,
        "restart": restart,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "sum": value.item(),
        "pid": os.getpid(),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }
    if args.out:
        with args.out.open("a") as fh:
            fh.write(json.dumps(note) + "\n")
    print(f"rank {rank}/{world} restart {restart}: all_reduce sum {value.item():g} ok", flush=True)
    if rank == args.crash_rank and restart == args.crash_at:
        raise RuntimeError(f"rank {rank} crashes on purpose at restart {restart}")
    if args.hold:
        deadline = time.monotonic() + args.hold_limit
        ones = torch.ones(1)
        while time.monotonic() < deadline:
            flag = torch.tensor([1.0 if args.hold.exists() else 0.0])
            dist.all_reduce(flag)  # every rank agrees on when to stop
            if flag.item() == world:
                break
            dist.all_reduce(ones)
            time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
