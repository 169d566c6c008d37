"""Where in-process restart keeps its coordination state in the cluster store.

Shared by workers and the daemon (standard library only, no torch, no
HTTP client), because the daemon writes one kind of key the workers watch:
**"rank terminated"**. Layout, under ``jobs/<job>/inprocess/<attempt>/``
(``<attempt>`` from :func:`elasticd.worker.names.attempt_tag`)::

    faults/terminated/<rank>                JSON {"by", "reason", "exit_code", "signal", "at"}
    faults/interrupted/<call>/<iter>/<rank> JSON {"kind", "message", "at"}
    calls/<call>/<iter>/<phase>/<rank>      arrival at a barrier ("start", "restart", "done")
    calls/<call>/<iter>/world               JSON list: the world of that iteration

``<rank>`` is always the initial (global) rank, ``RANK`` at process start.

``faults/`` is what every rank's monitor thread watches (one prefix, so one
long-poll); barriers watch the whole root. The torch store handed to the
training function lives elsewhere (``jobs/<job>/torch/<attempt>/inprocess/<call>/``)
so that process-group traffic never wakes a barrier.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticd.keys import worker_prefix
from elasticd.worker.names import attempt_tag, escape_key, job_id

if TYPE_CHECKING:
    from elasticd.store.base import Store

__all__ = ["Layout", "report_terminated", "terminated_record"]


@dataclass(frozen=True)
class Layout:
    """The keys of one job attempt's in-process coordination."""

    job: str
    attempt: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Layout:
        """The layout for the worker whose environment is ``environ`` (default: this process)."""
        return cls(job_id(environ), attempt_tag(environ))

    @classmethod
    def of(cls, job: str, attempt: str) -> Layout:
        """The layout for a raw job id and attempt tag (the daemon's side)."""
        return cls(escape_key(job), attempt)

    @property
    def root(self) -> str:
        return f"{worker_prefix(self.job)}inprocess/{self.attempt}/"

    @property
    def faults(self) -> str:
        return self.root + "faults/"

    @property
    def terminated_prefix(self) -> str:
        return self.faults + "terminated/"

    def terminated(self, rank: int) -> str:
        return f"{self.terminated_prefix}{rank}"

    def interrupted_prefix(self, call: int, iteration: int) -> str:
        return f"{self.faults}interrupted/{call}/{iteration}/"

    def interrupted(self, call: int, iteration: int, rank: int) -> str:
        return f"{self.interrupted_prefix(call, iteration)}{rank}"

    def phase_prefix(self, call: int, iteration: int, phase: str) -> str:
        return f"{self.root}calls/{call}/{iteration}/{phase}/"

    def arrived(self, call: int, iteration: int, phase: str, rank: int) -> str:
        return f"{self.phase_prefix(call, iteration, phase)}{rank}"

    def world(self, call: int, iteration: int) -> str:
        return f"{self.root}calls/{call}/{iteration}/world"

    def torch_namespace(self, call: int) -> str:
        return f"{worker_prefix(self.job)}torch/{self.attempt}/inprocess/{call}/"


def terminated_record(
    reason: str,
    *,
    by: str = "daemon",
    exit_code: int | None = None,
    signal: int | None = None,
    at: float | None = None,
) -> bytes:
    """The JSON value of a ``faults/terminated/<rank>`` key."""
    return json.dumps(
        {
            "by": by,
            "reason": reason,
            "exit_code": exit_code,
            "signal": signal,
            "at": time.time() if at is None else at,
        }
    ).encode()


async def report_terminated(
    store: Store,
    job: str,
    attempt: str,
    rank: int,
    reason: str,
    *,
    exit_code: int | None = None,
    signal: int | None = None,
) -> bool:
    """The daemon's half: tell the survivors that global rank ``rank`` is gone.

    Creates the key only if absent (a rank that reported its own end keeps
    its reason). Returns True if this call wrote it.
    """
    key = Layout.of(job, attempt).terminated(rank)
    value = terminated_record(reason, exit_code=exit_code, signal=signal)
    result = await store.compare_and_set(key, value, None)
    return result.ok
