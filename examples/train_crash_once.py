"""A torchrun-style gloo job whose rank 1 crashes on its first attempt.

Runs unchanged under ``torchrun`` and under elasticd. Every attempt
initialises the process group from the environment, all-reduces each rank's
``rank + 1`` and checks the sum; on attempt 0, rank 1 then raises, the
``@record`` decorator writes torch's error file, and the supervisor restarts
the group. On attempt 1 every rank succeeds.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    if value.item() != expected:
        raise RuntimeError(f"all_reduce gave {value.item()}, expected {expected}")
    print(
        f"rank {rank}/{world} attempt {attempt}: all_reduce sum {value.item():g} (ok)", flush=True
    )
    if rank == 1 and attempt == 0:
        raise RuntimeError("rank 1 crashes on purpose on the first attempt")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
