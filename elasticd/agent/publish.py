"""Publishing a node's group view to the store (``group/<job>/<node>``), coalesced.

(The same publisher writes the node's goodput record, ``gp/<job>/<node>``:
any model one node alone writes.)

Any daemon answers ``GET /jobs/{id}/workers`` from these views. The agent
calls :meth:`GroupPublisher.request` on every change; one background task
writes the latest view, so a burst of changes costs one write. A write the
store refuses is tried again (backoff 0.1 s to 2 s) until it lands: the
published view must end up as the agent's (a fenced group shown HEALTHY
with dead pids misleads). :meth:`GroupPublisher.flush` waits, bounded, until
the latest view is written, then stops the task.

Which side of the boundary: the daemon; it writes its own key only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from pydantic import BaseModel

from elasticd.errors import ElasticdError
from elasticd.models import GroupView
from elasticd.store import Store

__all__ = ["GroupPublisher", "decode_group"]

log = logging.getLogger("elasticd.agent")

#: Bound on the final flush of a stopping agent.
FLUSH_TIMEOUT = 5.0


def _as_json(view: BaseModel) -> bytes:
    return view.model_dump_json().encode()


class GroupPublisher:
    def __init__(
        self,
        store: Store,
        key: str,
        view: Callable[[], BaseModel | None],
        encode: Callable[[BaseModel], bytes] = _as_json,
    ) -> None:
        """``encode``: the value written for a view (its JSON by default)."""
        self._store = store
        self._key = key
        self._view = view
        self._encode = encode
        self._wanted = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self, name: str) -> None:
        self._task = asyncio.create_task(self._run(), name=name)

    def request(self) -> None:
        """The view changed: write it soon."""
        self._idle.clear()
        self._wanted.set()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            view = self._view()
            if view is not None:
                try:
                    await self._store.put(self._key, self._encode(view))
                    backoff = 0.1
                except ElasticdError as exc:
                    log.warning("cannot publish group view %s: %s", self._key, exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    self._wanted.set()
                    continue
            if not self._wanted.is_set():
                self._idle.set()

    async def flush(self) -> None:
        """Wait (bounded) until the latest view is written, then stop."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_TIMEOUT):
                await self._idle.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def decode_group(raw: bytes) -> GroupView | None:
    """Parse a published group view (JSON only); None if it is not one."""
    try:
        return GroupView.model_validate(json.loads(raw))
    except (ValueError, TypeError):
        return None
