"""Functions that tests run with elasticd.launch (top level: the workers import them by name)."""

from __future__ import annotations

import os


def crash_once(scale: float, *, tag: str = "") -> dict[str, object]:
    """Rank 1 raises on the first attempt; every rank then returns its environment's view."""
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 1 and restart == 0:
        raise ValueError("rank 1 fails on its first attempt")
    return {"rank": rank, "value": rank * scale, "tag": tag, "restart": restart}


def always_fails() -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 always fails")


def returns_a_set() -> object:
    return {1, 2}


class Holder:
    @staticmethod
    def nested(x: int) -> int:
        return x + int(os.environ["RANK"])
