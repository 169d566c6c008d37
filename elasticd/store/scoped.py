"""A view of a store confined to one prefix: what a job's workers may reach through the API.

A job's token (:class:`elasticd.identity.JobTokens`) reaches the store only
under ``jobs/<id>/`` (its torch store and its in-process restart keys,
:mod:`elasticd.keys`). Every key, prefix and watch is checked against that
prefix before the store sees it; anything else raises
:class:`~elasticd.errors.KeyForbidden` (403). Leases are the daemons' (a
job's workers bind nothing to them): granting, renewing or revoking one is
refused too.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from elasticd.errors import KeyForbidden
from elasticd.store.base import CasResult, Entry, Listing, Store, WatchEvent


class ScopedStore(Store):
    """``store`` as seen by a caller confined to ``prefix``."""

    def __init__(self, store: Store, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError("a scope is a folder: its prefix ends with '/'")
        self._store = store
        self.prefix = prefix

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
        return await self._store.compare_and_set(self._check(key), value, expected_version)

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        self._no_lease(lease)
        return await self._store.put(self._check(key), value)

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        for key, _ in items:
            self._check(key)
        return await self._store.put_batch(items)

    async def add(self, key: str, delta: int = 1) -> int:
        return await self._store.add(self._check(key), delta)

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        return await self._store.delete(self._check(key), expected_version)

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
