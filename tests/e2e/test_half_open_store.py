"""A half-open store link: API calls answer 503 in bounded time, and every ``store.lost``
is followed by its ``store.back`` (issue 23, defect 5).

Node ``n1`` reaches the store on ``n0`` through :class:`HalfOpenProxy`. When the
test turns it half-open, the proxy keeps accepting connections and reading
requests but never answers nor forwards them (a store host that is frozen, or a
black-holed path, looks like this to a client): no error comes back, only
silence. An API call on ``n1`` that needs the store must then answer 503 within
two thirds of the lease (the docs' promise; it waited the client's fixed 10 s),
and after the link heals, ``n1``'s ``store.lost`` in the job's events must be
followed by its ``store.back``, although the plan dropped ``n1`` from the job
meanwhile and tore its agent down (the agent that said ``store.lost`` was the
only one that could say ``store.back``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import LocalCluster
from tests.e2e.fault_support import assert_never_failed, events_of, report, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

LEASE_TTL = 3.0
#: What docs/store.md promises: a store call for the API answers within two thirds of
#: the lease (2 s at least).
PROMISED = max(2.0, LEASE_TTL * 2 / 3)


class HalfOpenProxy:
    """A loopback TCP proxy to ``127.0.0.1:target`` that can turn half-open.

    Half-open: every connection, open or new, is accepted and read, and nothing
    is forwarded or answered. Healing aborts the connections that were silenced
    (their requests are lost, as on a real link that comes back) and forwards
    new ones again.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.silent = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._ends: list[asyncio.StreamWriter] = []
        self._silenced: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._ends:
            writer.transport.abort()
        await asyncio.sleep(0)  # one turn of the loop: the aborted sockets close

    def go_silent(self) -> None:
        self.silent = True

    def heal(self) -> None:
        self.silent = False
        for writer in self._silenced:
            writer.transport.abort()
        self._silenced.clear()

    def _own(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        self._ends.append(writer)
        if self.silent:
            self._silenced.append(writer)
            self._own(self._swallow(reader))
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._ends.append(up_writer)
        self._own(self._pump(reader, up_writer, writer))
        self._own(self._pump(up_reader, writer, up_writer))

    async def _swallow(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while await reader.read(65536):
                pass

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, src_end: asyncio.StreamWriter
    ) -> None:
        """Copy src to dst; while half-open, read and drop (the link is silent both ways)."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65536):
                if self.silent:
                    if src_end not in self._silenced:
                        self._silenced += [src_end, dst]
                    continue
                dst.write(data)
                await dst.drain()
        dst.transport.abort()


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(tmp_path, lease_ttl=LEASE_TTL) as c:
        yield c


async def store_behind_proxy(cluster: LocalCluster) -> HalfOpenProxy:
    """n0 hosts the store; every node started after this reaches it through the proxy."""
    cluster.start("n0")
    await cluster.wait_ready("n0")
    proxy = HalfOpenProxy(cluster.nodes["n0"].port)
    await proxy.start()
    cluster.store_url = f"http://127.0.0.1:{proxy.port}"
    return proxy


async def submit_sleeper(c: httpx.AsyncClient, job_id: str, **fields: Any) -> None:
    """A job whose worker sleeps (termination grace 1 s); 201 or the test fails."""
    job = {
        "id": job_id,
        "entrypoint": sys.executable,
        "args": ["-c", "import time; time.sleep(600)"],
        "termination_grace": 1,
        **fields,
    }
    r = await c.post("/jobs", json=job)
    assert r.status_code == 201, r.text


async def timed(c: httpx.AsyncClient, method: str, path: str, **kw: Any) -> tuple[float, Any]:
    began = time.monotonic()
    r = await c.request(method, path, **kw)
    return time.monotonic() - began, r


def node_events(events: list[dict[str, Any]], node: str) -> list[tuple[str, str]]:
    return [(e["kind"], e["message"]) for e in events if e["node"] == node]


def unanswered_losses(events: list[dict[str, Any]], node: str) -> int:
    """``store.lost`` events of ``node`` not followed by a ``store.back`` of ``node``."""
    open_ = 0
    for e in events:
        if e["node"] != node:
            continue
        if e["kind"] == "store.lost":
            open_ += 1
        elif e["kind"] == "store.back" and open_:
            open_ -= 1
    return open_


async def test_half_open_store_link_answers_503_in_bounded_time_and_pairs_lost_with_back(cluster):
    """n1's link to the store goes silent for 4 leases: its API calls that need the store
    answer 503 naming the wait within two thirds of the lease; once healed, n1's
    ``store.lost`` is followed by its ``store.back`` in the job's events although the plan
    dropped n1 from the job meanwhile; the job never FAILED."""
    proxy = await store_behind_proxy(cluster)
    try:
        cluster.start("n1", "--labels", "host=n1")
        await cluster.wait_ready("n1")
        async with cluster.client("n0") as c0, cluster.client("n1") as c1:
            await submit_sleeper(c0, "elastic", min_nodes=1, max_nodes=2)
            # And a job only n1 may run, cancelled (on n0) while n1 cannot hear of it: its
            # agent on n1 ends without forming another round once the link heals.
            await submit_sleeper(c0, "pinned", node_selector={"host": "n1"})

            async def all_started() -> bool:
                elastic = {
                    e["node"]
                    for e in await events_of(c0, "elastic")
                    if e["kind"] == "workers.started"
                }
                pinned = [
                    e for e in await events_of(c0, "pinned") if e["kind"] == "workers.started"
                ]
                return elastic == {"n0", "n1"} and bool(pinned)

            await until(all_started, 30, "workers of both jobs")

            proxy.go_silent()
            silenced, silenced_wall = time.monotonic(), time.time()
            # API calls on n1 that need the store, while its link is silent.
            worst = 0.0
            for method, path, kw in [
                ("GET", "/jobs/elastic", {}),
                ("GET", "/jobs/elastic/workers", {}),
                ("GET", "/jobs/elastic/events", {}),
                ("POST", "/jobs/elastic/cancel", {"json": {}}),
                ("POST", "/jobs", {"json": {"id": "late", "entrypoint": sys.executable}}),
            ]:
                took, answer = await timed(c1, method, path, **kw)
                worst = max(worst, took)
                assert answer.status_code == 503, (method, path, answer.status_code, answer.text)
                assert "did not answer" in answer.json()["detail"], answer.text
                assert took < PROMISED + 0.5, (method, path, took)
            report("half-open store", "worst API answer on n1 (503)", worst)

            # The silence lasts well past the lease: n1 fences and its agent says store.lost,
            # and the leader (n0) drops n1 from the job's placement.
            # n1 says store.lost for "pinned" (silence + lease + a few bounded calls, under
            # 10 s; its event reaches the store after healing); then n0 cancels it.
            rest = 3 * LEASE_TTL - (time.monotonic() - silenced)
            await asyncio.sleep(max(rest, 0.0))
            r = await c0.post("/jobs/pinned/cancel", json={})
            assert r.status_code == 200, r.text
            rest = 4 * LEASE_TTL - (time.monotonic() - silenced)
            await asyncio.sleep(max(rest, 0.0))  # the fault itself lasts this long
            proxy.heal()
            healed = time.monotonic()

            async def paired() -> bool:
                for job_id in ("elastic", "pinned"):
                    events = await events_of(c0, job_id)
                    kinds = [k for k, _ in node_events(events, "n1")]
                    if "store.lost" not in kinds or unanswered_losses(events, "n1"):
                        return False
                return True

            try:
                await until(paired, 40, "every store.lost of n1 followed by its store.back")
            except AssertionError:
                elastic, pinned = [await events_of(c0, j) for j in ("elastic", "pinned")]
                raise AssertionError(
                    f"elastic: {node_events(elastic, 'n1')}\npinned: {node_events(pinned, 'n1')}"
                    f"\n{cluster.logs()}"
                ) from None
            report(
                "half-open store",
                "heal -> every store.lost of n1 answered",
                time.monotonic() - healed,
            )
            assert (await c0.get("/jobs/pinned")).json()["state"] == "CANCELLED"
            events = await events_of(c0, "elastic")
            # Said within a lease and one bounded call of the silence (was ~12 s after the
            # fence: the agent's call waited the client's 10 s).
            lost = next(e for e in events if e["node"] == "n1" and e["kind"] == "store.lost")
            late = lost["time"] - silenced_wall
            timeline = [
                f"{e['time'] - silenced_wall:+.2f} {e['kind']}" for e in events if e["node"] == "n1"
            ]
            # Fenced within the lease, then at most two bounded calls before the failing one.
            assert late < LEASE_TTL + 3 * PROMISED + 1.0, "\n".join(timeline)
            report("half-open store", "silence -> store.lost of n1", late)
            assert_never_failed(events)
            job = (await c0.get("/jobs/elastic")).json()
            assert job["restart_count"] == 0, job
            r = await c0.post("/jobs/elastic/cancel", json={})
            assert r.status_code == 200, r.text
    finally:
        await proxy.close()


async def test_a_daemon_killed_during_an_outage_says_store_back_after_it_restarts(cluster):
    """n1 says ``store.lost`` for its job while its link is silent, then is kill -9'd and
    started again before the link heals: the new daemon takes up the outage from its own
    events and says ``store.back`` once the store answers (before, the list of open outages
    lived in the dead process, and the ``store.lost`` stayed unanswered for good)."""
    proxy = await store_behind_proxy(cluster)
    try:
        n1 = cluster.start("n1", "--labels", "host=n1")
        await cluster.wait_ready("n1")
        async with cluster.client("n0") as c0:
            await submit_sleeper(c0, "pinned", node_selector={"host": "n1"})

            async def started() -> bool:
                return any(e["kind"] == "workers.started" for e in await events_of(c0, "pinned"))

            await until(started, 30, "the job's worker on n1")
            view = (await c0.get("/jobs/pinned/workers")).json()
            pids = [w["pid"] for g in view["groups"] for w in g["workers"] if w.get("pid")]

            proxy.go_silent()

            async def said_lost() -> bool:
                return "job pinned: store.lost" in n1.log.read_text()

            await until(said_lost, 30, "n1 to say store.lost")
            cluster.kill9("n1", pids)
            n1 = cluster.start("n1", "--labels", "host=n1", port=n1.port)
            await asyncio.sleep(LEASE_TTL)  # the new daemon waits for the silent store a while
            assert n1.proc.poll() is None, n1.log.read_text()[-2000:]
            proxy.heal()

            async def paired() -> bool:
                events = await events_of(c0, "pinned")
                kinds = [k for k, _ in node_events(events, "n1")]
                return "store.lost" in kinds and not unanswered_losses(events, "n1")

            try:
                await until(paired, 40, "n1's store.lost followed by its store.back")
            except AssertionError:
                events = await events_of(c0, "pinned")
                raise AssertionError(f"{node_events(events, 'n1')}\n{cluster.logs()}") from None
            back = [e for e in await events_of(c0, "pinned") if e["kind"] == "store.back"]
            assert back[-1]["node"] == "n1" and back[-1]["duration_s"] >= LEASE_TTL, back
            r = await c0.post("/jobs/pinned/cancel", json={})
            assert r.status_code == 200, r.text
    finally:
        await proxy.close()
