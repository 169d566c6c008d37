"""An etcd call answers within its deadline, and asks for a leader (issue 12, defect 3).

Under quorum loss a member holds a read or a write until its own request
timeout, and a plain watch on it stays open for ever. The client bounds every
call as a whole (fail-over included) and sends etcd's require-leader metadata
so that a member without a leader refuses at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from elasticd.errors import StoreUnavailable
from elasticd.store import etcd_call_timeouts
from elasticd.store.etcd import ELECTION_WAIT, EtcdStore

from .fake_http import FakeConn, fake_http

pytestmark = pytest.mark.timeout(30)


async def test_a_call_to_members_that_hang_ends_at_its_deadline() -> None:
    """Two members that take requests and never answer: a read fails over, then gives up at
    the deadline, not after one timeout per member."""

    async def hang(conn: FakeConn) -> None:
        while await conn.request() is not None:
            await conn.server.release.wait()

    async with (
        fake_http(hang) as first,
        fake_http(hang) as second,
        EtcdStore([first.address, second.address], timeout=0.6, deadline=0.9) as store,
    ):
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"did not answer /kv/range within 0\.9s"):
            await store.get("/k")
        assert time.monotonic() - began < 1.5
        assert len(first.requests) == 1 and len(second.requests) == 1  # it did fail over
        with pytest.raises(StoreUnavailable, match="may or may not have been applied"):
            await store.put("/k", b"v")


async def test_every_request_and_watch_requires_a_leader() -> None:
    """The gateway maps Grpc-Metadata-Hasleader to etcd's require-leader metadata."""

    async def refuse(conn: FakeConn) -> None:
        while await conn.request() is not None:
            await conn.answer(
                b'{"error":"etcdserver: no leader","message":"etcdserver: no leader","code":14}',
                status=503,
            )

    async with fake_http(refuse) as fake, EtcdStore([fake.address], timeout=2) as store:
        began = asyncio.get_running_loop().time()
        with pytest.raises(StoreUnavailable, match="no leader"):
            await store.get("/k")
        # "no leader" is tried again while an election may be on, then given up.
        waited = asyncio.get_running_loop().time() - began
        assert ELECTION_WAIT - 0.5 <= waited <= ELECTION_WAIT + 2, waited
        ranges = len(fake.requests)
        assert ranges > 2
        with pytest.raises(StoreUnavailable, match="no leader"):
            await asyncio.wait_for(store.watch("/k", 0, 5), 10)
    assert len(fake.requests) > ranges
    assert all(h.get("grpc-metadata-hasleader") == "true" for _, h, _ in fake.requests)


@pytest.mark.parametrize(
    ("lease_ttl", "expected"), [(3.0, (1.0, 2.0)), (0.5, (1.0, 2.0)), (30.0, (10.0, 10.0))]
)
def test_call_timeouts_follow_the_lease(lease_ttl: float, expected: tuple[float, float]) -> None:
    """A third and two thirds of the lease, 1 s and 2 s at least, 10 s at most."""
    assert etcd_call_timeouts(lease_ttl) == expected
