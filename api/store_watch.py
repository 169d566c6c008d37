"""The store long-poll of the HTTP API (its one caller: :mod:`api.store_http`).

Which side of the boundary: the daemon (and the store server); a request's own
long-poll, ended early when its client goes away.
"""

from __future__ import annotations

from starlette.types import Receive

from elasticd.store.base import Store, WatchEvent
from elasticd.tasks import race

#: Longest long-poll a client may ask for, in seconds.
MAX_WATCH_SECONDS = 600.0


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone away (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def watch_until_gone(
    store: Store, key: str, after: int, timeout: float, prefix: bool, receive: Receive
) -> list[WatchEvent]:
    """``store.watch``, given up (nothing) as soon as the client has gone away."""
    watching = store.watch(key, after, timeout, prefix=prefix)
    which, events = await race(watching, _disconnected(receive))
    return events if which == 0 and events is not None else []  # [] once the client has gone
