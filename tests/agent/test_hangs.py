"""Hang attribution: a stack dump read into where the main thread was, and the ranks whose
stacks differ named as the hang's cause (issue 37)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticd.agent.hangs import blame, main_thread, signature, stack_of, waits_in_collective
from elasticd.models import MAX_STACK_CHARS, RankStack, RootCause

#: A real faulthandler dump (SIGUSR1, torch 2.x) of a rank waiting in a gloo all-reduce.
ALL_REDUCE_DUMP = """\
Current thread 0x00007f4dff9d2b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/job/ar.py", line 13 in train
  File "/tmp/job/ar.py", line 16 in <module>
"""  # noqa: E501
ALL_REDUCE = (
    "all_reduce (distributed_c10d.py:3252) < wrapper (c10d_logger.py:83) < train (ar.py:13)"
)

#: A py-spy dump of a rank asleep in Python.
PY_SPY_DUMP = """\
Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4250 (idle): "Thread-1"
    wait (threading.py:331)
    run (threading.py:982)
Thread 4242 (idle): "MainThread"
    slow_step (train.py:7)
    train (train.py:12)
    <module> (train.py:16)
"""

SLOW_SCRIPT = """
import faulthandler, sys, threading

def helper():
    threading.Event().wait()

def slow_step():
    faulthandler.dump_traceback(all_threads=True)

def train():
    slow_step()

threading.Thread(target=helper, daemon=True).start()
threading.Event().wait(0.2)
train()
"""


def _real_dump(tmp_path: Path) -> str:
    """faulthandler's own output, as a worker writes it to its stderr: a helper thread
    listed first, the main thread last."""
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent(SLOW_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=30, check=True
    )
    return done.stderr


def test_a_real_faulthandler_dump_names_the_main_thread(tmp_path: Path) -> None:
    """Of faulthandler's threads, the main one (its outermost frame the program's) is read."""
    text = _real_dump(tmp_path)
    assert text.count("most recent call first") == 2, text
    assert stack_of(text) == "slow_step (slow.py:8) < train (slow.py:11) < <module> (slow.py:15)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ALL_REDUCE_DUMP, ALL_REDUCE),
        # torch's rank prefix on every line, and output around the dump
        (
            "step 3\n"
            + "".join(f"[rank0]: {line}\n" for line in ALL_REDUCE_DUMP.splitlines())
            + "more output\n",
            ALL_REDUCE,
        ),
        (PY_SPY_DUMP, "slow_step (train.py:7) < train (train.py:12) < <module> (train.py:16)"),
        # two dumps in one log: the last one
        (
            ALL_REDUCE_DUMP + "\n" + ALL_REDUCE_DUMP.replace("3252", "999"),
            ALL_REDUCE.replace("3252", "999"),
        ),
        # no main thread found by its root: the last thread listed
        (
            'Thread 0x1 (most recent call first):\n  File "a.py", line 1 in f\n\n'
            'Current thread 0x2 (most recent call first):\n  File "b.py", line 2 in g\n',
            "g (b.py:2)",
        ),
        ("", None),
        ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n", None),
        ("sent SIGUSR1 to pid 12: its faulthandler wrote the stacks ...", None),
    ],
    ids=["faulthandler", "rank-prefixed", "py-spy", "last-dump", "last-thread", "empty",
         "a-traceback", "a-note"],
)  # fmt: skip
def test_stack_of(text: str, expected: str | None) -> None:
    """The main thread's three innermost frames, innermost first; None without a dump."""
    assert stack_of(text) == expected


def test_a_signature_is_bounded_and_printable() -> None:
    """A worker's dump is its own text: what is kept is short and printable."""
    frames = main_thread(
        'Current thread 0x1 (most recent call first):\n  File "a.py", line 1 in '
        + "\x1b[31m" + "f" * 1000 + "\n"
    )  # fmt: skip
    assert frames is not None
    sig = signature(frames)
    assert len(sig) <= MAX_STACK_CHARS and sig.isprintable() and "\x1b" not in sig
    assert RankStack(rank=0, local_rank=0, stack=sig)  # fits the model's bound


@pytest.mark.parametrize(
    ("stack", "waits"),
    [
        (ALL_REDUCE, True),
        ("barrier (distributed_c10d.py:4000) < main (t.py:3)", True),
        ("wrapper (c10d_logger.py:83) < train (t.py:3)", True),
        ("slow_step (train.py:7) < train (train.py:12)", False),
        ("wait (threading.py:331) < get (queue.py:171)", False),  # a data loader's queue
    ],
)
def test_waits_in_collective(stack: str, waits: bool) -> None:
    """A collective of torch.distributed (by name or by its file) is a wait for the peers."""
    assert waits_in_collective(stack) is waits


SLEEP = "slow_step (train.py:7) < train (train.py:12) < <module> (train.py:16)"
LOAD = "next_batch (data.py:40) < train (train.py:10) < <module> (train.py:16)"
OTHER_AR = "all_reduce (distributed_c10d.py:3252) < wrapper (c10d_logger.py:83) < eval (ar.py:30)"


def _hang(node: str, *stacks: tuple[int, str], since: float = 1.0) -> RootCause:
    """One node's hang, its ranks' stacks (global rank, stack), local ranks from 0."""
    return RootCause(
        message=f"rank {stacks[0][0] if stacks else 0} hung: no progress",
        node=node,
        rank=stacks[0][0] if stacks else 0,
        local_rank=0,
        log_dir=f"/logs/j/attempt_1/{0}",
        since_round_s=since,
        stacks=[RankStack(rank=r, local_rank=i, stack=s) for i, (r, s) in enumerate(stacks)]
        or None,
    )


def _crash(node: str) -> RootCause:
    return RootCause(message="RuntimeError: Connection closed by peer", node=node, rank=9)


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        # rank 1 asleep while the 2 others wait in all_reduce: rank 1, on its node
        (
            [_hang("n0", (0, ALL_REDUCE)), _hang("n1", (1, SLEEP)), _hang("n2", (2, ALL_REDUCE))],
            (1, 1, 0, "rank 1 on n1 hung in slow_step (train.py:7), while the 2 other ranks "
             "wait in all_reduce (distributed_c10d.py:3252)"),
        ),
        # two nodes, one rank each: a tie, but only one waits in a collective
        (
            [_hang("n1", (1, SLEEP)), _hang("n0", (0, ALL_REDUCE))],
            (0, 1, 0, "rank 1 on n1 hung in slow_step (train.py:7), while the other rank "
             "waits in all_reduce (distributed_c10d.py:3252)"),
        ),
        # the culprit is the second local rank of its node: its own folder
        (
            [_hang("n0", (0, ALL_REDUCE), (1, LOAD)), _hang("n1", (2, ALL_REDUCE), (3, ALL_REDUCE))],
            (0, 1, 1, "rank 1 on n0 hung in next_batch (data.py:40), while the 3 other ranks "
             "wait in all_reduce (distributed_c10d.py:3252)"),
        ),
        # two ranks off, the first named, the other listed; the majority need not be larger
        (
            [_hang("n0", (0, SLEEP)), _hang("n1", (1, LOAD)), _hang("n2", (2, ALL_REDUCE))],
            (0, 0, 0, "rank 0 on n0 hung in slow_step (train.py:7), while the other rank waits "
             "in all_reduce (distributed_c10d.py:3252); also elsewhere: rank 1 on n1 in "
             "next_batch (data.py:40)"),
        ),
        # every rank in a collective, one in another (a mismatched collective): the odd one
        (
            [_hang("n0", (0, ALL_REDUCE)), _hang("n1", (1, OTHER_AR)), _hang("n2", (2, ALL_REDUCE))],
            (1, 1, 0, "rank 1 on n1 hung in all_reduce (distributed_c10d.py:3252), while the 2 "
             "other ranks wait in all_reduce (distributed_c10d.py:3252)"),
        ),
        # none in a collective: the strict majority decides
        (
            [_hang("n0", (0, LOAD)), _hang("n1", (1, SLEEP)), _hang("n2", (2, LOAD))],
            (1, 1, 0, "rank 1 on n1 hung in slow_step (train.py:7), while the 2 other ranks "
             "are in next_batch (data.py:40)"),
        ),
        # the crash of a survivor after the hang is no stack: the hangs still decide
        (
            [_hang("n0", (0, ALL_REDUCE)), _crash("n2"), _hang("n1", (1, SLEEP))],
            (2, 1, 0, "rank 1 on n1 hung in slow_step (train.py:7), while the other rank "
             "waits in all_reduce (distributed_c10d.py:3252)"),
        ),
        # no odd one: all alike; a tie with no collective; one node's stacks only alike
        ([_hang("n0", (0, ALL_REDUCE)), _hang("n1", (1, ALL_REDUCE))], None),
        ([_hang("n0", (0, SLEEP)), _hang("n1", (1, LOAD))], None),
        ([_hang("n1", (1, SLEEP))], None),
        # a crash came first: it is the cause, whatever the stacks of the later hangs
        ([_crash("n2"), _hang("n0", (0, ALL_REDUCE)), _hang("n1", (1, SLEEP))], None),
        # a hang without stacks (no handler, no py-spy) first: nothing to compare
        ([_hang("n0"), _hang("n1", (1, SLEEP)), _hang("n2", (2, ALL_REDUCE))], None),
        ([], None),
    ],
    ids=["3-nodes", "2-nodes-tie", "local-rank-1", "two-off", "mismatched-collective",
         "majority", "crash-between", "all-alike", "tie", "one-node", "crash-first",
         "no-stacks-first", "none"],
)  # fmt: skip
def test_blame(failures: list[RootCause], expected: tuple | None) -> None:
    """The ranks whose stacks differ from the others' (waiting in a collective, or a strict
    majority) are the cause; the error names the first, on its node, with its frame."""
    blamed = blame(failures)
    if expected is None:
        assert blamed is None
        return
    assert blamed is not None
    index, error = blamed
    failure, rank, local_rank, message = expected
    assert (index, error.node, error.rank, error.local_rank) == (
        failure,
        failures[failure].node,
        rank,
        local_rank,
    )
    assert error.message == message
    assert error.log_dir == f"/logs/j/attempt_1/{local_rank}"
    assert error.stacks == failures[failure].stacks and error.collateral is False


def test_a_rank_listed_twice_counts_once() -> None:
    """A store writer who lists a rank on several nodes cannot outvote the others with it."""
    lie = _hang("n2", (1, ALL_REDUCE), (1, ALL_REDUCE), (1, ALL_REDUCE))
    failures = [_hang("n0", (0, ALL_REDUCE)), _hang("n1", (1, SLEEP)), lie]
    blamed = blame([*failures[:1], _hang("n3", (3, SLEEP)), failures[1], lie])
    assert blamed is not None and blamed[1].rank == 3  # rank 1's first stack: SLEEP
    assert "also elsewhere: rank 1 on n1" in blamed[1].message


def _recorded(node: str, rank: int, stack: str, collectives: int | None) -> RootCause:
    """One node's hang with one rank and its flight recorder's count of collectives."""
    failure = _hang(node, (rank, stack))
    assert failure.stacks is not None
    counted = failure.stacks[0].model_copy(update={"collectives": collectives})
    return failure.model_copy(update={"stacks": [counted]})


@pytest.mark.parametrize(
    ("failures", "named"),
    [
        # The recorders say who is behind, whatever the stacks say (all alike here).
        ([_recorded("n0", 0, ALL_REDUCE, 4), _recorded("n1", 1, ALL_REDUCE, 3)], 1),
        ([_recorded("n0", 0, SLEEP, 7), _recorded("n1", 1, ALL_REDUCE, 8),
          _recorded("n2", 2, ALL_REDUCE, 8)], 0),
        # All at the same count, or one recorder only: the stacks decide.
        ([_recorded("n0", 0, ALL_REDUCE, 4), _recorded("n1", 1, SLEEP, 4)], 1),
        ([_recorded("n0", 0, ALL_REDUCE, None), _recorded("n1", 1, SLEEP, 3)], 1),
        ([_recorded("n0", 0, ALL_REDUCE, 4), _recorded("n1", 1, ALL_REDUCE, None)], None),
    ],
    ids=["behind", "behind-of-three", "level", "one-recorder", "one-recorder-alike"],
)  # fmt: skip
def test_the_flight_recorder_names_the_rank_behind_in_collectives(
    failures: list[RootCause], named: int | None
) -> None:
    blamed = blame(failures)
    if named is None:
        assert blamed is None
        return
    assert blamed is not None and blamed[1].rank == named
    counts = {s.collectives for f in failures for s in f.stacks or []}
    if len(counts - {None}) > 1:
        assert "is behind in collectives" in blamed[1].message, blamed[1].message


@pytest.mark.parametrize(
    ("dump", "summary"),
    [
        ({"entries": []}, {}),
        (
            {"entries": [
                {"collective_seq_id": 1, "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce"},
                {"collective_seq_id": 2, "process_group": ["0", "default_pg"], "profiling_name": "gloo:broadcast"},
                {"collective_seq_id": 9, "process_group": ["1", "tp"], "profiling_name": "nccl:all_gather"},
                {"collective_seq_id": 50, "is_p2p": True, "process_group": ["0", "default_pg"]},
            ]},
            {"default_pg": 2, "tp": 9},
        ),
        ({"entries": "not a list"}, {}),
        ({}, {}),
    ],
)  # fmt: skip
def test_a_recorder_dump_is_summed_up_per_process_group(dump: dict, summary: dict) -> None:
    """What the worker writes for the daemon: the highest collective of each group (p2p
    aside), never the dump itself."""
    from elasticd.worker.flight import summary as summed

    assert summed(dump)["collectives"] == summary
