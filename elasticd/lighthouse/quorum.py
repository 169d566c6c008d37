"""One job's Lighthouse on one node: the thin loops around the store (state in
:mod:`elasticd.lighthouse.state`, the decision in :mod:`elasticd.lighthouse.rules`).

Every node that serves the job's Lighthouse runs, in :class:`JobQuorum`:

* **the record loop**: its local Managers' heartbeats and quorum requests go into its
  record (``nodes/<node>``, put on its lease): at once for a request, at most every
  ``heartbeat_timeout / 5`` for heartbeats alone (one write per node, not per beat);
* **the quorum watch**: every new quorum document answers the local long polls it
  granted (a member with this node's name and a ticket at least the poll's);
* **the election**: ``leader`` is created if absent, bound to the node's lease (the
  scheduler's pattern: a record that is not a live node's, on the same lease, is taken
  over); while this node holds it, **the decide loop**: list the records, decide, write
  the new quorum by compare-and-set on the document's version, watch the records (or
  sleep until the decision's time) and again.

Two leaders at once (a lease that lapsed in a partition) cannot issue two quorums of one
id: each writes by compare-and-set on the version it read, so the quorums form one line
whatever the leaders believe. A leader that takes over starts from the stored document;
the highest id this node has seen is its floor, so a lost or damaged document never sends
the ids back. The loss of the leader's node costs one lease TTL (its key expires) plus,
at most, one heartbeat timeout (the new leader's first look at the records).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable

from elasticd import keys
from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import LeaseNotFound, StoreCompacted, StoreError
from elasticd.lighthouse.proto import MAX_PARTICIPANTS, Quorum, QuorumMember, Timestamp
from elasticd.lighthouse.rules import NewQuorum, Settings, Wait, decide
from elasticd.lighthouse.state import (
    MAX_DOC_BYTES,
    NodeRecord,
    PendingRequest,
    QuorumDoc,
    Seen,
    StoredMember,
    after_grant,
    decode_doc,
    decode_record,
    encode,
    new_doc,
    observe,
)
from elasticd.models import NODE_NAME_PATTERN
from elasticd.store import Entry, Store
from elasticd.tasks import TaskSet, race

log = logging.getLogger("elasticd.lighthouse")

#: Longest single watch (seconds): a quiet watch is renewed this often.
WATCH_SECONDS = 30.0
#: A replica not heard from locally for this many heartbeat timeouts leaves the record.
FORGET_AFTER = 3.0

#: JSON bytes of replica ids one node's record may name (a record holds each id twice at
#: most, its beats and its pending request, within state.MAX_DOC_BYTES).
MAX_ID_BYTES = 128 * 1024
#: Seconds a node whose decide loop crashed leaves leadership to the others.
RESIGN_SECONDS = 5.0

_NODE_NAME = re.compile(NODE_NAME_PATTERN)


class OverLimit(Exception):
    """A request or heartbeat that this node's record has no room for (too many replicas,
    or the record over its size bound): refused, RESOURCE_EXHAUSTED."""


class MissedQuorum(Exception):
    """A poll's request was granted by a quorum this node never saw (its history was
    compacted away): the Manager asks again."""


def to_quorum(doc: QuorumDoc) -> Quorum:
    return Quorum(
        doc.quorum_id,
        tuple(p.member.member() for p in doc.participants),
        Timestamp(*doc.created),
    )


class JobQuorum:
    """A job's Lighthouse state on this node (see the module)."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        node: str,
        lease: Callable[[], Awaitable[int]],
        settings: Settings,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_quorum: Callable[[QuorumDoc | None, QuorumDoc], None] | None = None,
    ) -> None:
        self.store = store
        self.job_id = job_id
        #: Told each quorum of a new id this node's leader wrote (previous, new): events.
        self.on_quorum = on_quorum
        self.node = node
        self.settings = settings
        self._lease = lease
        self.clock = clock
        self._tasks = TaskSet(f"lighthouse {job_id}")
        self._record_key = keys.lighthouse_node_key(job_id, node)
        self._quorum_key = keys.lighthouse_quorum_key(job_id)
        self._leader_key = keys.lighthouse_leader_key(job_id)
        # The local side: what this node's Managers said.
        self._beats: dict[str, int] = {}
        self._beaten: set[str] = set()
        self._heard: dict[str, float] = {}  # replica -> this node's monotonic time
        self._pending: dict[str, PendingRequest] = {}
        self._ticket = 0
        self._waiters: dict[str, list[tuple[int, asyncio.Future[Quorum]]]] = {}
        self._urgent = asyncio.Event()
        self._dirty = False
        #: The highest quorum id this node has seen: no quorum it writes goes below it.
        self.floor = 0
        #: The last valid quorum document seen (None: none yet).
        self.doc: QuorumDoc | None = None
        self.leading = False
        #: Why the leader's last decision formed no quorum (for logs and status).
        self.reason = ""
        self._refused: dict[str, str] = {}
        self._doc_version = 0
        self._id_bytes = 0  # JSON bytes of the replica ids in _heard

    # lifecycle

    async def start(self) -> None:
        """Read where the tickets and ids stand, publish the record, start the loops."""
        entry = await self.store.get(self._quorum_key)
        if entry is not None:
            self._apply_doc(entry.value, entry.version)
        mine = await self.store.get(self._record_key)
        tickets = [0]
        if mine is not None and not isinstance(rec := decode_record(mine.value, self.node), str):
            # A re-exec (or a restart within the lease): the replicas this node heard stay
            # heard, with their counters, so that a leader judging now still counts the ones
            # whose Managers have not called again yet (their polls died with the old image,
            # so its pending requests are dropped; their tickets are never reused).
            tickets += [p.ticket for p in rec.pending.values()]
            now = self.clock.monotonic()
            for replica, count in rec.beats.items():
                cost = len(json.dumps(replica))
                if self._id_bytes + cost <= MAX_ID_BYTES:
                    self._id_bytes += cost
                    self._beats[replica] = count
                    self._heard[replica] = now
        if self.doc is not None:
            tickets += [g.ticket for g in self.doc.granted.values() if g.node == self.node]
        self._ticket = max(tickets)  # a restarted daemon's tickets go on, never reused
        # Published before the election, which checks a leader's record; a store that
        # fails here fails the start (the caller's to retry), it does not hang it.
        await self.store.put(self._record_key, encode(self._record()), lease=await self._lease())
        self._tasks.spawn(self._record_loop(), name=f"lighthouse-record-{self.job_id}")
        self._tasks.spawn(self._watch_quorum(), name=f"lighthouse-watch-{self.job_id}")
        self._tasks.spawn(self._elect(), name=f"lighthouse-elect-{self.job_id}")

    async def stop(self, *, leave: bool = True) -> None:
        """Stop the loops and fail the polls; with ``leave``, delete this node's record and
        give up leadership at once (a re-exec that serves the job again keeps both)."""
        await self._tasks.aclose()
        for waiters in self._waiters.values():
            for _, future in waiters:
                if not future.done():
                    future.set_exception(MissedQuorum("the Lighthouse closed"))
        self._waiters.clear()
        if not leave:
            return
        with contextlib.suppress(StoreError):
            entry = await self.store.get(self._leader_key)
            if entry is not None and entry.value == self.node.encode():
                await self.store.delete(self._leader_key, entry.version)
            await self.store.delete(self._record_key)

    # what the Managers say

    def heartbeat(self, replica_id: str) -> None:
        """Note a beat (written with the next record); OverLimit past MAX_PARTICIPANTS."""
        if replica_id not in self._heard:
            if len(self._heard) >= MAX_PARTICIPANTS:
                raise OverLimit(f"this node already hears {MAX_PARTICIPANTS} replicas of the job")
            cost = len(json.dumps(replica_id))
            if self._id_bytes + cost > MAX_ID_BYTES:
                raise OverLimit(f"the replica ids heard here are over {MAX_ID_BYTES} bytes")
            self._id_bytes += cost
        self._beaten.add(replica_id)
        self._heard[replica_id] = self.clock.monotonic()
        self._beats.setdefault(replica_id, 0)

    async def quorum(self, member: QuorumMember) -> Quorum:
        """The first quorum that grants this request (a long poll; the caller bounds it).

        OverLimit when the node's record would be over its bound with it."""
        request = PendingRequest(ticket=self._ticket + 1, member=StoredMember.of(member))
        size = (
            len(encode(self._snapshot()))
            + len(request.model_dump_json())
            + 2 * len(member.replica_id)
        )
        if size > MAX_DOC_BYTES:
            raise OverLimit(f"this node's Lighthouse record would be over {MAX_DOC_BYTES} bytes")
        self.heartbeat(member.replica_id)
        self._ticket = ticket = request.ticket
        self._pending[member.replica_id] = request
        future: asyncio.Future[Quorum] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(member.replica_id, []).append((ticket, future))
        self._urgent.set()
        try:
            return await future
        finally:
            waiters = self._waiters.get(member.replica_id, [])
            if (ticket, future) in waiters:
                waiters.remove((ticket, future))
            if not waiters:
                self._waiters.pop(member.replica_id, None)

    def status(self) -> dict[str, object]:
        """What an operator or the daemon's API may show of this job's quorum here."""
        doc = self.doc
        return {
            "node": self.node,
            "leading": self.leading,
            "quorum_id": doc.quorum_id if doc is not None else None,
            "members": list(doc.members()) if doc is not None else [],
            "decided_by": doc.leader if doc is not None else None,
            "waiting_polls": self.waiting,
            "replicas_heard": len(self._heard),
            "reason": self.reason if self.leading else "",
        }

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    # the record loop

    def _snapshot(self) -> NodeRecord:
        return NodeRecord(node=self.node, beats=dict(self._beats), pending=dict(self._pending))

    def _record(self) -> NodeRecord:
        for replica in self._beaten:
            self._beats[replica] = self._beats.get(replica, 0) + 1
        self._beaten.clear()
        cutoff = self.clock.monotonic() - FORGET_AFTER * self.settings.heartbeat_timeout
        for replica in [r for r, t in self._heard.items() if t < cutoff]:
            del self._heard[replica]
            self._id_bytes -= len(json.dumps(replica))
            self._beats.pop(replica, None)
            self._pending.pop(replica, None)
        return self._snapshot()

    async def _write_record(self) -> None:
        try:
            raw = encode(self._record())
        except ValueError as exc:  # the checks in quorum() keep it within bounds; never die
            log.error("lighthouse %s: %s; dropping the pending requests", self.job_id, exc)
            self._pending.clear()
            raw = encode(self._record())
        self._dirty = False
        backoff = 0.05
        while True:
            try:
                await self.store.put(self._record_key, raw, lease=await self._lease())
                return
            except LeaseNotFound:
                await asyncio.sleep(backoff)  # the node grants a new one; ask it again
            except StoreError as exc:
                log.debug("lighthouse %s: writing the record: %s", self.job_id, exc)
                await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _record_loop(self) -> None:
        period = self.settings.heartbeat_timeout / 5
        last = -math.inf
        while True:
            if not self._urgent.is_set():
                due = last + period - self.clock.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), due if due > 0 else period)
            now = self.clock.monotonic()
            if self._urgent.is_set() or (now >= last + period and (self._beaten or self._dirty)):
                self._urgent.clear()
                last = now
                await self._write_record()

    # the quorum watch

    def _apply_doc(self, raw: bytes | None, version: int) -> None:
        """Take the quorum document at ``version`` (None: deleted); older ones are ignored
        (the leader applies its own write before its watch brings it)."""
        if version <= self._doc_version:
            return
        self._doc_version = version
        if raw is None:
            self.doc = None
            return
        doc = decode_doc(raw)
        if isinstance(doc, str):
            if self._refused.get("quorum") != doc:
                log.warning("lighthouse %s: the stored quorum is ignored: %s", self.job_id, doc)
                self._refused["quorum"] = doc
            self.doc = None
            return
        self.doc = doc
        self.floor = max(self.floor, doc.quorum_id)
        quorum: Quorum | None = None
        granted = {p.member.replica_id: p.ticket for p in doc.participants if p.node == self.node}
        for replica, grant in doc.granted.items():
            if grant.node != self.node:
                continue
            pending = self._pending.get(replica)
            if pending is not None and pending.ticket <= grant.ticket:
                del self._pending[replica]
                self._dirty = True
            for ticket, future in self._waiters.get(replica, []):
                if ticket > grant.ticket or future.done():
                    continue
                if ticket <= granted.get(replica, 0):
                    quorum = quorum or to_quorum(doc)
                    future.set_result(quorum)
                else:
                    future.set_exception(MissedQuorum("its quorum was missed; ask again"))

    async def _watch_quorum(self) -> None:
        backoff = 0.05
        while True:
            try:
                listing = await self.store.list(self._quorum_key)
                entry = next((e for e in listing.entries if e.key == self._quorum_key), None)
                if entry is not None:
                    self._apply_doc(entry.value, entry.version)
                elif self.doc is not None:
                    self._apply_doc(None, listing.revision)
                revision = listing.revision
                while True:
                    for event in await self.store.watch(self._quorum_key, revision, WATCH_SECONDS):
                        revision = max(revision, event.revision)
                        self._apply_doc(event.value, event.revision)
                    backoff = 0.05
            except StoreCompacted:
                continue
            except StoreError as exc:
                log.debug("lighthouse %s: watching the quorum: %s", self.job_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # the election

    async def _holder_is_live(self, holder: Entry) -> bool:
        """Whether the leader record names a node whose record lives on the same lease."""
        try:
            name = holder.value.decode("ascii")
        except UnicodeDecodeError:
            return False
        if holder.lease is None or not _NODE_NAME.match(name):
            return False
        record = await self.store.get(keys.lighthouse_node_key(self.job_id, name))
        return record is not None and record.lease == holder.lease

    async def _elect(self) -> None:
        backoff = 0.05
        while True:
            try:
                lease = await self._lease()
                result = await self.store.compare_and_set(
                    self._leader_key, self.node.encode(), None, lease=lease
                )
                holder = result.entry
                mine = result.ok or (
                    holder is not None
                    and (holder.value, holder.lease) == (self.node.encode(), lease)
                )
                if not mine and holder is not None and not await self._holder_is_live(holder):
                    log.warning(
                        "lighthouse %s: the leader record %r is not a live node's: taking over",
                        self.job_id,
                        holder.value[:80],
                    )
                    await self.store.delete(self._leader_key, holder.version)
                    continue
                if holder is None:
                    await asyncio.sleep(backoff)
                    continue
                if mine and not self.leading:
                    log.info("lighthouse %s: %s decides the quorums now", self.job_id, self.node)
                self.leading = mine
                if mine:
                    await race(self._until_changed(holder.version), self._decide_loop())
                else:
                    await self._until_changed(holder.version)
                self.leading = False
                backoff = 0.05
            except StoreError as exc:
                self.leading = False
                log.debug("lighthouse %s: leadership: %s", self.job_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:
                # A bug, or an input nobody foresaw: never hold the leader key while
                # deciding nothing, which would stop every group of the job.
                self.leading = False
                log.exception(
                    "lighthouse %s: the decide loop failed; %s leaves leadership for %.0f s",
                    self.job_id,
                    self.node,
                    RESIGN_SECONDS,
                )
                with contextlib.suppress(StoreError):
                    entry = await self.store.get(self._leader_key)
                    if entry is not None and entry.value == self.node.encode():
                        await self.store.delete(self._leader_key, entry.version)
                await asyncio.sleep(RESIGN_SECONDS)

    async def _until_changed(self, version: int) -> None:
        """Return once the leader key is no longer at ``version`` (changed or gone)."""
        while True:
            listing = await self.store.list(self._leader_key)
            now = next((e for e in listing.entries if e.key == self._leader_key), None)
            if now is None or now.version != version:
                return
            with contextlib.suppress(StoreCompacted):
                while not await self.store.watch(self._leader_key, listing.revision, WATCH_SECONDS):
                    pass
                return

    # the decide loop (while leading)

    async def _read_records(self) -> tuple[dict[str, NodeRecord], int]:
        prefix = keys.lighthouse_nodes_prefix(self.job_id)
        listing = await self.store.list(prefix)
        records: dict[str, NodeRecord] = {}
        for entry in listing.entries:
            name = entry.key[len(prefix) :]
            why = "it is not bound to a lease" if entry.lease is None else None
            parsed = decode_record(entry.value, name) if why is None else why
            if isinstance(parsed, str):
                if self._refused.get(entry.key) != parsed:
                    log.warning("lighthouse %s: record %s ignored: %s", self.job_id, name, parsed)
                    self._refused[entry.key] = parsed
                continue
            records[name] = parsed
        return records, listing.revision

    async def _decide_loop(self) -> None:
        seen = Seen()
        prefix = keys.lighthouse_nodes_prefix(self.job_id)
        while True:
            records, revision = await self._read_records()
            entry = await self.store.get(self._quorum_key)
            while True:
                doc = None
                if entry is not None:
                    parsed = decode_doc(entry.value)
                    doc = None if isinstance(parsed, str) else parsed
                    self._apply_doc(entry.value, entry.version)
                now = self.clock.monotonic()
                view = observe(seen, records, doc, self.floor, now)
                decision = decide(view.state, now, self.settings)
                if not isinstance(decision, NewQuorum):
                    if decision.reason != self.reason:
                        log.debug("lighthouse %s: %s", self.job_id, decision.reason)
                    self.reason = decision.reason
                    break
                wall = self.clock.time()
                created = (int(wall), min(int((wall % 1) * 1e9), 999_999_999))
                new = new_doc(
                    decision.quorum_id,
                    decision.participants,
                    view,
                    doc,
                    records,
                    created,
                    self.node,
                )
                try:
                    raw = encode(new)
                except ValueError as exc:  # members' fields too large together: none forms
                    decision = Wait(None, f"no quorum: {exc}")
                    if decision.reason != self.reason:
                        log.warning("lighthouse %s: %s", self.job_id, decision.reason)
                    self.reason = decision.reason
                    break
                result = await self.store.compare_and_set(
                    self._quorum_key, raw, entry.version if entry is not None else None
                )
                entry = result.entry
                if result.ok:
                    # Every step reissues the quorum: only a new id is worth an info line.
                    same = doc is not None and doc.quorum_id == new.quorum_id
                    (log.debug if same else log.info)(
                        "lighthouse %s: quorum %d of %d: %s",
                        self.job_id,
                        new.quorum_id,
                        len(new.participants),
                        decision.reason,
                    )
                    if not same and self.on_quorum is not None:
                        self.on_quorum(doc, new)
                    after_grant(seen, new, now)
                # a lost race: another writer's document; decide again from it
            timeout = WATCH_SECONDS
            if decision.until is not None:
                timeout = min(max(decision.until - self.clock.monotonic(), 0.0), WATCH_SECONDS)
            if timeout > 0:
                with contextlib.suppress(StoreCompacted):
                    await self.store.watch(prefix, revision, timeout, prefix=True)
