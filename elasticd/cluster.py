"""Cluster membership: this node's registration, its lease, and the watch on jobs.

Every daemon registers ``nodes/<name>`` (address, labels, slots, free slots)
bound to one lease it keeps alive; the same lease binds the node's
rendezvous ``alive`` keys, so one keep-alive per node proves liveness for
every job it runs. When the daemon dies the lease expires inside the store,
its keys vanish, and every watcher learns of it at once.

The daemon also watches the ``job/`` prefix: each change re-reads the job
documents and hands them to the scheduler, which starts an agent for every
active job this node can run. A lost lease (a partition longer than its TTL)
is re-granted and the node re-registered; agents holding keys bound to the
old lease see themselves fenced out through their own watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from pydantic import BaseModel, ValidationError

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import LeaseNotFound, StoreCompacted, StoreError
from elasticd.models import Job
from elasticd.store import Entry, Store

log = logging.getLogger("elasticd.cluster")

NODE_PREFIX = "nodes/"
JOB_PREFIX = "job/"
#: Seconds a node may stay silent before it is considered dead.
DEFAULT_LEASE_TTL = 3.0


class NodeRecord(BaseModel):
    """What a node publishes about itself (``GET /nodes``)."""

    name: str
    url: str
    addr: str
    labels: dict[str, str]
    slots: int
    free_slots: int
    gpus: list[str] | None = None
    version: str
    started_at: float


class Cluster:
    """This node's membership and its view of the cluster's jobs."""

    def __init__(
        self,
        store: Store,
        record: NodeRecord,
        *,
        on_jobs: Callable[[list[Job]], None],
        lease_ttl: float = DEFAULT_LEASE_TTL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.record = record
        self.lease_ttl = lease_ttl
        self._on_jobs = on_jobs
        self._clock = clock
        self._lease: int | None = None
        self._lease_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    @property
    def key(self) -> str:
        return NODE_PREFIX + self.record.name

    async def start(self) -> None:
        await self.lease()
        self._tasks = [
            asyncio.create_task(self._keep_alive(), name="node-keepalive"),
            asyncio.create_task(self._watch_jobs(), name="job-watch"),
        ]

    async def stop(self) -> None:
        """Stop watching and leave: revoking the lease removes this node's keys at once."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._lease is not None:
            with contextlib.suppress(StoreError):
                await self.store.revoke(self._lease)
            self._lease = None

    async def lease(self) -> int:
        """The node's live lease, granted (and the node registered) if needed."""
        async with self._lease_lock:
            if self._lease is None:
                lease = await self.store.grant(self.lease_ttl)
                await self.store.put(self.key, self.record.model_dump_json().encode(), lease=lease)
                self._lease = lease
                log.info("node %s registered (lease %x)", self.record.name, lease)
            return self._lease

    async def publish(self, **changes: object) -> None:
        """Update this node's record (e.g. free slots)."""
        self.record = self.record.model_copy(update=changes)
        lease = await self.lease()
        with contextlib.suppress(StoreError):
            await self.store.put(self.key, self.record.model_dump_json().encode(), lease=lease)

    async def nodes(self) -> list[NodeRecord]:
        listing = await self.store.list(NODE_PREFIX)
        out = []
        for entry in listing.entries:
            try:
                out.append(NodeRecord.model_validate_json(entry.value))
            except ValidationError:
                log.warning("ignoring malformed node record %s", entry.key)
        return out

    async def node(self, name: str) -> NodeRecord | None:
        entry = await self.store.get(NODE_PREFIX + name)
        if entry is None:
            return None
        try:
            return NodeRecord.model_validate_json(entry.value)
        except ValidationError:
            return None

    async def _keep_alive(self) -> None:
        interval = self.lease_ttl / 3
        failing_since: float | None = None
        while True:
            await asyncio.sleep(interval)  # a lease renewal is periodic by nature
            try:
                lease = await self.lease()
                await self.store.keep_alive(lease)
                failing_since = None
            except LeaseNotFound:
                log.warning("node %s lost its lease; registering again", self.record.name)
                self._lease = None
            except StoreError as exc:
                now = self._clock.monotonic()
                failing_since = failing_since or now
                log.warning("keep-alive failed for %.1fs: %s", now - failing_since, exc)

    async def _watch_jobs(self) -> None:
        """Keep a parsed copy of every job document, updated by the watch's events only.

        One full read at the start (and after a compaction or an outage); after
        that each change costs the parsing of the documents that changed, not
        of every job the cluster ever ran.
        """
        backoff = 0.1
        while True:
            try:
                listing = await self.store.list(JOB_PREFIX)
                jobs = {e.key: job for e in listing.entries if (job := parse_job(e.key, e.value))}
                self._on_jobs(list(jobs.values()))
                revision = listing.revision
                backoff = 0.1
                while True:
                    events = await self.store.watch(JOB_PREFIX, revision, 30.0, prefix=True)
                    if not events:
                        continue  # a quiet watch timed out: watch again from the same revision
                    for event in events:
                        revision = max(revision, event.revision)
                        if event.kind == "delete" or event.value is None:
                            jobs.pop(event.key, None)
                        elif (job := parse_job(event.key, event.value)) is not None:
                            jobs[event.key] = job
                    self._on_jobs(list(jobs.values()))
            except StoreCompacted:
                continue
            except StoreError as exc:
                if self._stopping:
                    return
                log.warning("job watch: %s (retrying in %.1fs)", exc, backoff)
                await asyncio.sleep(backoff)  # back off while the store is unreachable
                backoff = min(backoff * 2, 5.0)


def parse_job(key: str, value: bytes) -> Job | None:
    try:
        return Job.model_validate_json(value)
    except ValidationError:
        log.warning("ignoring malformed job document %s", key)
        return None


def parse_jobs(entries: Iterable[Entry]) -> list[Job]:
    """Every well-formed job document among ``entries`` (malformed ones are logged)."""
    return [job for e in entries if (job := parse_job(e.key, e.value)) is not None]
