"""Connection limits below the app: what a client may make the daemon hold before any auth.

uvicorn's httptools protocol bounds neither the request head nor the time
to send it: a peer that opens a connection and sends a header line without
end makes the daemon buffer all of it (8 connections of 64 MiB each took a
daemon from 99 to 611 MiB), and one that sends nothing, or one byte a
second, holds its connection forever (uvicorn arms its keep-alive timer
only after a response). :class:`LimitedHttpProtocol` is uvicorn's httptools
protocol with three limits, applied before a request reaches the app and
so before authentication:

* **Head size**: the request line and headers of one request may take at
  most :data:`MAX_HEAD_BYTES`; beyond that the peer gets ``431`` and the
  connection is closed.
* **Head time**: they must arrive within :data:`HEAD_TIMEOUT` seconds of
  the connection opening, or of the request's first byte on a kept-alive
  connection; else ``408`` and close. (Idle time between requests is
  uvicorn's keep-alive timeout; bodies are bounded by :mod:`api.limits`.)
* **Connections**: at most the server's cap at once (:func:`connection_cap`
  of the descriptor limit, at most :data:`MAX_CONNECTIONS`). A connection
  beyond it first makes room: the connection that has waited longest
  without a whole request head (idle, or sending its head slowly; never
  one whose request runs) is closed (:func:`evictable`), so a flood of
  idle connections cannot keep a real caller, such as a health probe, from
  being served: the newcomer is the youngest and sends its head at once.
  Only when every connection is running a request is the newcomer
  answered ``503`` and closed. uvicorn's own ``limit_concurrency`` (503 to
  requests while connections plus running requests reach it) is set one
  above, so it bites only on running tasks.

* **Body time**: a request's body must arrive within :data:`BODY_TIMEOUT`
  seconds of its head; else ``408`` (or, once the app answered, a plain
  close). A connection whose response is sent before its body arrived (a
  ``401`` is answered from the head alone, :mod:`api.auth`) is closed at
  once, so an unfinished body holds nothing.

The protocol also reads, once per unix-socket connection, the peer's
``(pid, uid, gid)`` from the kernel (``SO_PEERCRED``) and puts it in every
request's scope under :data:`PEER_KEY`: the caller's identity
(:mod:`api.auth`). A TCP connection never has it, so no header can forge it.

So a flood costs at most ``cap × MAX_HEAD_BYTES`` of buffered
heads, each for at most ``HEAD_TIMEOUT``. ``uvicorn_settings()`` gives the
``uvicorn.Config`` arguments that install all this.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
import socket
import struct
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("elasticd.api")

#: The request line and headers of one request (nginx's default allows 4 × 8 KiB).
MAX_HEAD_BYTES = 64 * 1024
#: Seconds to send a request's line and headers.
HEAD_TIMEOUT = 10.0
#: Seconds to send a request's body once its head arrived.
BODY_TIMEOUT = 30.0
#: Where a unix-socket peer's ``(pid, uid, gid)`` goes in the request's scope.
PEER_KEY = "elasticd.peer"
#: The most connections served at once (each open stream, e.g. a log follower, holds one).
MAX_CONNECTIONS = 1000
#: The fewest: a daemon under a tiny descriptor limit still answers a few callers.
MIN_CONNECTIONS = 8


def connection_cap(fd_limit: int) -> int:
    """Connections to serve at once under a descriptor limit of ``fd_limit`` (pure).

    Half the limit, so a flood of idle connections (no token is needed to
    open one) leaves the other half to the workers' pipes and heartbeat
    files, cgroups, the databases and the store (issue 23: 1,010 idle
    connections took every descriptor of a daemon at 1,024, and its jobs
    failed to start); at most :data:`MAX_CONNECTIONS`, at least
    :data:`MIN_CONNECTIONS`.
    """
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, fd_limit // 2))


def evictable(waiting: dict[int, float | None]) -> int | None:
    """Which connection makes room for a new one: ``waiting`` maps each to the
    time it started waiting for a request head (None: a request is running);
    the longest waiting, or None when every one runs a request (pure)."""
    idle = [(since, key) for key, since in waiting.items() if since is not None]
    return min(idle)[1] if idle else None


def _raw_problem(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps(
        {"type": "about:blank", "title": reason, "status": status, "detail": detail}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded request heads and connections."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout = HEAD_TIMEOUT

    def __init__(self, *args: Any, max_connections: int = MAX_CONNECTIONS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: This server's cap (:func:`uvicorn_settings`), counted over its connections.
        self.max_connections = max_connections
        self._in_head = True  # reading a request's line and headers
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_pending = False
        self._peer: tuple[int, int, int] | None = None
        #: When this connection began waiting for a request head (None: one is running).
        self._waiting_since: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = _peer_credentials(transport)
        self._waiting_since = self.loop.time()
        if len(self.connections) > self.max_connections and not self._make_room():
            self._refuse(
                503,
                "Service Unavailable",
                f"this daemon already runs requests on all of its {self.max_connections} "
                "connections; try again shortly",
            )
            return
        self._arm_head_timer()

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request head (see the
        module docstring); False when every other connection runs a request."""
        others = {
            id(c): c
            for c in self.connections
            if c is not self and isinstance(c, LimitedHttpProtocol)
        }
        victim = evictable({key: c._waiting_since for key, c in others.items()})
        if victim is None:
            return False
        others[victim]._evict()
        return True

    def _evict(self) -> None:
        self._waiting_since = None
        self._disarm_head_timer()
        if self._head_bytes:  # it had begun a request: say why it ends
            self.transport.write(
                _raw_problem(503, "Service Unavailable", "closed to serve a newer connection")
            )
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # The head did not end in this chunk, so all of the chunk is head bytes
            # (a chunk that completed a head is not counted: it may carry a body).
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(
                    431,
                    "Request Header Fields Too Large",
                    f"the request line and headers exceed {self.max_head_bytes} bytes",
                )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._peer is not None:
            self.scope[PEER_KEY] = self._peer  # type: ignore[literal-required]
        self._in_head = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._waiting_since = None
        self._disarm_head_timer()
        self._body_pending = True
        self._disarm_body_timer()
        self._body_timer = self.loop.call_later(BODY_TIMEOUT, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_pending = False
        self._disarm_body_timer()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._body_pending and not self.transport.is_closing():
            # Answered before its body came (a 401 from the head alone): the rest
            # of the body is nobody's business, and waiting for it holds a connection.
            self._disarm_body_timer()
            self.transport.close()
            return
        self._waiting_since = self.loop.time()
        super().on_response_complete()

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._body_pending or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()
            return
        self._refuse(
            408,
            "Request Timeout",
            f"the request body did not arrive within {BODY_TIMEOUT:g} s of its head",
        )

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        self._refuse(
            408,
            "Request Timeout",
            f"the request line and headers did not arrive within {self.head_timeout:g} s",
        )

    def _refuse(self, status: int, reason: str, detail: str) -> None:
        self._disarm_head_timer()
        self.transport.write(_raw_problem(status, reason, detail))
        self.transport.close()


def _peer_credentials(transport: asyncio.BaseTransport) -> tuple[int, int, int] | None:
    """A unix-socket peer's ``(pid, uid, gid)``, from the kernel; None on TCP."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    size = struct.calcsize("3i")
    pid, uid, gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size)
    )
    return pid, uid, gid


def uvicorn_settings(max_connections: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that install these limits.

    ``max_connections``: the cap of this server (None: :func:`connection_cap`
    of this process's descriptor limit as it is now).
    """
    if max_connections is None:
        max_connections = connection_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    return {
        # uvicorn makes one protocol per connection from this factory.
        "http": functools.partial(LimitedHttpProtocol, max_connections=max_connections),
        "limit_concurrency": max_connections + 1,
        "timeout_keep_alive": 5,
    }


class AcceptErrors:
    """A loop exception handler that says "out of descriptors" once a period, not per accept.

    asyncio reports every accept that failed for want of a descriptor (and
    retries it a second later); under a flood at the fd limit that is hundreds
    of identical log records a second. Everything else goes to the default handler.
    """

    def __init__(self, period: float = 10.0) -> None:
        self.period = period
        self._last = float("-inf")
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last < self.period:
            self.suppressed += 1
            return
        self._last = now
        log.warning(
            "cannot accept connections: %s (%d more since the last report; retried every second)",
            context.get("exception"),
            self.suppressed,
        )
        self.suppressed = 0
