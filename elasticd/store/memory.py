"""An in-memory store: the reference implementation of :class:`~elasticd.store.base.Store`.

Everything runs on the event loop, so every operation is atomic by
construction: an operation decides and applies its change without an
``await`` in between. The design, in the order a change flows:

* **One change, one revision.** ``_put``/``_delete`` bump the store-wide
  revision, update the entry table and the lease's key set, and append a
  :class:`WatchEvent` to the watch history.
* **The history is as long as watchers need** (issue 23: a blanket 100,000
  changes held 110 MiB of a crash-looping daemon's memory). A watch asks for
  the changes after a revision it was handed: a listing's revision, or the
  last change its previous watch returned. A parked watch needs nothing old:
  the first change of its key or prefix wakes it with that change's
  revision, and it reads from there. So the history keeps the changes after
  the lowest revision handed out (a listing's, the last change of a watch's
  answer) in the last ``history_keep`` seconds (10: a client between a
  listing and its watch, or between two long-polls), less ``history_margin``
  changes (1,000, which also cover a woken watch until it runs); older
  changes are dropped as they stop being needed (:func:`history_floor`,
  pure). The revision a watch asks from is not noted: a quiet watch that
  times out asks again from the same revision, and would pin the history
  for as long as it stays quiet; past the window and the margin it gets
  ``StoreCompacted`` and re-lists, once per quiet period, as every watcher
  in elasticd does. ``history`` changes and ``history_bytes`` bytes of keys
  and values stay hard caps.
* **Visibility.** Watchers see changes up to ``_visible``. Here a change is
  visible the moment it is applied; :mod:`elasticd.store.embedded` overrides
  :meth:`MemoryStore._changed` and :meth:`MemoryStore._settle` so that a
  change becomes visible (and a call returns) only once it is on disk
  (reads go through :meth:`MemoryStore._settle_read`, which the embedded
  store lets answer from memory while its disk refuses writes).
* **Watch** answers from history when it can. Otherwise it parks one future
  in a waiter table (per key, or per prefix) and awaits it under the
  timeout. A change wakes exactly the waiters whose key or prefix it touches,
  so an idle watch costs no CPU and a wake-up is never spurious.
* **Nothing is O(keys) or O(watchers) per request** (issue 16: ten thousand
  nodes each reading and watching their own key). A sorted index of the keys
  answers a listing by bisection (O(log n + what it returns)); each key's
  changes in the history are indexed by revision, so a key watch finds its
  events without scanning everybody else's; a change looks up the waiters of
  its key and of each of its prefixes, not every parked prefix watch.
* **Leases** expire through ``loop.call_later`` timers, rescheduled by
  ``keep_alive``; there is no polling loop. Expiry and ``revoke`` delete the
  lease's keys one change at a time, so watchers see each delete. Tests that
  drive time themselves call :meth:`MemoryStore.expire` instead of waiting.

Lease ids are random 52-bit integers (exact in JSON everywhere), so an id a
client still holds from an earlier process never names a new lease.
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import itertools
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

from elasticd.errors import (
    InvalidKey,
    LeaseNotFound,
    StoreCompacted,
    StoreUnavailable,
    ValueTooLarge,
)
from elasticd.store.base import (
    DEFAULT_MAX_LIST_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    CasResult,
    Entry,
    Listing,
    Store,
    WatchEvent,
    check_batch,
    check_listing_size,
)

#: Longest key (UTF-8 bytes) any backend accepts.
MAX_KEY_BYTES = 4096

#: How many changes the in-memory history keeps for watches (a round of 10,000 nodes
#: writes 20,000: a presence key and a seat each; the byte bound still applies).
DEFAULT_HISTORY = 100_000

#: Seconds a revision handed out (a listing's, a watch's) stays watchable from.
DEFAULT_HISTORY_KEEP = 10.0
#: Changes kept below the oldest revision a watcher needs.
DEFAULT_HISTORY_MARGIN = 1000
#: Hard cap on the bytes of keys and values in the history (also bounded by ``max_list_bytes``).
DEFAULT_HISTORY_BYTES = 16 << 20
#: Width of the time buckets :class:`RecentRevisions` keeps (seconds).
_BUCKET = 1.0

#: Sorts after every character a key may hold: ``prefix + _TOP`` bounds the keys under it.
_TOP = "\U0010ffff"

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def validate_key(key: str, *, prefix: bool = False) -> None:
    """Raise :class:`InvalidKey` unless ``key`` is acceptable to every backend.

    A key is non-empty, valid UTF-8, at most :data:`MAX_KEY_BYTES` long, has no
    control character and no ``..`` path segment. A prefix may be empty, and
    its last segment may be a partial ``..`` (``"/a/.."`` matches ``"/a/..b"``).
    """
    if not isinstance(key, str):
        raise InvalidKey(f"a store key must be a string, not {type(key).__name__}")
    if not key and not prefix:
        raise InvalidKey("a store key must not be empty")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"store key {key!r} is not valid UTF-8: {exc.reason}") from None
    if size > MAX_KEY_BYTES:
        raise InvalidKey(f"store key of {size} bytes is longer than the {MAX_KEY_BYTES} allowed")
    if _CONTROL.search(key):
        raise InvalidKey(f"store key {key!r} contains a control character")
    if ".." in key:
        segments = key.split("/")
        if prefix:
            segments = segments[:-1]
        if ".." in segments:
            raise InvalidKey(f"store key {key!r} has a '..' path segment")


def check_value(value: bytes, limit: int) -> bytes:
    """Return ``value`` as ``bytes``; raise :class:`ValueTooLarge` over ``limit``."""
    if not isinstance(value, bytes):
        if not isinstance(value, bytearray | memoryview):
            raise TypeError(f"a store value must be bytes, not {type(value).__name__}")
        value = bytes(value)
    if len(value) > limit:
        raise ValueTooLarge(f"a value of {len(value)} bytes is over the store's limit of {limit}")
    return value


#: A counter is a signed 64-bit integer: an add that would leave that range is refused
#: (unbounded, its decimal text would pass Python's 4,300-digit conversion limit).
COUNTER_MIN = -(2**63)
COUNTER_MAX = 2**63 - 1


def counter_total(key: str, base: int, delta: int) -> int:
    """``base + delta``; :class:`InvalidKey` (a 422) when it leaves the 64-bit range."""
    if not COUNTER_MIN <= delta <= COUNTER_MAX:
        raise InvalidKey("delta must be a signed 64-bit integer")
    total = base + delta
    if not COUNTER_MIN <= total <= COUNTER_MAX:
        raise InvalidKey(f"adding to the counter at {key!r} would leave the 64-bit range")
    return total


def parse_counter(key: str, value: bytes | None) -> int:
    """The integer a counter key holds (absent = 0); :class:`InvalidKey` if it is not one."""
    if value is None:
        return 0
    try:
        text = value.decode("ascii")
        if text.strip() != text or not text or len(text) > 20:  # 64 bits: 20 characters
            raise ValueError(text)
        return int(text)
    except (UnicodeDecodeError, ValueError):
        raise InvalidKey(
            f"store key {key!r} holds {value[:40]!r}, not an ASCII decimal counter"
        ) from None


def new_lease_id(taken: Iterable[int] = ()) -> int:
    """A random positive lease id that fits exactly in a JSON number (52 bits)."""
    used = taken if isinstance(taken, Container) else set(taken)  # no copy per grant
    while True:
        lease = secrets.randbits(52)
        if lease and lease not in used:
            return lease


def history_floor(revision: int, parked: int | None, recent: int | None, margin: int) -> int:
    """The highest revision whose change no watcher can still need (0: keep everything).

    ``revision``: the store's visible revision; ``parked``: the lowest revision a
    parked watch waits from; ``recent``: the lowest revision handed out or asked
    about within the keep window. Changes at or below the floor may be dropped.
    """
    need = min(r for r in (revision, parked, recent) if r is not None)
    return max(0, need - margin)


class RecentRevisions:
    """The lowest revision handed out per second of the last ``keep`` seconds.

    ``note`` is O(1) (one bucket per second, however many calls); ``oldest``
    drops the buckets past the window. Time comes in as ``now``.
    """

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self._buckets: deque[list[float]] = deque()  # [start time, lowest revision]

    def note(self, now: float, revision: int) -> None:
        buckets = self._buckets
        if buckets and now - buckets[-1][0] < _BUCKET:
            if revision < buckets[-1][1]:
                buckets[-1][1] = revision
        else:
            buckets.append([now, revision])

    def oldest(self, now: float) -> int | None:
        buckets = self._buckets
        while buckets and now - buckets[0][0] > self.keep:
            buckets.popleft()
        return int(min(b[1] for b in buckets)) if buckets else None


def _size(event: WatchEvent) -> int:
    return len(event.key) + (len(event.value) if event.value is not None else 0)


@dataclass
class _Lease:
    id: int
    ttl: float
    keys: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class MemoryStore(Store):
    """An in-memory :class:`Store` for one event loop; the fake to use in tests.

    The watch history keeps what watchers need (see the module docstring):
    ``history_keep`` seconds of handed-out revisions plus ``history_margin``
    changes, within ``history`` changes and ``history_bytes`` bytes; a watch
    from before it raises :class:`StoreCompacted`. ``clock`` (monotonic
    seconds) is injectable for tests.
    """

    def __init__(
        self,
        *,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
        history: int = DEFAULT_HISTORY,
        history_keep: float = DEFAULT_HISTORY_KEEP,
        history_margin: int = DEFAULT_HISTORY_MARGIN,
        history_bytes: int = DEFAULT_HISTORY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if history < 1:
            raise ValueError("history must keep at least one change")
        if history_keep < 0 or history_margin < 0 or history_bytes < 1:
            raise ValueError("history_keep and history_margin must be >= 0, history_bytes > 0")
        self.max_value_bytes = max_value_bytes
        self.max_list_bytes = max_list_bytes
        self._entries: dict[str, Entry] = {}
        self._sorted: builtins.list[str] = []  # the keys of _entries, sorted (for listings)
        #: Per key, the revisions of its changes still in _history, oldest first.
        # Lists, not deques: most keys have one change in the history, and an empty deque
        # costs 600 bytes (a list of one, 64); the oldest leaves by pop(0), short lists.
        self._key_changes: dict[str, builtins.list[int]] = {}
        self._changed_keys: builtins.list[str] = []  # the keys of _key_changes, sorted
        self._revision = 0
        self._visible = 0  # highest revision watchers may see
        self._compacted = 0  # every change with a higher revision is in _history
        self._history: deque[WatchEvent] = deque(maxlen=history)
        self._history_bytes = 0  # keys and values in _history, bounded by max_history_bytes
        self.max_history_bytes = min(history_bytes, max_list_bytes)
        self.history_margin = history_margin
        self._clock = clock
        #: Revisions handed out (listings, watches) in the last ``history_keep`` seconds.
        self._recent = RecentRevisions(history_keep)
        self._leases: dict[int, _Lease] = {}
        # A parked watch's future resolves with the revision of the change that woke it.
        # Waiters are kept in insertion-ordered dicts (used as sets), so a change wakes them
        # in the order they parked: the same calls always resume in the same order (the
        # seeded simulation under tests/sim replays a schedule exactly).
        self._key_waiters: dict[str, dict[asyncio.Future[int], None]] = {}
        self._prefix_waiters: dict[asyncio.Future[int], str] = {}
        self._waiters_by_prefix: dict[str, dict[asyncio.Future[int], None]] = {}
        self._closed = False

    # -- public API --------------------------------------------------------

    @property
    def revision(self) -> int:
        """The store's current revision (the revision of its latest change)."""
        return self._revision

    def history_size(self) -> tuple[int, int]:
        """The watch history now: (changes, bytes of keys and values). For tests and metrics."""
        return len(self._history), self._history_bytes

    async def get(self, key: str) -> Entry | None:
        self._check_open()
        validate_key(key)
        entry = self._entries.get(key)
        await self._settle_read(key)
        return entry

    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_version: int | None,
        *,
        lease: int | None = None,
    ) -> CasResult:
        self._check_open()
        validate_key(key)
        value = check_value(value, self.max_value_bytes)
        current = self._entries.get(key)
        current_version = current.version if current is not None else None
        if current_version != expected_version:
            await self._settle()
            return CasResult(ok=False, entry=current)
        entry = self._put(key, value, self._lease_for_write(lease))
        await self._settle()
        return CasResult(ok=True, entry=entry)

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        self._check_open()
        validate_key(key)
        value = check_value(value, self.max_value_bytes)
        entry = self._put(key, value, self._lease_for_write(lease))
        await self._settle()
        return entry

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        self._check_open()
        check_batch(items)
        checked = []
        for key, value in items:  # every check before the first write: all or nothing
            validate_key(key)
            checked.append((key, check_value(value, self.max_value_bytes)))
        entries = [self._put(key, value, None) for key, value in checked]
        await self._settle()
        return entries

    async def add(self, key: str, delta: int = 1) -> int:
        self._check_open()
        validate_key(key)
        current = self._entries.get(key)
        total = counter_total(key, parse_counter(key, current.value if current else None), delta)
        # A counter keeps the lease it was created with.
        lease = current.lease if current is not None else None
        self._put(key, str(total).encode("ascii"), lease)
        await self._settle()
        return total

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        self._check_open()
        validate_key(key)
        current = self._entries.get(key)
        if current is None or (
            expected_version is not None and current.version != expected_version
        ):
            await self._settle()
            return False
        self._delete(key)
        await self._settle()
        return True

    async def list(self, prefix: str) -> Listing:
        self._check_open()
        validate_key(prefix, prefix=True)
        entries = []
        size = 0
        keys = self._sorted
        at = bisect.bisect_left(keys, prefix)
        while at < len(keys) and keys[at].startswith(prefix):
            entry = self._entries[keys[at]]
            entries.append(entry)
            size += len(entry.key) + len(entry.value)
            check_listing_size(prefix, size, len(entries), self.max_list_bytes)
            at += 1
        revision = self._revision
        self._recent.note(self._clock(), revision)  # its holder may watch from it next
        revision = await self._settle_read(prefix, prefix=True, revision=revision)
        return Listing(entries=entries, revision=revision)

    async def grant(self, ttl: float) -> int:
        self._check_open()
        if not ttl > 0:
            raise ValueError(f"a lease TTL must be positive, not {ttl!r}")
        lease = _Lease(id=new_lease_id(self._leases), ttl=float(ttl))
        self._leases[lease.id] = lease
        self._arm(lease)
        return lease.id

    async def keep_alive(self, lease: int) -> None:
        self._check_open()
        found = self._leases.get(lease)
        if found is None:
            raise LeaseNotFound(f"lease {lease} expired or was revoked")
        self._arm(found)

    async def revoke(self, lease: int) -> None:
        self._check_open()
        self._end_lease(lease)
        await self._settle()

    async def expire(self, lease: int) -> None:
        """Expire ``lease`` now, as if its TTL had run out (for tests that drive time)."""
        self._check_open()
        self._end_lease(lease)
        await self._settle()

    def compact(self, revision: int | None = None) -> None:
        """Forget the history of changes up to ``revision`` (default: all of it).

        Afterwards a watch with ``after_version`` below ``revision`` raises
        :class:`StoreCompacted`, as after an etcd compaction.
        """
        target = self._revision if revision is None else min(revision, self._revision)
        history = self._history
        while history and history[0].revision <= target:
            self._drop_oldest()
        self._compacted = max(self._compacted, target)

    async def watch(
        self,
        key: str,
        after_version: int,
        timeout: float,
        *,
        prefix: bool = False,
    ) -> builtins.list[WatchEvent]:
        self._check_open()
        validate_key(key, prefix=prefix)
        # The revision asked about is not noted: a quiet watcher asks again and again from
        # the same old revision (every timeout), and would pin the history for ever.
        events = self._events_after(key, after_version, prefix)
        if events or timeout <= 0:
            self._note_answer(events)
            return events
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                # Loops only when woken by a change at or below ``after_version``
                # (a watch from a revision the store has not reached yet).
                while not events:
                    waiter: asyncio.Future[int] = loop.create_future()
                    if prefix:
                        self._prefix_waiters[waiter] = key
                        self._waiters_by_prefix.setdefault(key, {})[waiter] = None
                    else:
                        self._key_waiters.setdefault(key, {})[waiter] = None
                    try:
                        woken = await waiter
                    finally:
                        self._forget_waiter(waiter, key, prefix)
                    # Parked, it was woken by its first change since: nothing of it lies
                    # before that change, so it needs no history older than it (a parked
                    # watch pins none; the margin covers the moment until it runs).
                    after_version = max(after_version, woken - 1)
                    events = self._events_after(key, after_version, prefix)
        except TimeoutError:
            return []
        self._note_answer(events)
        return events

    def _note_answer(self, events: builtins.list[WatchEvent]) -> None:
        """The watcher's next watch is from the last change it got."""
        if events:
            self._recent.note(self._clock(), events[-1].revision)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lease in self._leases.values():
            if lease.timer is not None:
                lease.timer.cancel()
        gone = StoreUnavailable("the store was closed")
        for waiters in self._key_waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(gone)
        for waiter in self._prefix_waiters:
            if not waiter.done():
                waiter.set_exception(gone)

    # -- hooks for a persistent subclass ----------------------------------

    def _changed(self, event: WatchEvent, entry: Entry | None) -> None:
        """Called once per applied change; here it becomes visible at once."""
        self._visible = event.revision
        self._wake((event,))

    async def _settle(self) -> None:
        """Return once every change applied so far is durable (here: at once)."""

    async def _settle_read(self, key: str, *, prefix: bool = False, revision: int = 0) -> int:
        """Before a read of ``key`` (or of the keys under it, with ``prefix``) answers: by
        default, once every change is durable (as :meth:`_settle`); the embedded store waits
        only for the changes of what was read. Returns the revision a listing made at
        ``revision`` reports (one a crash cannot take back)."""
        await self._settle()
        return revision

    # -- the state machine -------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("the store was closed")

    def _lease_for_write(self, lease: int | None) -> int | None:
        if lease is not None and lease not in self._leases:
            raise LeaseNotFound(f"lease {lease} expired or was revoked")
        return lease

    def _put(self, key: str, value: bytes, lease: int | None) -> Entry:
        self._revision += 1
        revision = self._revision
        previous = self._entries.get(key)
        if previous is not None and previous.lease is not None and previous.lease != lease:
            old = self._leases.get(previous.lease)
            if old is not None:
                old.keys.discard(key)
        if lease is not None:
            self._leases[lease].keys.add(key)
        entry = Entry(
            key=key,
            value=value,
            version=revision,
            created=previous.created if previous is not None else revision,
            lease=lease,
        )
        if previous is None:
            bisect.insort(self._sorted, key)
        self._entries[key] = entry
        self._record(WatchEvent(kind="put", key=key, value=value, revision=revision), entry)
        return entry

    def _delete(self, key: str) -> None:
        previous = self._entries.pop(key)
        at = bisect.bisect_left(self._sorted, key)
        del self._sorted[at]
        if previous.lease is not None:
            lease = self._leases.get(previous.lease)
            if lease is not None:
                lease.keys.discard(key)
        self._revision += 1
        self._record(WatchEvent(kind="delete", key=key, value=None, revision=self._revision), None)

    def _record(self, event: WatchEvent, entry: Entry | None) -> None:
        history = self._history
        if len(history) == history.maxlen:
            self._compacted = history[0].revision
            self._drop_oldest()
        history.append(event)
        self._history_bytes += _size(event)
        changes = self._key_changes.get(event.key)
        if changes is None:
            changes = self._key_changes[event.key] = []
            bisect.insort(self._changed_keys, event.key)
        changes.append(event.revision)
        # Bounded in bytes too, so large values cannot pile up in memory (and no watch
        # answer is larger than a listing may be): the oldest changes are compacted.
        while self._history_bytes > self.max_history_bytes and len(history) > 1:
            self._compacted = self._drop_oldest().revision
        self._trim_history()
        self._changed(event, entry)

    def _trim_history(self) -> None:
        """Drop the changes no watcher can still need (:func:`history_floor`)."""
        history = self._history
        if not history:
            return
        floor = history_floor(
            self._visible, None, self._recent.oldest(self._clock()), self.history_margin
        )
        while history and history[0].revision <= floor:
            self._compacted = self._drop_oldest().revision

    def _drop_oldest(self) -> WatchEvent:
        """Forget the oldest change of the history (and its entry in the key's index)."""
        dropped = self._history.popleft()
        self._history_bytes -= _size(dropped)
        changes = self._key_changes.get(dropped.key)
        if changes:
            del changes[0]  # a key's changes leave the history in the order they came
            if not changes:
                del self._key_changes[dropped.key]
                del self._changed_keys[bisect.bisect_left(self._changed_keys, dropped.key)]
        return dropped

    def _arm(self, lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(lease.ttl, self._end_lease, lease.id)

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        if lease.timer is not None:
            lease.timer.cancel()
        for key in sorted(lease.keys):
            entry = self._entries.get(key)
            if entry is not None and entry.lease == lease_id:
                self._delete(key)

    # -- watch plumbing ----------------------------------------------------

    def _events_after(self, key: str, after: int, prefix: bool) -> builtins.list[WatchEvent]:
        if after < self._compacted:
            raise StoreCompacted(
                f"changes up to revision {self._compacted} are compacted; watch from "
                f"revision {self._compacted} or later after re-reading {key!r}",
                self._compacted,
            )
        visible = self._visible
        if after >= visible or not self._history:
            return []
        history = self._history
        first = history[0].revision  # history is contiguous: event i has revision first + i
        if not prefix:
            # The key's own changes, found through its index: O(its changes), not
            # O(everybody's changes since ``after``).
            return self._changes_of(key, after, visible, first)
        keys = self._changed_keys
        lo = bisect.bisect_left(keys, key)
        hi = bisect.bisect_left(keys, key + _TOP, lo)
        if hi - lo < visible - after:
            # Fewer keys under the prefix than changes to look at: ask each key's index
            # (a watch on a small prefix from long ago does not scan everybody's changes).
            found = []
            for i in range(lo, hi):
                found.extend(self._changes_of(keys[i], after, visible, first))
            found.sort(key=lambda e: e.revision)
            return found
        start = max(after + 1 - first, 0)
        stop = visible - first + 1
        size = len(history)
        recent = itertools.islice(reversed(history), size - stop, size - start)
        found = [e for e in recent if e.key.startswith(key)]
        found.reverse()
        return found

    def _changes_of(
        self, key: str, after: int, visible: int, first: int
    ) -> builtins.list[WatchEvent]:
        """The changes of ``key`` in ``(after, visible]``, oldest first, from its index."""
        changes = self._key_changes.get(key)
        if not changes or changes[-1] <= after:
            return []
        history = self._history
        found = []
        for revision in reversed(changes):
            if revision <= after:
                break
            if revision <= visible:
                found.append(history[revision - first])
        found.reverse()
        return found

    def _wake(self, events: Iterable[WatchEvent]) -> None:
        for event in events:
            waiters = self._key_waiters.pop(event.key, None)
            if waiters:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(event.revision)
            by_prefix = self._waiters_by_prefix
            if not by_prefix:
                continue
            # Only the waiters of this key's prefixes: the fewer of the key's own
            # prefixes and the prefixes watched are looked at, never every watcher.
            key = event.key
            if len(by_prefix) <= len(key):
                prefixes: Iterable[str] = [p for p in by_prefix if key.startswith(p)]
            else:
                prefixes = [key[:i] for i in range(len(key) + 1) if key[:i] in by_prefix]
            for prefix in prefixes:
                for waiter in by_prefix.pop(prefix, ()):
                    if not waiter.done():
                        waiter.set_result(event.revision)

    def _forget_waiter(self, waiter: asyncio.Future[int], key: str, prefix: bool) -> None:
        if prefix:
            self._prefix_waiters.pop(waiter, None)
            same = self._waiters_by_prefix.get(key)
            if same is not None:
                same.pop(waiter, None)
                if not same:
                    del self._waiters_by_prefix[key]
            return
        waiters = self._key_waiters.get(key)
        if waiters is not None:
            waiters.pop(waiter, None)
            if not waiters:
                del self._key_waiters[key]
