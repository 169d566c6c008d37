"""The job service: what the REST routes call, and the local scheduler of agents.

It keeps jobs in SQLite, turns submissions into agents when this node has
room, and answers every read. Job state changes go through
:func:`elasticd.states.job_transition`, so an illegal one is refused and a
terminal state is final.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from elasticd.agent.agent import AgentContext, ConsoleSink, JobAgent, decode_group, group_key
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.config import Config
from elasticd.db import Database
from elasticd.errors import (
    JobConflict,
    JobNotFound,
    LogNotFound,
    ShuttingDown,
    StoreError,
)
from elasticd.events import EventLog
from elasticd.models import Event, GroupView, Job, JobList, JobSpec, WorkersView
from elasticd.rendezvous import SoloRendezvous
from elasticd.states import JobState, job_transition
from elasticd.store import Store

log = logging.getLogger("elasticd.jobs")

DAEMON_STOPPED = "the elasticd daemon stopped while the job was running"
DAEMON_CRASHED = (
    "the elasticd daemon was not running (it crashed or was killed) while the job was running"
)
MAX_LOG_BYTES = 8 * 1024 * 1024


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class JobService:
    """Jobs of this daemon: submit, read, cancel, and the agents that run them."""

    def __init__(
        self,
        config: Config,
        db: Database,
        events: EventLog,
        store: Store,
        *,
        token_file: str | None = None,
        slots: int,
        gpu_ids: list[str] | None = None,
        console: ConsoleSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.db = db
        self.events = events
        self.store = store
        self.clock = clock
        self.console = console
        self._token_file = token_file
        self._slots = slots
        self._gpu_ids = gpu_ids
        self._free = list(range(slots))
        self._allocated: dict[str, list[int]] = {}
        self._agents: dict[str, JobAgent] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._accepting = True
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._job_finished: dict[str, asyncio.Event] = {}

    # lifecycle

    def recover(self) -> None:
        """After a start: a job the last run left active is failed, never silently lost."""
        for job in self.db.active_jobs():
            self.events.emit(job.id, "daemon", "job.orphaned", DAEMON_CRASHED, state="FAILED")
            self._update(job, state=JobState.FAILED, reason=DAEMON_CRASHED)

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def stop_agents(self) -> None:
        """Stop every agent (each stops its workers, shielded) and fail their jobs."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for job in self.db.active_jobs():
            self.events.emit(job.id, "daemon", "daemon.stopped", DAEMON_STOPPED, state="FAILED")
            self._update(job, state=JobState.FAILED, reason=DAEMON_STOPPED)

    # writes

    def submit(self, spec: JobSpec) -> tuple[Job, bool]:
        """Accept a job. Returns (job, created); same id + same spec returns the existing one."""
        if not self._accepting:
            raise ShuttingDown("the daemon is shutting down and accepts no new jobs")
        if spec.id is not None:
            existing = self.db.get_job(spec.id)
            if existing is not None:
                if existing.spec.without_id() == spec.without_id():
                    return existing, False
                raise JobConflict(
                    f"job {spec.id!r} exists with a different spec; choose another id "
                    "or submit the identical spec to get the existing job"
                )
        job_id = spec.id or uuid.uuid4().hex[:12]
        spec = spec.model_copy(update={"id": job_id})
        job = Job(
            id=job_id,
            spec=spec,
            state=JobState.PENDING,
            max_restarts=spec.max_restarts,
            created_at=self.clock.time(),
        )
        if not self.db.insert_job(job):  # lost a race with an identical id
            return self.submit(spec)
        self.events.emit(
            job_id,
            "daemon",
            "job.submitted",
            f"job accepted: {spec.nproc_per_node} x {spec.entrypoint} "
            f"{' '.join(spec.args)}".rstrip(),
            state=JobState.PENDING.value,
        )
        self._schedule()
        return job, True

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state.is_terminal:
            raise JobConflict(
                f"job {job_id!r} already ended as {job.state.value}; nothing to cancel"
            )
        agent = self._agents.get(job_id)
        self.events.emit(job_id, "daemon", "job.cancel_requested", "cancel requested by user")
        if agent is not None:
            agent.cancel()
            return self.get(job_id)
        return self._update(job, state=JobState.CANCELLED, reason="cancelled by user")

    # reads

    def get(self, job_id: str) -> Job:
        job = self.db.get_job(job_id)
        if job is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        return job

    def list_jobs(self, state: list[JobState] | None, limit: int, offset: int) -> JobList:
        jobs, total = self.db.list_jobs(state, limit, offset)
        next_offset = offset + len(jobs) if offset + len(jobs) < total else None
        return JobList(jobs=jobs, total=total, next_offset=next_offset)

    async def workers(self, job_id: str) -> WorkersView:
        job = self.get(job_id)
        groups: list[GroupView] = []
        try:
            listing = await self.store.list(group_key(job_id, ""))
            groups = [g for g in (decode_group(e.value) for e in listing.entries) if g]
        except StoreError as exc:
            log.warning("job %s: store unavailable for workers view: %s", job_id, exc)
        if not groups:
            saved = self.db.get_workers(job_id)
            if saved is not None:
                groups = saved.groups
        agent = self._agents.get(job_id)
        if agent is not None and agent.view is not None:  # our own group: freshest copy
            groups = [g for g in groups if g.node != agent.view.node] + [agent.view]
        return self._workers_view(job, groups)

    def _workers_view(self, job: Job, groups: list[GroupView]) -> WorkersView:
        return WorkersView(
            job_id=job.id,
            state=job.state,
            restart_count=job.restart_count,
            max_restarts=job.max_restarts,
            remaining_restarts=max(0, job.max_restarts - job.restart_count),
            round=job.round,
            groups=sorted(groups, key=lambda g: g.group_rank),
        )

    def list_events(self, job_id: str, after: int, limit: int) -> list[Event]:
        self.get(job_id)
        return self.events.read(job_id, after, limit)

    async def follow_events(self, job_id: str, after: int, timeout: float) -> list[Event]:
        self.get(job_id)
        return await self.events.follow(job_id, after, timeout)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Wait until the job is terminal (for ``elasticd run`` and tests)."""
        job = self.get(job_id)
        after = 0
        async with asyncio.timeout(timeout):
            while not job.state.is_terminal:
                events = await self.events.follow(job_id, after, 30)
                if events:
                    after = events[-1].seq
                job = self.get(job_id)
        return job

    def log_file(
        self,
        job_id: str,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
    ) -> Path:
        """The path of one worker log, refusing anything outside the job's log folder."""
        self.get(job_id)
        job_dir = (self.config.logs / job_id).resolve()
        if attempt is None:
            attempts = sorted(
                (
                    int(p.name.removeprefix("attempt_"))
                    for p in job_dir.glob("attempt_*")
                    if p.name.removeprefix("attempt_").isdigit()
                ),
            )
            if not attempts:
                raise LogNotFound(f"job {job_id!r} has no logs yet")
            attempt = attempts[-1]
        path = (job_dir / f"attempt_{attempt}" / str(local_rank) / f"{stream}.log").resolve()
        if not path.is_relative_to(job_dir):
            raise LogNotFound("log parameters point outside the job's log folder")
        if not path.is_file():
            raise LogNotFound(
                f"no {stream} log for job {job_id!r}, attempt {attempt}, local rank {local_rank}"
            )
        return path

    def read_log(self, path: Path, tail: int | None) -> str:
        size = path.stat().st_size
        with path.open("rb") as fh:
            if size > MAX_LOG_BYTES:
                fh.seek(size - MAX_LOG_BYTES)
            data = fh.read()
        text = data.decode("utf-8", errors="replace")
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-tail:]) if tail > 0 else ""
        return text

    # scheduling

    def _schedule(self) -> None:
        """Start an agent for every pending job this node can run now, oldest first."""
        if not self._accepting:
            return
        pending, _ = self.db.list_jobs([JobState.PENDING], limit=10_000, offset=0)
        for job in reversed(pending):
            if job.id in self._agents:
                continue
            spec = job.spec
            if not selector_matches(spec.node_selector, self.config.labels):
                continue
            if spec.nproc_per_node > self._slots:
                reason = (
                    f"this node has {self._slots} slots; the job needs {spec.nproc_per_node} "
                    "per node (set --slots, or lower nproc_per_node)"
                )
                self.events.emit(job.id, "daemon", "job.unschedulable", reason, state="FAILED")
                self._update(job, state=JobState.FAILED, reason=reason)
                continue
            if spec.nproc_per_node > len(self._free):
                continue
            self._start_agent(job)

    def _start_agent(self, job: Job) -> None:
        slots = self._free[: job.spec.nproc_per_node]
        del self._free[: job.spec.nproc_per_node]
        self._allocated[job.id] = slots
        cuda = None
        if self._gpu_ids is not None:
            cuda = ",".join(self._gpu_ids[s] for s in slots)
        ctx = AgentContext(
            node=self.config.node_name,
            advertise_addr=self.config.advertise,
            daemon_url=self.config.url,
            log_root=self.config.logs,
            store=self.store,
            events=self.events,
            update_job=self.update_job,
            rendezvous=SoloRendezvous(
                self.store,
                job.id,
                node=self.config.node_name,
                role=job.spec.role,
                local_world_size=job.spec.nproc_per_node,
                advertise_addr=self.config.advertise,
                master_addr=job.spec.master_addr,
                master_port=job.spec.master_port,
            ),
            base_env=self._base_env,
            token_file=self._token_file,
            cuda_visible_devices=cuda,
            console=self.console,
            clock=self.clock,
        )
        agent = JobAgent(job, ctx)
        self._agents[job.id] = agent
        task = asyncio.create_task(agent.run(), name=f"agent-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(self._agent_done(job.id))

    def _agent_done(self, job_id: str) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            agent = self._agents.pop(job_id, None)
            self._tasks.pop(job_id, None)
            self._free.extend(self._allocated.pop(job_id, []))
            self._free.sort()
            if agent is not None and agent.view is not None:
                job = self.db.get_job(job_id)
                if job is not None:
                    self.db.save_workers(job_id, self._workers_view(job, [agent.view]))
            if not task.cancelled():
                self._schedule()

        return done

    # state changes

    def update_job(self, job_id: str, **changes: Any) -> Job:
        return self._update(self.get(job_id), **changes)

    def _update(self, job: Job, **changes: Any) -> Job:
        target: JobState | None = changes.pop("state", None)
        now = self.clock.time()
        updates: dict[str, Any] = dict(changes)
        if target is not None and target is not job.state:
            job_transition(job.state, target)
            updates["state"] = target
            if target is JobState.RUNNING and job.started_at is None:
                updates["started_at"] = now
            if target.is_terminal:
                updates["finished_at"] = now
        if not updates:
            return job
        new = job.model_copy(update=updates)
        self.db.save_job(new)
        if "state" in updates:
            self.events.emit(
                job.id,
                "daemon",
                "job.state",
                f"job {job.state.value} -> {target.value if target else ''}"
                + (f": {changes['reason']}" if changes.get("reason") else ""),
                state=new.state.value,
                error=new.error if new.state is JobState.FAILED else None,
            )
        return new
