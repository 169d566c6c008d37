"""A lean path for the store's hot routes, in front of the FastAPI ones.

Why: a rendezvous of N nodes sends the store server a few requests per node
(announce, read its seat, keep its lease alive, watch), and FastAPI's
per-request machinery (routing over every route, the dependency solver,
pydantic models for the body and the answer, the exception middleware) cost
about four times what the store spends answering (cProfile at 10,000 nodes:
12 of 24 s of the server's time in FastAPI's routing and dependencies). This
ASGI middleware answers the hot routes itself:

=======  =================================  ===============================
GET      ``/store/kv?key=K``                ``{"entry": Entry | null}``
PUT      ``/store/kv``                      ``{"entry": Entry}``
DELETE   ``/store/kv?key=K[&expected_version=V]``  ``{"deleted": bool}``
POST     ``/store/cas``                     ``{"ok": bool, "entry": ...}``
GET      ``/store/list?prefix=P``           ``{"entries": [...], "revision"}``
POST     ``/store/leases/{id}/keepalive``   ``{"lease": id, "ttl": null}``
GET      ``/store/watch?key=&after=[&timeout=][&prefix=]``  ``{"events": [...]}``
=======  =================================  ===============================

and only when the request is plainly well-formed: the bearer token matches
(constant-time, as :func:`api.auth.bearer_auth`), each query parameter is
given once and nothing else is, numbers are plain decimal, booleans ``true``
or ``false``, and a body has a ``Content-Length`` within the route's limit
and is a JSON object of exactly the model's fields with their exact JSON
types (strings, integers that are not booleans, null), its values valid
base64. Anything else, a missing or wrong token included, goes to the FastAPI
routes unchanged (with the body it already read handed on), which answer it
as they always did: 401, 413, 422 with the field names, or a coercion pydantic
accepts. So the API, its errors and ``openapi.json`` are the FastAPI app's;
this path only answers faster what the routes would answer the same way
(``tests/store/test_fast_path.py`` compares both, byte for byte).

It sits inside :class:`api.guard.RequestGuard` (Host, Origin, Content-Type
are checked before it) and answers store errors through the one table of
:mod:`api.problems`.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import error_problem
from api.store_watch import MAX_WATCH_SECONDS, watch_until_gone
from elasticd.errors import ElasticdError
from elasticd.store.base import Entry, Store
from elasticd.store.codec import WireFormatError, decode_value, encode_entry, encode_event

_INT = re.compile(r"-?[0-9]{1,30}")
_UINT = re.compile(r"[0-9]{1,30}")
_FLOAT = re.compile(r"[0-9]{1,10}(\.[0-9]{1,10})?")
_KEEPALIVE = re.compile(r"/store/leases/([0-9]{1,30})/keepalive")

_JSON_HEADERS = [(b"content-type", b"application/json")]


class _Fallback(Exception):
    """Not plainly well-formed: let the FastAPI route answer it."""


def _dumps(data: Any) -> bytes:
    # As starlette's JSONResponse renders (what the FastAPI routes send).
    return json.dumps(
        data, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def _entry_or_none(entry: Entry | None) -> dict[str, Any] | None:
    return None if entry is None else encode_entry(entry)


def _query(scope: Scope, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters: each required one once, optional ones at most once, no other."""
    text = scope.get("query_string", b"").decode("latin-1")
    pairs = parse_qsl(text, keep_blank_values=True)
    params = dict(pairs)
    if len(params) != len(pairs) or not all(name in params for name in required):
        raise _Fallback
    if any(name not in required and name not in optional for name in params):
        raise _Fallback
    return params


def _nonempty(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Fallback
    try:
        value.encode("utf-8")  # a lone surrogate: the model refuses it (its own 422)
    except UnicodeEncodeError:
        raise _Fallback from None
    return value


def _int(text: str, pattern: re.Pattern[str] = _INT) -> int:
    if pattern.fullmatch(text) is None:
        raise _Fallback
    return int(text)


def _json_int_or_none(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _Fallback


def _value(value: Any) -> bytes:
    try:
        return decode_value(value)
    except WireFormatError:
        raise _Fallback from None


def _object(body: bytes, required: frozenset[str], allowed: frozenset[str]) -> dict[str, Any]:
    """The body as a JSON object with every required field and only allowed ones."""
    try:
        data = json.loads(body)
    except ValueError:
        raise _Fallback from None
    if not isinstance(data, dict) or not required <= data.keys() or not data.keys() <= allowed:
        raise _Fallback
    return data


_PUT_REQUIRED = frozenset({"key", "value"})
_PUT_ALLOWED = frozenset({"key", "value", "lease"})
_CAS_REQUIRED = frozenset({"key", "value", "expected_version"})
_CAS_ALLOWED = frozenset({"key", "value", "expected_version", "lease"})
_NOTHING: frozenset[str] = frozenset()


Handler = Callable[[Store, Scope, bytes, Receive], Awaitable[Any]]


class StoreFastPath:
    """ASGI middleware: answer the hot ``/store`` routes directly (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        get_store: Callable[[], Store],
        token: str | None,
        body_limit: int,
        authorised: Callable[[Scope], bool] | None = None,
    ) -> None:
        self.app = app
        self._get_store = get_store
        self._expected = token.encode() if token else None
        self._check = authorised
        self._body_limit = body_limit
        self._routes: dict[tuple[str, str], tuple[Handler, bool]] = {
            ("GET", "/store/kv"): (self._get, False),
            ("PUT", "/store/kv"): (self._put, True),
            ("DELETE", "/store/kv"): (self._delete, False),
            ("POST", "/store/cas"): (self._cas, True),
            ("GET", "/store/list"): (self._list, False),
            ("GET", "/store/watch"): (self._watch, False),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        route = self._routes.get((method, path))
        if route is None and method == "POST" and _KEEPALIVE.fullmatch(path):
            route = (self._keepalive, True)  # matched before any body is read
        if route is None or not self._authorised(scope):
            await self.app(scope, receive, send)
            return
        handler, with_body = route
        body = b""
        if with_body:
            read = await self._body(scope, receive)
            if read is None:  # no or an unusual length: the route's own checks answer
                await self.app(scope, receive, send)
                return
            body, complete = read
            if not complete:
                return  # the client went away before sending its body: nobody to answer
        try:
            answer = await handler(self._get_store(), scope, body, receive)
        except _Fallback:
            await self.app(scope, _replay(body, receive) if with_body else receive, send)
            return
        except ElasticdError as exc:
            await error_problem(exc)(scope, receive, send)
            return
        await _send_json(send, answer)

    def _authorised(self, scope: Scope) -> bool:
        if self._check is not None:
            return self._check(scope)
        if self._expected is None:
            return True
        given = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if given is not None:
                    return False  # two of them: the route decides
                given = value
        if given is None:
            return False
        scheme, _, secret = given.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret:
            return False
        return hmac.compare_digest(secret.strip().encode(), self._expected)

    async def _body(self, scope: Scope, receive: Receive) -> tuple[bytes, bool] | None:
        """The body (and False if the client left first); None to leave it to the route."""
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                if length is not None:
                    return None
                length = value
            elif name == b"transfer-encoding":
                return None
        # At most 20 digits: int() refuses strings of over 4,300 (a 500 otherwise).
        if length is None or not length.isdigit() or len(length) > 20:
            return None
        if int(length) > self._body_limit:
            return None
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), False
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), True

    # -- the routes ---------------------------------------------------------

    async def _get(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        key = _nonempty(_query(scope, ("key",), ())["key"])
        return {"entry": _entry_or_none(await store.get(key))}

    async def _put(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        data = _object(body, _PUT_REQUIRED, _PUT_ALLOWED)
        key, value = _nonempty(data["key"]), _value(data["value"])
        lease = _json_int_or_none(data.get("lease"))
        return {"entry": encode_entry(await store.put(key, value, lease=lease))}

    async def _delete(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        params = _query(scope, ("key",), ("expected_version",))
        key = _nonempty(params["key"])
        version = params.get("expected_version")
        expected = None if version is None else _int(version)
        return {"deleted": await store.delete(key, expected)}

    async def _cas(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        data = _object(body, _CAS_REQUIRED, _CAS_ALLOWED)
        key, value = _nonempty(data["key"]), _value(data["value"])
        expected = _json_int_or_none(data["expected_version"])
        lease = _json_int_or_none(data.get("lease"))
        result = await store.compare_and_set(key, value, expected, lease=lease)
        return {"ok": result.ok, "entry": _entry_or_none(result.entry)}

    async def _list(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        prefix = _query(scope, (), ("prefix",)).get("prefix", "")
        listing = await store.list(prefix)
        return {
            "entries": [encode_entry(e) for e in listing.entries],
            "revision": listing.revision,
        }

    async def _keepalive(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        found = _KEEPALIVE.fullmatch(scope["path"])
        if found is None or scope.get("query_string"):
            raise _Fallback
        _object(body, _NOTHING, _NOTHING)
        lease = int(found.group(1))
        await store.keep_alive(lease)
        return {"lease": lease, "ttl": None}

    async def _watch(self, store: Store, scope: Scope, body: bytes, receive: Receive) -> Any:
        params = _query(scope, ("key", "after"), ("timeout", "prefix"))
        key, after = params["key"], _int(params["after"])
        timeout = 30.0
        if "timeout" in params:
            if _FLOAT.fullmatch(params["timeout"]) is None:
                raise _Fallback
            timeout = float(params["timeout"])
            if not 0 <= timeout <= MAX_WATCH_SECONDS:
                raise _Fallback
        prefix = params.get("prefix", "false")
        if prefix not in ("true", "false"):
            raise _Fallback
        events = await watch_until_gone(store, key, after, timeout, prefix == "true", receive)
        return {"events": [encode_event(e) for e in events]}


async def _send_json(send: Send, data: Any) -> None:
    payload = _dumps(data)
    headers = [(b"content-length", str(len(payload)).encode()), *_JSON_HEADERS]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the route after this path read the body: the body first, then the rest."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
