"""elasticd.launch: a Python function as the workers, results by rank, failures with the root cause."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

import elasticd
from elasticd.launcher import LaunchError
from tests.observability import launch_targets as t


def test_returns_values_by_rank_after_a_restart():
    """A rank that fails once is restarted with its group; the call returns every rank's value."""
    results = elasticd.launch(t.crash_once, nproc_per_node=2, max_restarts=2, timeout=60)(
        1.5, tag="x"
    )
    assert results == {
        0: {"rank": 0, "value": 0.0, "tag": "x", "restart": 1},
        1: {"rank": 1, "value": 1.5, "tag": "x", "restart": 1},
    }


def test_static_methods_of_top_level_classes_work():
    """A dotted qualified name resolves in the workers like in the caller."""
    assert elasticd.launch(t.Holder.nested, nproc_per_node=2, timeout=60)(10) == {0: 10, 1: 11}


def test_failure_raises_with_the_root_cause():
    """When the budget is spent, LaunchError names the rank and carries the worker's traceback."""
    with pytest.raises(LaunchError) as exc:
        elasticd.launch(t.always_fails, nproc_per_node=2, max_restarts=0, timeout=60)()
    cause = exc.value.root_cause
    assert cause is not None and cause.rank == 1 and cause.exit_code == 1
    assert cause.message == "RuntimeError: rank 1 always fails"
    assert "raise RuntimeError" in (cause.traceback or "")
    assert "rank 1" in str(exc.value) and "Traceback" in str(exc.value)
    assert exc.value.job is not None and exc.value.job.state.value == "FAILED"


def test_return_values_must_be_json():
    """A result that is not JSON fails the worker with a message that says so (no pickle)."""
    with pytest.raises(LaunchError, match="not JSON"):
        elasticd.launch(t.returns_a_set, max_restarts=0, timeout=60)()


def test_refuses_what_workers_cannot_import_and_non_json_args():
    """Lambdas and closures are refused up front, and so are arguments that are not JSON."""

    def local() -> None:
        pass

    for fn in (lambda: 1, local):
        with pytest.raises(TypeError, match="top level of a module"):
            elasticd.launch(fn)
    with pytest.raises(TypeError, match="as JSON"):
        elasticd.launch(t.crash_once)(object())


def test_inside_an_event_loop_points_to_run_async():
    """Calling the blocking form inside a running loop explains the async form."""

    async def inner() -> None:
        with pytest.raises(RuntimeError, match="run_async"):
            elasticd.launch(t.crash_once)(1.0)

    asyncio.run(inner())


async def test_run_async_in_the_callers_loop():
    """run_async runs the launch in the test's own event loop."""
    async with asyncio.timeout(60):
        got = await elasticd.launch(t.Holder.nested, timeout=60).run_async(1)
    assert got == {0: 1}


def test_import_elasticd_does_not_import_the_daemon():
    """`import elasticd` stays light: the launcher (and the daemon) load on first use."""
    code = (
        "import sys, elasticd\n"
        "assert 'elasticd.node.daemon' not in sys.modules and 'elasticd.launcher' not in sys.modules\n"
        "elasticd.launch\n"
        "assert 'elasticd.launcher' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
