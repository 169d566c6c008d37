"""One replica group of one worker under stock torchft: the program the Lighthouse tests run.

A ``torchft.Manager`` (``min_replica_size``, ``quorum_retries`` above 0) over a
``ProcessGroupGloo``, a toy model, gradients averaged with ``manager.allreduce(t).wait()``
(not torchft's DDP, whose comm hook was seen to crash survivors when a peer died
mid-all-reduce), and ``should_commit`` before each optimizer step. The group's own torch
store (a ``TCPStore`` on a free port) is made here, as torchrun's agent would.

Everything stays on loopback: the Manager and the checkpoint server advertise
``localhost``, gloo uses ``lo``. The Lighthouse is ``TORCHFT_LIGHTHOUSE``.

Each committed step prints one JSON line: ``{"group", "step", "quorum", "participants",
"weights"}`` (``weights``: the parameters' sum, equal across groups that agree).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--quorum-retries", type=int, default=30)
    args = parser.parse_args()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    socket.gethostname = lambda: "localhost"  # what torchft's servers advertise

    import torch
    from torch import nn, optim
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Linear(8, 4)
    opt = optim.SGD(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        opt.load_state_dict(state["optim"])  # type: ignore[arg-type]

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{args.group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="localhost",
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=20),
        connect_timeout=timedelta(seconds=10),
        quorum_retries=args.quorum_retries,
    )
    data = torch.Generator().manual_seed(1000 + args.group)  # each group its own shard
    try:
        while manager.current_step() < args.steps:
            opt.zero_grad()
            manager.start_quorum()
            loss = model(torch.randn(16, 8, generator=data)).pow(2).mean()
            loss.backward()
            for param in model.parameters():
                assert param.grad is not None
                manager.allreduce(param.grad).wait()
            time.sleep(args.step_time)
            if not manager.should_commit():
                continue
            opt.step()
            weights = float(sum(p.detach().double().sum() for p in model.parameters()))
            line = {
                "group": args.group,
                "step": manager.current_step(),
                "quorum": manager._quorum_id,  # no public accessor in torchft 0.2.0
                "participants": manager.num_participants(),
                "weights": round(weights, 9),
            }
            print(json.dumps(line), flush=True)
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
