"""A view of a store confined to one prefix: what a job's workers may reach through the API.

A job's token (:class:`elasticd.identity.JobTokens`) reaches the store only
under ``jobs/<id>/`` (its torch store and its in-process restart keys,
:mod:`elasticd.keys`). Every key, prefix and watch is checked against that
prefix before the store sees it; anything else raises
:class:`~elasticd.errors.KeyForbidden` (403). Leases are the daemons' (a
job's workers bind nothing to them): granting, renewing or revoking one is
refused too.

The prefix has a share (issue 35): at most ``max_keys`` keys and
``max_bytes`` bytes of values (``job_store_max_keys``,
``job_store_max_bytes``); a write past it is 429 or 413 naming the setting
(:func:`elasticd.shares.prefix_share_problem`), so a job cannot fill the
store host's disk, as root, through its token. What the prefix holds is kept
by a :class:`PrefixLedger` shared by the daemon's requests: read with one
listing at most every ``refresh`` seconds (other nodes' writes are seen
then), and counted on at once by every write through this daemon, reserved
before the write is sent so that concurrent writes cannot all pass one check.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elasticd.errors import KeyForbidden, ListingTooLarge, OverShare, OverShareBytes
from elasticd.shares import Usage, prefix_share_problem
from elasticd.store.base import CasResult, Entry, Listing, Store, WatchEvent

#: The defaults of ``job_store_max_keys`` and ``job_store_max_bytes``: a job's torch store
#: and in-process keys are small and few; its data belongs in files, not the store.
DEFAULT_JOB_STORE_MAX_KEYS = 100_000
DEFAULT_JOB_STORE_MAX_BYTES = 32 << 20
#: What a counter key (``add``) is counted as: its decimal text.
COUNTER_BYTES = 20


@dataclass(frozen=True)
class PrefixShare:
    """The share of one scope's prefix (``job_store_max_keys``, ``job_store_max_bytes``)."""

    max_keys: int
    max_bytes: int


class PrefixLedger:
    """The size of each key under each scoped prefix, as this daemon last knew it.

    One per daemon (the API's ``/store`` access); a prefix not written for
    ``forget`` seconds is dropped, so the ledger holds the live jobs' prefixes only.
    """

    def __init__(
        self,
        *,
        refresh: float = 5.0,
        forget: float = 60.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refresh = refresh
        self.forget = forget
        self._now = now
        self._sizes: dict[str, tuple[float, dict[str, int]]] = {}
        self._used: dict[str, float] = {}
        self._reading: dict[str, asyncio.Future[bool]] = {}

    async def sizes(self, store: Store, prefix: str) -> dict[str, int] | None:
        """Each key's value size under ``prefix`` (None: more than one listing may hold)."""
        now = self._now()
        for stale in [p for p, at in self._used.items() if now - at > self.forget]:
            self._used.pop(stale, None)
            self._sizes.pop(stale, None)
        self._used[prefix] = now
        read = self._sizes.get(prefix)
        if read is None or now - read[0] > self.refresh:
            # One listing per prefix at a time: each may be store_max_list_bytes, and a
            # token's burst of writes (its connection share) must not read it once each.
            reading = self._reading.get(prefix)
            if reading is None:
                reading = asyncio.ensure_future(self._read(store, prefix, now))
                self._reading[prefix] = reading
                reading.add_done_callback(lambda _: self._reading.pop(prefix, None))
            if not await asyncio.shield(reading):
                return None
        return self._sizes[prefix][1]

    async def _read(self, store: Store, prefix: str, now: float) -> bool:
        try:
            listing = await store.list(prefix)
        except ListingTooLarge:
            return False
        read = self._sizes.get(prefix)
        if read is None or now - read[0] > self.refresh:  # else a concurrent read won:
            # its dict may already hold reservations, which a fresh one would lose
            self._sizes[prefix] = (now, {e.key: len(e.key) + len(e.value) for e in listing.entries})
        return True


class ScopedStore(Store):
    """``store`` as seen by a caller confined to ``prefix``."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        *,
        share: PrefixShare | None = None,
        ledger: PrefixLedger | None = None,
    ) -> None:
        if not prefix.endswith("/"):
            raise ValueError("a scope is a folder: its prefix ends with '/'")
        self._store = store
        self.prefix = prefix
        self._share = share
        self._ledger = ledger if ledger is not None else PrefixLedger()

    async def _reserve(self, writes: Sequence[tuple[str, int]]) -> dict[str, int | None]:
        """Count ``writes`` (key, new size) against the share, or raise ``OverShare``;
        returns what each key held before (None: absent), to undo with :meth:`_undo`."""
        if self._share is None:
            return {}
        sizes = await self._ledger.sizes(self._store, self.prefix)
        if sizes is None:
            raise OverShareBytes(
                f"the job's store prefix {self.prefix} holds more than one listing may "
                "(store_max_list_bytes); delete keys it no longer needs"
            )
        before: dict[str, int | None] = {}
        for key, nbytes in writes:
            usage = Usage(len(sizes), sum(sizes.values()))
            old = sizes.get(key)
            problem = prefix_share_problem(
                self.prefix,
                usage,
                new_key=old is None,
                old_bytes=old or 0,
                new_bytes=nbytes,
                max_keys=self._share.max_keys,
                max_bytes=self._share.max_bytes,
            )
            if problem is not None:
                self._undo(sizes, before)
                status, message = problem
                raise (OverShareBytes if status == 413 else OverShare)(message)
            before.setdefault(key, old)
            sizes[key] = nbytes
        return before

    async def _undo_write(self, before: dict[str, int | None]) -> None:
        if before:
            sizes = await self._ledger.sizes(self._store, self.prefix)
            if sizes is not None:
                self._undo(sizes, before)

    @staticmethod
    def _undo(sizes: dict[str, int], before: dict[str, int | None]) -> None:
        for key, old in before.items():
            if old is None:
                sizes.pop(key, None)
            else:
                sizes[key] = old

    def _check(self, key: str) -> str:
        if not key.startswith(self.prefix) or "/../" in key or key.endswith("/.."):
            raise KeyForbidden(f"this token may only use keys under {self.prefix!r}, not {key!r}")
        return key

    async def get(self, key: str) -> Entry | None:
        return await self._store.get(self._check(key))

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int | None, *, lease: int | None = None
    ) -> CasResult:
        self._no_lease(lease)
        before = await self._reserve([(self._check(key), len(key) + len(value))])
        try:
            result = await self._store.compare_and_set(key, value, expected_version)
        except BaseException:
            await self._undo_write(before)
            raise
        if not result.ok:
            await self._undo_write(before)
        return result

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        self._no_lease(lease)
        before = await self._reserve([(self._check(key), len(key) + len(value))])
        try:
            return await self._store.put(key, value)
        except BaseException:
            await self._undo_write(before)
            raise

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        before = await self._reserve(
            [(self._check(key), len(key) + len(value)) for key, value in items]
        )
        try:
            return await self._store.put_batch(items)
        except BaseException:
            await self._undo_write(before)
            raise

    async def add(self, key: str, delta: int = 1) -> int:
        before = await self._reserve([(self._check(key), COUNTER_BYTES)])
        try:
            return await self._store.add(key, delta)
        except BaseException:
            await self._undo_write(before)
            raise

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        deleted = await self._store.delete(self._check(key), expected_version)
        if deleted and self._share is not None:
            sizes = await self._ledger.sizes(self._store, self.prefix)
            if sizes is not None:
                sizes.pop(key, None)
        return deleted

    async def list(self, prefix: str) -> Listing:
        return await self._store.list(self._check(prefix))

    async def grant(self, ttl: float) -> int:
        raise KeyForbidden("leases are the daemons': a job's token may not grant one")

    async def keep_alive(self, lease: int) -> None:
        raise KeyForbidden("leases are the daemons': a job's token may not renew one")

    async def revoke(self, lease: int) -> None:
        raise KeyForbidden("leases are the daemons': a job's token may not revoke one")

    async def watch(
        self, key: str, after_version: int, timeout: float, *, prefix: bool = False
    ) -> builtins.list[WatchEvent]:
        return await self._store.watch(self._check(key), after_version, timeout, prefix=prefix)

    def _no_lease(self, lease: int | None) -> None:
        if lease is not None:
            raise KeyForbidden("leases are the daemons': a job's token may not bind a key to one")
