"""torchft's ``LighthouseService`` over gRPC, one server per job, on loopback only.

:class:`Lighthouse` is what the daemon holds: ``await lighthouse.serve(job_id, uid=...,
settings=...)`` starts the job's :class:`~elasticd.lighthouse.quorum.JobQuorum` and a
``grpc.aio`` server on ``127.0.0.1`` (port 0, or the port a re-exec had) and returns
the address the job's workers get as ``TORCHFT_LIGHTHOUSE`` (``http://127.0.0.1:PORT``);
``await lighthouse.close(job_id)`` stops both. Each method is a generic handler over
bytes (:mod:`elasticd.lighthouse.proto` does the wire format): no protobuf, no stubs.

Every request is bounded:

* a message over :data:`~elasticd.lighthouse.proto.MAX_MESSAGE_BYTES` is refused by gRPC
  (``RESOURCE_EXHAUSTED``), a malformed one here (``INVALID_ARGUMENT``, naming why);
* a long poll waits at most :data:`MAX_POLL_SECONDS` (or the client's deadline, if
  sooner), then ``DEADLINE_EXCEEDED`` (the Manager retries: ``quorum_retries``);
* at most :data:`MAX_WAITING_POLLS` polls of one job wait at once; more are
  ``RESOURCE_EXHAUSTED``;
* the peer must be the job's user or root (:mod:`elasticd.lighthouse.peer`, from the
  kernel's TCP tables), else ``PERMISSION_DENIED``; where there are no tables (not
  Linux) the check is off and the serve call logs it.

Which side of the boundary: the daemon. grpcio is the optional extra ``elasticd[torchft]``;
it is imported when a Lighthouse is made, never by the daemon's other modules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.lighthouse import peer as peers
from elasticd.lighthouse.proto import (
    HEARTBEAT_RESPONSE,
    MAX_MESSAGE_BYTES,
    ProtoError,
    decode_heartbeat_request,
    decode_quorum_request,
    encode_quorum_response,
)
from elasticd.lighthouse.quorum import JobQuorum, MissedQuorum, OverLimit
from elasticd.lighthouse.rules import Settings
from elasticd.lighthouse.state import QuorumDoc
from elasticd.store import Store

log = logging.getLogger("elasticd.lighthouse")

T = TypeVar("T")

SERVICE = "torchft.LighthouseService"
#: Longest a quorum poll waits (seconds): torchft's own quorum timeout is 60 s by default.
MAX_POLL_SECONDS = 300.0
#: Most quorum polls of one job waiting at once on one node.
MAX_WAITING_POLLS = 1024
#: Most calls one job's server runs at once (polls and heartbeats).
MAX_CONCURRENT_RPCS = MAX_WAITING_POLLS + 256
#: How long an allowed peer's verdict is kept (seconds): a connection's port and user do
#: not change while it is open, and a Manager beats every 100 ms on one connection.
PEER_CACHE_SECONDS = 2.0
#: Most peers remembered per job.
PEER_CACHE_SIZE = 4096


class PeerCheck:
    """The uid check of a job's server, with a short cache of allowed peers."""

    def __init__(
        self,
        uid: int,
        read: Callable[[], list[peers.TcpRow] | None] = peers.read_tables,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.uid = uid
        self._read = read
        self._clock = clock
        self._ok: dict[str, float] = {}

    def __call__(self, peer: str, port: int) -> str | None:
        """None if ``peer`` may call the server on ``port``, else why not."""
        now = self._clock()
        if self._ok.get(peer, -1.0) > now:
            return None
        address = peers.parse_grpc_peer(peer)
        if address is None:
            return f"the peer {peer[:100]!r} is not a TCP address"
        rows = self._read()
        if rows is None:
            return None  # no tables to check against (logged at serve)
        uid = peers.peer_uid(rows, address, (address[0], port))
        if not peers.allowed(uid, self.uid):
            return f"uid {uid} is not the job's user ({self.uid}) or root"
        if len(self._ok) >= PEER_CACHE_SIZE:
            self._ok.clear()
        self._ok[peer] = now + PEER_CACHE_SECONDS
        return None


@dataclass
class _Served:
    quorum: JobQuorum
    server: Any  # grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Lighthouse:
    """Every job's Lighthouse on this node (see the module); an async context manager."""

    def __init__(
        self,
        store: Store,
        node: str,
        lease: Callable[[], Awaitable[int]],
        *,
        clock: Clock = SYSTEM_CLOCK,
        check_peers: bool = True,
        tcp_tables: Callable[[], list[peers.TcpRow] | None] = peers.read_tables,
    ) -> None:
        import grpc  # the extra elasticd[torchft]; an ImportError here names it

        self._grpc = grpc
        self.store = store
        self.node = node
        self._lease = lease
        self.clock = clock
        self.check_peers = check_peers
        self._tables = tcp_tables
        self._jobs: dict[str, _Served] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    def address(self, job_id: str) -> str | None:
        """The job's ``TORCHFT_LIGHTHOUSE`` on this node, while it is served."""
        served = self._jobs.get(job_id)
        return served.address if served is not None else None

    def quorum(self, job_id: str) -> JobQuorum | None:
        """The job's quorum state on this node (for status and tests)."""
        served = self._jobs.get(job_id)
        return served.quorum if served is not None else None

    async def serve(
        self,
        job_id: str,
        *,
        uid: int,
        settings: Settings,
        port: int = 0,
        on_quorum: Callable[[QuorumDoc | None, QuorumDoc], None] | None = None,
    ) -> str:
        """Serve the job's Lighthouse (idempotent); the address its workers get."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("the Lighthouse is closed")
            if job_id in self._jobs:
                return self._jobs[job_id].address
            quorum = JobQuorum(
                self.store,
                job_id,
                self.node,
                self._lease,
                settings,
                clock=self.clock,
                on_quorum=on_quorum,
            )
            await quorum.start()
            try:
                server, bound = await self._start_server(job_id, quorum, uid, port)
            except BaseException:
                await quorum.stop()
                raise
            self._jobs[job_id] = served = _Served(quorum, server, bound)
            log.info("lighthouse %s: serving on %s", job_id, served.address)
            return served.address

    async def close(self, job_id: str, *, leave: bool = True) -> None:
        """Stop serving the job: the server, then its loops (``leave``: see JobQuorum.stop)."""
        async with self._lock:
            served = self._jobs.pop(job_id, None)
        if served is None:
            return
        await served.server.stop(grace=0)
        await served.quorum.stop(leave=leave)

    async def aclose(self, *, leave: bool = True) -> None:
        self._closed = True
        for job_id in list(self._jobs):
            await self.close(job_id, leave=leave)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # the server

    async def _start_server(
        self, job_id: str, quorum: JobQuorum, uid: int, port: int
    ) -> tuple[Any, int]:
        grpc = self._grpc
        check: PeerCheck | None = None
        if self.check_peers:
            if self._tables() is None:
                log.warning(
                    "lighthouse %s: no /proc/net/tcp here: any local user may reach it", job_id
                )
            else:
                check = PeerCheck(uid, self._tables)
        bound_port = 0

        async def admit(request: bytes, context: Any, decode: Callable[[bytes], T]) -> T:
            """The peer checked, then the request decoded; else the call ends with why."""
            why = check(context.peer(), bound_port) if check is not None else None
            if why is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            try:
                return decode(request)
            except ProtoError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                raise  # abort raised already

        async def on_quorum(request: bytes, context: Any) -> bytes:
            member = await admit(request, context, decode_quorum_request)
            if not member.replica_id:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "the requester has no replica_id"
                )
            if quorum.waiting >= MAX_WAITING_POLLS:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_WAITING_POLLS} quorum requests of this job already wait here",
                )
            remaining = context.time_remaining()
            limit = MAX_POLL_SECONDS if remaining is None else min(remaining, MAX_POLL_SECONDS)
            try:
                async with asyncio.timeout(limit):
                    result = await quorum.quorum(member)
            except OverLimit as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no quorum within {limit:.0f} s"
                )
            except MissedQuorum as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            return encode_quorum_response(result)

        async def on_heartbeat(request: bytes, context: Any) -> bytes:
            replica_id = await admit(request, context, decode_heartbeat_request)
            if replica_id:
                try:
                    quorum.heartbeat(replica_id)
                except OverLimit as exc:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return HEARTBEAT_RESPONSE

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Quorum": grpc.unary_unary_rpc_method_handler(on_quorum),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(on_heartbeat),
            },
        )
        server = grpc.aio.server(
            handlers=[handler],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                # Another socket on the same port could take half the connections.
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", MAX_CONCURRENT_RPCS),
            ],
        )
        bound_port = server.add_insecure_port(f"127.0.0.1:{port}")
        if not bound_port:
            raise OSError(f"the Lighthouse of job {job_id} could not bind 127.0.0.1:{port}")
        await server.start()
        return server, bound_port
