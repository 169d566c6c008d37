"""The one-line integrations, each with its real framework on CPU under a real daemon: the
steps and checkpoints the framework made reach the job (``GET /jobs/{id}``'s ``progress``).

Each script trains a tiny model for 7 steps (Hugging Face: 6) in one process and checkpoints
every 3 steps; the ground truth is what the framework left on disk (the newest checkpoint).
A missing framework skips its test, unless CI is set (.ci/run installs requirements-dev.txt).
The plain-loop helper needs no framework: a crash after a checkpoint, and the restart
resumes from it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PY, script, wait_job

ROOT = Path(__file__).resolve().parents[2]
#: The workers import this tree's elasticd; Hugging Face builds from configs, offline.
ENV = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

LIGHTNING = """
import sys
import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from elasticd.worker.integrations.lightning import ElasticdCallback

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
saves = ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=3, save_top_k=-1)
trainer = pl.Trainer(
    max_steps=7, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=True,
    callbacks=[ElasticdCallback(), saves],
)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
"""

FABRIC = """
import sys
import torch
from lightning_fabric import Fabric
from elasticd.worker.integrations.fabric import ElasticdFabricCallback

fabric = Fabric(accelerator="cpu", devices=1, callbacks=[ElasticdFabricCallback()])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
for step in range(1, 8):
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step % 3 == 0:
        fabric.save(f"{sys.argv[1]}/step={step}.ckpt", {"model": model, "step": step})
"""

HUGGING_FACE = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from elasticd.worker.integrations.huggingface import ElasticdTrainerCallback

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
ids = torch.randint(0, 32, (64, 8))
args = TrainingArguments(
    output_dir=sys.argv[1], max_steps=6, per_device_train_batch_size=4, use_cpu=True,
    report_to=[], save_strategy="steps", save_steps=3, logging_steps=1,
    dataloader_num_workers=0, disable_tqdm=True,
)
dataset = [{"input_ids": row, "labels": row} for row in ids]
trainer = Trainer(
    model=model, args=args, train_dataset=dataset, callbacks=[ElasticdTrainerCallback()]
)
trainer.train()
"""


def newest(folder: Path, pattern: str) -> tuple[int, Path]:
    """The framework's own newest checkpoint on disk: (its step, its path)."""
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := re.search(pattern, p.name))]
    assert found, f"the framework saved nothing in {folder}: {list(folder.iterdir())}"
    return max(found)


async def run(client: httpx.AsyncClient, tmp_path: Path, name: str, body: str) -> dict[str, Any]:
    out = tmp_path / "ckpt"
    out.mkdir()
    path = script(tmp_path, name, body)
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [path, str(out)], "env": ENV, "max_restarts": 0},
    )
    assert r.status_code in (200, 201), r.text
    job = await wait_job(client, r.json()["id"], timeout=150)
    assert job["state"] == "SUCCEEDED", job.get("reason")
    return job


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None and not os.environ.get("CI"):
        pytest.skip(f"{module} is not installed (pip install -r requirements-dev.txt)")


CASES = {  # name -> (module, script, pattern of the framework's checkpoint names, steps)
    "lightning": ("pytorch_lightning", LIGHTNING, r"step=(\d+)\.ckpt$", 7),
    "fabric": ("lightning_fabric", FABRIC, r"step=(\d+)\.ckpt$", 7),
    "huggingface": ("transformers", HUGGING_FACE, r"^checkpoint-(\d+)$", 6),
}


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(CASES))
async def test_a_frameworks_steps_and_checkpoints_reach_the_daemon(
    client: httpx.AsyncClient, tmp_path: Path, name: str
) -> None:
    """With the one-line callback, the job's progress has the framework's last step and its
    newest checkpoint on disk (step and path)."""
    module, body, pattern, steps = CASES[name]
    need(module)
    job = await run(client, tmp_path, f"{name}.py", body)
    step, path = newest(tmp_path / "ckpt", pattern)
    progress = job["progress"]
    assert (progress["checkpoint_step"], progress["checkpoint_path"]) == (step, str(path))
    assert progress["attempt"]["max_step"] == steps
    assert progress["attempt"]["checkpointing_since"] is None  # every save ended


LOOP = """
import os, sys
from elasticd.worker import ping
from elasticd.worker.integrations.loop import checkpoint, resume_path, resume_step

out = sys.argv[1]
last = resume_step()
start = 0 if last is None else last + 1
if start:
    with open(os.path.join(out, "resumed"), "w") as f:
        f.write(f"{start} {resume_path()}")
for step in range(start, 12):
    ping(step=step)
    if step % 4 == 0:
        path = os.path.join(out, f"step-{step}")
        with checkpoint(step, path):
            open(path, "w").close()
    if step == 9 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(1)
"""


async def test_the_loop_helper_resumes_a_restart_from_its_checkpoint(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A hand-written loop with checkpoint() and resume_step(): the crash at step 9 restarts
    from the checkpoint of step 8, which the restarted attempt is told of."""
    out = tmp_path / "ckpt"
    out.mkdir()
    path = script(tmp_path, "loop.py", LOOP)
    r = await client.post(
        "/jobs",
        json={"entrypoint": PY, "args": [path, str(out)], "env": ENV, "max_restarts": 1},
    )
    job = await wait_job(client, r.json()["id"], timeout=60)
    assert job["state"] == "SUCCEEDED" and job["restart_count"] == 1
    assert (out / "resumed").read_text() == f"9 {out / 'step-8'}"
    progress = job["progress"]
    assert (progress["checkpoint_step"], progress["max_step"]) == (8, 9)
    assert progress["attempt"]["started_from"] == 8 and progress["attempt"]["max_step"] == 11
