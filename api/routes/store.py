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

This module is the declaration: the wire models, each operation's
parameters and :data:`ROUTES`. One ASGI handler, :class:`api.store_http.StoreHTTP`,
answers every request from it (who may ask is its caller's to say); the
OpenAPI document shows it through :func:`store_router`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from inspect import Parameter, Signature
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.problems import LEASE_NOT_FOUND, problem_response
from api.schemas import Empty
from api.store_watch import MAX_WATCH_SECONDS
from elasticd.store.base import MAX_BATCH_KEYS
from elasticd.store.codec import decode_value
from elasticd.store.memory import COUNTER_MAX, COUNTER_MIN

#: Room in a request body for everything but the value (key, JSON, numbers).
_BODY_OVERHEAD = 64 * 1024


def body_limit(max_value_bytes: int) -> int:
    """Largest request body a store with this value limit needs (base64 + overhead)."""
    return (max_value_bytes + 2) // 3 * 4 + _BODY_OVERHEAD


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


class StoreWatchResponse(_Wire):
    """The changes after ``after``, oldest first; empty when the timeout passed first."""

    events: list[StoreWatchEvent]


# -- query and path parameters -------------------------------------------------


class StoreKeyQuery(BaseModel):
    """``GET /store/kv``."""

    key: str = Field(min_length=1)


class StoreDeleteQuery(BaseModel):
    """``DELETE /store/kv``."""

    key: str = Field(min_length=1)
    expected_version: int | None = None


class StoreListQuery(BaseModel):
    """``GET /store/list``."""

    prefix: str = ""


class StoreWatchQuery(BaseModel):
    """``GET /store/watch``."""

    key: str
    after: int = Field(description="Answer with changes above this revision")
    timeout: float = Field(default=30.0, ge=0, le=MAX_WATCH_SECONDS)
    prefix: bool = False


class StoreLeasePath(BaseModel):
    """``/store/leases/{lease}...``."""

    lease: int


# -- the routes ------------------------------------------------------------------


@dataclass(frozen=True)
class StoreRoute:
    """One operation of ``/store``: what the handler parses and the document shows."""

    name: str
    method: str
    path: str  # under /store
    doc: str
    response: type[BaseModel] | None  # None: an empty answer (204)
    status: int = 200
    query: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    lease_in_path: bool = False
    #: More answers the document shows (an unknown lease's 404).
    responses: dict[int | str, dict[str, Any]] | None = None


#: Every ``/store`` operation, in the order a request's path is matched against them.
ROUTES: tuple[StoreRoute, ...] = (
    StoreRoute("get_key", "GET", "/kv", "Read one key.", StoreGetResponse, query=StoreKeyQuery),
    StoreRoute(
        "put_key",
        "PUT",
        "/kv",
        "Write a key unconditionally.",
        StorePutResponse,
        body=StorePutRequest,
        responses=LEASE_NOT_FOUND,
    ),
    StoreRoute(
        "delete_key",
        "DELETE",
        "/kv",
        "Delete a key; with ``expected_version`` only if it still has that version.",
        StoreDeleteResponse,
        query=StoreDeleteQuery,
    ),
    StoreRoute(
        "put_batch",
        "POST",
        "/batch",
        "Write several keys unconditionally, all or nothing (one writer keeps its order).",
        StoreBatchResponse,
        body=StoreBatchRequest,
    ),
    StoreRoute(
        "compare_and_set",
        "POST",
        "/cas",
        "Compare-and-set on the key's version; a lost race is ``ok: false``, not an error.",
        StoreCasResponse,
        body=StoreCasRequest,
        responses=LEASE_NOT_FOUND,
    ),
    StoreRoute(
        "add",
        "POST",
        "/add",
        "Atomically add to an integer counter.",
        StoreAddResponse,
        body=StoreAddRequest,
    ),
    StoreRoute(
        "list_prefix",
        "GET",
        "/list",
        "Every entry whose key starts with ``prefix``.",
        StoreListResponse,
        query=StoreListQuery,
    ),
    StoreRoute(
        "grant",
        "POST",
        "/leases",
        "Create a lease with a TTL.",
        StoreLeaseResponse,
        201,
        body=StoreGrantRequest,
    ),
    StoreRoute(
        "keep_alive",
        "POST",
        "/leases/{lease}/keepalive",
        "Renew a lease for another TTL (404 when it expired or was revoked). Body: ``{}``.",
        StoreLeaseResponse,
        body=Empty,
        lease_in_path=True,
        responses=LEASE_NOT_FOUND,
    ),
    StoreRoute(
        "revoke",
        "DELETE",
        "/leases/{lease}",
        "End a lease now, deleting its keys.",
        None,
        204,
        lease_in_path=True,
    ),
    StoreRoute(
        "watch",
        "GET",
        "/watch",
        "Long-poll until a change to the key (or under the prefix) above ``after`` exists.",
        StoreWatchResponse,
        query=StoreWatchQuery,
    ),
)


def store_router() -> APIRouter:
    """The ``/store`` operations as routes, for the OpenAPI document.

    :class:`api.store_http.StoreHTTP` answers every request to them before
    routing; these routes only describe them (and make ``/store/kv/``
    redirect to ``/store/kv`` as any route would).
    """
    router = APIRouter(prefix="/store", tags=["store"])
    for route in ROUTES:
        router.add_api_route(
            route.path,
            _described(route),
            methods=[route.method],
            name=route.name,
            response_model=route.response,
            status_code=route.status,
            response_class=JSONResponse if route.response is not None else Response,
            responses={
                **(route.responses or {}),
                **(OVER_SHARE if route.path in SHARED_WRITES and route.method != "DELETE" else {}),
            },
        )
    return router


#: The writes a job's token makes under its prefix, within its share (issue 35).
SHARED_WRITES = frozenset({"/kv", "/batch", "/cas", "/add"})
OVER_SHARE: dict[int | str, dict[str, Any]] = {
    429: problem_response(
        "A job's token past its prefix's share of keys (job_store_max_keys); past its share "
        "of bytes (job_store_max_bytes) the answer is 413"
    )
}


def _described(route: StoreRoute) -> Callable[..., Any]:
    """An endpoint whose signature is the route's parameters (it is never called)."""
    params = []
    if route.lease_in_path:
        params.append(Parameter("lease", Parameter.KEYWORD_ONLY, annotation=int))
    if route.query is not None:
        annotation: Any = Annotated[route.query, Query()]
        params.append(Parameter("query", Parameter.KEYWORD_ONLY, annotation=annotation))
    if route.body is not None:
        params.append(Parameter("body", Parameter.KEYWORD_ONLY, annotation=route.body))

    async def endpoint(**_: Any) -> None:
        raise AssertionError("api.store_http.StoreHTTP answers /store before routing")

    endpoint.__signature__ = Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = route.name
    endpoint.__doc__ = route.doc
    return endpoint
