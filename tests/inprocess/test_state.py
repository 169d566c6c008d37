"""Pure parts of in-process restart: rank assignment, rank filters, timeout rules, the key layout."""

from __future__ import annotations

import asyncio
import datetime
import json

import pytest

from elasticd.inprocess import (
    ActiveWorldSizeDivisibleBy,
    CallWrapper,
    FillGaps,
    Layout,
    MaxActiveWorldSize,
    ShiftRanks,
    State,
    Wrapper,
    report_terminated,
)
from elasticd.inprocess.state import apply_filter
from elasticd.inprocess.wrapper import _wants_call_wrapper
from elasticd.store.memory import MemoryStore


def test_shift_ranks_drops_the_terminated_and_shifts_the_rest_down() -> None:
    """ShiftRanks keeps the order of the survivors; their ranks close the gaps."""
    state = State.initial(3, 5)
    after = ShiftRanks()(state, {1, 2})
    assert after.world == (0, 3, 4) and after.rank == 1 and after.world_size == 3
    assert after.initial_rank == 3 and after.initial_world_size == 5


def test_fill_gaps_moves_only_the_highest_ranks() -> None:
    """FillGaps: survivors below the new size keep their rank; the highest move into the gaps."""
    after = FillGaps()(State.initial(4, 5), {1})
    assert after.world == (0, 4, 2, 3)
    assert after.rank == 1  # rank 4 took rank 1's place
    assert FillGaps()(State.initial(2, 5), {1}).rank == 2  # rank 2 kept its place


def test_rank_filters_make_spares() -> None:
    """Filters pick the active world deterministically; spares have no active rank."""
    state = ShiftRanks()(State.initial(4, 6), {0})  # world (1, 2, 3, 4, 5)
    capped = apply_filter(state, MaxActiveWorldSize(3))
    assert capped.active_world == (1, 2, 3) and not capped.active and capped.active_rank is None
    divisible = apply_filter(state, ActiveWorldSizeDivisibleBy(2))
    assert divisible.active_world == (1, 2, 3, 4) and divisible.active_rank == 3
    assert apply_filter(state, None).active_world == state.world
    with pytest.raises(ValueError, match="n >= 1"):
        MaxActiveWorldSize(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"soft_timeout": 90, "hard_timeout": 60},
            "soft_timeout must be shorter than hard_timeout",
        ),
        (
            {"hard_timeout": 200, "barrier_timeout": 120},
            "hard_timeout must be shorter than barrier_timeout",
        ),
        ({"soft_timeout": 0}, "soft_timeout must be positive"),
        ({"completion_timeout": 0}, "completion_timeout must be positive"),
        (
            {"last_call_wait": 200, "barrier_timeout": 150},
            "last_call_wait must be shorter than barrier_timeout",
        ),
        (
            {"progress_watchdog_interval": 70},
            "progress_watchdog_interval must be shorter than soft_timeout",
        ),
    ],
)
def test_timeout_ordering_is_enforced(kwargs: dict[str, float], message: str) -> None:
    """Each ordering rule (soft < hard < barrier, ...) is a ValueError that names it."""
    with pytest.raises(ValueError, match=message):
        Wrapper(**kwargs)  # type: ignore[arg-type]


def test_timeouts_accept_timedelta_and_refuse_junk() -> None:
    """timedelta and numbers are seconds; other types are a TypeError."""
    wrapper = Wrapper(
        soft_timeout=datetime.timedelta(seconds=5), hard_timeout=6, barrier_timeout=7.5
    )
    assert (wrapper.timeouts.soft, wrapper.timeouts.hard, wrapper.timeouts.barrier) == (
        5.0,
        6.0,
        7.5,
    )
    with pytest.raises(TypeError, match="soft_timeout"):
        Wrapper(soft_timeout="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initialize must be callable"):
        Wrapper(initialize=42)  # type: ignore[arg-type]


def test_a_disabled_wrapper_returns_the_function() -> None:
    """enabled=False leaves the function untouched."""

    def train() -> int:
        return 1

    assert Wrapper(enabled=False)(train) is train


def test_the_call_wrapper_is_passed_to_annotated_parameters() -> None:
    """Parameters annotated CallWrapper (or optional of it) receive the active call."""

    def a(call: CallWrapper | None = None, other: int = 0) -> None: ...

    def b(x: int, cw: CallWrapper) -> None: ...

    def c(x: int) -> None: ...

    assert _wants_call_wrapper(a) == ["call"]
    assert _wants_call_wrapper(b) == ["cw"]
    assert _wants_call_wrapper(c) == []


async def test_the_daemon_reports_a_terminated_rank_where_workers_watch() -> None:
    """report_terminated writes faults/terminated/<rank> once, under the layout the workers compute."""
    env = {"ELASTICD_JOB_ID": "job.1", "TORCHELASTIC_RESTART_COUNT": "2"}
    layout = Layout.from_env(env)
    assert layout.terminated(3) == "jobs/job.1/inprocess/restart2/faults/terminated/3"
    async with asyncio.timeout(5):
        store = MemoryStore()
        assert await report_terminated(store, "job.1", "restart2", 3, "killed by SIGKILL", signal=9)
        assert not await report_terminated(store, "job.1", "restart2", 3, "second report")
        entry = await store.get(layout.terminated(3))
    assert entry is not None
    record = json.loads(entry.value)
    assert (
        record["by"] == "daemon"
        and record["reason"] == "killed by SIGKILL"
        and record["signal"] == 9
    )
