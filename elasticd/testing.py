"""Fakes for users' own tests (and ours): no sockets, no processes, no clock sleeps.

* :class:`~elasticd.store.memory.MemoryStore` — the in-memory cluster store.
  It implements the whole :class:`~elasticd.store.base.Store` contract
  (revisions, CAS, leases with real TTL timers, watch, compaction) and adds
  :meth:`~elasticd.store.memory.MemoryStore.expire` to end a lease without
  waiting for its TTL.
* :class:`~elasticd.clock.FakeClock` — a clock that moves only when told to.
"""

from __future__ import annotations

from elasticd.clock import FakeClock
from elasticd.store.memory import MemoryStore

__all__ = ["FakeClock", "MemoryStore"]
