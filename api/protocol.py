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
* **Connections**: at most :data:`MAX_CONNECTIONS` at once; a connection
  beyond that gets ``503`` and is closed at once. uvicorn's own
  ``limit_concurrency`` (503 to requests while connections plus running
  requests reach it) is set one above, so it bites only on running tasks.

So a flood costs at most ``MAX_CONNECTIONS × MAX_HEAD_BYTES`` of buffered
heads, each for at most ``HEAD_TIMEOUT``. ``uvicorn_settings()`` gives the
``uvicorn.Config`` arguments that install all this.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: The request line and headers of one request (nginx's default allows 4 × 8 KiB).
MAX_HEAD_BYTES = 64 * 1024
#: Seconds to send a request's line and headers.
HEAD_TIMEOUT = 10.0
#: Connections served at once (each open stream, e.g. a log follower, holds one).
MAX_CONNECTIONS = 1000


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
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request's line and headers
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(
                503,
                "Service Unavailable",
                f"this daemon already serves {self.max_connections} connections; "
                "close idle ones or try again shortly",
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
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
        self._in_head = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

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


def uvicorn_settings() -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that install these limits."""
    return {
        "http": LimitedHttpProtocol,
        "limit_concurrency": MAX_CONNECTIONS + 1,
        "timeout_keep_alive": 5,
    }
