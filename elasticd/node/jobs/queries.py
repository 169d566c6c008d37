"""What the routes read of the jobs: documents as served, the queue, groups, events, logs.

A job is served with its place in the fleet's plan filled in (queue entry,
nodes). A running group of a node that is gone is shown UNKNOWN. Worker logs
are read through :func:`~elasticd.supervise.files.open_worker_file` (no link,
no FIFO, a regular file of the worker's own), in a thread, and only from a
folder of the job asked about (:func:`~elasticd.node.jobs.documents.incarnation`).
Log retention (``log_retention_*``) is applied to the same folders here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import BinaryIO, Literal

from elasticd.agent.agent import JobAgent, decode_group
from elasticd.agent.goodput import read_records
from elasticd.errors import JobNotFound, LogNotFound, StoreError
from elasticd.goodput import FACT_KINDS, Goodput, account, job_facts, merge_nodes
from elasticd.keys import goodput_prefix, group_prefix, job_key, lighthouse_quorum_key
from elasticd.lighthouse.state import decode_doc
from elasticd.logs import stream_file
from elasticd.models import (
    Event,
    GroupView,
    Job,
    JobList,
    QueueView,
    WorkersView,
    incarnation,
    incarnation_tag,
    tagged_for,
    valid_job_id,
)
from elasticd.node.cluster import valid_node_url
from elasticd.node.jobs.documents import JobsSide, parse_job, same_job
from elasticd.node.jobs.groups import belongs, group_views
from elasticd.node.jobs.merged import EventSource, follow_merged, merged_events
from elasticd.replicas import QuorumView
from elasticd.sched.plan import FleetPlan
from elasticd.states import JobState, WorkerState
from elasticd.supervise.files import UnsafeWorkerFile, open_worker_file

log = logging.getLogger("elasticd.node.jobs")

MAX_LOG_BYTES = 8 * 1024 * 1024


def _in_group(group: GroupView, job: Job) -> GroupView:
    """A group view of ``job`` naming its replica group (None: an ordinary job), and the
    child job that runs it, on the group and on each worker (pure)."""
    if job.replica_group is None:
        return group
    k = job.replica_group
    workers = [w.model_copy(update={"replica_group": k}) for w in group.workers]
    return group.model_copy(update={"replica_group": k, "job": job.id, "workers": workers})


class JobQueries:
    """Answers to the API's reads; changes nothing but log folders past retention."""

    def __init__(
        self,
        side: JobsSide,
        *,
        plan: Callable[[], FleetPlan | None],
        agents: Mapping[str, JobAgent],
        agent_of: Callable[[Job], JobAgent | None],
    ) -> None:
        """``plan``: the fleet's plan as last seen; ``agents``: the ones running here;
        ``agent_of``: the one running a job (not another job of its id)."""
        self.side = side
        self._plan = plan
        self._agents = agents
        self._agent_of = agent_of

    async def get(self, job_id: str) -> Job:
        job = self._as_served(await self.side.documents.read(job_id))
        if job.is_parent:
            children = await self.side.documents.children(job)
            job = job.model_copy(
                update={
                    "groups": group_views(job, children, self._plan()),
                    "quorum": await self._quorum(job),
                }
            )
        return job

    async def _quorum(self, parent: Job) -> QuorumView | None:
        """The last quorum of the job's Lighthouse, its members' groups found by their stores
        (each Manager names its group's ``MASTER_ADDR:MASTER_PORT``); None before the first."""
        entry = await self.side.store.get(lighthouse_quorum_key(parent.id))
        doc = decode_doc(entry.value) if entry is not None else None
        if doc is None or isinstance(doc, str):
            return None
        ports: dict[int, int] = {}
        for child in await self._groups_of(parent):
            for view in await self._groups_view(child):
                if view.master_port is not None and child.replica_group is not None:
                    ports[view.master_port] = child.replica_group
        groups = set()
        for p in doc.participants:
            _, _, port = p.member.store_address.rpartition(":")
            if port.isdigit() and int(port) in ports:
                groups.add(ports[int(port)])
        seconds, nanos = doc.created
        return QuorumView(
            quorum_id=doc.quorum_id,
            participants=list(doc.members()),
            groups=sorted(groups),
            leader=doc.leader,
            created=seconds + nanos / 1e9 if seconds else None,
        )

    async def _groups_of(self, parent: Job) -> list[Job]:
        """The replica groups (child jobs) of ``parent`` written so far, by group."""
        children = await self.side.documents.children(parent)
        mine = [c for c in children.values() if belongs(c, parent)]
        return sorted(mine, key=lambda c: c.replica_group or 0)

    async def _sources(self, job: Job) -> list[EventSource]:
        """Whose events a read of ``job``'s takes: its own, and its groups' (a parent)."""
        own = EventSource(job.id, incarnation_tag(job), job.replica_group)
        if not job.is_parent:
            return [own]
        groups = await self._groups_of(job)
        return [own] + [EventSource(c.id, incarnation_tag(c), c.replica_group) for c in groups]

    async def _of(self, job_id: str, seen: Job | None) -> Job:
        """The job to answer about: ``seen``, the job its caller was authorized for (read by
        that check, in this request: not read again; :meth:`_still` checks it after the
        read), or the stored one."""
        return seen if seen is not None else await self.get(job_id)

    async def _still(self, seen: Job | None) -> None:
        """After reading a job's keys by its id: the job is still ``seen``, so nothing read
        belongs to a job submitted under its id meanwhile (whose keys all come after its
        document). Another owner's job is never shown to ``seen``'s reader."""
        if seen is not None:
            same_job(seen, await self.side.documents.read(seen.id))

    def _as_served(self, job: Job) -> Job:
        """The job with its place in the fleet's plan (queue entry, nodes) filled in."""
        plan = self._plan()
        if plan is None or job.state.is_terminal:
            return job
        nodes = plan.nodes_of(job.id)
        return job.model_copy(update={"queue": plan.entry(job.id), "nodes": nodes or None})

    def queue(self) -> QueueView:
        """The fleet's queue in order, and where the placed jobs run (``GET /queue``)."""
        plan = self._plan() or FleetPlan()
        return QueueView(
            queue=list(plan.queue),
            placements={j: p.model_copy() for j, p in plan.placements.items()},
        )

    async def list_jobs(self, state: list[JobState] | None, limit: int, offset: int) -> JobList:
        jobs = await self.side.documents.all()
        if state is not None:
            wanted = set(state)
            jobs = [j for j in jobs if j.state in wanted]
        jobs.sort(key=lambda j: (-j.created_at, j.id))
        known = {j.id: j for j in jobs}
        plan = self._plan()
        page = [
            self._as_served(j).model_copy(update={"groups": group_views(j, known, plan)})
            if j.is_parent
            else self._as_served(j)
            for j in jobs[offset : offset + limit]
        ]
        next_offset = offset + len(page) if offset + len(page) < len(jobs) else None
        return JobList(jobs=page, total=len(jobs), next_offset=next_offset)

    async def workers(self, job_id: str, seen: Job | None = None) -> WorkersView:
        """The job's worker groups; ``seen``: the job its caller was authorized for. A job of
        replica groups: every group's, each group and worker naming its replica group."""
        job = await self._of(job_id, seen)
        if job.is_parent:
            groups: list[GroupView] = []
            for child in await self._groups_of(job):
                view = await self.workers(child.id, child)
                groups.extend(view.groups)
            await self._still(seen)
            return self._workers_view(job, groups)
        own = await self._groups_view(job)
        await self._still(seen)
        return self._workers_view(job, own)

    @staticmethod
    def _workers_view(job: Job, groups: list[GroupView]) -> WorkersView:
        return WorkersView(
            job_id=job.id,
            state=job.state,
            restart_count=job.restart_count,
            max_restarts=job.max_restarts,
            remaining_restarts=max(0, job.max_restarts - job.restart_count),
            round=job.round,
            groups=groups,
        )

    async def _groups_view(self, job: Job) -> list[GroupView]:
        """The worker groups of an ordinary job (or of one replica group) in its current round."""
        job_id = job.id
        tag = incarnation_tag(job)
        listing = await self.side.store.list(group_prefix(job_id))
        decoded = (decode_group(e.value) for e in listing.entries)
        # A group of a deleted job of the id (its agent elsewhere still publishing): not shown.
        groups = [g for g in decoded if g is not None and tagged_for(g.job_tag, tag)]
        agent = self._agent_of(job)
        if agent is not None:
            agent.refresh_progress()
        if agent is not None and agent.view is not None:  # our own group: freshest copy
            groups = [g for g in groups if g.node != agent.view.node] + [agent.view]
        current = [g for g in groups if g.round == job.round] or groups
        current = [_in_group(await self._as_seen(g), job) for g in current]
        return sorted(current, key=lambda g: (g.group_rank, g.node))

    async def _as_seen(self, group: GroupView) -> GroupView:
        """A running group of a node that is gone (its lease expired) is shown UNKNOWN.

        Its agent can no longer publish, so its last view (HEALTHY, with pids)
        may no longer be true; a view is thus never more than a lease stale.
        """
        if group.node == self.side.node or group.state.is_terminal:
            return group
        if (
            group.state is WorkerState.STOPPED
            or await self.side.cluster.node(group.node) is not None
        ):
            return group
        workers = [
            w if w.state.is_terminal else w.model_copy(update={"state": WorkerState.UNKNOWN})
            for w in group.workers
        ]
        return group.model_copy(update={"state": WorkerState.UNKNOWN, "workers": workers})

    async def goodput(self, job_id: str, seen: Job | None = None) -> Goodput:
        """Where the job's time went, as of now: every node's record joined, this
        node's read fresh from the heartbeats (``elasticd.goodput``). ``seen``: as for
        :meth:`workers`."""
        job = await self._of(job_id, seen)
        tag = incarnation_tag(job)
        agent = self._agent_of(job)
        # As of now on this node's record's own clock, when it runs the job (steady: a step
        # of the wall clock since the job began here moves no figure); else the wall clock.
        now = agent.goodput_time() if agent is not None else self.side.clock.time()
        listing = await self.side.store.list(goodput_prefix(job_id))
        records = read_records(listing.entries, goodput_prefix(job_id), tag)
        if agent is not None:
            agent.refresh_progress()
            records[self.side.node] = agent.goodput
        events = await self.side.events.cluster_events_of(job_id, FACT_KINDS, tag)
        await self._still(seen)
        attempts = merge_nodes(records.values())
        return account(job_id, job_facts(job, events), attempts, now)

    async def goodput_of(self, job_ids: list[str]) -> list[Goodput]:
        """The goodput of each of these jobs that can be read now (the others are left out)."""
        out = []
        for job_id in job_ids:
            with contextlib.suppress(JobNotFound, StoreError):
                out.append(await self.goodput(job_id))
        return out

    def running_here(self) -> list[str]:
        """The jobs this node has an agent for."""
        return list(self._agents)

    async def list_events(
        self, job_id: str, after: int, limit: int, seen: Job | None = None
    ) -> list[Event]:
        """The job's events after ``after``; ``seen``: as for :meth:`workers`. Only this
        job's: an event of an earlier job of the id that reached the store late is left
        out (:func:`~elasticd.node.events.of_job`)."""
        job = await self._of(job_id, seen)
        events, _ = await merged_events(self.side.events, await self._sources(job), after, limit)
        await self._still(seen)
        return events

    async def follow_events(
        self, job_id: str, after: int, timeout: float, seen: Job | None = None
    ) -> list[Event]:
        """The job's events after ``after``, waiting up to ``timeout`` for one; ``seen``: as
        for :meth:`workers` (a long-poll may outlast the job, and a new job of its id), and
        only this job's, as for :meth:`list_events`. Events of another job of the id end
        the wait with a 409 when they are a new job's (one read of the document then)."""
        job = await self._of(job_id, seen)
        if job.is_parent or job.replica_group is not None:
            sources = await self._sources(job)
            events = await follow_merged(self.side.events, sources, job_id, after, timeout)
            await self._still(seen)
            return events
        events = await self.side.events.follow_cluster(
            job_id, after, timeout, incarnation_tag(job), functools.partial(self._still, job)
        )
        await self._still(seen)
        return events

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Wait until the job is terminal (for ``elasticd run`` and tests)."""
        async with asyncio.timeout(timeout):
            key = job_key(job_id)
            while True:
                # Watch from the listing's revision, not the document's version: an old
                # version may be past the store's history (StoreCompacted at once, a spin).
                listing = await self.side.store.list(key)
                entry = next((e for e in listing.entries if e.key == key), None)
                if entry is None:
                    raise JobNotFound(f"no job with id {job_id!r}")
                job = parse_job(job_id, entry.value)
                if job.state.is_terminal:
                    return job
                with contextlib.suppress(StoreError):
                    await self.side.store.watch(key, listing.revision, 30.0)

    async def retain_logs(self, job_ids: list[str] | None = None) -> dict[str, list[int]]:
        """Apply log retention (``log_retention_*``) to these jobs' folders (default: all).

        A job whose agent runs here keeps its newest folder whatever the
        policy says (it may be the running attempt's). Returns what went.
        """
        removed: dict[str, list[int]] = {}
        for job_id in job_ids if job_ids is not None else self.side.logs.job_ids():
            if not valid_job_id(job_id):
                continue
            gone = await asyncio.to_thread(
                self.side.logs.retain,
                job_id,
                self.side.config.log_retention_attempts,
                self.side.config.log_retention_bytes,
                job_id in self._agents,
            )
            if gone:
                removed[job_id] = gone
                log.info("job %s: log retention removed %d attempt folders", job_id, len(gone))
        return removed

    def log_attempts(self, job_id: str, incarnation: str) -> list[int]:
        """The attempts of the job that have a log folder on this node, oldest first.

        ``incarnation`` (:func:`incarnation`): the job asked about; a folder left by
        an earlier job of that id (deleted, its id taken again) has none of its attempts.
        """
        if not valid_job_id(job_id) or not self.side.logs.belongs(job_id, incarnation):
            return []
        return self.side.logs.attempts(job_id)

    def open_log(
        self,
        job_id: str,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
        *,
        incarnation: str,
    ) -> BinaryIO:
        """One worker log of this node, opened for reading; ``LogNotFound`` when there is none.

        Blocking (run it in a thread from the event loop). The file is opened
        through :func:`~elasticd.supervise.files.open_worker_file` only: a link,
        a FIFO or a hard link the worker put in its place is refused, never read.
        Only a folder of the job ``incarnation`` names is read: an earlier job of
        that id (deleted, its id taken again, maybe by another owner) is another's.
        """
        if not valid_job_id(job_id):
            raise LogNotFound(f"{job_id!r} is not a valid job id")
        if not self.side.logs.belongs(job_id, incarnation):
            raise LogNotFound(f"job {job_id!r} has no logs on node {self.side.node}")
        if attempt is None:
            attempts = self.log_attempts(job_id, incarnation)
            if not attempts:
                raise LogNotFound(f"job {job_id!r} has no logs on node {self.side.node}")
            attempt = attempts[-1]
        where = (
            f"job {job_id!r}, attempt {attempt}, local rank {local_rank} on node {self.side.node}"
        )
        worker_dir = self.side.logs.worker_dir(job_id, attempt, local_rank)
        try:
            fd = open_worker_file(worker_dir, stream_file(stream))
        except FileNotFoundError:
            raise LogNotFound(f"no {stream} log for {where}") from None
        except UnsafeWorkerFile:
            raise LogNotFound(
                f"the {stream} log of {where} is not a regular file of the worker's own (the "
                "job replaced it, e.g. with a link or a FIFO); the daemon does not read it"
            ) from None
        except OSError as exc:
            raise LogNotFound(
                f"the {stream} log of {where} cannot be read: {exc.strerror or exc}"
            ) from None
        return os.fdopen(fd, "rb", buffering=0)

    async def read_log(
        self,
        job: Job,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
        tail: int | None,
    ) -> str:
        """The last :data:`MAX_LOG_BYTES` of one worker log (the last ``tail`` lines), as text."""
        which = incarnation(job)

        def read() -> bytes:
            with self.open_log(job.id, local_rank, stream, attempt, incarnation=which) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size > MAX_LOG_BYTES:
                    fh.seek(size - MAX_LOG_BYTES)
                chunks = []
                got = 0
                while got < MAX_LOG_BYTES and (chunk := fh.read(MAX_LOG_BYTES - got)):
                    chunks.append(chunk)
                    got += len(chunk)
                return b"".join(chunks)

        text = (await asyncio.to_thread(read)).decode("utf-8", errors="replace")
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-tail:]) if tail > 0 else ""
        return text

    async def check_log(
        self,
        job: Job,
        local_rank: int,
        stream: Literal["stdout", "stderr"],
        attempt: int | None,
    ) -> None:
        """Raise ``LogNotFound`` unless the log can be opened now."""
        fh = await asyncio.to_thread(
            functools.partial(
                self.open_log, job.id, local_rank, stream, attempt, incarnation=incarnation(job)
            )
        )
        fh.close()

    async def node_url(self, node: str) -> str:
        """The API address of another live node, for proxying its logs (the token goes there).

        Only a record bound to a lease (a daemon keeps it alive) and naming
        ``http(s)://host:port`` and nothing more is used.
        """
        record = await self.side.cluster.node(node)
        if record is None:
            raise LogNotFound(f"node {node!r} is not a live member of the cluster")
        if not valid_node_url(record.url):
            raise LogNotFound(
                f"node {node!r} publishes the address {record.url!r}, which is not "
                "http(s)://host:port; its logs are not fetched"
            )
        return record.url

    # scheduling
