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

Anyone holding the store's credentials can write into it, so nothing read
from it is trusted to name a path or an address. A job document is used
only if it is a valid :class:`~elasticd.models.Job` (its id obeys the API's
rule) stored at ``job/<its id>`` (:func:`check_job_document`); a refused one
is reported once per revision (``on_refused``: a ``job.refused`` event, or a
record under ``refused/<node>/``) and never reaches the scheduler. A node
record is used only when it is bound to a lease, names itself, and its URL
is ``http(s)://host:port`` (:meth:`Cluster.node`, :func:`valid_node_url`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elasticd import keys
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import LeaseNotFound, StoreCompacted, StoreError
from elasticd.models import JOB_ID_PATTERN, NODE_NAME_PATTERN, Job, valid_job_id
from elasticd.sched.plan import MAX_SELECTOR_ITEMS, MAX_SELECTOR_KEY, MAX_SELECTOR_VALUE
from elasticd.shares import Usage
from elasticd.store import Entry, Store
from elasticd.store.parts import list_in_parts
from elasticd.tasks import TaskSet

log = logging.getLogger("elasticd.node.cluster")

NODE_PREFIX = keys.NODES
JOB_PREFIX = keys.JOBS
#: Seconds a node may stay silent before it is considered dead.
DEFAULT_LEASE_TTL = 3.0


#: The most slots a node record may claim: a record claiming more is ignored, so a store
#: writer cannot publish a node that would swallow the fleet's queue.
MAX_NODE_SLOTS = 4096

_LabelKey = Annotated[str, Field(min_length=1, max_length=MAX_SELECTOR_KEY)]
_LabelValue = Annotated[str, Field(max_length=MAX_SELECTOR_VALUE)]


class NodeRecord(BaseModel):
    """What a node publishes about itself (``GET /nodes``).

    Read back from the store, which a store writer can fill: every field is
    bounded, and a record that does not validate is ignored (never a crash).
    """

    model_config = ConfigDict(allow_inf_nan=False)

    name: Annotated[str, Field(pattern=NODE_NAME_PATTERN)]
    url: str = Field(max_length=300)
    addr: str = Field(max_length=255)
    labels: dict[_LabelKey, _LabelValue] = Field(max_length=MAX_SELECTOR_ITEMS)
    slots: int = Field(ge=0, le=MAX_NODE_SLOTS)
    free_slots: int = Field(ge=-MAX_NODE_SLOTS, le=MAX_NODE_SLOTS)
    gpus: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=1024)
    version: str = Field(max_length=64)
    started_at: float
    declined: list[Annotated[str, Field(pattern=JOB_ID_PATTERN)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Active jobs this node gave up (it left them for good): the fleet "
        "scheduler places them elsewhere.",
    )
    state: Literal["ready", "quarantined", "drained"] = Field(
        default="ready",
        description="In the fleet, or out of it: quarantined by its policy, or drained by an "
        "admin (from its health record, filled in when served, never stored).",
    )
    reason: str | None = Field(default=None, max_length=1024, description="Why it is out.")
    since: float | None = Field(default=None, description="When it went out (wall time).")
    until: float | None = Field(default=None, description="When its quarantine ends (a TTL).")
    by: str | None = Field(
        default=None, max_length=128, description="`policy`, or the admin who drained it."
    )
    attributed_failures: int = Field(
        default=0, ge=0, description="Failures attributed to it within the policy's window."
    )


def lease_lapse(renewed_at: float | None, lease_ttl: float, now: float) -> float | None:
    """How long a lease last renewed (sent) at ``renewed_at`` may have been expired at ``now``.

    ``None`` while it surely lives (or was never granted). A lease lives at
    least ``lease_ttl`` from the moment its last successful renewal was sent.
    """
    if renewed_at is None or now - renewed_at < lease_ttl:
        return None
    return now - renewed_at - lease_ttl


class Cluster:
    """This node's membership and its view of the cluster's jobs."""

    def __init__(
        self,
        store: Store,
        record: NodeRecord,
        *,
        on_jobs: Callable[[list[Job]], None],
        on_refused: Callable[[str, str], None] | None = None,
        on_renewed: Callable[[], None] | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``on_renewed()`` is called after each lease renewal that got through: the
        store answers (the node then says ``store.back`` where an agent cannot)."""
        self.store = store
        self.record = record
        self.lease_ttl = lease_ttl
        self._on_jobs = on_jobs
        self._on_refused = on_refused
        self._on_renewed = on_renewed
        #: Refused job documents already reported: key -> the revision reported.
        self._refused: dict[str, int] = {}
        #: Each owned job document the watch holds: key -> ((owner, local), its bytes).
        self._held: dict[str, tuple[tuple[str, bool], int]] = {}
        self._clock = clock
        self._lease: int | None = None
        #: Monotonic time at which the last grant or keep-alive that succeeded was sent:
        #: the lease lives at least ``lease_ttl`` from then, and may end right after.
        self.renewed_at: float | None = None
        self._lease_lock = asyncio.Lock()
        #: One :meth:`publish` writes at a time, and writes the record as it is then.
        self._publish_lock = asyncio.Lock()
        #: The record the last write that got through put in the store.
        self._published: NodeRecord | None = None
        #: The keep-alive and the job watch: started by start, ended by stop.
        self._tasks = TaskSet("cluster")
        self._stopping = False

    @property
    def key(self) -> str:
        return keys.node_key(self.record.name)

    async def start(self) -> None:
        await self.lease()
        self._tasks.spawn(self._keep_alive(), name="node-keepalive")
        self._tasks.spawn(self._watch_jobs(), name="job-watch")

    async def stop(self) -> None:
        """Stop watching and leave: revoking the lease removes this node's keys at once."""
        self._stopping = True
        # Cancelled and awaited; a cancellation of this stop (its bound) still gets through.
        await self._tasks.aclose()
        if self._lease is not None:
            with contextlib.suppress(StoreError):
                await self.store.revoke(self._lease)
            self._lease = None

    async def lease(self) -> int:
        """The node's live lease, granted (and the node registered) if needed."""
        async with self._lease_lock:
            if self._lease is None:
                sent = self._clock.monotonic()
                lease = await self.store.grant(self.lease_ttl)
                await self.store.put(self.key, self.record.model_dump_json().encode(), lease=lease)
                self._lease = lease
                self.renewed_at = sent
                log.info("node %s registered (lease %x)", self.record.name, lease)
            return self._lease

    @property
    def lease_id(self) -> int | None:
        """The node's lease as granted now (None: not registered)."""
        return self._lease

    async def resume_lease(self, lease: int) -> None:
        """Take up the lease of this daemon's previous program image (re-exec): renewed now
        and the record written on it again, so the node's keys, its rendezvous presence and
        its leadership stay. A lease that lapsed meanwhile: a new one is granted later."""
        async with self._lease_lock:
            sent = self._clock.monotonic()
            try:
                await self.store.keep_alive(lease)
            except LeaseNotFound:
                log.warning("node %s: the lease from before the re-exec lapsed", self.record.name)
                return
            self._lease, self.renewed_at = lease, sent
            await self.store.put(self.key, self.record.model_dump_json().encode(), lease=lease)
            log.info("node %s kept its lease %x through the re-exec", self.record.name, lease)

    async def renew(self) -> None:
        """One renewal of the node's lease now, if it has one (the re-exec's, right before
        the exec: the next image gets a whole TTL from :attr:`renewed_at`)."""
        if self._lease is None:
            return
        sent = self._clock.monotonic()
        await self.store.keep_alive(self._lease)
        self.renewed_at = max(sent, self.renewed_at or sent)

    async def publish(self, **changes: object) -> None:
        """Update this node's record (e.g. free slots) here, then in the store.

        Callers run concurrently (each change of the slots spawns one), and two puts in
        flight over an HTTP store may land in either order: the writes are one at a time,
        each of the record as it is when it is sent, so the last to land is the newest.
        A write that finds the newest record already written is skipped.
        """
        self.record = self.record.model_copy(update=changes)
        async with self._publish_lock:
            record = self.record
            if record is self._published:
                return
            lease = await self.lease()
            with contextlib.suppress(StoreError):
                await self.store.put(self.key, record.model_dump_json().encode(), lease=lease)
                self._published = record

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
        """The record of a live node: bound to a lease, well-formed, and naming itself."""
        entry = await self.store.get(keys.node_key(name))
        if entry is None or entry.lease is None:
            return None  # a record no daemon keeps alive is not a live node's
        try:
            record = NodeRecord.model_validate_json(entry.value)
        except ValidationError:
            return None
        return record if record.name == name else None

    def lease_lapse(self, now: float) -> float | None:
        """Seconds since the lease may have expired (>= 0), or ``None`` while it surely lives."""
        return lease_lapse(self.renewed_at, self.lease_ttl, now)

    async def lease_lapsed(self) -> float:
        """Return once the lease may have expired: no renewal got through for ``lease_ttl``.

        The other nodes then declare this one dead, so its workers must stop
        (the agent fences). Returns how long the store has been out of reach.
        Waits on a timer, never on a store call, so a call that hangs cannot
        delay it.
        """
        while True:
            now = self._clock.monotonic()
            if self.lease_lapse(now) is not None:
                assert self.renewed_at is not None
                return now - self.renewed_at
            if self.renewed_at is None:  # not registered yet
                await asyncio.sleep(self.lease_ttl)
            else:  # a timer to the earliest expiry; a renewal meanwhile moves it on
                await asyncio.sleep(max(0.01, self.renewed_at + self.lease_ttl - now))

    async def _keep_alive(self) -> None:
        interval = self.lease_ttl / 3
        retry = min(interval, 0.2)
        failing_since: float | None = None
        while True:
            # A lease renewal is periodic by nature; after a failure try again soon,
            # so that a short outage never lets the lease run out.
            await asyncio.sleep(interval if failing_since is None else retry)
            sent = self._clock.monotonic()
            try:
                lease = await self.lease()
                await self.store.keep_alive(lease)
                self.renewed_at = max(sent, self.renewed_at or sent)
                failing_since = None
                if self._on_renewed is not None:
                    self._on_renewed()
            except LeaseNotFound:
                log.warning("node %s lost its lease; registering again", self.record.name)
                self._lease = None
                failing_since = failing_since or sent
            except StoreError as exc:
                now = self._clock.monotonic()
                if failing_since is None:
                    log.warning("keep-alive failed: %s", exc)
                failing_since = failing_since or sent
                log.debug("keep-alive failing for %.1fs: %s", now - failing_since, exc)

    async def _watch_jobs(self) -> None:
        """Keep a parsed copy of every job document, updated by the watch's events only.

        One full read at the start (and after a compaction or an outage); after
        that each change costs the parsing of the documents that changed, not
        of every job the cluster ever ran.
        """
        backoff = 0.1
        while True:
            try:
                listing = await list_in_parts(self.store, JOB_PREFIX)
                jobs = {
                    e.key: job
                    for e in listing.entries
                    if (job := self._parse(e.key, e.value, e.version)) is not None
                }
                self._held = {}
                for e in listing.entries:
                    self._count(e.key, jobs.get(e.key), len(e.value))
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
                            self._refused.pop(event.key, None)
                            self._held.pop(event.key, None)
                        elif job := self._parse(event.key, event.value, event.revision):
                            jobs[event.key] = job
                            self._count(event.key, job, len(event.value))
                        # A refused overwrite keeps the last valid copy: forgetting the job
                        # would drop its events here.
                    self._on_jobs(list(jobs.values()))
            except StoreCompacted:
                continue
            except StoreError as exc:
                if self._stopping:
                    return
                log.warning("job watch: %s (retrying in %.1fs)", exc, backoff)
                await asyncio.sleep(backoff)  # back off while the store is unreachable
                backoff = min(backoff * 2, 5.0)

    def _count(self, key: str, job: Job | None, nbytes: int) -> None:
        if job is not None and job.owner is not None and not job.owner.admin:
            self._held[key] = ((job.owner.name, job.owner.local), nbytes)
        else:
            self._held.pop(key, None)

    def holds(self, key: str) -> bool:
        """Whether the job watch has seen the owned document at ``key``."""
        return key in self._held

    def owner_usage(self, owner: tuple[str, bool], *, besides: str | None = None) -> Usage:
        """The job documents ``owner`` (name, local) keeps as this node's watch last saw
        them, ended ones included, ``besides`` (a key) left out (issue 35)."""
        held = [n for key, (who, n) in self._held.items() if who == owner and key != besides]
        return Usage(len(held), sum(held))

    def _parse(self, key: str, value: bytes, revision: int) -> Job | None:
        """The job document at ``key``; a refused one is reported once per revision."""
        job, reason = check_job_document(key, value)
        if reason is None:
            self._refused.pop(key, None)
            return job
        if self._refused.get(key) != revision:
            self._refused[key] = revision
            log.warning("refusing the job document %r: %s", key, reason)
            if self._on_refused is not None:
                self._on_refused(key, reason)
        return None


def check_job_document(key: str, value: bytes) -> tuple[Job | None, str | None]:
    """``(job, None)`` for a valid job document stored at ``key``; ``(None, why)`` otherwise.

    Valid means: it parses as a :class:`~elasticd.models.Job` (whose id obeys
    the API's rule), and the key is ``job/<its id>``. Anything else was not
    written by elasticd and must never reach a path or an agent.
    """
    key_id = key.removeprefix(JOB_PREFIX)
    if not key.startswith(JOB_PREFIX) or not valid_job_id(key_id):
        return None, (
            f"the key {key!r} does not name a valid job id (letters, digits, '.', '_', '-', "
            "starting with a letter or digit, at most 128)"
        )
    try:
        job = Job.model_validate_json(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "document"
        return None, f"it is not a valid job document ({where}: {first.get('msg', 'invalid')})"
    if job.id != key_id:
        return None, f"it holds job {job.id!r}, not {key_id!r}"
    return job, None


def parse_job(key: str, value: bytes) -> Job | None:
    """The job document at ``key``, or None when it is refused.

    Logged at debug level only: the job watch reports each refused document
    once (:meth:`Cluster._parse`), and a listing must not fill the log.
    """
    job, reason = check_job_document(key, value)
    if reason is not None:
        log.debug("ignoring the job document %r: %s", key, reason)
    return job


def parse_jobs(entries: Iterable[Entry]) -> list[Job]:
    """Every valid job document among ``entries`` (refused ones are logged)."""
    return [job for e in entries if (job := parse_job(e.key, e.value)) is not None]


def valid_node_url(url: str) -> bool:
    """Whether ``url`` is ``http(s)://host:port``, with nothing else (no user, path, query)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and port is not None
        and "@" not in parts.netloc
        and parts.path in ("", "/")
        and not parts.query
        and not parts.fragment
        and not any(c.isspace() or ord(c) < 32 for c in url)
    )
