"""Python clients of the REST API: :class:`Client` (sync) and :class:`AsyncClient`, over httpx.

Both return the same pydantic models the daemon stores and serves
(:mod:`elasticd.models`), and raise :class:`ClientError` with the HTTP status
and the server's problem detail (RFC 9457) when a call fails, or
:class:`DaemonUnreachable` when there is no daemon to answer::

    from elasticd.client import Client

    with Client("http://127.0.0.1:7070", token_file="/etc/elasticd/token") as c:
        job = c.submit({"entrypoint": "python", "args": ["train.py"], "nproc_per_node": 2})
        for event in c.follow_events(job.id):      # Server-Sent Events, resumed on reconnect
            print(event.seq, event.kind, event.message)
        print(c.get(job.id).state)

On the daemon's own node, ``Client(socket="/run/elasticd/elasticd.sock")``
needs no token: the daemon asks the kernel who is calling (``SO_PEERCRED``)
and serves that user. :func:`find_daemon` picks what the CLI uses when told
nothing: ``$ELASTICD_SOCKET``, else ``$ELASTICD_URL``, else the first unix
socket that exists of :data:`SOCKETS` or this user's own daemon's socket, else
:data:`DEFAULT_URL` without a token. The token a daemon of this user made for
itself (``<state_dir>/token``) is sent only to a URL the user chose (``--url``,
``$ELASTICD_URL``): while no daemon listens on the default address, any local
user may, and would collect it.

Workers get ``ELASTICD_URL`` and ``ELASTICD_TOKEN_FILE`` (their job's own
token: its store keys and its own record) in their environment.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from elasticd import tokens
from elasticd.errors import ElasticdError
from elasticd.goodput import Goodput
from elasticd.models import Event, Job, JobList, JobSpec, QueueView, WorkersView
from elasticd.states import JobState

__all__ = [
    "DEFAULT_URL",
    "AsyncClient",
    "Client",
    "ClientError",
    "Connection",
    "DaemonUnreachable",
    "find_daemon",
    "SSEParser",
    "ServerSentEvent",
    "read_token_file",
]

DEFAULT_URL = "http://127.0.0.1:7070"


def _state_home() -> Path:
    """Where a daemon of this user keeps its state by default (elasticd.config's rule)."""
    if os.geteuid() == 0:
        return Path("/var/lib/elasticd")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "elasticd"


#: The unix sockets tried, in order, when no URL or socket is given: the node's shared
#: daemon (the systemd unit's), then this user's own daemon.
SOCKETS = (Path("/run/elasticd/elasticd.sock"),)


@dataclass(frozen=True)
class Connection:
    """How to reach a daemon: a unix socket, or a URL and maybe a token file."""

    url: str = DEFAULT_URL
    socket: Path | None = None
    token_file: Path | None = None


def find_daemon(
    url: str | None = None,
    socket: str | Path | None = None,
    token_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Connection:
    """The daemon to talk to: what was given, else the environment, else the defaults."""
    env = os.environ if environ is None else environ
    token = Path(token_file) if token_file else None
    if token is None and env.get("ELASTICD_TOKEN_FILE"):
        token = Path(env["ELASTICD_TOKEN_FILE"])
    if socket is None and url is None and env.get("ELASTICD_SOCKET"):
        socket = env["ELASTICD_SOCKET"]
    if socket is not None:
        return Connection(socket=Path(socket), token_file=token)
    url = url or env.get("ELASTICD_URL")
    if url is None:
        for candidate in (*SOCKETS, _state_home() / "run" / "elasticd.sock"):
            if candidate.is_socket() and token is None:
                return Connection(socket=candidate)
        # No daemon's socket: the default address is only a guess, and any local user may
        # listen there while no daemon does (loopback is no identity). Your own daemon's
        # token goes only where you send it (--url, $ELASTICD_URL), never to a guess.
        return Connection(url=DEFAULT_URL, token_file=token)
    if token is None:
        own = _state_home() / "token"
        if os.access(own, os.R_OK):
            token = own
    return Connection(url=url, token_file=token)


#: Consecutive failed reconnects after which following a stream gives up.
MAX_RECONNECTS = 5
#: A stream with no byte for this long (four server heartbeats) is taken as dropped.
STREAM_READ_TIMEOUT = 60.0

_M = TypeVar("_M", bound=BaseModel)
_EVENTS = TypeAdapter(list[Event])
Stream = Literal["stdout", "stderr"]
SpecLike = JobSpec | Mapping[str, Any]


class ClientError(ElasticdError):
    """A call to the daemon failed: ``status`` and the server's problem ``detail``.

    ``str(error)`` is the server's message, ready to show to a person.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        title: str | None = None,
        problem: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.detail = message
        self.problem: dict[str, Any] = dict(problem or {})


class DaemonUnreachable(ClientError):
    """No daemon answered at the URL (refused, unresolvable, timed out, dropped)."""


def read_token_file(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed)."""
    try:
        return tokens.read_token_file(path)
    except tokens.TokenFileError as exc:
        raise ClientError(str(exc)) from None


@dataclass(frozen=True)
class ServerSentEvent:
    """One SSE message: ``id``, ``event`` (the type, "message" by default) and ``data``."""

    event: str
    data: str
    id: str | None = None
    retry: int | None = None


class SSEParser:
    """Incremental Server-Sent Events parser: ``feed(text)`` returns the complete messages."""

    def __init__(self) -> None:
        self._buffer = ""
        self.last_id: str | None = None
        self.retry: int | None = None

    def feed(self, text: str) -> list[ServerSentEvent]:
        self._buffer += text.replace("\r\n", "\n").replace("\r", "\n")
        out: list[ServerSentEvent] = []
        while "\n\n" in self._buffer:
            block, self._buffer = self._buffer.split("\n\n", 1)
            kind, data, has_data, retry = "message", [], False, None
            for line in block.split("\n"):
                if not line or line.startswith(":"):
                    continue  # a comment: the heartbeat
                field, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if field == "event":
                    kind = value
                elif field == "data":
                    data.append(value)
                    has_data = True
                elif field == "id" and "\x00" not in value:
                    self.last_id = value
                elif field == "retry" and value.isdigit():
                    retry = self.retry = int(value)
            if has_data:
                out.append(ServerSentEvent(kind, "\n".join(data), self.last_id, retry))
        return out


def _problem_error(response: httpx.Response) -> ClientError:
    problem: dict[str, Any] = {}
    try:
        body = json.loads(response.content or b"null")
        if isinstance(body, dict):
            problem = body
    except ValueError:
        pass
    detail = problem.get("detail") or response.text.strip() or response.reason_phrase
    if not isinstance(detail, str):
        detail = json.dumps(detail)
    return ClientError(
        detail, status=response.status_code, title=problem.get("title"), problem=problem
    )


def _transport_error(url: str, exc: httpx.HTTPError) -> ClientError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.RemoteProtocolError):
        reason = str(exc) or type(exc).__name__
        return DaemonUnreachable(
            f"cannot reach the elasticd daemon at {url} ({reason}); is it running? "
            "(set --url or ELASTICD_URL)"
        )
    if isinstance(exc, httpx.TimeoutException):
        return DaemonUnreachable(f"the elasticd daemon at {url} did not answer in time")
    return ClientError(f"request to the elasticd daemon at {url} failed: {exc}")


def _parse(model: type[_M], response: httpx.Response) -> _M:
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise ClientError(
            f"unexpected answer from the daemon for {response.request.url.path}: {exc}",
            status=response.status_code,
        ) from None


def _spec_body(spec: SpecLike) -> dict[str, Any]:
    if isinstance(spec, JobSpec):
        return spec.model_dump(mode="json", exclude_none=True)
    return dict(spec)


def _states(state: Iterable[JobState | str] | None) -> list[str] | None:
    if state is None:
        return None
    return [s.value if isinstance(s, JobState) else str(s) for s in state]


def _log_params(
    local_rank: int,
    stream: Stream,
    attempt: int | None,
    tail: int | None,
    node: str | None,
    follow: bool = False,
) -> dict[str, Any]:
    params: dict[str, Any] = {"local_rank": local_rank, "stream": stream}
    if node is not None:  # the daemon asked forwards the call to that node's daemon
        params["node"] = node
    if attempt is not None:
        params["attempt"] = attempt
    if tail is not None:
        params["tail"] = tail
    if follow:
        params["follow"] = "true"
    return params


def _headers(token: str | None) -> dict[str, str]:
    headers = {"User-Agent": "elasticd-client", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _resolve_token(token: str | None, token_file: str | Path | None) -> str | None:
    if token is None and token_file:
        return read_token_file(token_file)
    return token


def _stream_timeout(timeout: float) -> httpx.Timeout:
    return httpx.Timeout(timeout, read=STREAM_READ_TIMEOUT)


class _Follow:
    """Reconnect bookkeeping shared by both clients' ``follow_events``."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.failures = 0
        self.ended = False
        self.parser = SSEParser()

    def request_headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.after:
            headers["Last-Event-ID"] = str(self.after)
        return headers

    def events(self, text: str) -> list[Event]:
        out = []
        for message in self.parser.feed(text):
            if message.event == "end":
                self.ended = True
                continue
            event = Event.model_validate_json(message.data)
            if event.seq <= self.after:
                continue  # never repeat one
            self.after = event.seq
            self.failures = 0
            out.append(event)
        return out

    def dropped(self, url: str, exc: ClientError | None) -> float:
        """Seconds to wait before reconnecting; raises once reconnecting seems hopeless."""
        self.failures += 1
        if self.failures > MAX_RECONNECTS:
            raise exc or DaemonUnreachable(f"the event stream from {url} keeps dropping")
        retry_ms = self.parser.retry if self.parser.retry is not None else 1000
        return float(min(retry_ms / 1000, 0.25 * 2.0**self.failures))


_T = TypeVar("_T")


@dataclass(frozen=True)
class _Call:
    """One request of the API: both clients send it as it is (httpx's ``request`` arguments)."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    timeout: float | httpx.Timeout | None = None
    headers: dict[str, str] | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``httpx.Client.request``/``stream`` (and the async ones)."""
        given = {
            "params": self.params,
            "json": self.json,
            "timeout": self.timeout,
            "headers": self.headers,
        }
        return {name: value for name, value in given.items() if value is not None}


class _Api:
    """The requests of the API and how their answers are read: the one request builder.

    :class:`Client` and :class:`AsyncClient` only send what this builds (the
    sync and async transports of httpx); the answer is read here, once.
    """

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout

    @staticmethod
    def submit(spec: SpecLike) -> _Call:
        return _Call("POST", "/jobs", json=_spec_body(spec))

    @staticmethod
    def get(job_id: str) -> _Call:
        return _Call("GET", f"/jobs/{job_id}")

    @staticmethod
    def list_jobs(state: Iterable[JobState | str] | None, limit: int, offset: int) -> _Call:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if (states := _states(state)) is not None:
            params["state"] = states
        return _Call("GET", "/jobs", params=params)

    @staticmethod
    def cancel(job_id: str) -> _Call:
        return _Call("POST", f"/jobs/{job_id}/cancel", json={})

    @staticmethod
    def queue() -> _Call:
        return _Call("GET", "/queue")

    @staticmethod
    def workers(job_id: str) -> _Call:
        return _Call("GET", f"/jobs/{job_id}/workers")

    @staticmethod
    def goodput(job_id: str) -> _Call:
        return _Call("GET", f"/jobs/{job_id}/goodput")

    def events(self, job_id: str, after: int, limit: int, wait: float) -> _Call:
        params = {"after": after, "limit": limit, "wait": wait}
        return _Call("GET", f"/jobs/{job_id}/events", params=params, timeout=self.timeout + wait)

    def follow_events(self, job_id: str, state: _Follow) -> _Call:
        return _Call(
            "GET",
            f"/jobs/{job_id}/events",
            params={"after": state.after},
            headers=state.request_headers(),
            timeout=_stream_timeout(self.timeout),
        )

    @staticmethod
    def delete(job_id: str) -> _Call:
        return _Call("DELETE", f"/jobs/{job_id}")

    @staticmethod
    def nodes() -> _Call:
        return _Call("GET", "/nodes")

    @staticmethod
    def drain(name: str, reason: str, *, undrain: bool = False) -> _Call:
        verb = "undrain" if undrain else "drain"
        return _Call("POST", f"/nodes/{quote(name, safe='')}/{verb}", json={"reason": reason})

    @staticmethod
    def reload() -> _Call:
        return _Call("POST", "/reload", json={})

    def logs(
        self,
        job_id: str,
        local_rank: int,
        stream: Stream,
        attempt: int | None,
        tail: int | None,
        node: str | None,
        *,
        follow: bool = False,
    ) -> _Call:
        """A log as it is now, or (``follow``) as it grows: a quiet log is then no error."""
        params = _log_params(local_rank, stream, attempt, tail, node, follow=follow)
        timeout = httpx.Timeout(self.timeout, read=None) if follow else None
        return _Call("GET", f"/jobs/{job_id}/logs", params=params, timeout=timeout)

    def checked(self, response: httpx.Response) -> httpx.Response:
        """The response of a call that succeeded; ClientError with the problem otherwise."""
        if response.status_code >= 400:
            raise _problem_error(response)
        return response

    def failed(self, exc: httpx.HTTPError) -> ClientError:
        return _transport_error(self.url, exc)


def _events_of(response: httpx.Response) -> list[Event]:
    return _EVENTS.validate_json(response.content)


def _client_setup(
    url: str, socket: str | Path | None, transport: _T | None, uds: Callable[[str], _T]
) -> tuple[str, _T | None]:
    """The base URL and transport: a unix socket's, where one is given."""
    if socket is not None:  # the kernel tells the daemon who we are: no token needed
        return "http://localhost", transport or uds(str(socket))
    return url, transport


class Client:
    """Synchronous client. Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        socket: str | Path | None = None,
    ) -> None:
        url, transport = _client_setup(url, socket, transport, _sync_uds)
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._api = _Api(self.url, timeout)
        self._http = httpx.Client(
            base_url=self.url,
            headers=_headers(_resolve_token(token, token_file)),
            timeout=timeout,
            transport=transport,
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        try:
            response = self._http.request(call.method, call.path, **call.options())
        except httpx.HTTPError as exc:
            raise self._api.failed(exc) from None
        return self._api.checked(response)

    # jobs

    def submit(self, spec: SpecLike) -> Job:
        """Submit a job (a :class:`JobSpec` or the same as a dict); returns it."""
        return _parse(Job, self._send(self._api.submit(spec)))

    def get(self, job_id: str) -> Job:
        return _parse(Job, self._send(self._api.get(job_id)))

    def list_jobs(
        self, state: Iterable[JobState | str] | None = None, limit: int = 100, offset: int = 0
    ) -> JobList:
        return _parse(JobList, self._send(self._api.list_jobs(state, limit, offset)))

    def cancel(self, job_id: str) -> Job:
        return _parse(Job, self._send(self._api.cancel(job_id)))

    def delete(self, job_id: str) -> None:
        """Forget a job that ended (its log files stay on disk)."""
        self._send(self._api.delete(job_id))

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes, as the API's JSON."""
        nodes: list[dict[str, Any]] = self._send(self._api.nodes()).json()
        return nodes

    def drain(self, name: str, reason: str, *, undrain: bool = False) -> dict[str, Any]:
        """Quarantine a node (an admin's), or release it with ``undrain``: its state."""
        view: dict[str, Any] = self._send(self._api.drain(name, reason, undrain=undrain)).json()
        return view

    def reload(self) -> dict[str, Any]:
        """Ask the daemon to re-execute itself in place (admins only); its health answer."""
        answer: dict[str, Any] = self._send(self._api.reload()).json()
        return answer

    def queue(self) -> QueueView:
        """The fleet's queue in placement order, and where placed jobs run."""
        return _parse(QueueView, self._send(self._api.queue()))

    def workers(self, job_id: str) -> WorkersView:
        return _parse(WorkersView, self._send(self._api.workers(job_id)))

    def goodput(self, job_id: str) -> Goodput:
        """Where the job's time went (docs/goodput.md)."""
        return _parse(Goodput, self._send(self._api.goodput(job_id)))

    def events(
        self, job_id: str, after: int = 0, *, limit: int = 1000, wait: float = 0
    ) -> list[Event]:
        """Events after ``after``; with ``wait`` the daemon holds the call up to that long."""
        return _events_of(self._send(self._api.events(job_id, after, limit, wait)))

    def follow_events(self, job_id: str, after: int = 0) -> Iterator[Event]:
        """Every event after ``after``, live, until the job ends (SSE, resumed on reconnect)."""
        state = _Follow(after)
        while not state.ended:
            error: ClientError | None = None
            call = self._api.follow_events(job_id, state)
            try:
                with self._http.stream(call.method, call.path, **call.options()) as response:
                    if response.status_code >= 400:
                        response.read()
                    for text in self._api.checked(response).iter_text():
                        yield from state.events(text)
            except httpx.HTTPError as exc:
                error = self._api.failed(exc)
            if not state.ended:
                time.sleep(state.dropped(self.url, error))

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Wait until the job is terminal and return it (``TimeoutError`` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        after = 0
        while True:
            job = self.get(job_id)
            if job.state.is_terminal:
                return job
            remaining = 30.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"job {job_id!r} is still {job.state.value}")
            events = self.events(job_id, after, wait=min(30.0, max(0.05, remaining)))
            if events:
                after = events[-1].seq

    # logs

    def logs(
        self,
        job_id: str,
        local_rank: int = 0,
        stream: Stream = "stdout",
        *,
        attempt: int | None = None,
        tail: int | None = None,
        node: str | None = None,
    ) -> str:
        """A log as it is now; ``node``: that node's worker (the daemon asked forwards)."""
        return self._send(self._api.logs(job_id, local_rank, stream, attempt, tail, node)).text

    def follow_logs(
        self,
        job_id: str,
        local_rank: int = 0,
        stream: Stream = "stdout",
        *,
        attempt: int | None = None,
        tail: int | None = None,
        node: str | None = None,
    ) -> Iterator[str]:
        """The log as it grows, until the job ends (across restarts unless ``attempt``)."""
        call = self._api.logs(job_id, local_rank, stream, attempt, tail, node, follow=True)
        decoder = _log_decoder()
        try:
            with self._http.stream(call.method, call.path, **call.options()) as response:
                if response.status_code >= 400:
                    response.read()
                for chunk in self._api.checked(response).iter_bytes():
                    if text := decoder.decode(chunk):
                        yield text
        except httpx.HTTPError as exc:
            raise self._api.failed(exc) from None
        if rest := decoder.decode(b"", final=True):
            yield rest


class AsyncClient:
    """The asyncio client; the same methods as :class:`Client`, awaited."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        socket: str | Path | None = None,
    ) -> None:
        url, transport = _client_setup(url, socket, transport, _async_uds)
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._api = _Api(self.url, timeout)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=_headers(_resolve_token(token, token_file)),
            timeout=timeout,
            transport=transport,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        try:
            response = await self._http.request(call.method, call.path, **call.options())
        except httpx.HTTPError as exc:
            raise self._api.failed(exc) from None
        return self._api.checked(response)

    async def submit(self, spec: SpecLike) -> Job:
        return _parse(Job, await self._send(self._api.submit(spec)))

    async def get(self, job_id: str) -> Job:
        return _parse(Job, await self._send(self._api.get(job_id)))

    async def list_jobs(
        self, state: Iterable[JobState | str] | None = None, limit: int = 100, offset: int = 0
    ) -> JobList:
        return _parse(JobList, await self._send(self._api.list_jobs(state, limit, offset)))

    async def cancel(self, job_id: str) -> Job:
        return _parse(Job, await self._send(self._api.cancel(job_id)))

    async def delete(self, job_id: str) -> None:
        """Forget a job that ended (its log files stay on disk)."""
        await self._send(self._api.delete(job_id))

    async def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes, as the API's JSON."""
        nodes: list[dict[str, Any]] = (await self._send(self._api.nodes())).json()
        return nodes

    async def drain(self, name: str, reason: str, *, undrain: bool = False) -> dict[str, Any]:
        """Quarantine a node (an admin's), or release it with ``undrain``: its state."""
        answer = await self._send(self._api.drain(name, reason, undrain=undrain))
        view: dict[str, Any] = answer.json()
        return view

    async def reload(self) -> dict[str, Any]:
        """Ask the daemon to re-execute itself in place (admins only); its health answer."""
        answer: dict[str, Any] = (await self._send(self._api.reload())).json()
        return answer

    async def queue(self) -> QueueView:
        """The fleet's queue in placement order, and where placed jobs run."""
        return _parse(QueueView, await self._send(self._api.queue()))

    async def workers(self, job_id: str) -> WorkersView:
        return _parse(WorkersView, await self._send(self._api.workers(job_id)))

    async def goodput(self, job_id: str) -> Goodput:
        return _parse(Goodput, await self._send(self._api.goodput(job_id)))

    async def events(
        self, job_id: str, after: int = 0, *, limit: int = 1000, wait: float = 0
    ) -> list[Event]:
        return _events_of(await self._send(self._api.events(job_id, after, limit, wait)))

    async def follow_events(self, job_id: str, after: int = 0) -> AsyncIterator[Event]:
        state = _Follow(after)
        while not state.ended:
            error: ClientError | None = None
            call = self._api.follow_events(job_id, state)
            try:
                async with self._http.stream(call.method, call.path, **call.options()) as response:
                    if response.status_code >= 400:
                        await response.aread()
                    async for text in self._api.checked(response).aiter_text():
                        for event in state.events(text):
                            yield event
            except httpx.HTTPError as exc:
                error = self._api.failed(exc)
            if not state.ended:
                await asyncio.sleep(state.dropped(self.url, error))

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        async with asyncio.timeout(timeout):
            after = 0
            while True:
                job = await self.get(job_id)
                if job.state.is_terminal:
                    return job
                events = await self.events(job_id, after, wait=30.0)
                if events:
                    after = events[-1].seq

    async def logs(
        self,
        job_id: str,
        local_rank: int = 0,
        stream: Stream = "stdout",
        *,
        attempt: int | None = None,
        tail: int | None = None,
        node: str | None = None,
    ) -> str:
        call = self._api.logs(job_id, local_rank, stream, attempt, tail, node)
        return (await self._send(call)).text

    async def follow_logs(
        self,
        job_id: str,
        local_rank: int = 0,
        stream: Stream = "stdout",
        *,
        attempt: int | None = None,
        tail: int | None = None,
        node: str | None = None,
    ) -> AsyncIterator[str]:
        call = self._api.logs(job_id, local_rank, stream, attempt, tail, node, follow=True)
        decoder = _log_decoder()
        try:
            async with self._http.stream(call.method, call.path, **call.options()) as response:
                if response.status_code >= 400:
                    await response.aread()
                async for chunk in self._api.checked(response).aiter_bytes():
                    if text := decoder.decode(chunk):
                        yield text
        except httpx.HTTPError as exc:
            raise self._api.failed(exc) from None
        if rest := decoder.decode(b"", final=True):
            yield rest


def _log_decoder() -> codecs.IncrementalDecoder:
    """A log's bytes as text, a character split across chunks kept whole."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _sync_uds(path: str) -> httpx.BaseTransport:
    return httpx.HTTPTransport(uds=path)


def _async_uds(path: str) -> httpx.AsyncBaseTransport:
    return httpx.AsyncHTTPTransport(uds=path)
