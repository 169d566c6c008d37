"""The workers' output on the console of ``elasticd submit --wait``, as ``ray job submit``.

``submit --wait`` follows the job's events; this streams, beside them, what
its workers write, through the same route as ``elasticd logs -f`` (one
follow per local rank and stream, each across every attempt, ending when the
job ends). The logs come from the daemon the command talks to (as ``logs -f``
without ``--node``): the workers it runs; a job of several nodes shows one
node's. A worker's stdout goes to stdout, its stderr to stderr, each line
whole, prefixed ``[<role><local rank>]:`` when several workers write (the
prefix of torchrun's ``--tee``). At most :data:`MAX_FOLLOWED` local ranks are
followed: each follow is one of the caller's long-polls, which the daemon
bounds per principal (``principal_max_long_polls``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from elasticd.client import ClientError, Stream

__all__ = ["MAX_FOLLOWED", "WorkerOutput", "followed_ranks", "whole_lines"]

#: The most local ranks whose output ``submit --wait`` follows (two long-polls each).
MAX_FOLLOWED = 8

#: How long, once the job has ended, the output may take to drain.
DRAIN_S = 10.0


def followed_ranks(nproc_per_node: int, ranks_filter: list[int] | None) -> list[int]:
    """The local ranks whose output is shown (pure): the job's ``local_ranks_filter``, else
    every one, the first :data:`MAX_FOLLOWED` of them."""
    ranks = [r for r in ranks_filter if r < nproc_per_node] if ranks_filter else None
    return (ranks if ranks is not None else list(range(nproc_per_node)))[:MAX_FOLLOWED]


def whole_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The text of ``chunks`` as whole lines, each with its newline (pure); a last line
    without one gets one."""
    rest = ""
    for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split("\n")
        for line in lines:
            yield line + "\n"
    if rest:
        yield rest + "\n"


class WorkerOutput:
    """One thread per (local rank, stream), each printing a followed log line by line."""

    def __init__(
        self,
        client: Any,
        job_id: str,
        ranks: list[int],
        *,
        role: str = "default",
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        self._client = client
        self._job_id = job_id
        self._ranks = ranks
        self._role = role
        self._outs = {"stdout": out or sys.stdout, "stderr": err or sys.stderr}
        self._lock = threading.Lock()  # one line at a time on the console
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for rank in self._ranks:
            for stream in ("stdout", "stderr"):
                thread = threading.Thread(
                    target=self._follow,
                    args=(rank, stream),
                    name=f"elasticd-follow-{rank}-{stream}",
                    daemon=True,  # Ctrl-C ends the command, not waiting for a follow
                )
                thread.start()
                self._threads.append(thread)

    def join(self, timeout: float = DRAIN_S) -> None:
        """Wait (bounded) for every follow to end; each does when the job has ended."""
        for thread in self._threads:
            thread.join(timeout)

    def _follow(self, rank: int, stream: Stream) -> None:
        prefix = f"[{self._role}{rank}]:" if len(self._ranks) > 1 else ""
        out = self._outs[stream]
        try:
            for line in whole_lines(self._client.follow_logs(self._job_id, rank, stream)):
                with self._lock:
                    out.write(prefix + line)
                    out.flush()
        except (ClientError, OSError, ValueError):
            # No logs of this rank here (a job this node does not run), the daemon gone,
            # a console closed: the output is a view; the job's end is reported anyway.
            return
