"""The one client of a store served over HTTP (``/store/...``, see :mod:`api.routes.store`).

Every process that reaches a store through a daemon's (or a store server's)
``/store`` API uses :class:`HttpStore`: the daemon (``store_url = http://...``),
``torchrun --rdzv-backend=elasticd``'s rendezvous, and, through the thin
synchronous facade :class:`elasticd.store.blocking.BlockingStore` (which runs
it on a private event loop thread), the workers' torch store
(:mod:`elasticd.worker.store`). Requests are built and answers read by
:mod:`elasticd.store.codec`; this module sends them, maps what comes back to
the store's errors and applies the caller's :class:`Retry`. Plain ``http://``
goes over the lean keep-alive client of :mod:`elasticd.store.wire`;
``https://`` and injected transports (tests pass ``httpx.ASGITransport(app)``
and need no socket) over an ``httpx.AsyncClient``, imported only then, so that
a worker importing the client does not pay for httpx.

This module is the IO boundary for the HTTP store, so every failure is
translated here, once:

* any transport error (refused, reset, DNS, timeout) becomes
  ``StoreUnavailable`` naming the URL: ``store at http://10.0.0.5:7070 is
  unreachable: connection refused``;
* a 401/403 becomes ``StoreUnavailable`` saying the token was refused (the
  daemon logs it and keeps retrying, so fixing the token file heals it);
* problem+json statuses map back to the exception they came from (404 "Lease
  not found" → ``LeaseNotFound``, 410 → ``StoreCompacted`` with its revision,
  413 → ``ValueTooLarge``, 422 "Invalid store key" → ``InvalidKey``, 503 →
  ``StoreUnavailable``); any other 404 means the URL is not a store.

**What a caller does when the store does not answer** is its own choice, made
explicit as the client's :class:`Retry`:

* :data:`FAIL_FAST` (the daemon's, and the default): a transport error, a
  timeout or a 503 raises ``StoreUnavailable`` at once, and a watch whose
  history was compacted raises ``StoreCompacted``. The daemon's loops above
  the store decide what an outage means (the agent's fence and outage wait,
  the rendezvous' deadlines, a watcher's re-list).
* :data:`RIDE_OUT` (the workers': a torch store must survive a daemon restart
  as torch's TCPStore client survives a slow server): those failures are sent
  again after a pause (0.05 s, doubling to 1 s) until the operation's
  deadline, ``Retry.patience`` seconds after it began (for a watch, its own
  timeout, at least the request timeout); and a compacted watch returns
  ``[]``, as at its timeout, because these callers re-read anyway. A refused
  token, a bad request or a wrong answer is never retried.

Keys and values are checked locally first, so a bad key never costs a round
trip. ``watch`` is a long-poll whose HTTP timeout is the watch timeout plus the
client's timeout; watches longer than the server allows are split into
several polls.
"""

from __future__ import annotations

import asyncio
import builtins
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import urlsplit

from elasticd.errors import (
    ConfigError,
    InvalidKey,
    LeaseNotFound,
    ListingTooLarge,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
    ValueTooLarge,
)
from elasticd.store.base import (
    DEFAULT_MAX_LIST_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    CasResult,
    Entry,
    Listing,
    Store,
    WatchEvent,
    check_batch,
    check_listing_size,
)
from elasticd.store.codec import (
    StoreCall,
    WireFormatError,
    add_call,
    batch_call,
    cas_call,
    delete_call,
    get_call,
    grant_call,
    keep_alive_call,
    list_call,
    put_call,
    revoke_call,
    watch_call,
)
from elasticd.store.memory import check_value, validate_key
from elasticd.store.shared import Gate, SharedWatches
from elasticd.store.wire import WireClient, WireError, WireResponse

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")

__all__ = ["FAIL_FAST", "RIDE_OUT", "HttpStore", "Retry", "next_pause", "transport_reason"]

#: Longest single long-poll; a longer watch is split into several.
MAX_POLL_SECONDS = 300.0

#: Requests other than watches one client sends at once; more wait for a turn.
#: Each request in flight holds a connection, and a store server accepts a
#: bounded number (``api.protocol.MAX_CONNECTIONS``): a process running
#: thousands of agents must not open a connection for each of their requests.
MAX_IN_FLIGHT = 128


@dataclass(frozen=True)
class Retry:
    """What the client does when the store does not answer; see the module docstring.

    ``patience``: None, fail at once; else retry a transport error, a timeout
    or a 503 with pauses from ``first_pause`` doubling to ``max_pause`` until
    this many seconds after the operation began. ``empty_on_compacted``: a
    watch whose history is compacted returns ``[]`` instead of raising
    ``StoreCompacted``.
    """

    patience: float | None = None
    empty_on_compacted: bool = False
    first_pause: float = 0.05
    max_pause: float = 1.0


#: The daemon's choice: every failure raises at once; its own loops decide.
FAIL_FAST = Retry()

#: The workers' choice: ride out a daemon that is restarting (300 s, torch's store
#: timeout; callers pass their own with ``dataclasses.replace``).
RIDE_OUT = Retry(patience=300.0, empty_on_compacted=True)


def next_pause(retry: Retry, pause: float, now: float, deadline: float) -> float | None:
    """How long to wait before sending again, or None: give up (pure).

    ``pause`` is this attempt's backoff step; the wait never runs past ``deadline``.
    """
    if retry.patience is None or now >= deadline:
        return None
    return min(pause, deadline - now)


class _NoAnswer(StoreUnavailable):
    """The store did not answer (transport error, timeout) or answered 503: what
    :class:`Retry` may send again. Callers see a :class:`StoreUnavailable`."""


def transport_reason(exc: BaseException) -> str:
    """A short human reason for a transport error ("connection refused", "timed out")."""
    hx = sys.modules.get("httpx")  # only its own errors can be its timeouts
    if hx is not None and isinstance(exc, hx.TimeoutException):
        return "timed out"
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower()  # "connection refused", not asyncio's text
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror.lower()
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip()
    if text.startswith("[Errno"):
        text = text.split("]", 1)[-1].strip()
    return text.lower() if text else type(exc).__name__


def _import_httpx() -> Any:
    """httpx, imported on first use (only ``https://`` and injected transports need it)."""
    # httpcore runs ``import sniffio`` each time it sets up a lock or an event,
    # several times per request. When sniffio is not installed (newer anyio no
    # longer needs it), each of those failed imports searches all of sys.path:
    # that was half the client's CPU per request. Recording the module as absent
    # makes the failure instant; httpcore then assumes asyncio, which is right here.
    if importlib.util.find_spec("sniffio") is None:
        sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]
    import httpx

    return httpx


class HttpStore(Store):
    """A :class:`Store` at ``base_url`` (e.g. ``http://node1:7070``), over HTTP.

    ``timeout`` bounds every request but a watch, whose bound is its own
    timeout plus this one: the whole call, its wait for a turn among the
    requests in flight included. A daemon gives two thirds of its lease
    (:func:`elasticd.store.open_store`), so an API call that needs the store
    answers 503 within that when the store does not answer. ``retry`` is what
    a failure to answer does (:class:`Retry`; the default fails at once).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 10.0,
        retry: Retry = FAIL_FAST,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_value_bytes = max_value_bytes
        self.max_list_bytes = max_list_bytes
        self.retry = retry
        self._timeout = timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._closed = False
        self._gate = Gate(MAX_IN_FLIGHT)
        self._shared = SharedWatches(self._watch)
        self._wire: WireClient | None = None
        self._client: httpx.AsyncClient | None = None
        parsed = urlsplit(self.base_url)
        if transport is None and parsed.scheme == "http" and parsed.hostname and not parsed.path:
            self._wire = WireClient(parsed.hostname, parsed.port or 80, headers=self._headers)
            return
        hx = _import_httpx()
        try:
            self._client = hx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                transport=transport,
                timeout=timeout,
                # Watches hold a connection each for their whole long-poll.
                limits=hx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        except (hx.InvalidURL, ValueError) as exc:
            raise ConfigError(f"store URL {base_url!r} is not a valid URL: {exc}") from exc

    def __repr__(self) -> str:
        return f"HttpStore({self.base_url!r})"

    # -- the one request path ----------------------------------------------

    async def _do(self, call: StoreCall[T], *, patience: float | None = None, **options: Any) -> T:
        """Send ``call`` as :attr:`retry` says and read its answer.

        ``patience`` overrides the retry's (a watch is retried for as long as
        it would wait). A body of the wrong shape means the peer is not our store.
        """
        if self.retry.patience is None:
            data = await self._gated(call, **options)
        else:
            data = await self._ride_out(call, patience or self.retry.patience, options)
        try:
            return call.answer(data)
        except WireFormatError as exc:
            raise StoreUnavailable(f"store at {self.base_url} {exc}") from exc

    async def _ride_out(self, call: StoreCall[Any], patience: float, options: Any) -> Any:
        """``call`` sent again, after a backoff, while the store does not answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        pause = self.retry.first_pause
        while True:
            try:
                return await self._gated(call, **options)
            except _NoAnswer as exc:
                wait = next_pause(self.retry, pause, loop.time(), deadline)
                if wait is None:
                    raise StoreUnavailable(
                        f"store at {self.base_url} could not be reached within "
                        f"{patience:g}s ({exc})"
                    ) from exc
            await asyncio.sleep(wait)
            pause = min(pause * 2, self.retry.max_pause)

    async def _gated(
        self, call: StoreCall[Any], *, timeout: float | None = None, gated: bool = True
    ) -> Any:
        limit = self._timeout if timeout is None else timeout
        if not gated:
            return await self._send(call, limit)
        # One bound for the whole call, its wait for a turn included: when the store
        # stops answering (a half-open link, a frozen host), the calls in flight hold
        # every turn, and a caller behind them must not wait for them and then its own.
        try:
            async with asyncio.timeout(limit):
                if call.method == "GET":  # a read: identical ones waiting for a turn share it
                    slot = (call.path, tuple(sorted((call.params or {}).items())))
                    return await self._gate.read(slot, lambda: self._send(call, limit))
                return await self._gate.run(lambda: self._send(call, limit))
        except TimeoutError as exc:
            raise self._no_answer(call, limit) from exc

    def _no_answer(self, call: StoreCall[Any], limit: float) -> _NoAnswer:
        return _NoAnswer(
            f"store at {self.base_url} did not answer {call.method} {call.path} within {limit:g}s"
        )

    async def _send(self, call: StoreCall[Any], limit: float) -> Any:
        """One request, over the wire client or httpx; its answer's JSON."""
        if self._closed:
            raise StoreUnavailable(f"the client of the store at {self.base_url} is closed")
        response: httpx.Response | WireResponse
        if self._wire is not None:
            try:
                response = await self._wire.request(
                    call.method, call.path, params=call.params, body=call.body, timeout=limit
                )
            except TimeoutError as exc:
                raise self._no_answer(call, limit) from exc
            except WireError as exc:
                raise _NoAnswer(
                    f"store at {self.base_url} is unreachable: {str(exc).lower()}"
                ) from exc
        else:
            response = await self._send_httpx(call, limit)
        what = f"{call.method} {call.path}"
        if response.status_code >= 300:
            self._raise_for(response, what)
        if response.status_code == 204:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise StoreUnavailable(
                f"store at {self.base_url} answered {what} with something "
                "that is not JSON; is this the address of an elasticd store?"
            ) from exc

    async def _send_httpx(self, call: StoreCall[Any], limit: float) -> httpx.Response:
        assert self._client is not None
        hx = sys.modules["httpx"]  # imported when the client was made
        try:
            response: httpx.Response = await self._client.request(
                call.method, call.path, params=call.params, json=call.body, timeout=limit
            )
        except (TimeoutError, hx.TimeoutException) as exc:
            raise self._no_answer(call, limit) from exc
        except hx.RequestError as exc:
            raise _NoAnswer(
                f"store at {self.base_url} is unreachable: {transport_reason(exc)}"
            ) from exc
        return response

    def _raise_for(self, response: httpx.Response | WireResponse, what: str) -> NoReturn:
        status = response.status_code
        body: dict[str, Any] = {}
        try:
            parsed = response.json()
            if isinstance(parsed, dict):
                body = parsed
        except ValueError:
            pass
        title = str(body.get("title", ""))
        detail = str(body.get("detail") or response.text[:200] or response.reason_phrase)
        where = f"store at {self.base_url}"
        if status in (401, 403):
            raise StoreUnavailable(
                f"{where} refused our credentials ({status}): {detail}; "
                "check that this daemon uses the cluster's token"
            )
        if status == 404 and title == "Lease not found":
            raise LeaseNotFound(detail)
        if status == 404:
            raise StoreUnavailable(
                f"{where} has no store API ({what} → 404); is the store URL right?"
            )
        if status == 410:
            raise StoreCompacted(detail, int(body.get("revision", 0)))
        if status == 413 and title == "Listing too large":
            raise ListingTooLarge(detail)
        if status == 413:
            raise ValueTooLarge(detail)
        if status == 422 and title == "Invalid store key":
            raise InvalidKey(detail)
        if status in (400, 422):
            raise StoreError(f"{where} rejected {what}: {detail}")
        if status == 503:
            raise _NoAnswer(f"{where} answered {what} with {status}: {detail}")
        raise StoreUnavailable(f"{where} answered {what} with {status}: {detail}")

    # -- Store -------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        validate_key(key)
        return await self._do(get_call(key))

    async def compare_and_set(
        self,
        key: str,
        value: bytes,
        expected_version: int | None,
        *,
        lease: int | None = None,
    ) -> CasResult:
        validate_key(key)
        value = check_value(value, self.max_value_bytes)
        return await self._do(cas_call(key, value, expected_version, lease))

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        validate_key(key)
        return await self._do(put_call(key, check_value(value, self.max_value_bytes), lease))

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        check_batch(items)
        checked = []
        for key, value in items:
            validate_key(key)
            checked.append((key, check_value(value, self.max_value_bytes)))
        if not checked:
            return []
        return await self._do(batch_call(checked))

    async def add(self, key: str, delta: int = 1) -> int:
        validate_key(key)
        return await self._do(add_call(key, delta))

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        validate_key(key)
        return await self._do(delete_call(key, expected_version))

    async def list(self, prefix: str) -> Listing:
        validate_key(prefix, prefix=True)
        result = await self._do(list_call(prefix))
        size = sum(len(e.key) + len(e.value) for e in result.entries)
        check_listing_size(prefix, size, len(result.entries), self.max_list_bytes)
        return result

    async def grant(self, ttl: float) -> int:
        if not ttl > 0:
            raise ValueError(f"a lease TTL must be positive, not {ttl!r}")
        return await self._do(grant_call(ttl))

    async def keep_alive(self, lease: int) -> None:
        await self._do(keep_alive_call(lease))

    async def revoke(self, lease: int) -> None:
        await self._do(revoke_call(lease))

    async def watch(
        self,
        key: str,
        after_version: int,
        timeout: float,
        *,
        prefix: bool = False,
    ) -> builtins.list[WatchEvent]:
        validate_key(key, prefix=prefix)
        try:
            return await self._shared.watch(key, after_version, timeout, prefix)
        except StoreCompacted:
            if self.retry.empty_on_compacted:
                return []  # as at the timeout: this caller reads again anyway
            raise

    async def _watch(
        self, key: str, after_version: int, timeout: float, prefix: bool
    ) -> builtins.list[WatchEvent]:
        """One watch request (long-polls of at most MAX_POLL_SECONDS), not shared."""
        remaining = max(timeout, 0.0)
        while True:
            poll = min(remaining, MAX_POLL_SECONDS)
            events = await self._do(
                watch_call(key, after_version, poll, prefix),
                timeout=poll + self._timeout,
                gated=False,  # a long-poll holds its connection: it must not hold a turn
                patience=max(poll, self._timeout),  # retried as long as it would wait
            )
            remaining -= poll
            if events or remaining <= 0:
                return events

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
        if self._wire is not None:
            await self._wire.aclose()
