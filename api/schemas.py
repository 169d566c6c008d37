"""Wire models of the REST API.

The daemon's records are served as they are stored, so most models live in
:mod:`elasticd.models` and are re-exported here; API-only shapes are below.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from elasticd.goodput import Goodput
from elasticd.models import (
    Event,
    GroupView,
    Job,
    JobList,
    JobSpec,
    RootCause,
    WorkersView,
    WorkerView,
)

__all__ = [
    "Event",
    "Goodput",
    "GroupView",
    "Health",
    "Empty",
    "Job",
    "JobList",
    "JobSpec",
    "Problem",
    "RootCause",
    "WorkerView",
    "WorkersView",
]


class SlurmProof(BaseModel):
    """A Slurm step's store host's answer to a task's challenge (``GET /slurm/proof``)."""

    proof: str
    """HMAC-SHA256 of the step's token over ``elasticd-slurm-proof:<nonce>``, hex."""


class Health(BaseModel):
    """Liveness / readiness answer."""

    status: str
    node: str
    version: str
    reason: str | None = None
    """Why the daemon is not ready (``/readyz`` only)."""
    warnings: list[str] = []
    """What this ready daemon will refuse, and how to fix it (``/readyz`` only)."""
    pid: int | None = None
    """The daemon's process id (the same across a re-exec: ``elasticd reload``)."""
    started_at: float | None = None
    """When the running program image started (Unix time): a re-exec changes it."""


class Problem(BaseModel):
    """An error, as RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str


class Empty(BaseModel):
    """`{}`: the body of a POST that has nothing else to say (a cancel, a lease keepalive).

    Every state-changing request is JSON, so that no web page can send one
    without a CORS preflight (which the daemon never grants).
    """

    model_config = ConfigDict(extra="forbid")
