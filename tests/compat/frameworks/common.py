"""What the framework scripts share: the crash of the first attempt, and the artifact."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def crash_on_first_attempt(step: int) -> None:
    """Rank 1 fails after its first training step of attempt 0, as a flaky node would."""
    if step == 1 and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        print("rank 1: crashing on purpose in attempt 0", file=sys.stderr, flush=True)
        os._exit(3)


def write_artifact(world_size: int, steps: int, loss: float) -> None:
    """Each rank records what it finished with: ``<out>/rank<RANK>.json``."""
    out = Path(sys.argv[1])
    record = {
        "rank": int(os.environ["RANK"]),
        "world_size": world_size,
        "steps": steps,
        "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "loss_is_finite": loss == loss and abs(loss) != float("inf"),
    }
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record, sort_keys=True))


def finish() -> None:
    """End the rank once every rank has written its artifact, skipping torch's teardown.

    torch 2.13's gloo can hang a rank in ``destroy_process_group`` once its peer has
    left (seen under `elasticd run`: rank 1 waited two minutes after rank 0 exited 0),
    or abort it at interpreter exit (see ``launchers.EXIT_ABORT``): neither is what
    these tests compare, so the rank exits here, after a barrier, with its files closed.
    """
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
