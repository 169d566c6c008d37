"""The etcd backend: etcd v3 through its JSON gateway (grpc-gateway), over plain HTTP/1.1.

``store_url = "etcd://h1:2379,h2:2379"`` puts the cluster store in etcd, so
that it has no single point of failure. No etcd client library is needed:
the gateway speaks JSON over plain HTTP POSTs (``/v3/kv/range``,
``/v3/kv/txn``, ``/v3/kv/deleterange``, ``/v3/lease/...``, ``/v3/watch``).
etcd 3.4 serves the gateway at both ``/v3/`` and ``/v3beta/``, 3.5+ only at
``/v3/`` (the default here), 3.3 only at ``/v3beta/`` (pass
``api_prefix="/v3beta"``).

How the store contract maps onto etcd:

* ``version``/``created``/``revision`` are etcd's ``mod_revision``,
  ``create_revision`` and header ``revision``, unchanged.
* ``compare_and_set`` is one txn: compare ``mod_revision == expected`` (or
  ``create_revision == 0`` for create-if-absent), put on success (with
  ``prev_kv`` to learn ``created``), range on failure so a lost race returns
  the winner's entry in the same round trip.
* ``add`` is a CAS loop that starts from the failure branch's entry, with a
  short randomised back-off between lost rounds.
* ``watch`` opens a streamed ``/v3/watch`` with ``start_revision =
  after_version + 1`` and returns the first batch of events (or ``[]`` at the
  timeout, when it drops the stream). A watch cancelled for compaction raises
  ``StoreCompacted`` with ``revision = compact_revision - 1``: the lowest
  ``after_version`` still watchable, as for the other backends.
* Lease TTLs are whole seconds in etcd; a TTL is rounded up.
* etcd hands past events to a new watch from a loop that runs every 100 ms,
  so a watch from an old revision answers within ~100 ms, and a watch with
  timeout 0 waits :data:`MIN_WATCH_SECONDS` for them. A watch from the
  current revision wakes within milliseconds.

The gateway's quirks handled here: int64 fields are JSON strings; fields at
their default value are omitted (a failed txn has no ``succeeded``, a PUT event
has no ``type``, an empty value has no ``value``, an unknown lease's keep-alive
answer has no ``TTL``); keys and values are base64.

The HTTP client: ``http://`` and ``https://`` endpoints are reached with the
lean keep-alive client of :mod:`elasticd.store.wire`, one per endpoint; each
watch has a connection of its own, closed when the watch returns. httpx is
used only when a ``transport`` is injected (tests). Why: one process may have
a thousand requests and watches in flight against etcd (one per node of a
large rendezvous in the scale benchmark), and httpcore's pool does work in
proportion to its open connections on every request, which made the pool,
not etcd, the bottleneck.

Security (:class:`~elasticd.store.EtcdOptions`, see docs/store.md "Running
etcd securely"):

* TLS: ``https://`` endpoints are verified against ``ca_file`` (else the
  system's CAs) with the host name checked, and present ``cert_file`` /
  ``key_file`` as a client certificate when etcd runs with
  ``--client-cert-auth``. Never unverified.
* Users: with ``username`` and ``password`` the client authenticates at
  ``/v3/auth/authenticate`` before its first request and sends the token in
  the ``Authorization`` header of every request and watch. etcd's tokens
  expire (simple tokens after ``--auth-token-ttl`` idle seconds, JWTs at
  their expiry, all at an etcd restart): a request refused for its token
  (``invalid auth token``, ``revision of auth store is old``, or ``user name
  is empty`` once auth was enabled after the client started) is sent again
  once with a fresh token. That is safe for writes too: etcd checks the
  token before applying, so a refused write was not applied. Concurrent
  refusals share one re-authentication. A watch stream outlives its token
  (etcd checks it when the watch is created), and a new watch refused for
  its token is opened again. Other refusals (no credentials, a wrong
  password, permission denied) raise :class:`StoreAuthError` saying which
  setting to change. The password is never logged nor put in a URL.
* ``prefix``: every key is stored under it (and read back without it), so an
  etcd role limited to that prefix is all elasticd needs.

Fail-over: requests go to the endpoint that last answered. When it cannot be
connected to, the next one is tried. Reads also move on after a broken
response; writes do not, because their outcome is unknown: they raise
``StoreUnavailable`` saying so, and the caller re-reads. Every transport
error is translated here into ``StoreUnavailable`` naming the endpoints.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import logging
import math
import random
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from elasticd.errors import (
    ConfigError,
    LeaseNotFound,
    StoreAuthError,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
    ValueTooLarge,
)
from elasticd.store import EtcdOptions
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
from elasticd.store.http import MAX_IN_FLIGHT, transport_reason
from elasticd.store.memory import check_value, counter_total, parse_counter, validate_key
from elasticd.store.shared import Gate, SharedWatches
from elasticd.store.wire import WireClient, WireConnectError, WireError, WireResponse

log = logging.getLogger("elasticd.store.etcd")

T = TypeVar("T")

#: Shortest wait for a watch's first events once its stream is open: etcd sends
#: past events to a new watch from a loop that runs every 100 ms.
MIN_WATCH_SECONDS = 0.25

# gRPC status codes the gateway reports in {"code": N}.
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_RESOURCE_EXHAUSTED = 8
_OUT_OF_RANGE = 11


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _int(data: dict[str, Any], name: str) -> int:
    """An int64 field: a JSON string, or absent when 0."""
    return int(data.get(name, 0))


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's rule)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # empty prefix (or all 0xff): every key


#: etcd's "require leader" gRPC metadata, as the gateway takes it from HTTP headers:
#: a member that has lost its leader refuses the request at once (``no leader``)
#: instead of holding it until its own request timeout, and cancels a watch
#: stream a few election timeouts after it lost its leader (a plain watch on a
#: member cut off from quorum stays open and silent for ever).
REQUIRE_LEADER = {"Grpc-Metadata-Hasleader": "true"}
#: What a member says while the cluster elects a leader (retried, see ``_during_election``).
NO_LEADER = "no leader"
#: Longest a call without a deadline waits out an election.
ELECTION_WAIT = 3.0


def _auth_header(token: str | None) -> dict[str, str]:
    """The headers of every request: require a leader; etcd's gateway takes the bare token
    (no "Bearer") in ``Authorization``."""
    if token is None:
        return dict(REQUIRE_LEADER)
    return {**REQUIRE_LEADER, "Authorization": token}


def _reason(exc: BaseException) -> str:
    """A short reason for a transport error of either client ("connection refused")."""
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, WireError):
        return str(exc).lower()
    return transport_reason(exc)


class _TokenRefused(Exception):
    """etcd refused a request for its token (or the lack of one); not a :class:`StoreError`.

    Raised below :meth:`EtcdStore._authenticated`, which authenticates again
    and retries, or turns it into :class:`StoreAuthError`.
    """

    def __init__(self, message: str, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


#: What etcd says when a token expired, was revoked or predates an auth change,
#: and when a request came without one while auth is enabled.
_TOKEN_REFUSALS = ("invalid auth token", "revision of auth store is old", "user name is empty")


def tls_context(options: EtcdOptions) -> ssl.SSLContext:
    """The TLS settings of ``https://`` endpoints: verified, with the client certificate if any."""
    try:
        context = ssl.create_default_context(
            cafile=str(options.ca_file) if options.ca_file else None
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"store_ca_file {options.ca_file} cannot be used: {exc}") from None
    if options.cert_file is not None:
        try:
            context.load_cert_chain(options.cert_file, options.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"store_cert_file {options.cert_file} / store_key_file {options.key_file} "
                f"cannot be used: {exc}"
            ) from None
    return context


def _wire_client(endpoint: str, tls: ssl.SSLContext | None) -> tuple[WireClient, str] | None:
    """The lean client of an ``http(s)://`` endpoint and its base path; ``None`` otherwise."""
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
        return None  # oddities: httpx handles them
    if url.scheme == "http":
        return WireClient(url.hostname, url.port or 80), url.path
    return WireClient(url.hostname, url.port or 443, tls=tls), url.path


def _normalise(endpoint: str) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if not endpoint:
        raise ConfigError("an etcd endpoint is empty")
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    try:
        url = httpx.URL(endpoint)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ConfigError(f"etcd endpoint {endpoint!r} is not a valid URL: {exc}") from exc
    if url.userinfo:
        # Never echo it: it may hold a password.
        raise ConfigError(
            f"etcd endpoint {url.copy_with(username=None, password=None)} has credentials in it; "
            "put the user in store_username and the password in store_password_file"
        )
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"etcd endpoint {endpoint!r} must be host:port or http(s)://host:port")
    return endpoint


class EtcdStore(Store):
    """A :class:`Store` in an etcd v3 cluster, reached at ``endpoints`` (``host:port`` or URLs)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 10.0,
        deadline: float | None = None,
        api_prefix: str = "/v3",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
        options: EtcdOptions | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ConfigError("EtcdStore needs a list of one or more endpoints")
        self.endpoints = [_normalise(e) for e in endpoints]
        self.max_value_bytes = max_value_bytes
        self.max_list_bytes = max_list_bytes
        self.options = options or EtcdOptions()
        if (self.options.username is None) != (self.options.password is None):
            raise ConfigError("etcd authentication needs both a user name and a password")
        self._namespace = self.options.prefix.encode("utf-8")
        self._prefix = "/" + api_prefix.strip("/")
        self._timeout = timeout  # connecting, and one request to one member
        self._deadline = deadline  # one call, fail-over included (None: unbounded)
        self._current = 0
        https = any(e.startswith("https://") for e in self.endpoints)
        tls = tls_context(self.options) if https else None
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            verify=tls or True,
        )
        # Per endpoint: the lean client and the endpoint's path, or None to use httpx.
        self._wires = [None if transport else _wire_client(e, tls) for e in self.endpoints]
        # The auth token: None before authenticating (or when etcd has auth off).
        self._token: str | None = None
        self._authenticated_once = False
        self._auth_lock = asyncio.Lock()
        self._adds: dict[str, list[tuple[int, asyncio.Future[int]]]] = {}
        self._add_runners: set[asyncio.Task[None]] = set()
        self._closed = False
        self._shared = SharedWatches(self._watch)
        self._gate = Gate(MAX_IN_FLIGHT)

    def __repr__(self) -> str:
        return f"EtcdStore({self.endpoints!r})"

    # -- keys under the prefix -------------------------------------------------

    def _key64(self, key: str) -> str:
        return _b64(self._namespace + key.encode("utf-8"))

    def _range_of(self, key: str, prefix: bool) -> dict[str, str]:
        raw = self._namespace + key.encode("utf-8")
        if not prefix:
            return {"key": _b64(raw)}
        if not raw:
            return {"key": _b64(b"\0"), "range_end": _b64(b"\0")}
        return {"key": _b64(raw), "range_end": _b64(prefix_end(raw))}

    def _key_of(self, key64: str) -> str:
        return base64.b64decode(key64)[len(self._namespace) :].decode("utf-8")

    def _entry(self, kv: dict[str, Any]) -> Entry:
        lease = _int(kv, "lease")
        return Entry(
            key=self._key_of(kv["key"]),
            value=base64.b64decode(kv.get("value", "")),
            version=_int(kv, "mod_revision"),
            created=_int(kv, "create_revision"),
            lease=lease or None,
        )

    # -- authentication ---------------------------------------------------------

    async def _authenticated(self, call: Callable[[str | None], Awaitable[T]]) -> T:
        """``call(token)``, authenticating first, and once more if etcd refuses the token."""
        token = await self._fresh_token(None) if not self._authenticated_once else self._token
        try:
            return await call(token)
        except _TokenRefused as exc:
            if self.options.username is None:
                raise StoreAuthError(
                    f"etcd at {exc.endpoint} requires authentication ({exc}); set "
                    "store_username and store_password_file (see docs/store.md, "
                    '"Running etcd securely")'
                ) from None
        token = await self._fresh_token(token)
        try:
            return await call(token)
        except _TokenRefused as exc:
            raise StoreAuthError(
                f"etcd at {exc.endpoint} refused a fresh token of user "
                f"{self.options.username!r}: {exc}"
            ) from None

    async def _fresh_token(self, refused: str | None) -> str | None:
        """A token newer than ``refused``: one another caller just got, or a new one."""
        async with self._auth_lock:
            if self._authenticated_once and self._token != refused:
                return self._token  # renewed while this caller waited for the lock
            self._token = await self._authenticate()
            self._authenticated_once = True
            return self._token

    async def _authenticate(self) -> str | None:
        """A new token for the configured user; ``None`` without one or with etcd's auth off."""
        if self.options.username is None:
            return None
        body = {"name": self.options.username, "password": self.options.password}
        try:
            data = await self._post_once("/auth/authenticate", body, idempotent=True, token=None)
        except _TokenRefused as exc:  # cannot happen without a token; be explicit anyway
            raise StoreAuthError(f"etcd at {exc.endpoint} refused to authenticate: {exc}") from None
        except StoreAuthError as exc:
            if "not enabled" in str(exc):
                log.warning(
                    "etcd at %s has authentication disabled although store_username is set: "
                    "anyone who reaches it can change the cluster; run `etcdctl auth enable` "
                    "(see docs/store.md)",
                    ", ".join(self.endpoints),
                )
                return None
            raise
        token = data.get("token")
        if not isinstance(token, str) or not token:
            raise StoreUnavailable(f"{self._where()} answered /auth/authenticate without a token")
        return token

    # -- transport, fail-over and error translation --------------------------

    def _where(self) -> str:
        return "etcd at " + ", ".join(self.endpoints)

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._current + i) % n for i in range(n)]

    async def _post(self, path: str, body: dict[str, Any], *, idempotent: bool) -> dict[str, Any]:
        """POST to the gateway as the configured user, failing over; the decoded JSON answer.

        With a ``deadline`` the whole call, fail-over and re-authentication
        included, is bounded by it: a member that lost quorum holds a
        linearizable read or a write until its own request timeout (5 s plus
        two election timeouts) until it notices, and callers (the API, the
        lease keeper) need an answer sooner. A call cut off raises
        :class:`StoreUnavailable`. Each attempt is bounded by ``timeout``,
        shorter, so that a member that hangs leaves time to try the next.
        """

        async def send() -> dict[str, Any]:
            return await self._post_ungated(path, body, idempotent=idempotent)

        # A bounded number of connections (see MAX_IN_FLIGHT); identical reads
        # waiting for a turn share one request.
        if path == "/kv/range":
            return await self._gate.read(json.dumps(body, sort_keys=True), send)
        return await self._gate.run(send)

    async def _post_ungated(
        self, path: str, body: dict[str, Any], *, idempotent: bool
    ) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self._deadline):
                return await self._during_election(
                    lambda: self._authenticated(
                        lambda token: self._post_once(
                            path, body, idempotent=idempotent, token=token
                        )
                    )
                )
        except TimeoutError:
            outcome = (
                ""
                if idempotent
                else "; the write may or may not have been applied, re-read before retrying"
            )
            raise StoreUnavailable(
                f"{self._where()} did not answer {path} within {self._deadline:g}s (no quorum?)"
                + outcome
            ) from None

    async def _during_election(
        self, call: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """``call()``, tried again while every member answers "no leader".

        During a leader election (about a second after a leader dies) members
        refuse requests with "no leader" before doing anything, so a write is
        not applied either and trying again is safe. Bounded by the call's
        deadline, or :data:`ELECTION_WAIT` without one; a real quorum loss
        then surfaces as :class:`StoreUnavailable`.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + ELECTION_WAIT
        pause = 0.05
        while True:
            try:
                return await call()
            except StoreUnavailable as exc:
                if NO_LEADER not in str(exc) or (
                    self._deadline is None and loop.time() + pause > give_up
                ):
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)

    async def _post_once(
        self, path: str, body: dict[str, Any], *, idempotent: bool, token: str | None
    ) -> dict[str, Any]:
        """POST to the gateway with ``token``, failing over; the decoded JSON answer."""
        if self._closed:
            raise StoreUnavailable(f"the client of {self._where()} is closed")
        failures: list[str] = []
        for index in self._order():
            endpoint = self.endpoints[index]
            try:
                response = await self._send(index, path, body, token)
            except (httpx.ConnectError, httpx.ConnectTimeout, WireConnectError) as exc:
                failures.append(f"{endpoint}: {_reason(exc)}")  # nothing was sent
                continue
            except (httpx.RequestError, WireError, TimeoutError) as exc:
                if idempotent:
                    failures.append(f"{endpoint}: {_reason(exc)}")
                    continue
                raise StoreUnavailable(
                    f"etcd at {endpoint} failed during {path} ({_reason(exc)}); "
                    "the write may or may not have been applied, re-read before retrying"
                ) from exc
            try:
                data = self._decode(response, endpoint, path)
            except StoreUnavailable as exc:
                if response.status_code < 500:
                    raise
                # This member cannot serve (no leader, partitioned, stopping):
                # move on, now for reads and at the next call for writes.
                self._current = (index + 1) % len(self.endpoints)
                if not idempotent:
                    raise
                failures.append(str(exc))
                continue
            self._current = index
            return data
        raise self._unreachable(failures)

    def _unreachable(self, failures: builtins.list[str]) -> StoreUnavailable:
        """The error when every endpoint failed: StoreAuthError for a refused certificate."""
        joined = "; ".join(failures)
        if "alert" in joined and "certificate" in joined:
            return StoreAuthError(
                f"{self._where()} refused this client's TLS certificate ({joined}); set "
                "store_cert_file and store_key_file to a certificate signed by the CA etcd "
                "trusts (its --trusted-ca-file)"
            )
        return StoreUnavailable(f"{self._where()} is unreachable: {joined}")

    async def _send(
        self, index: int, path: str, body: dict[str, Any], token: str | None
    ) -> httpx.Response | WireResponse:
        """One POST to one endpoint, with the lean client where it serves, else httpx."""
        wire = self._wires[index]
        headers = _auth_header(token)
        if wire is None:
            return await self._client.post(
                self.endpoints[index] + self._prefix + path, json=body, headers=headers
            )
        client, base = wire
        # As httpx's timeout does: connecting and the exchange are bounded separately,
        # and a connect failure (nothing sent) is told apart from a later one.
        return await client.request(
            "POST",
            base + self._prefix + path,
            body=body,
            headers=headers,
            timeout=self._timeout,
            connect_timeout=self._timeout,
        )

    def _decode(
        self, response: httpx.Response | WireResponse, endpoint: str, path: str
    ) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict) and "CommonName" in response.text:
            raise StoreAuthError(
                f"etcd at {endpoint} refuses gateway requests from a client certificate with a "
                "Common Name while its auth is enabled; issue store_cert_file without a CN "
                "(e.g. openssl -subj /O=elasticd): the user is store_username"
            )
        if not isinstance(data, dict) and response.status_code == 404:
            raise StoreUnavailable(
                f"etcd at {endpoint} has no {self._prefix}{path} (404); is this an etcd v3 "
                "client URL? For etcd 3.3 use api_prefix='/v3beta'"
            )
        if not isinstance(data, dict):
            raise StoreUnavailable(
                f"etcd at {endpoint} answered {path} with {response.status_code} and a body "
                "that is not JSON; is this an etcd v3 client URL?"
            )
        if "error" in data or response.status_code >= 300:
            self._raise_error(data, endpoint, path, response.status_code)
        return data

    def _raise_error(self, data: dict[str, Any], endpoint: str, path: str, status: int) -> None:
        error = data.get("error")
        if isinstance(error, dict):  # streamed endpoints nest the error
            data = error
        message = str(data.get("message") or data.get("error") or f"HTTP {status}")
        code = int(data.get("code", data.get("grpc_code", 0)))
        if any(refusal in message for refusal in _TOKEN_REFUSALS):
            raise _TokenRefused(message, endpoint)
        if "authentication failed" in message:
            raise StoreAuthError(
                f"etcd at {endpoint} refused user {self.options.username!r}: wrong user name or "
                "password; check store_username and the password in store_password_file"
            )
        if "authentication is not enabled" in message:
            raise StoreAuthError(f"etcd at {endpoint}: {message}")
        if code == _PERMISSION_DENIED or "permission denied" in message:
            raise StoreAuthError(
                f"etcd at {endpoint} denied user {self.options.username!r} {path} ({message}); "
                f"grant its role readwrite on the key prefix {self.options.prefix!r} "
                "(see docs/store.md)"
            )
        if "lease not found" in message:
            raise LeaseNotFound(f"etcd: {message}")
        if "too large" in message or code == _RESOURCE_EXHAUSTED:
            raise ValueTooLarge(
                f"etcd at {endpoint} refused the request as too large ({message}); "
                "raise etcd's --max-request-bytes or store less"
            )
        if code == _OUT_OF_RANGE and "compacted" in message:
            raise StoreCompacted(f"etcd: {message}", 0)
        if status == 404 and code == 0:
            raise StoreUnavailable(
                f"etcd at {endpoint} has no {self._prefix}{path}; for etcd 3.3 use "
                "api_prefix='/v3beta'"
            )
        if code == _NOT_FOUND:
            raise StoreError(f"etcd at {endpoint}: {message}")
        raise StoreUnavailable(f"etcd at {endpoint} failed {path}: {message}")

    @asynccontextmanager
    async def _stream(
        self, path: str, body: dict[str, Any], read_timeout: float, token: str | None
    ) -> AsyncIterator[AsyncIterator[str]]:
        """A streamed POST's lines, failing over when an endpoint cannot be connected to."""
        if self._closed:
            raise StoreUnavailable(f"the client of {self._where()} is closed")
        failures: list[str] = []
        for index in self._order():
            async with AsyncExitStack() as stack:
                try:
                    lines = await stack.enter_async_context(
                        self._open_stream(index, path, body, read_timeout, token)
                    )
                except (httpx.RequestError, WireError, TimeoutError) as exc:
                    failures.append(f"{self.endpoints[index]}: {_reason(exc)}")
                    continue
                self._current = index
                yield lines
                return
        raise self._unreachable(failures)

    @asynccontextmanager
    async def _open_stream(
        self, index: int, path: str, body: dict[str, Any], read_timeout: float, token: str | None
    ) -> AsyncIterator[AsyncIterator[str]]:
        """A streamed POST to one endpoint: its lines, or its error answer raised.

        Connecting waits the client's timeout; each read ``read_timeout``.
        """
        endpoint = self.endpoints[index]
        wire = self._wires[index]
        headers = _auth_header(token)
        if wire is None:
            timeout = httpx.Timeout(self._timeout, read=read_timeout)
            request = self._client.build_request(
                "POST", endpoint + self._prefix + path, json=body, headers=headers, timeout=timeout
            )
            response = await self._client.send(request, stream=True)
            try:
                if response.status_code >= 300:
                    await response.aread()
                    self._decode(response, endpoint, path)
                async with aclosing(self._lines(response.aiter_lines(), endpoint)) as lines:
                    yield lines
            finally:
                await response.aclose()
            return
        client, base = wire
        async with client.stream(
            "POST",
            base + self._prefix + path,
            body=body,
            headers=headers,
            connect_timeout=self._timeout,
            read_timeout=read_timeout,
        ) as stream:
            if stream.status_code >= 300:
                content = await stream.aread()
                answer = WireResponse(
                    stream.status_code, stream.reason_phrase, stream.headers, content
                )
                self._decode(answer, endpoint, path)
            async with (
                aclosing(stream.aiter_lines()) as raw,
                aclosing(self._lines(raw, endpoint)) as lines,
            ):
                yield lines

    async def _lines(self, raw: AsyncIterator[str], endpoint: str) -> AsyncGenerator[str, None]:
        """The non-blank lines of a stream, its transport errors translated."""
        try:
            async for line in raw:
                if line.strip():
                    yield line
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise StoreUnavailable(f"etcd at {endpoint} stopped answering a watch") from exc
        except (httpx.RequestError, WireError) as exc:
            raise StoreUnavailable(f"etcd at {endpoint} broke off a watch: {_reason(exc)}") from exc

    # -- Store -----------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        validate_key(key)
        data = await self._post("/kv/range", self._range_of(key, False), idempotent=True)
        kvs = data.get("kvs", [])
        return self._entry(kvs[0]) if kvs else None

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
        if expected_version is not None and expected_version <= 0:
            # No written key has version 0; etcd would read it as "absent".
            return CasResult(ok=False, entry=await self.get(key))
        return await self._cas(key, value, expected_version, lease)

    async def _cas(
        self, key: str, value: bytes, expected_version: int | None, lease: int | None
    ) -> CasResult:
        key64 = self._key64(key)
        if expected_version is None:
            compare = {"key": key64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {
                "key": key64,
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": str(expected_version),
            }
        put: dict[str, Any] = {"key": key64, "value": _b64(value), "prev_kv": True}
        if lease is not None:
            put["lease"] = str(lease)
        body = {
            "compare": [compare],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": key64}}],
        }
        data = await self._post("/kv/txn", body, idempotent=False)
        responses = data.get("responses", [{}])
        if not data.get("succeeded", False):
            kvs = responses[0].get("response_range", {}).get("kvs", [])
            return CasResult(ok=False, entry=self._entry(kvs[0]) if kvs else None)
        revision = _int(data["header"], "revision")
        prev = responses[0].get("response_put", {}).get("prev_kv")
        created = _int(prev, "create_revision") if prev else revision
        entry = Entry(key=key, value=value, version=revision, created=created, lease=lease)
        return CasResult(ok=True, entry=entry)

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        validate_key(key)
        value = check_value(value, self.max_value_bytes)
        body: dict[str, Any] = {"key": self._key64(key), "value": _b64(value), "prev_kv": True}
        if lease is not None:
            body["lease"] = str(lease)
        data = await self._post("/kv/put", body, idempotent=False)
        revision = _int(data["header"], "revision")
        prev = data.get("prev_kv")
        created = _int(prev, "create_revision") if prev else revision
        return Entry(key=key, value=value, version=revision, created=created, lease=lease)

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> builtins.list[Entry]:
        """One txn with a put per key: one round trip, one revision, all or nothing."""
        check_batch(items)
        checked = []
        for key, value in items:
            validate_key(key)
            checked.append((key, check_value(value, self.max_value_bytes)))
        if not checked:
            return []
        puts = [
            {"request_put": {"key": self._key64(key), "value": _b64(value), "prev_kv": True}}
            for key, value in checked
        ]
        data = await self._post(
            "/kv/txn", {"compare": [], "success": puts, "failure": []}, idempotent=False
        )
        revision = _int(data["header"], "revision")
        responses = data.get("responses", [])
        entries = []
        for i, (key, value) in enumerate(checked):
            answer = responses[i] if i < len(responses) else {}
            prev = answer.get("response_put", {}).get("prev_kv")
            created = _int(prev, "create_revision") if prev else revision
            entries.append(Entry(key=key, value=value, version=revision, created=created))
        return entries

    async def add(self, key: str, delta: int = 1) -> int:
        validate_key(key)
        counter_total(key, 0, delta)  # a delta out of range fails alone, not its batch
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        queue = self._adds.get(key)
        if queue is not None:  # a CAS loop for this key is running: ride along
            queue.append((delta, done))
            return await done
        self._adds[key] = [(delta, done)]
        runner = asyncio.create_task(self._run_adds(key))
        self._add_runners.add(runner)
        runner.add_done_callback(self._add_runners.discard)
        return await done

    async def _run_adds(self, key: str) -> None:
        """Apply the queued adds to ``key`` by CAS, as many per round trip as are waiting.

        Adds from this client are combined: one CAS writes their sum, and each
        caller gets the running total at its place in the batch, exactly as if
        they had been applied one after the other. Only adds from other clients
        contend, and a lost round backs off a little so contenders spread out.
        """
        queue = self._adds[key]
        current: Entry | None = None
        fetched = False
        backoff = 0.0005
        try:
            while True:
                queue[:] = [(d, f) for d, f in queue if not f.done()]  # drop cancelled callers
                if not queue:
                    return
                if not fetched:
                    current = await self.get(key)
                    fetched = True
                batch = list(queue)
                base = parse_counter(key, current.value if current else None)
                total = counter_total(key, base, sum(d for d, _ in batch))
                result = await self._cas(
                    key,
                    str(total).encode("ascii"),
                    current.version if current else None,
                    current.lease if current else None,  # a counter keeps its lease
                )
                if not result.ok:
                    current = result.entry
                    await asyncio.sleep(random.uniform(0, backoff))
                    backoff = min(backoff * 2, 0.02)
                    continue
                current = result.entry
                running = base
                for d, waiter in batch:
                    running += d
                    if not waiter.done():
                        waiter.set_result(running)
                del queue[: len(batch)]
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else StoreUnavailable("add was cancelled")
            for _, waiter in queue:
                if not waiter.done():
                    waiter.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
        finally:
            del self._adds[key]

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        validate_key(key)
        key64 = self._key64(key)
        if expected_version is None:
            data = await self._post("/kv/deleterange", {"key": key64}, idempotent=False)
            return _int(data, "deleted") > 0
        body = {
            "compare": [
                {
                    "key": key64,
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(expected_version),
                }
            ],
            "success": [{"request_delete_range": {"key": key64}}],
            "failure": [],
        }
        data = await self._post("/kv/txn", body, idempotent=False)
        if not data.get("succeeded", False):
            return False
        responses = data.get("responses", [{}])
        return _int(responses[0].get("response_delete_range", {}), "deleted") > 0

    async def list(self, prefix: str) -> Listing:
        validate_key(prefix, prefix=True)
        data = await self._post("/kv/range", self._range_of(prefix, True), idempotent=True)
        entries = [self._entry(kv) for kv in data.get("kvs", [])]
        size = sum(len(e.key) + len(e.value) for e in entries)
        check_listing_size(prefix, size, len(entries), self.max_list_bytes)
        return Listing(entries=entries, revision=_int(data["header"], "revision"))

    async def grant(self, ttl: float) -> int:
        if not ttl > 0:
            raise ValueError(f"a lease TTL must be positive, not {ttl!r}")
        seconds = max(1, math.ceil(ttl))
        data = await self._post("/lease/grant", {"TTL": str(seconds)}, idempotent=False)
        return _int(data, "ID")

    async def keep_alive(self, lease: int) -> None:
        data = await self._post("/lease/keepalive", {"ID": str(lease)}, idempotent=True)
        result = data.get("result", data)
        if _int(result, "TTL") <= 0:
            raise LeaseNotFound(f"lease {lease} expired or was revoked")

    async def revoke(self, lease: int) -> None:
        try:
            await self._post("/lease/revoke", {"ID": str(lease)}, idempotent=True)
        except LeaseNotFound:
            pass  # revoking an unknown lease is not an error

    async def watch(
        self,
        key: str,
        after_version: int,
        timeout: float,
        *,
        prefix: bool = False,
    ) -> builtins.list[WatchEvent]:
        validate_key(key, prefix=prefix)
        return await self._shared.watch(key, after_version, timeout, prefix)

    async def _watch(
        self, key: str, after_version: int, timeout: float, prefix: bool
    ) -> builtins.list[WatchEvent]:
        """One watch stream, not shared (see :mod:`elasticd.store.shared`)."""
        create = self._range_of(key, prefix)
        create["start_revision"] = str(max(after_version + 1, 1))
        body = {"create_request": create}
        return await self._authenticated(
            lambda token: self._watch_once(body, key, after_version, timeout, token)
        )

    async def _watch_once(
        self, body: dict[str, Any], key: str, after_version: int, timeout: float, token: str | None
    ) -> builtins.list[WatchEvent]:
        # The timeout runs from the moment the stream is open (connecting is
        # bounded by the client's own timeout), with a floor so that a zero
        # timeout still sees the past events etcd sends after creating it.
        async with self._stream("/watch", body, timeout + self._timeout, token) as lines:
            try:
                async with asyncio.timeout(max(timeout, MIN_WATCH_SECONDS)):
                    async for line in lines:
                        events = self._watch_message(line, key, after_version)
                        if events:
                            return events
            except TimeoutError:
                return []
        raise StoreUnavailable(f"{self._where()} ended a watch of {key!r} without an answer")

    def _watch_message(self, line: str, key: str, after: int) -> builtins.list[WatchEvent]:
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise StoreUnavailable(f"{self._where()} sent a watch line that is not JSON") from exc
        if "error" in message:
            self._raise_error(message, self.endpoints[self._current], "/watch", 200)
        result = message.get("result", {})
        if result.get("canceled"):
            compacted = _int(result, "compact_revision")
            if compacted:
                raise StoreCompacted(
                    f"etcd compacted its history up to revision {compacted}; re-read "
                    f"{key!r} and watch from revision {compacted - 1} or later",
                    compacted - 1,
                )
            reason = result.get("cancel_reason", "no reason given")
            if any(refusal in reason for refusal in _TOKEN_REFUSALS):
                raise _TokenRefused(reason, self.endpoints[self._current])
            if "permission denied" in reason:
                self._raise_error({"message": reason}, self.endpoints[self._current], "/watch", 200)
            raise StoreUnavailable(f"{self._where()} cancelled a watch of {key!r}: {reason}")
        events = []
        for event in result.get("events", []):
            kv = event["kv"]
            revision = _int(kv, "mod_revision")
            if revision <= after:
                continue
            deleted = event.get("type") == "DELETE"
            events.append(
                WatchEvent(
                    kind="delete" if deleted else "put",
                    key=self._key_of(kv["key"]),
                    value=None if deleted else base64.b64decode(kv.get("value", "")),
                    revision=revision,
                )
            )
        return events

    async def compact(self, revision: int) -> None:
        """Compact etcd's history up to ``revision`` (an admin operation, used by tests)."""
        await self._post("/kv/compaction", {"revision": str(revision)}, idempotent=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for runner in list(self._add_runners):
            runner.cancel()
        await asyncio.gather(*self._add_runners, return_exceptions=True)
        await self._client.aclose()
        for wire in self._wires:
            if wire is not None:
                await wire[0].aclose()
