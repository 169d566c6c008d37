"""Serve a store over HTTP: the app factory, and a store-only process.

``create_store_app(store, token)`` is the ``/store`` API alone, behind the
bearer token, with the problem+json error table. The daemon serves the same
handler in its own app; ``elasticd serve --store-only`` and this module's
entry point serve just this::

    python -m api.store_server --host 127.0.0.1 --port 7070 \\
        --state-dir /var/lib/elasticd [--token-file /etc/elasticd/token]

The process keeps the embedded SQLite store at ``<state-dir>/store.sqlite3``,
prints ``listening on http://HOST:PORT`` (flushed) once it accepts
connections (``--port 0`` picks a free port and prints it), and exits 0 on
SIGTERM or SIGINT after finishing the writes in flight. uvicorn's own signal
handlers are switched off: the handler here only sets an event, and the
shutdown runs in order (close the store, which answers pending watches and
flushes pending commits → stop uvicorn, bounded by a grace period).

Its files hold every job spec, ``env`` included, so they are born private:
the umask is 077 before anything is created, the state folder is 0700 (an
existing one of this user's is set so) and the store and its ``-wal`` and
``-shm`` files are 0600.

Without a token the server refuses to bind anything but loopback, and
answers only requests addressed to a loopback name; cross-origin and
non-JSON writes are refused either way (:mod:`api.guard`). Request heads and
connections are bounded (:mod:`api.protocol`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from api.auth import bearer_store
from api.guard import RequestGuard
from api.problems import install_error_handlers
from api.protocol import uvicorn_settings
from api.routes.store import body_limit, store_router
from api.store_http import StoreHTTP
from elasticd import __version__, tokens
from elasticd.errors import ConfigError, ElasticdError
from elasticd.security import PRIVATE_UMASK
from elasticd.store.base import DEFAULT_MAX_VALUE_BYTES, Store
from elasticd.tasks import race

#: Seconds uvicorn waits for in-flight requests at shutdown.
SHUTDOWN_GRACE = 5.0


def create_store_app(store: Store, token: str | None) -> FastAPI:
    """A FastAPI app serving ``store`` at ``/store/...``; every operation needs ``token``.

    :class:`api.store_http.StoreHTTP` answers them, as in the daemon's app;
    the routes only describe them.
    """
    app = FastAPI(title="elasticd store", version=__version__)
    install_error_handlers(app)
    limit = getattr(store, "max_value_bytes", None)
    max_value_bytes = limit if isinstance(limit, int) else DEFAULT_MAX_VALUE_BYTES
    app.add_middleware(  # added first: runs after the guard, before routing
        StoreHTTP, access=bearer_store(store, token), body_limit=body_limit(max_value_bytes)
    )
    app.add_middleware(RequestGuard, tokenless=token is None)  # Host, Origin, Content-Type
    app.include_router(store_router())
    return app


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace stripped); ConfigError if unusable."""
    try:
        return tokens.read_token_file(path, what="--token-file")
    except tokens.TokenFileError as exc:
        raise ConfigError(str(exc)) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers, announcing its address once it listens."""

    def __init__(self, config: uvicorn.Config, listening: asyncio.Event) -> None:
        super().__init__(config)
        self._listening = listening

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals belong to the process owner (see serve_store)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self._listening.set()


async def serve_store(
    store: Store,
    *,
    host: str,
    port: int,
    token: str | None,
    stop: asyncio.Event,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serve ``store`` until ``stop`` is set, then close it and stop serving, in that order.

    ``on_listening(url)`` is called once connections are accepted; by default
    it prints ``listening on URL`` to stdout, flushed.
    """
    if token is None and not _is_loopback(host):
        raise ConfigError(
            f"refusing to serve the store on {host} without a token: "
            "pass --token-file, or bind 127.0.0.1"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets
    # whose proto says TCP, and without it every response waits ~40 ms (Nagle
    # against delayed ACKs). Linux also copies TCP_NODELAY from the listener.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_store_app(store, token),
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE),
        # httptools with bounded request heads, head read time and connections.
        **uvicorn_settings(),
    )
    listening = asyncio.Event()
    server = _Server(config, listening)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        # The server is never a loser of these races: it is shielded, and stopped below.
        await race(asyncio.shield(serving), listening.wait())
        if listening.is_set():
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{bound_port}"
            if on_listening is None:
                print(f"listening on {url}", flush=True)
            else:
                on_listening(url)
        await race(asyncio.shield(serving), stop.wait())
    finally:
        await store.close()  # answers pending watches (503) and flushes pending commits
        server.should_exit = True
        await serving
        sock.close()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m api.store_server",
        description="Serve the embedded elasticd cluster store (no agent) over HTTP.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7070, help="port (0 picks a free one)")
    parser.add_argument("--state-dir", type=Path, required=True, help="directory of store.sqlite3")
    parser.add_argument("--token-file", type=Path, help="file holding the bearer token")
    parser.add_argument(
        "--synchronous",
        choices=["FULL", "NORMAL"],
        default="FULL",
        help="SQLite fsync policy (FULL: survives power loss; NORMAL: survives process crashes)",
    )
    parser.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop (auto: uvloop when installed, about twice the throughput)",
    )
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    from elasticd.security import make_private_dir, make_state_private, refuse_foreign_state
    from elasticd.store.embedded import EmbeddedStore

    token = read_token_file(args.token_file) if args.token_file else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    refuse_foreign_state(args.state_dir)
    make_private_dir(args.state_dir)
    make_state_private(args.state_dir.resolve())
    store = EmbeddedStore(args.state_dir / "store.sqlite3", synchronous=args.synchronous)
    try:
        await serve_store(store, host=args.host, port=args.port, token=token, stop=stop)
    finally:
        await store.close()


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when asked for (or, with ``auto``, when installed)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("--loop uvloop: uvloop is not installed") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 after a signal, 2 on a configuration error)."""
    # Before anything is created: the store (every job spec, env included) is born 0600.
    os.umask(PRIVATE_UMASK)
    args = _parse(argv)
    try:
        with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
            runner.run(_main(args))
    except ElasticdError as exc:
        print(f"elasticd store: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
