"""Hang attribution: where each rank was, and which ranks are the cause (issue 37).

In a collective hang every rank goes silent at once: the one that stopped
(asleep, in a deadlock, stuck reading data) and all the others, which wait for
it in ``all_reduce``. The heartbeats cannot tell them apart; their stacks can.
On a hang each node's agent dumps the stacks of every one of its ranks
(:class:`elasticd.agent.hooks.HangHook`), keeps a short *signature* of each
(:class:`~elasticd.models.RankStack` in the node's
:class:`~elasticd.models.RootCause`), and once the round's failures from the
nodes are joined in the job document (:func:`elasticd.agent.edits.record_failure`)
:func:`blame` names the ranks whose stack differs.

Everything here is pure:

* :func:`main_thread` reads a dump, faulthandler's (``SIGUSR1``, written into
  the worker's ``stderr.log``) or py-spy's, into the frames of the main
  thread, innermost first;
* :func:`signature` makes the few innermost frames a bounded line:
  ``slow_step (train.py:12) < train (train.py:20) < <module> (train.py:30)``;
* :func:`blame` decides, from the round's failures, who hung: first by the
  flight recorders where the job turned them on (:mod:`elasticd.worker.flight`:
  the rank that issued fewer collectives than the others is behind, and they
  wait for it); else by the stacks: ranks waiting
  in a collective (a frame of ``torch.distributed``) are victims when others
  are not, and the ranks that are not are the cause; when every rank waits in
  a collective (mismatched collectives), or none does, the ranks outside a
  strict majority are. With no odd one (all alike, or a tie) nothing is
  named and the first failure in time stays the cause.

What a dump says is the job's own text (a worker writes its stderr as it
likes): it is only ever parsed, bounded, and shown as the job's error.

Which side of the boundary: the daemon; pure, no IO.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from elasticd.models import MAX_RANK_STACKS, MAX_STACK_CHARS, RankStack, RootCause

__all__ = [
    "DEPTH",
    "Frame",
    "blame",
    "innermost",
    "main_thread",
    "signature",
    "stack_of",
    "waits_in_collective",
]

#: How many of the innermost frames a signature keeps.
DEPTH = 3

#: faulthandler: ``Current thread 0x... (most recent call first):`` or ``Thread 0x... (...):``.
_FH_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')
#: py-spy dump: ``Thread 1234 (idle): "MainThread"``, then ``    func (file.py:12)``.
_SPY_THREAD = re.compile(r'^Thread (?:0x)?[0-9a-fA-F]+ \([^)]*\): "(.*)"\s*$')
_SPY_FRAME = re.compile(r"^\s+(\S.*?) \((.+):(\d+)\)\s*$")
_RANK_PREFIX = re.compile(r"^\[rank\d{1,7}\]: ?")
#: The outermost frames of a program's main thread (a script, ``python -m``).
_MAIN_ROOTS = ("<module>", "_run_module_as_main", "_run_code")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")

#: torch.distributed's collectives: a rank whose innermost frame is one of them (or in
#: the files that hold them) waits for its peers.
_COLLECTIVE_FILES = frozenset({"distributed_c10d.py", "c10d_logger.py"})
_COLLECTIVES = frozenset(
    {
        "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
        "all_gather_object", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
        "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
        "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
        "scatter_object_list", "send", "recv", "batch_isend_irecv",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Frame:
    """One Python frame of a dump."""

    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({PurePosixPath(self.file).name}:{self.line})"


def main_thread(text: str) -> list[Frame] | None:
    """The main thread's frames (innermost first) of the last dump in ``text``; None: none.

    faulthandler names no thread: the main thread is the one whose outermost
    frame is a program's (``<module>``), else the last listed (threads are
    listed newest first, and the main thread is the oldest). py-spy names it
    ``MainThread``.
    """
    threads: list[tuple[str | None, list[Frame]]] = []
    for raw in text.splitlines():
        line = _RANK_PREFIX.sub("", raw)
        if _FH_THREAD.match(line):
            threads.append(("fh", []))
        elif (spy := _SPY_THREAD.match(line)) is not None:
            threads.append((f"spy:{spy.group(1)}", []))
        elif threads and (m := _FH_FRAME.match(line)) is not None and threads[-1][0] == "fh":
            threads[-1][1].append(Frame(m.group(3), m.group(1), int(m.group(2))))
        elif threads and (m := _SPY_FRAME.match(line)) is not None and threads[-1][0] != "fh":
            threads[-1][1].append(Frame(m.group(1), m.group(2), int(m.group(3))))
    threads = _last_dump(threads)
    named = [frames for kind, frames in threads if kind == "spy:MainThread" and frames]
    if named:
        return named[-1]
    rooted = [frames for _, frames in threads if frames and frames[-1].function in _MAIN_ROOTS]
    if rooted:
        return rooted[-1]
    listed = [frames for _, frames in threads if frames]
    return listed[-1] if listed else None


def _last_dump(
    threads: list[tuple[str | None, list[Frame]]],
) -> list[tuple[str | None, list[Frame]]]:
    """The threads of the last dump: a dump ends with its main thread (faulthandler lists
    it last, with a program's outermost frame), so a thread after it starts a new one."""
    start = 0
    for i, (kind, frames) in enumerate(threads[:-1]):
        if kind == "fh" and frames and frames[-1].function in _MAIN_ROOTS:
            start = i + 1
    return threads[start:]


def signature(frames: Sequence[Frame], depth: int = DEPTH) -> str:
    """The innermost ``depth`` frames as one bounded, printable line, innermost first."""
    text = " < ".join(str(f) for f in frames[:depth])
    text = _UNPRINTABLE.sub("?", text)
    return text if len(text) <= MAX_STACK_CHARS else text[: MAX_STACK_CHARS - 3] + "..."


def stack_of(text: str) -> str | None:
    """The signature of the main thread in a dump's text; None when it holds no dump."""
    frames = main_thread(text)
    return signature(frames) if frames else None


def innermost(stack: str) -> str:
    """A signature's innermost frame: ``slow_step (train.py:12)``."""
    return stack.split(" < ", 1)[0]


def waits_in_collective(stack: str) -> bool:
    """Whether a signature's innermost frame is a collective of torch.distributed."""
    top = innermost(stack)
    function, _, where = top.rpartition(" (")
    file = where.rsplit(":", 1)[0]
    return function in _COLLECTIVES or file in _COLLECTIVE_FILES


@dataclass(frozen=True)
class _Seen:
    """One rank's stack, with the index of its node's failure in the round's list."""

    failure: int
    node: str | None
    stack: RankStack


def blame(failures: Sequence[RootCause]) -> tuple[int, RootCause] | None:
    """Who hung: the index of the culprit's node's failure in ``failures`` (in time order)
    and the job's error naming that rank; None when the stacks name no one.

    Only a round whose first failure is a hang with its stacks is judged (a crash
    that came first is the cause, whatever stacks its peers had when they timed out).
    """
    if not failures or not failures[0].stacks:
        return None
    seen = _ranks(failures)
    if (behind := _behind(failures, seen)) is not None:
        return behind
    groups: dict[str, list[_Seen]] = {}
    for s in seen:
        groups.setdefault(s.stack.stack, []).append(s)
    if len(groups) < 2:
        return None
    waiting = {sig: g for sig, g in groups.items() if waits_in_collective(sig)}
    if waiting and len(waiting) < len(groups):
        # Some wait in a collective and others do not: the others are the cause.
        culprits = [s for sig, g in groups.items() if sig not in waiting for s in g]
        majority = max(waiting, key=lambda sig: len(waiting[sig]))
        victims, waits = sum(len(g) for g in waiting.values()), True
    else:
        largest = max(len(g) for g in groups.values())
        top = [sig for sig, g in groups.items() if len(g) == largest]
        if len(top) > 1:
            return None  # a tie: no odd one
        majority = top[0]
        culprits = [s for sig, g in groups.items() if sig != majority for s in g]
        victims, waits = largest, majority in waiting
    culprit = culprits[0]
    if victims == 1:
        others = "the other rank " + ("waits in" if waits else "is in")
    else:
        others = f"the {victims} other ranks " + ("wait in" if waits else "are in")
    message = (
        f"rank {culprit.stack.rank} on {culprit.node} hung in {innermost(culprit.stack.stack)}, "
        f"while {others} {innermost(majority)}"
    )
    if len(culprits) > 1:
        also = ", ".join(
            f"rank {s.stack.rank} on {s.node} in {innermost(s.stack.stack)}" for s in culprits[1:4]
        )
        more = f" and {len(culprits) - 4} more" if len(culprits) > 4 else ""
        message += f"; also elsewhere: {also}{more}"
    return culprit.failure, _named(failures[culprit.failure], culprit.stack, message)


def _behind(failures: Sequence[RootCause], seen: list[_Seen]) -> tuple[int, RootCause] | None:
    """The rank behind in collectives, by the flight recorders (the surest sign: the others
    wait in a collective it never issued); None when they do not tell (fewer than two ranks
    recorded, all alike)."""
    known = [s for s in seen if s.stack.collectives is not None]
    counts = {s.stack.collectives for s in known}
    if len(known) < 2 or len(counts) < 2:
        return None
    low, high = min(c for c in counts if c is not None), max(c for c in counts if c is not None)
    culprits = [s for s in known if s.stack.collectives == low]
    culprit = culprits[0]
    others = len(known) - len(culprits)
    message = (
        f"rank {culprit.stack.rank} on {culprit.node} is behind in collectives ({low} issued, "
        f"{'the other rank' if others == 1 else f'the {others} other ranks'} at up to {high}): "
        f"it hung in {innermost(culprit.stack.stack)}"
    )
    if len(culprits) > 1:
        message += "; also behind: " + ", ".join(
            f"rank {s.stack.rank} on {s.node}" for s in culprits[1:4]
        )
    return culprit.failure, _named(failures[culprit.failure], culprit.stack, message)


def _ranks(failures: Sequence[RootCause]) -> list[_Seen]:
    """Every rank's stack of the round, the first seen of each rank (in time order)."""
    seen: dict[int, _Seen] = {}
    for i, failure in enumerate(failures):
        for stack in (failure.stacks or [])[:MAX_RANK_STACKS]:
            seen.setdefault(stack.rank, _Seen(i, failure.node, stack))
    return list(seen.values())


def _named(base: RootCause, stack: RankStack, message: str) -> RootCause:
    """The node's failure made to name the culprit rank (its own worker folder)."""
    log_dir = base.log_dir
    if log_dir is not None and stack.local_rank != base.local_rank:
        log_dir = str(PurePosixPath(log_dir).with_name(str(stack.local_rank)))
    return base.model_copy(
        update={
            "message": message,
            "rank": stack.rank,
            "local_rank": stack.local_rank,
            "log_dir": log_dir,
            "collateral": False,
        }
    )
