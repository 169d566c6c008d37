"""The store server's fast path (api/store_fast.py) answers as the FastAPI routes do.

Two apps over two stores given the same history: one with the fast path, one
without. Every request, well-formed or not, must get the same status, headers
and body from both; the well-formed ones of the hot routes must not reach the
routes at all, the others must.
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from api.store_fast import StoreFastPath
from api.store_server import create_store_app
from elasticd.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(20)

TOKEN = "fast-path-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


#: (method, path, query, headers, body bytes or None); answered by both apps in turn.
CASES: list[tuple[str, str, dict[str, Any] | None, dict[str, str], bytes | None]] = [
    ("GET", "/store/kv", {"key": "a"}, AUTH, None),  # absent
    ("PUT", "/store/kv", None, JSON, json.dumps({"key": "a", "value": b64(b"1")}).encode()),
    ("GET", "/store/kv", {"key": "a"}, AUTH, None),
    ("PUT", "/store/kv", None, JSON, b'{"key":"b","value":"' + b64(b"x").encode() + b'"}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"c","value":"eA==","lease":null}'),
    ("POST", "/store/cas", None, JSON, b'{"key":"a","value":"Mg==","expected_version":2}'),
    ("POST", "/store/cas", None, JSON, b'{"key":"a","value":"Mg==","expected_version":2}'),  # lost
    ("POST", "/store/cas", None, JSON, b'{"key":"n","value":"Mg==","expected_version":null}'),
    ("GET", "/store/list", {"prefix": ""}, AUTH, None),
    ("GET", "/store/list", None, AUTH, None),
    ("GET", "/store/list", {"prefix": "a"}, AUTH, None),
    ("GET", "/store/watch", {"key": "a", "after": 0, "timeout": 0}, AUTH, None),
    ("GET", "/store/watch", {"key": "", "after": 0, "prefix": "true", "timeout": 0.5}, AUTH, None),
    ("GET", "/store/watch", {"key": "zz", "after": 1, "timeout": "0.05"}, AUTH, None),
    ("DELETE", "/store/kv", {"key": "b", "expected_version": 1}, AUTH, None),  # wrong version
    ("DELETE", "/store/kv", {"key": "b"}, AUTH, None),
    ("POST", "/store/leases/99/keepalive", None, JSON, b"{}"),  # 404 Lease not found
    # Errors the store raises: the same problem from the one table.
    ("GET", "/store/kv", {"key": "bad\x00key"}, AUTH, None),
    ("PUT", "/store/kv", None, JSON, b'{"key":"a\\u0000","value":"eA=="}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"l","value":"eA==","lease":12345}'),
    # Not plainly well-formed: the routes answer (401, 413, 422, coercions).
    ("GET", "/store/kv", {"key": "a"}, {}, None),
    ("GET", "/store/kv", {"key": "a"}, {"Authorization": "Bearer wrong"}, None),
    ("GET", "/store/kv", {"key": "a"}, {"Authorization": f"Basic {TOKEN}"}, None),
    ("PUT", "/store/kv", None, {"Content-Type": "application/json"}, b'{"key":"a","value":""}'),
    ("GET", "/store/kv", {"key": ""}, AUTH, None),
    ("GET", "/store/kv", None, AUTH, None),
    ("GET", "/store/kv", [("key", "a"), ("key", "b")], AUTH, None),  # type: ignore[list-item]
    ("GET", "/store/kv", {"key": "a", "other": "1"}, AUTH, None),
    ("PUT", "/store/kv", None, JSON, b'{"key":"a","value":"not base64!"}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"a","value":"eA==","extra":1}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"","value":"eA=="}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":5,"value":"eA=="}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"\\ud800x","value":"eA=="}'),  # lone surrogate
    ("PUT", "/store/kv", None, {**JSON, "Content-Length": "0" * 5000 + "26"}, b'{"key":"a"}'),
    ("POST", "/store/leases/5", None, JSON, b"{}"),  # not the keepalive: the router answers
    ("PUT", "/store/kv", None, JSON, b'{"key":"a","value":"eA==","lease":"7"}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"a","value":"eA==","lease":true}'),
    ("PUT", "/store/kv", None, JSON, b'{"key":"a"}'),
    ("PUT", "/store/kv", None, JSON, b"[1,2]"),
    ("PUT", "/store/kv", None, JSON, b"{not json"),
    ("POST", "/store/cas", None, JSON, b'{"key":"a","value":"Mg=="}'),  # expected_version missing
    ("POST", "/store/cas", None, JSON, b'{"key":"a","value":"Mg==","expected_version":3.0}'),
    ("POST", "/store/cas", None, JSON, b'{"key":"a","value":"Mg==","expected_version":"3"}'),
    ("DELETE", "/store/kv", {"key": "a", "expected_version": "x"}, AUTH, None),
    ("DELETE", "/store/kv", {"key": "zz", "expected_version": "+4"}, AUTH, None),
    ("GET", "/store/watch", {"key": "a"}, AUTH, None),
    ("GET", "/store/watch", {"key": "a", "after": "1.5", "timeout": 0}, AUTH, None),
    ("GET", "/store/watch", {"key": "a", "after": 0, "timeout": 601}, AUTH, None),
    ("GET", "/store/watch", {"key": "a", "after": 0, "timeout": "-1"}, AUTH, None),
    ("GET", "/store/watch", {"key": "a", "after": 0, "timeout": 0, "prefix": "1"}, AUTH, None),
    ("GET", "/store/watch", {"key": "a", "after": 0, "timeout": 0, "prefix": "yes"}, AUTH, None),
    ("POST", "/store/leases/abc/keepalive", None, JSON, b"{}"),
    ("POST", "/store/leases/5/keepalive", None, JSON, b'{"x":1}'),
    ("POST", "/store/leases/5/keepalive", {"q": "1"}, JSON, b"{}"),
    ("POST", "/store/leases/5/other", None, JSON, b"{}"),
    ("HEAD", "/store/kv", {"key": "a"}, AUTH, None),
    ("PATCH", "/store/kv", None, JSON, b"{}"),
    ("PUT", "/store/kv", None, JSON, b'{"key":"big","value":"' + b"A" * 2_000_000 + b'"}'),
    ("POST", "/store/add", None, JSON, b'{"key":"counter","delta":2}'),  # not a fast route
]

#: Indexes of CASES that the fast path answers itself (the rest go to the routes).
FAST = set(range(20))


def _daemon_app(store: MemoryStore) -> Any:
    """The daemon's own app (which serves the same /store routes), over ``store``."""
    from api.app import create_app
    from elasticd.identity import Authenticator

    daemon = SimpleNamespace(
        token=TOKEN,
        store=store,
        config=SimpleNamespace(),
        authenticator=Authenticator(admin_token=TOKEN),
    )
    return create_app(daemon)  # type: ignore[arg-type]


async def _answers(
    fast_path: bool, daemon: bool = False
) -> tuple[list[tuple[int, list[tuple[str, str]], bytes]], int]:
    store = MemoryStore()
    app = _daemon_app(store) if daemon else create_store_app(store, TOKEN, fast_path=fast_path)
    routed = 0
    inner = app.router

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        nonlocal routed
        routed += 1
        await inner(scope, receive, send)

    app.router = counting  # type: ignore[assignment]
    answers = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for method, path, query, headers, body in CASES:
            before = routed
            response = await client.request(
                method, path, params=query, headers=headers, content=body
            )
            headers_seen = sorted(
                (k, v) for k, v in response.headers.items() if k not in ("date", "server")
            )
            answers.append((response.status_code, headers_seen, response.content))
            if fast_path and not daemon:  # (the daemon answers 401s before any route)
                index = len(answers) - 1
                assert (routed == before) == (index in FAST), (index, CASES[index][:3])
    await store.close()
    return answers, routed


async def test_fast_path_answers_as_the_routes_do() -> None:
    fast, _ = await _answers(fast_path=True)
    slow, routed = await _answers(fast_path=False)
    assert routed == len(CASES)
    for case, a, b in zip(CASES, fast, slow, strict=True):
        assert a == b, case[:3]
    statuses = {status for status, _, _ in fast}
    assert {200, 401, 404, 405, 413, 422} <= statuses  # the cases reach every kind of answer


async def test_the_daemon_app_answers_as_the_store_routes_do() -> None:
    """The daemon serves /store too, with the fast path in front: the same answers (a request
    without a valid token is refused by the daemon's own authentication, api/auth.py, with its
    own words: 401 all the same)."""
    fast, _ = await _answers(fast_path=True, daemon=True)
    slow, _ = await _answers(fast_path=False)
    for case, a, b in zip(CASES, fast, slow, strict=True):
        if b[0] == 401:
            assert a[0] == 401, case[:3]
            continue
        assert a == b, case[:3]


async def test_a_client_that_leaves_mid_watch_ends_it() -> None:
    """A long-poll whose client went away is dropped (the store keeps no watcher)."""
    store = MemoryStore()
    calls: list[str] = []

    async def routes(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])

    fast = StoreFastPath(routes, get_store=lambda: store, token=None, body_limit=1 << 20)
    gone = asyncio.Event()
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/store/watch",
        "query_string": b"key=k&after=0&timeout=60",
        "headers": [],
    }
    serving = asyncio.create_task(fast(scope, receive, send))
    await asyncio.sleep(0.05)
    assert not serving.done()
    gone.set()
    await asyncio.wait_for(serving, 2)
    assert calls == []
    assert json.loads(sent[-1]["body"]) == {"events": []}
    await store.close()


async def test_keepalive_of_a_live_lease_answers_as_the_route_does() -> None:
    answers = []
    for fast_path in (True, False):
        store = MemoryStore()
        lease = await store.grant(30)
        app = create_store_app(store, TOKEN, fast_path=fast_path)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.post(
                f"/store/leases/{lease}/keepalive", headers=JSON, content=b"{}"
            )
        body = response.content.replace(str(lease).encode(), b"LEASE")
        answers.append((response.status_code, response.headers["content-type"], body))
        await store.close()
    assert answers[0] == answers[1]
    assert answers[0][0] == 200


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_content_length_of_thousands_of_digits_is_too_large_not_a_crash(
    fast_path: bool,
) -> None:
    """int() refuses strings of over 4,300 digits: both paths answer 413, never a 500."""
    store = MemoryStore()
    app = create_store_app(store, TOKEN, fast_path=fast_path)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for headers in (JSON, {"Content-Type": "application/json"}):  # with a token, without
            response = await client.put(
                "/store/kv",
                headers={**headers, "Content-Length": "0" * 5000 + "11"},
                content=b'{"key":"a"}',
            )
            assert response.status_code == 413, response.text
    await store.close()
