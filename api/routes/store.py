"""``/store/...``: the cluster store over HTTP, for daemons that share an embedded store.

The wire shape (JSON only; values are standard base64 with padding):

=======  ==========================================  =================================
GET      ``/store/kv?key=K``                         ``{"entry": Entry | null}``
PUT      ``/store/kv`` ``{key, value, lease}``       ``{"entry": Entry}``
DELETE   ``/store/kv?key=K&expected_version=V``      ``{"deleted": bool}``
POST     ``/store/cas``                              ``{"ok": bool, "entry": Entry | null}``
         ``{key, value, expected_version, lease}``
POST     ``/store/batch`` ``{items: [{key, value}]}``  ``{"entries": [Entry]}``
POST     ``/store/add`` ``{key, delta}``             ``{"value": int}``
GET      ``/store/list?prefix=P``                    ``{"entries": [Entry], "revision"}``
POST     ``/store/leases`` ``{ttl}``                 ``201 {"lease": id, "ttl"}``
POST     ``/store/leases/{id}/keepalive``            ``{"lease": id, "ttl"}``
DELETE   ``/store/leases/{id}``                      ``204``
GET      ``/store/watch?key=&after=&timeout=&prefix=``  ``{"events": [WatchEvent]}``
=======  ==========================================  =================================

Keys travel in the query string or the body, never in the path: clients and
proxies normalise paths (``/./``, ``//``, ``%2F``), and a store key must
arrive byte for byte. A lost CAS race is a ``200`` with ``ok: false`` and the
winner's entry, not an error. A missing key is ``{"entry": null}``, not a 404,
so that a wrong base URL can never read as "absent".

Errors come from the store's exception tree through the one table in
:mod:`api.problems` (``LeaseNotFound`` 404, ``ValueTooLarge`` 413,
``InvalidKey`` 422, ``StoreCompacted`` 410, ``StoreUnavailable`` 503). A body
larger than a maximal value could need is refused with 413 before it is
read: on its ``Content-Length``, or while streaming when it has none.

``/store/watch`` is a long-poll. It answers when a change exists, at its
timeout, or drops the watch when the client goes away, so a restarted peer
leaves no watch behind.

Authentication is not done here: the app adds the bearer-token dependency to
every route.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.problems import LEASE_NOT_FOUND
from api.schemas import Empty
from api.store_watch import MAX_WATCH_SECONDS, watch_until_gone
from elasticd.store.base import (
    DEFAULT_MAX_VALUE_BYTES,
    MAX_BATCH_KEYS,
    Entry,
    Store,
    WatchEvent,
)
from elasticd.store.codec import decode_value, encode_value
from elasticd.store.memory import COUNTER_MAX, COUNTER_MIN

#: Room in a request body for everything but the value (key, JSON, numbers).
_BODY_OVERHEAD = 64 * 1024


def body_limit(max_value_bytes: int) -> int:
    """Largest request body a store with this value limit needs (base64 + overhead)."""
    return (max_value_bytes + 2) // 3 * 4 + _BODY_OVERHEAD


def _too_large(limit: int) -> HTTPException:
    return HTTPException(
        413, f"the request body is over {limit} bytes; store values are limited in size"
    )


# -- wire models -------------------------------------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StoreEntry(_Wire):
    """One key's current value."""

    key: str
    value: str = Field(description="The value, base64")
    version: int = Field(description="Revision of the key's last write: the CAS fencing token")
    created: int = Field(description="Revision that created the key")
    lease: int | None = Field(default=None, description="Lease the key is bound to, if any")

    @classmethod
    def of(cls, entry: Entry) -> StoreEntry:
        return cls(
            key=entry.key,
            value=encode_value(entry.value),
            version=entry.version,
            created=entry.created,
            lease=entry.lease,
        )


def _entry_or_none(entry: Entry | None) -> StoreEntry | None:
    return StoreEntry.of(entry) if entry is not None else None


class StoreGetResponse(_Wire):
    """The key's entry, or null when the key is absent."""

    entry: StoreEntry | None


class StorePutRequest(_Wire):
    """Write a value unconditionally."""

    key: str = Field(min_length=1)
    value: str = Field(description="The value, base64")
    lease: int | None = Field(default=None, description="Bind the key to this lease")

    @field_validator("value")
    @classmethod
    def _check_b64(cls, value: str) -> str:
        decode_value(value)
        return value


class StorePutResponse(_Wire):
    """The entry as written."""

    entry: StoreEntry


class StoreCasRequest(StorePutRequest):
    """Write only if the key's version is ``expected_version`` (null: only if absent)."""

    expected_version: int | None = Field(
        description="The version the key must have now; null to create it only if absent"
    )


class StoreCasResponse(_Wire):
    """Whether this write won, and the key's entry after the call (the winner's on a loss)."""

    ok: bool
    entry: StoreEntry | None


class StoreBatchItem(_Wire):
    """One key of a batch."""

    key: str = Field(min_length=1)
    value: str = Field(description="The value, base64")

    @field_validator("value")
    @classmethod
    def _check_b64(cls, value: str) -> str:
        decode_value(value)
        return value


class StoreBatchRequest(_Wire):
    """Write every key unconditionally, all or nothing, in the order given."""

    items: list[StoreBatchItem] = Field(max_length=MAX_BATCH_KEYS)

    @field_validator("items")
    @classmethod
    def _each_key_once(cls, items: list[StoreBatchItem]) -> list[StoreBatchItem]:
        if len({item.key for item in items}) != len(items):
            raise ValueError("a batch names a key twice: write each key once")
        return items


class StoreBatchResponse(_Wire):
    """The entries as written, in the order given."""

    entries: list[StoreEntry]


class StoreAddRequest(_Wire):
    """Add ``delta`` to the integer counter at ``key`` (absent counts as 0)."""

    key: str = Field(min_length=1)
    delta: int = Field(
        default=1,
        ge=COUNTER_MIN,
        le=COUNTER_MAX,
        description="A signed 64-bit integer; a counter never leaves that range (422).",
    )


class StoreAddResponse(_Wire):
    """The counter's value after the add."""

    value: int


class StoreDeleteResponse(_Wire):
    """Whether the key was deleted."""

    deleted: bool


class StoreListResponse(_Wire):
    """The entries under the prefix, sorted by key, and the revision they were read at."""

    entries: list[StoreEntry]
    revision: int


class StoreGrantRequest(_Wire):
    """Create a lease."""

    ttl: float = Field(gt=0, le=86_400, description="Seconds until it expires unless kept alive")


class StoreLeaseResponse(_Wire):
    """A live lease."""

    lease: int
    ttl: float | None = None


class StoreWatchEvent(_Wire):
    """One change."""

    kind: Literal["put", "delete"]
    key: str
    value: str | None = Field(description="The new value, base64; null for a delete")
    revision: int

    @classmethod
    def of(cls, event: WatchEvent) -> StoreWatchEvent:
        value = encode_value(event.value) if event.value is not None else None
        return cls(kind=event.kind, key=event.key, value=value, revision=event.revision)


class StoreWatchResponse(_Wire):
    """The changes after ``after``, oldest first; empty when the timeout passed first."""

    events: list[StoreWatchEvent]


# -- size limit ----------------------------------------------------------------


class _LimitedRequest(Request):
    """A request whose body stream stops with 413 past ``limit`` bytes."""

    limit: int = body_limit(DEFAULT_MAX_VALUE_BYTES)

    async def stream(self) -> AsyncGenerator[bytes, None]:
        seen = 0
        async for chunk in super().stream():
            seen += len(chunk)
            if seen > self.limit:
                raise _too_large(self.limit)
            yield chunk


def _limited_route(limit: int) -> type[APIRoute]:
    class LimitedRoute(APIRoute):
        """Refuse over-large bodies before the body is parsed."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def limited(request: Request) -> Response:
                length = request.headers.get("content-length")
                if (
                    length is not None
                    and length.isdigit()
                    and (
                        len(length) > 20 or int(length) > limit  # int() refuses 4,300+ digits
                    )
                ):
                    raise _too_large(limit)
                wrapped = _LimitedRequest(request.scope, request.receive)
                wrapped.limit = limit
                return await handler(wrapped)

            return limited

    return LimitedRoute


# -- routes --------------------------------------------------------------------


def store_router(
    get_store: Callable[[], Store],
    *,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
) -> APIRouter:
    """The ``/store`` routes over the store that ``get_store()`` returns at each request."""
    router = APIRouter(
        prefix="/store", tags=["store"], route_class=_limited_route(body_limit(max_value_bytes))
    )

    @router.get("/kv", response_model=StoreGetResponse)
    async def get_key(key: Annotated[str, Query(min_length=1)]) -> StoreGetResponse:
        """Read one key."""
        return StoreGetResponse(entry=_entry_or_none(await get_store().get(key)))

    @router.put("/kv", response_model=StorePutResponse, responses=LEASE_NOT_FOUND)
    async def put_key(body: StorePutRequest) -> StorePutResponse:
        """Write a key unconditionally."""
        entry = await get_store().put(body.key, decode_value(body.value), lease=body.lease)
        return StorePutResponse(entry=StoreEntry.of(entry))

    @router.delete("/kv", response_model=StoreDeleteResponse)
    async def delete_key(
        key: Annotated[str, Query(min_length=1)],
        expected_version: int | None = None,
    ) -> StoreDeleteResponse:
        """Delete a key; with ``expected_version`` only if it still has that version."""
        return StoreDeleteResponse(deleted=await get_store().delete(key, expected_version))

    @router.post("/batch", response_model=StoreBatchResponse)
    async def put_batch(body: StoreBatchRequest) -> StoreBatchResponse:
        """Write several keys unconditionally, all or nothing (one writer keeps its order)."""
        items = [(item.key, decode_value(item.value)) for item in body.items]
        entries = await get_store().put_batch(items)  # each key once: checked above (422)
        return StoreBatchResponse(entries=[StoreEntry.of(e) for e in entries])

    @router.post("/cas", response_model=StoreCasResponse, responses=LEASE_NOT_FOUND)
    async def compare_and_set(body: StoreCasRequest) -> StoreCasResponse:
        """Compare-and-set on the key's version; a lost race is ``ok: false``, not an error."""
        result = await get_store().compare_and_set(
            body.key, decode_value(body.value), body.expected_version, lease=body.lease
        )
        return StoreCasResponse(ok=result.ok, entry=_entry_or_none(result.entry))

    @router.post("/add", response_model=StoreAddResponse)
    async def add(body: StoreAddRequest) -> StoreAddResponse:
        """Atomically add to an integer counter."""
        return StoreAddResponse(value=await get_store().add(body.key, body.delta))

    @router.get("/list", response_model=StoreListResponse)
    async def list_prefix(prefix: str = "") -> StoreListResponse:
        """Every entry whose key starts with ``prefix``."""
        listing = await get_store().list(prefix)
        return StoreListResponse(
            entries=[StoreEntry.of(e) for e in listing.entries], revision=listing.revision
        )

    @router.post("/leases", response_model=StoreLeaseResponse, status_code=201)
    async def grant(body: StoreGrantRequest) -> StoreLeaseResponse:
        """Create a lease with a TTL."""
        return StoreLeaseResponse(lease=await get_store().grant(body.ttl), ttl=body.ttl)

    @router.post(
        "/leases/{lease}/keepalive", response_model=StoreLeaseResponse, responses=LEASE_NOT_FOUND
    )
    async def keep_alive(lease: int, body: Empty) -> StoreLeaseResponse:
        """Renew a lease for another TTL (404 when it expired or was revoked). Body: ``{}``."""
        await get_store().keep_alive(lease)
        return StoreLeaseResponse(lease=lease)

    @router.delete("/leases/{lease}", status_code=204, response_class=Response)
    async def revoke(lease: int) -> Response:
        """End a lease now, deleting its keys."""
        await get_store().revoke(lease)
        return Response(status_code=204)

    @router.get("/watch", response_model=StoreWatchResponse)
    async def watch(
        request: Request,
        key: str,
        after: Annotated[int, Query(description="Answer with changes above this revision")],
        timeout: Annotated[float, Query(ge=0, le=MAX_WATCH_SECONDS)] = 30.0,
        prefix: bool = False,
    ) -> StoreWatchResponse:
        """Long-poll until a change to the key (or under the prefix) above ``after`` exists."""
        events = await watch_until_gone(get_store(), key, after, timeout, prefix, request.receive)
        return StoreWatchResponse(events=[StoreWatchEvent.of(e) for e in events])

    return router
