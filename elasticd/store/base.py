"""The store interface every backend implements (in-memory, embedded HTTP, etcd).

Semantics, shared with etcd v3 so that every backend can honour them:

* A store-wide **revision** starts at 0 and grows by one with every change
  (put, delete, lease expiry deleting a key). It orders all changes.
* An entry's ``version`` is the revision of its last write (etcd's
  ``mod_revision``); ``created`` is the revision that created it
  (``create_revision``). Versions are the fencing tokens of compare-and-set.
* ``compare_and_set`` is the one write primitive for shared state: it writes
  only when the key's current version equals ``expected_version``
  (``None`` means "the key must be absent"). A lost race is not an exception:
  the result carries the winner's entry.
* ``put_batch`` writes several keys at once, all or nothing, in one round
  trip, in the order given: each key's ``created``/``version`` is at least
  that of the keys before it. etcd gives the whole batch one revision (one
  txn); the other backends one revision per key. It is how one writer keeps
  its own order without waiting for one round trip per key (the event log).
* Keys bound to a lease are deleted when the lease expires or is revoked.
* ``watch`` answers as soon as a change under the key (or prefix) with a
  revision above ``after_version`` exists, or with an empty list at the
  timeout. It never sleeps-and-polls.

Values are bytes; callers encode JSON. Nothing here ever unpickles. Every
backend bounds what one client can make it hold: a value over
``max_value_bytes`` is :class:`~elasticd.errors.ValueTooLarge`, a listing
over ``max_list_bytes`` is :class:`~elasticd.errors.ListingTooLarge`.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

from elasticd.errors import ListingTooLarge

#: Default largest value a store accepts (bytes); configurable per backend
#: (``store_max_value_bytes``). Job documents, events and rendezvous state are
#: kilobytes; a larger value is a bug or an attempt to grow a daemon's memory.
DEFAULT_MAX_VALUE_BYTES = 1024 * 1024

#: Default largest list answer (keys plus values, bytes); configurable per
#: backend (``store_max_list_bytes``). A larger listing raises
#: :class:`~elasticd.errors.ListingTooLarge` instead of being built in memory.
DEFAULT_MAX_LIST_BYTES = 64 * 1024 * 1024

#: Most keys one :meth:`Store.put_batch` may write (etcd refuses a txn of more
#: than ``--max-txn-ops`` operations, 128 by default).
MAX_BATCH_KEYS = 100


def check_batch(items: Sequence[tuple[str, bytes]]) -> None:
    """Refuse a batch that no backend may apply atomically: too many keys, or one twice."""
    if len(items) > MAX_BATCH_KEYS:
        raise ValueError(f"a batch holds at most {MAX_BATCH_KEYS} keys, not {len(items)}")
    if len({key for key, _ in items}) != len(items):
        raise ValueError("a batch names a key twice")


def check_listing_size(prefix: str, size: int, count: int, limit: int) -> None:
    """Raise :class:`~elasticd.errors.ListingTooLarge` when a listing is over ``limit`` bytes."""
    if size > limit:
        raise ListingTooLarge(
            f"the entries under prefix {prefix!r} hold over {limit} bytes (at least {count} "
            f"entries, {size} bytes), the store's list limit (store_max_list_bytes); list a "
            "narrower prefix or delete what is not needed"
        )


@dataclass(frozen=True, slots=True)
class Entry:
    """One key's current value (slots: the embedded store holds one per key)."""

    key: str
    value: bytes
    version: int  # revision of the last write (etcd mod_revision)
    created: int  # revision that created the key (etcd create_revision)
    lease: int | None = None


@dataclass(frozen=True)
class CasResult:
    """The outcome of a compare-and-set.

    ``ok`` tells whether this call's write won. ``entry`` is the key's entry
    after the call: the new one on success, the winner's (or ``None`` when the
    key is absent) on a lost race.
    """

    ok: bool
    entry: Entry | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None  # None for a delete
    revision: int  # store revision of this change


@dataclass(frozen=True)
class Listing:
    """The entries under a prefix, and the store revision they were read at.

    Watching the prefix from ``revision`` misses nothing that happened after
    the read.
    """

    entries: Sequence[Entry]
    revision: int


class Store(abc.ABC):
    """An async versioned key-value store with CAS, leases and watch.

    Stores are async context managers; ``close`` releases clients and tasks.
    """

    @abc.abstractmethod
    async def get(self, key: str) -> Entry | None:
        """The key's entry, or ``None`` when absent."""

    @abc.abstractmethod
    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_version: int | None,
        *,
        lease: int | None = None,
    ) -> CasResult:
        """Write ``value`` if the key's version is ``expected_version``.

        ``expected_version=None`` creates the key only if it is absent.
        """

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        """Write unconditionally (for data with a single writer, e.g. a node's own record)."""

    @abc.abstractmethod
    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        """Write every ``(key, value)`` unconditionally, all or nothing, in one round trip.

        The entries come back in the order given, with non-decreasing
        revisions. At most :data:`MAX_BATCH_KEYS` keys, each named once
        (``ValueError`` otherwise); keys are not bound to a lease.
        """

    @abc.abstractmethod
    async def add(self, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to an integer counter (absent = 0); return the new value."""

    @abc.abstractmethod
    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        """Delete the key; with ``expected_version`` only if it matches. True if deleted."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> Listing:
        """All entries whose key starts with ``prefix``, sorted by key.

        Raises :class:`~elasticd.errors.ListingTooLarge` when their keys and
        values hold more than the store's list limit.
        """

    @abc.abstractmethod
    async def grant(self, ttl: float) -> int:
        """Create a lease that expires ``ttl`` seconds from now unless kept alive."""

    @abc.abstractmethod
    async def keep_alive(self, lease: int) -> None:
        """Renew the lease for another full TTL. Raises ``LeaseNotFound`` if it is gone."""

    @abc.abstractmethod
    async def revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys. Revoking an unknown lease is not an error."""

    @abc.abstractmethod
    async def watch(
        self,
        key: str,
        after_version: int,
        timeout: float,
        *,
        prefix: bool = False,
    ) -> builtins.list[WatchEvent]:
        """Changes to ``key`` (or under it, with ``prefix``) with revision > ``after_version``.

        Returns as soon as there is at least one; returns ``[]`` at the timeout.
        Raises ``StoreCompacted`` if that history is gone.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release clients, connections and background tasks."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
