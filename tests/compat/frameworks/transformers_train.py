"""HF transformers: Trainer on a tiny GPT-2 built from a config (random weights, no download)."""

from __future__ import annotations

import tempfile

import torch
from common import crash_on_first_attempt, finish, write_artifact
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

STEPS = 4


class CrashOnce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        crash_on_first_attempt(state.global_step)


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (64, 8))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            use_cpu=True,
            ddp_backend="gloo",
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[CrashOnce()])
        result = trainer.train()
        write_artifact(args.world_size, trainer.state.global_step, float(result.training_loss))
    finish()  # a barrier, then out without torch's teardown (see common.finish)


if __name__ == "__main__":
    main()
