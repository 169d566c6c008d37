"""HF accelerate: a linear model trained 4 steps on 2 CPU processes (gloo) by Accelerator."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from common import crash_on_first_attempt, finish, write_artifact
from torch.utils.data import DataLoader, TensorDataset

STEPS = 4


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    steps, loss = 0, torch.tensor(0.0)
    for inputs, targets in data:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        crash_on_first_attempt(steps)
        if steps == STEPS:
            break
    accelerator.wait_for_everyone()
    write_artifact(accelerator.num_processes, steps, float(loss))
    finish()  # a barrier, then out without torch's teardown (see common.finish)


if __name__ == "__main__":
    main()
