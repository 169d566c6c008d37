"""A torchft training loop that survives on elasticd (issue 39): one replica group's worker.

Submit it as a job of replica groups; every group is its own gang, and a group that dies
is restarted alone while the others go on at the next step with a smaller quorum::

    elasticd run --replica-groups 3 --nproc-per-node 1 --max-restarts 3 -- \\
        python examples/torchft_train.py --steps 200

What elasticd gives each worker, besides torchrun's contract (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``: within its group):

- ``TORCHFT_LIGHTHOUSE``: this node's Lighthouse for the job (elasticd serves torchft's
  ``LighthouseService``; its quorum state lives in the cluster store, so no one daemon is a
  single point of failure);
- ``REPLICA_GROUP_ID`` (0..N-1) and ``NUM_REPLICA_GROUPS`` (N).

What the loop must do to survive a fault (each point is a way we saw it die):

- ``quorum_retries`` above 0: the Manager's default (0) ends the group at the first failed
  quorum call, e.g. while the Lighthouse's leader moves to another node;
- reduce gradients with ``manager.allreduce(t).wait()``; ``should_commit`` (through the
  ``OptimizerWrapper``) discards a step a peer died in;
- hand the Manager ``state_dict``/``load_state_dict`` of everything a step changes (model,
  optimizer), so that a restarted group heals from a live peer at the next quorum instead of
  reloading a checkpoint;
- the group's rank 0 hosts its store (``TCPStore(..., is_master=True)``): the Manager is
  only its client;
- ``elasticd.worker.ping(step=...)``: progress for elasticd's hang detection and goodput.

Each committed step prints one JSON line on stdout, ``{"t", "pid", "group", "step", "quorum",
"participants", "weights"}`` (``weights``: a checksum of the parameters; equal across
groups when they agree), which the tests read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=100, help="stop after this many commits")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of 'work' a step")
    parser.add_argument("--quorum-retries", type=int, default=20)
    parser.add_argument(
        "--out", default=None, help="also append each line to OUT/g<group>.jsonl (the tests)"
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="the fewest groups a step needs (default: NUM_REPLICA_GROUPS // 2 + 1)",
    )
    args = parser.parse_args(argv)

    import torch
    from torch import nn, optim
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from elasticd import worker

    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    min_replicas = args.min_replicas if args.min_replicas is not None else groups // 2 + 1

    # The Manager is a client of the group's store at MASTER_ADDR:MASTER_PORT; under torchrun
    # its agent hosts it, under elasticd (TORCHELASTIC_USE_AGENT_STORE=False) the group's rank
    # 0 does, as init_process_group would.
    master = None
    if int(os.environ["RANK"]) == 0:
        master = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=True,
            wait_for_workers=False,
        )

    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Linear(8, 4)
    inner = optim.SGD(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optim"])  # type: ignore[arg-type]

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{group}",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        quorum_retries=args.quorum_retries,
    )
    optimizer = OptimizerWrapper(manager, inner)
    data = torch.Generator().manual_seed(1000 + group)  # each group its own shard
    try:
        while manager.current_step() < args.steps:
            optimizer.zero_grad()  # starts the step's quorum
            batch = torch.randn(16, 8, generator=data)
            loss = model(batch).pow(2).mean()
            loss.backward()
            for param in model.parameters():
                if param.grad is not None:
                    manager.allreduce(param.grad).wait()
            time.sleep(args.step_time)
            optimizer.step()  # commits only if every participant's step went through
            step = manager.current_step()
            worker.ping(step=step)
            weights = float(sum(p.detach().double().sum() for p in model.parameters()))
            line = {
                "t": time.time(),
                "pid": os.getpid(),
                "group": group,
                "step": step,
                "quorum": manager._quorum_id,  # noqa: SLF001 (no public accessor in 0.2.0)
                "participants": manager.num_participants(),
                "weights": round(weights, 9),
            }
            text = json.dumps(line)
            print(text, flush=True)
            if args.out is not None:
                with open(os.path.join(args.out, f"g{group}.jsonl"), "a") as out:
                    out.write(text + "\n")
    finally:
        manager.shutdown(wait=False)
        del master
    return 0


if __name__ == "__main__":
    sys.exit(main())
