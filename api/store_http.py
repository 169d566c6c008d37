"""One ASGI handler answers every ``/store`` request, from one declaration.

:mod:`api.routes.store` declares the operations (:data:`~api.routes.store.ROUTES`:
method, path, parameter and body models, answer); the OpenAPI document shows
the same table. :class:`StoreHTTP` sits in front of routing (in the daemon's
app and the store server's) and answers each request whose path is one of
them, in this order, as FastAPI answered them before it (the recorded
answers of ``tests/store/test_store_http.py``):

1. the path and method: a path that names no operation goes on to the app
   (its 404, or its redirect of ``/store/kv/``); a known path with another
   method is ``405`` with ``Allow``;
2. a body over the store's limit: ``413`` on its ``Content-Length``, before
   anything else is read;
3. who asks: ``access(scope)`` gives the store this caller may use (the
   whole store, or a job's scoped one) or the answer that refuses it (``401``,
   ``403``);
4. the body, read up to the limit (``413`` past it while streaming);
5. the parameters. Why two ways: a rendezvous of N nodes sends a few
   requests per node, and pydantic models per request cost more than the
   store's own work (cProfile, 10,000 nodes). So a plainly well-formed
   request of the hot operations (each query parameter once and no other;
   plain decimals; a body of exactly the model's fields with their exact
   JSON types and valid base64) is read by hand, and anything else by the
   declared models, which answer ``422`` with each field's message, or
   accept what they coerce (``"lease": "7"``). Both give the same
   arguments (``tests/store/test_store_http.py`` checks that for every
   recorded request the hand reader takes);
6. the store call, its errors through the one table of :mod:`api.problems`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import first_header
from api.problems import error_problem, problem, validation_problem
from api.routes.store import ROUTES, StoreLeasePath, StoreRoute
from api.store_watch import MAX_WATCH_SECONDS, watch_until_gone
from elasticd.errors import ElasticdError
from elasticd.store.base import Entry, Store
from elasticd.store.codec import WireFormatError, decode_value, encode_entry, encode_event

#: The store a request may use, or the answer that refuses it (its 401 or 403).
Access = Callable[[Scope], "Store | Response"]
#: An operation: the store, its arguments and ``receive``; the status and the JSON answer.
Run = Callable[[Store, dict[str, Any], Receive], Awaitable[tuple[int, Any]]]
#: A hand reader: the query string, the path's lease and the body; raises _Unusual.
Reader = Callable[[str, str | None, bytes], dict[str, Any]]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_INT = re.compile(r"-?[0-9]{1,30}")
_UINT = re.compile(r"[0-9]{1,30}")
_FLOAT = re.compile(r"[0-9]{1,10}(\.[0-9]{1,10})?")


def _too_large(limit: int) -> Response:
    return problem(
        413,
        "Request too large",
        f"the request body is over {limit} bytes; store values are limited in size",
    )


# -- the operations --------------------------------------------------------------


def _entry_or_none(entry: Entry | None) -> dict[str, Any] | None:
    return None if entry is None else encode_entry(entry)


async def _get_key(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    return 200, {"entry": _entry_or_none(await store.get(a["key"]))}


async def _put_key(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    return 200, {"entry": encode_entry(await store.put(a["key"], a["value"], lease=a["lease"]))}


async def _delete_key(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    return 200, {"deleted": await store.delete(a["key"], a["expected_version"])}


async def _put_batch(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    entries = await store.put_batch(a["items"])  # each key once: the model checked (422)
    return 200, {"entries": [encode_entry(e) for e in entries]}


async def _compare_and_set(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    result = await store.compare_and_set(
        a["key"], a["value"], a["expected_version"], lease=a["lease"]
    )
    return 200, {"ok": result.ok, "entry": _entry_or_none(result.entry)}


async def _add(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    return 200, {"value": await store.add(a["key"], a["delta"])}


async def _list_prefix(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    listing = await store.list(a["prefix"])
    return 200, {
        "entries": [encode_entry(e) for e in listing.entries],
        "revision": listing.revision,
    }


async def _grant(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    return 201, {"lease": await store.grant(a["ttl"]), "ttl": a["ttl"]}


async def _keep_alive(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    await store.keep_alive(a["lease"])
    return 200, {"lease": a["lease"], "ttl": None}


async def _revoke(store: Store, a: dict[str, Any], _: Receive) -> tuple[int, Any]:
    await store.revoke(a["lease"])
    return 204, None


async def _watch(store: Store, a: dict[str, Any], receive: Receive) -> tuple[int, Any]:
    events = await watch_until_gone(store, a["key"], a["after"], a["timeout"], a["prefix"], receive)
    return 200, {"events": [encode_event(e) for e in events]}


_RUN: dict[str, Run] = {
    "get_key": _get_key,
    "put_key": _put_key,
    "delete_key": _delete_key,
    "put_batch": _put_batch,
    "compare_and_set": _compare_and_set,
    "add": _add,
    "list_prefix": _list_prefix,
    "grant": _grant,
    "keep_alive": _keep_alive,
    "revoke": _revoke,
    "watch": _watch,
}


# -- reading a plainly well-formed request by hand ---------------------------------


class _Unusual(Exception):
    """Not plainly well-formed: the declared models read it."""


def _query(text: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters: each required one once, optional ones at most once, no other."""
    pairs = parse_qsl(text, keep_blank_values=True)
    params = dict(pairs)
    if len(params) != len(pairs) or not all(name in params for name in required):
        raise _Unusual
    if any(name not in required and name not in optional for name in params):
        raise _Unusual
    return params


def _nonempty(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Unusual
    try:
        value.encode("utf-8")  # a lone surrogate: the model refuses it (its own 422)
    except UnicodeEncodeError:
        raise _Unusual from None
    return value


def _int(text: str, pattern: re.Pattern[str] = _INT) -> int:
    if pattern.fullmatch(text) is None:
        raise _Unusual
    return int(text)


def _json_int_or_none(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _Unusual


def _value(value: Any) -> bytes:
    try:
        return decode_value(value)
    except WireFormatError:
        raise _Unusual from None


def _object(body: bytes, required: frozenset[str], allowed: frozenset[str]) -> dict[str, Any]:
    """The body as a JSON object with every required field and only allowed ones."""
    try:
        data = json.loads(body)
    except ValueError:
        raise _Unusual from None
    if not isinstance(data, dict) or not required <= data.keys() or not data.keys() <= allowed:
        raise _Unusual
    return data


_PUT_REQUIRED = frozenset({"key", "value"})
_PUT_ALLOWED = frozenset({"key", "value", "lease"})
_CAS_REQUIRED = frozenset({"key", "value", "expected_version"})
_CAS_ALLOWED = frozenset({"key", "value", "expected_version", "lease"})
_NOTHING: frozenset[str] = frozenset()


def _read_get_key(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    return {"key": _nonempty(_query(query, ("key",), ())["key"])}


def _read_put_key(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    data = _object(body, _PUT_REQUIRED, _PUT_ALLOWED)
    return {
        "key": _nonempty(data["key"]),
        "value": _value(data["value"]),
        "lease": _json_int_or_none(data.get("lease")),
    }


def _read_delete_key(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    params = _query(query, ("key",), ("expected_version",))
    version = params.get("expected_version")
    return {
        "key": _nonempty(params["key"]),
        "expected_version": None if version is None else _int(version),
    }


def _read_compare_and_set(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    data = _object(body, _CAS_REQUIRED, _CAS_ALLOWED)
    return {
        "key": _nonempty(data["key"]),
        "value": _value(data["value"]),
        "expected_version": _json_int_or_none(data["expected_version"]),
        "lease": _json_int_or_none(data.get("lease")),
    }


def _read_list_prefix(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    return {"prefix": _query(query, (), ("prefix",)).get("prefix", "")}


def _read_keep_alive(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    if lease is None or query:
        raise _Unusual
    _object(body, _NOTHING, _NOTHING)
    return {"lease": _int(lease, _UINT)}


def _read_watch(query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    params = _query(query, ("key", "after"), ("timeout", "prefix"))
    timeout = 30.0
    if "timeout" in params:
        if _FLOAT.fullmatch(params["timeout"]) is None:
            raise _Unusual
        timeout = float(params["timeout"])
        if not 0 <= timeout <= MAX_WATCH_SECONDS:
            raise _Unusual
    prefix = params.get("prefix", "false")
    if prefix not in ("true", "false"):
        raise _Unusual
    return {
        "key": params["key"],
        "after": _int(params["after"]),
        "timeout": timeout,
        "prefix": prefix == "true",
    }


#: The hot operations of a rendezvous; the others are read by their models only.
_READ_BY_HAND: dict[str, Reader] = {
    "get_key": _read_get_key,
    "put_key": _read_put_key,
    "delete_key": _read_delete_key,
    "compare_and_set": _read_compare_and_set,
    "list_prefix": _read_list_prefix,
    "keep_alive": _read_keep_alive,
    "watch": _read_watch,
}


# -- reading any request by the declared models --------------------------------------


class _Invalid(Exception):
    """The request's parameters or body are invalid: the answer to send."""

    def __init__(self, answer: Response) -> None:
        self.answer = answer


def _located(exc: ValidationError, where: str) -> list[dict[str, Any]]:
    return [{**err, "loc": (where, *err["loc"])} for err in exc.errors()]


def _model_json(body: bytes) -> Any:
    """The body's JSON as FastAPI read it: absent is ``...``; 422 or 400 when unreadable."""
    if not body:
        return ...
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        error = {"loc": ("body", exc.pos), "msg": "JSON decode error"}
        raise _Invalid(validation_problem([error])) from None
    except ValueError:  # not UTF-8
        raise _Invalid(problem(400, "HTTP error", "There was an error parsing the body")) from None


def read_by_models(route: StoreRoute, query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    """The operation's arguments as the declared models read them (``_Invalid`` for a 422)."""
    data = _model_json(body) if route.body is not None else None
    errors: list[dict[str, Any]] = []
    args: dict[str, Any] = {}
    if route.lease_in_path:
        try:
            args["lease"] = StoreLeasePath.model_validate({"lease": lease}).lease
        except ValidationError as exc:
            errors += _located(exc, "path")
    if route.query is not None:
        given = dict(parse_qsl(query, keep_blank_values=True))  # the last of a repeated one
        named = {name: given[name] for name in route.query.model_fields if name in given}
        try:
            args.update(route.query.model_validate(named).model_dump())
        except ValidationError as exc:
            errors += _located(exc, "query")
    if route.body is not None:
        if data is ...:
            errors.append({"loc": ("body",), "msg": "Field required"})
        else:
            try:
                args.update(_arguments(route.body.model_validate(data, from_attributes=True)))
            except ValidationError as exc:
                errors += _located(exc, "body")
    if errors:
        raise _Invalid(validation_problem(errors))
    return args


def _arguments(model: BaseModel) -> dict[str, Any]:
    """A body model's fields as the operation takes them: values decoded from base64."""
    fields = model.model_dump()
    if "value" in fields:
        fields["value"] = decode_value(fields["value"])
    if "items" in fields:
        fields["items"] = [(item["key"], decode_value(item["value"])) for item in fields["items"]]
    return fields


def read(route: StoreRoute, query: str, lease: str | None, body: bytes) -> dict[str, Any]:
    """The operation's arguments: by hand when plainly well-formed, else by the models."""
    reader = _READ_BY_HAND.get(route.name)
    if reader is not None:
        try:
            return reader(query, lease, body)
        except _Unusual:
            pass
    return read_by_models(route, query, lease, body)


# -- matching a path ----------------------------------------------------------------------

_EXACT: dict[tuple[str, str], StoreRoute] = {}
_ALLOW: dict[str, str] = {}  # a fixed path: the method of its first route (405's Allow)
_PATTERNS: list[tuple[re.Pattern[str], StoreRoute]] = []  # the paths with a lease in them
for _route in ROUTES:
    _full = "/store" + _route.path
    if "{" in _full:
        _PATTERNS.append((re.compile(_full.replace("{lease}", "(?P<lease>[^/]+)")), _route))
    else:
        _EXACT.setdefault((_route.method, _full), _route)
        _ALLOW.setdefault(_full, _route.method)
assert set(_RUN) == {route.name for route in ROUTES}, "every declared route has its operation"


def match(method: str, path: str) -> tuple[StoreRoute, str | None] | str | None:
    """The route and the path's lease; the method to allow (405); None for no such path."""
    route = _EXACT.get((method, path))
    if route is not None:
        return route, None
    if path in _ALLOW:
        return _ALLOW[path]  # as a router answers: the first route of the path
    allowed = None
    for pattern, candidate in _PATTERNS:
        found = pattern.fullmatch(path)
        if found is None:
            continue
        if candidate.method == method:
            return candidate, found.group("lease")
        if allowed is None:
            allowed = candidate.method
    return allowed


# -- the handler ------------------------------------------------------------------------------


class StoreHTTP:
    """ASGI middleware: answer every ``/store`` operation (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, access: Access, body_limit: int) -> None:
        self.app = app
        self._access = access
        self._body_limit = body_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/store/"):
            await self.app(scope, receive, send)
            return
        found = match(scope["method"], scope["path"])
        if found is None:
            await self.app(scope, receive, send)
            return
        if isinstance(found, str):
            refusal = problem(
                405, "Method not allowed", "Method Not Allowed", headers={"Allow": found}
            )
            await refusal(scope, receive, send)
            return
        route, lease = found
        if route.body is not None and self._declared_too_large(scope):
            await _too_large(self._body_limit)(scope, receive, send)
            return
        store = self._access(scope)
        if isinstance(store, Response):
            await store(scope, receive, send)
            return
        body = b""
        if route.body is not None:
            read_body = await self._body(receive)
            if read_body is None:
                await _too_large(self._body_limit)(scope, receive, send)
                return
            body, complete = read_body
            if not complete:
                return  # the client went away before sending its body: nobody to answer
        query = scope.get("query_string", b"").decode("latin-1")
        try:
            status, answer = await _RUN[route.name](store, read(route, query, lease, body), receive)
        except _Invalid as exc:
            await exc.answer(scope, receive, send)
            return
        except ElasticdError as exc:
            await error_problem(exc)(scope, receive, send)
            return
        if answer is None:
            await Response(status_code=status)(scope, receive, send)
            return
        await _send_json(send, status, answer)

    def _declared_too_large(self, scope: Scope) -> bool:
        length = first_header(scope, b"content-length")
        # int() refuses strings of over 4,300 digits: the length says too large all the same.
        return (
            length is not None
            and length.isdigit()
            and (len(length) > 20 or int(length) > self._body_limit)
        )

    async def _body(self, receive: Receive) -> tuple[bytes, bool] | None:
        """The body (and False if the client left first); None past the limit."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), False
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self._body_limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True


async def _send_json(send: Send, status: int, data: Any) -> None:
    # As starlette's JSONResponse renders.
    payload = json.dumps(
        data, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")
    headers = [(b"content-length", str(len(payload)).encode()), *_JSON_HEADERS]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
