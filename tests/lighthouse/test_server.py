"""The gRPC service: torchft's own client (its Rust extension, loaded without torch) gets
quorums from it; hostile, oversized, unauthorised and unbounded calls are refused."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from elasticd.lighthouse import peer, proto, server
from elasticd.lighthouse.proto import QuorumMember
from elasticd.lighthouse.rules import Settings
from elasticd.lighthouse.server import Lighthouse
from elasticd.testing import MemoryStore

grpc = pytest.importorskip("grpc")
pytestmark = pytest.mark.timeout(60)

SETTINGS = Settings(min_replicas=2, join_timeout=0.5, heartbeat_timeout=1.0)


def torchft_extension() -> ModuleType:
    """torchft's compiled client, without ``import torchft`` (which imports torch)."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchft is not installed")
    found = list(Path(spec.submodule_search_locations[0]).glob("_torchft*.so"))
    ext_spec = importlib.util.spec_from_file_location("torchft._torchft", found[0])
    assert ext_spec is not None and ext_spec.loader is not None
    module = importlib.util.module_from_spec(ext_spec)
    ext_spec.loader.exec_module(module)
    return module


@pytest.fixture
async def lighthouse() -> AsyncIterator[Lighthouse]:
    async with MemoryStore() as store:
        lease = await store.grant(30.0)

        async def get_lease() -> int:
            return lease

        async with Lighthouse(store, "n1", get_lease) as lh:
            yield lh


async def in_threads(*calls: Any) -> list[Any]:
    """Run blocking client calls side by side without blocking the server's loop."""
    return await asyncio.gather(*(asyncio.to_thread(call) for call in calls))


async def test_torchfts_client_gets_a_quorum_and_heartbeats(lighthouse: Lighthouse) -> None:
    """Two of torchft's LighthouseClients: heartbeat, then one quorum naming both."""
    ext = torchft_extension()
    address = await lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS)
    assert address.startswith("http://127.0.0.1:")

    def ask(replica: str) -> Any:
        client = ext.LighthouseClient(address, timedelta(seconds=5))
        client.heartbeat(replica)
        return client.quorum(
            replica,
            timedelta(seconds=20),
            address=f"a-{replica}",
            store_address="s",
            step=7,
            world_size=1,
            data={"k": 1},
        )

    q1, q2 = await in_threads(lambda: ask("r1"), lambda: ask("r2"))
    assert q1.quorum_id == q2.quorum_id == 1
    assert [p.replica_id for p in q1.participants] == ["r1", "r2"]
    assert [p.address for p in q1.participants] == ["a-r1", "a-r2"]
    assert q1.participants[0].step == 7
    assert q1.created.seconds > 1_600_000_000


async def call(address: str, method: str, body: bytes, timeout: float = 5.0) -> bytes:
    async with grpc.aio.insecure_channel(address.removeprefix("http://")) as channel:
        stub = channel.unary_unary(f"/torchft.LighthouseService/{method}")
        result: bytes = await stub(body, timeout=timeout)
        return result


async def status_of(address: str, method: str, body: bytes, timeout: float = 5.0) -> Any:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(address, method, body, timeout)
    return info.value.code(), info.value.details()


async def test_malformed_and_oversized_requests_are_refused(lighthouse: Lighthouse) -> None:
    address = await lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS)
    code, details = await status_of(address, "Quorum", b"\x0e")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "wire type 6" in details
    code, details = await status_of(address, "Quorum", b"")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no requester" in details
    code, _ = await status_of(address, "Quorum", proto.encode_quorum_request(QuorumMember()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await status_of(address, "Heartbeat", b"\x0a" + b"\xff\xff\x07" + b"x" * 131071)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await call(address, "Heartbeat", proto.encode_heartbeat_request("r1")) == b""


async def test_a_poll_is_bounded_in_time_and_number(
    lighthouse: Lighthouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_POLL_SECONDS a poll ends DEADLINE_EXCEEDED; past MAX_WAITING_POLLS a new
    one is RESOURCE_EXHAUSTED at once."""
    monkeypatch.setattr(server, "MAX_POLL_SECONDS", 0.3)
    monkeypatch.setattr(server, "MAX_WAITING_POLLS", 1)
    address = await lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS)
    lonely = proto.encode_quorum_request(QuorumMember("r1"))
    code, details = await status_of(address, "Quorum", lonely)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no quorum" in details
    monkeypatch.setattr(server, "MAX_POLL_SECONDS", 5.0)
    first = asyncio.create_task(call(address, "Quorum", lonely, timeout=2.0))
    jq = lighthouse.quorum("job1")
    assert jq is not None
    async with asyncio.timeout(5):
        while jq.waiting < 1:
            await asyncio.sleep(0.01)
    code, details = await status_of(
        address, "Quorum", proto.encode_quorum_request(QuorumMember("r2"))
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already wait" in details
    with pytest.raises(grpc.aio.AioRpcError):
        await first


async def test_another_users_socket_is_refused() -> None:
    """The kernel's table names another uid for the client socket: PERMISSION_DENIED; the
    job's own uid, from the same tables, is let in."""
    job_uid = 4242

    def tables_as(uid: int) -> Any:
        def read() -> list[peer.TcpRow] | None:
            rows = peer.read_tables() or []
            return [peer.TcpRow(r.local, r.remote, uid, r.inode) for r in rows]

        return read

    async with MemoryStore() as store:
        lease = await store.grant(30.0)

        async def get_lease() -> int:
            return lease

        for uid, allowed in ((4343, False), (job_uid, True)):
            async with Lighthouse(store, "n1", get_lease, tcp_tables=tables_as(uid)) as lh:
                address = await lh.serve("job1", uid=job_uid, settings=SETTINGS)
                beat = proto.encode_heartbeat_request("r1")
                if allowed:
                    assert await call(address, "Heartbeat", beat) == b""
                else:
                    code, details = await status_of(address, "Heartbeat", beat)
                    assert code == grpc.StatusCode.PERMISSION_DENIED and "4343" in details


async def test_serve_is_idempotent_and_close_frees_the_port(lighthouse: Lighthouse) -> None:
    """Serving twice gives one address; after close, a re-exec can bind the same port."""
    address = await lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS)
    assert await lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS) == address
    port = int(address.rsplit(":", 1)[1])
    await lighthouse.close("job1", leave=False)
    assert lighthouse.address("job1") is None
    again = await lighthouse.serve("job1", uid=os.getuid(), settings=SETTINGS, port=port)
    assert again == address
