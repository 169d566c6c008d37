"""The store long-poll of the HTTP API (its one caller: :mod:`api.store_http`).

Which side of the boundary: the daemon (and the store server); a request's own
long-poll, ended early when its client goes away.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive

from elasticd.store.base import Store, WatchEvent

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
    watching = asyncio.ensure_future(store.watch(key, after, timeout, prefix=prefix))
    if not watching.done():
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((watching, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not watching.done():
                watching.cancel()  # the client went away, or this request was cancelled
        if not watching.done():
            return []
    return watching.result()
