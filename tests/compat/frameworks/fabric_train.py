"""Lightning Fabric: DDP on 2 CPU processes (gloo), under the launcher's TorchElastic env."""

from __future__ import annotations

import torch
from common import crash_on_first_attempt, finish, write_artifact
from lightning_fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

STEPS = 4


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", num_nodes=1)
    fabric.launch()  # under torchrun or elasticd: the processes exist already
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = fabric.setup_dataloaders(data)
    steps, loss = 0, torch.tensor(0.0)
    for inputs, targets in data:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        crash_on_first_attempt(steps)
        if steps == STEPS:
            break
    fabric.barrier()
    write_artifact(fabric.world_size, steps, float(loss))
    finish()  # a barrier, then out without torch's teardown (see common.finish)


if __name__ == "__main__":
    main()
