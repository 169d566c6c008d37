"""The worker's cluster-store client: torch's store semantics over the daemon's /store API."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from elasticd.errors import StoreUnavailable
from elasticd.store.blocking import BlockingStore
from elasticd.worker.store import (
    ClusterStoreClient,
    StoreUnreachable,
    attempt_tag,
    default_namespace,
    escape_key,
)
from tests.e2e.cluster import TOKEN as CLUSTER_TOKEN
from tests.e2e.cluster import LocalCluster, free_port

from .support import child_env, finish, spawn, store_server

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """One real store server (uvicorn, loopback, bearer token) for the module."""
    with store_server(TOKEN) as served:
        yield served


@pytest.fixture
def client(url: str, request: pytest.FixtureRequest) -> Iterator[ClusterStoreClient]:
    """A client in a namespace of its own."""
    with ClusterStoreClient(url, TOKEN, f"jobs/t/{request.node.name}/", timeout=10) as c:
        yield c


def test_set_get_add_delete_check(client: ClusterStoreClient) -> None:
    """The basic operations round-trip bytes and counters, in the namespace."""
    client.set("a", b"\x00\xffbinary")
    assert client.get("a") == b"\x00\xffbinary"
    assert client.add("n", 2) == 2 and client.add("n", 3) == 5
    assert client.get("n") == b"5"  # torch reads counters as decimal text too
    assert client.check(["a", "n"]) and not client.check(["a", "zzz"])
    assert client.num_keys() == 2
    assert client.delete("a") and not client.delete("a")
    assert client.get_now("a") is None
    entries, _ = client.listing(client.namespace)
    assert [e.key for e in entries] == [client.namespace + "n"]


def test_compare_set_follows_torch(client: ClusterStoreClient) -> None:
    """compare_set: absent + '' creates; match swaps; mismatch returns the current value."""
    assert client.compare_set("k", b"", b"first") == b"first"
    assert client.compare_set("k", b"first", b"second") == b"second"
    assert client.compare_set("k", b"wrong", b"third") == b"second"
    assert client.compare_set("absent", b"expected", b"x") == b"expected"  # torch's TCPStore answer
    assert client.get_now("absent") is None


def test_compare_set_is_atomic_under_races(client: ClusterStoreClient) -> None:
    """Eight threads incrementing through compare_set lose no update."""

    def bump(tag: int) -> None:
        for i in range(10):
            while True:
                current = client.get_now("ctr") or b"0|"
                desired = f"{int(current.split(b'|')[0]) + 1}|{tag}.{i}".encode()
                if client.compare_set("ctr", current, desired) == desired:
                    break

    client.set("ctr", b"0|")
    threads = [threading.Thread(target=bump, args=(tag,)) for tag in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert client.get("ctr").split(b"|")[0] == b"80"


def test_get_blocks_until_the_key_is_written_by_watching(client: ClusterStoreClient) -> None:
    """A get on an absent key returns as soon as another client writes it (no sleep-and-retry)."""
    writer = ClusterStoreClient(client.base_url, TOKEN, client.namespace)
    results: list[float] = []

    def wait() -> None:
        assert client.get("late", timeout=10) == b"here"
        results.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    written = time.monotonic()
    writer.set("late", b"here")
    thread.join(timeout=10)
    writer.close()
    assert results and results[0] - written < 0.2


def test_wait_times_out_with_timeout_error(client: ClusterStoreClient) -> None:
    """wait() on keys that never appear raises TimeoutError after its timeout."""
    client.set("one", b"1")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="never"):
        client.wait(["one", "never"], timeout=0.4)
    assert 0.4 <= time.monotonic() - started < 2


def test_any_torch_key_is_a_valid_store_key(client: ClusterStoreClient) -> None:
    """Keys with '..', '.', spaces, '%' and control characters are escaped, reversibly distinct."""
    keys = ["a/../b", "..", ".", "x y%z", "tab\there", "/cpu//0/0"]
    for i, key in enumerate(keys):
        client.set(key, str(i).encode())
    assert [client.get(k) for k in keys] == [str(i).encode() for i in range(len(keys))]
    assert escape_key("rank_0/store") == "rank_0/store"
    assert escape_key("a/../b") == "a/%2E%2E/b"


def test_a_wrong_token_fails_at_once(url: str) -> None:
    """A refused token is an error right away (no retrying a 401 until the deadline)."""
    with ClusterStoreClient(url, "wrong", "jobs/t/", timeout=30) as bad:
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match="401"):
            bad.set("k", b"v")
        assert time.monotonic() - started < 2


def test_a_missing_daemon_is_retried_until_the_deadline() -> None:
    """With nobody listening, calls retry with backoff and then raise StoreUnreachable."""
    with ClusterStoreClient("http://127.0.0.1:9", None, "jobs/t/", timeout=0.5) as gone:
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match="could not be reached"):
            gone.get_now("k")
        assert 0.5 <= time.monotonic() - started < 3


def test_the_namespace_comes_from_the_job_and_attempt(tmp_path: Path, url: str) -> None:
    """from_env reads ELASTICD_URL and the token file; keys live under jobs/<job>/torch/<attempt>/."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {
        "ELASTICD_URL": url,
        "ELASTICD_TOKEN_FILE": str(token_file),
        "ELASTICD_JOB_ID": "resnet-1",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    assert attempt_tag(env) == "restart2"
    assert attempt_tag({**env, "ELASTICD_ATTEMPT": "7.2"}) == "7.2"
    assert default_namespace(env) == "jobs/resnet-1/torch/restart2/"
    with ClusterStoreClient.from_env(environ=env) as c:
        c.set("k", b"v")
        assert c.read("jobs/resnet-1/torch/restart2/k") is not None
    with pytest.raises(StoreUnreachable, match="ELASTICD_URL"):
        ClusterStoreClient.from_env(environ={})


TORCH_WORKER = """
    import datetime, os, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from elasticd.worker import store

    rank = int(os.environ["RANK"])
    s = store(timeout=60)
    assert isinstance(s, dist.Store)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", s), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    s.set(f"done/{rank}", str(t.item()))
    s.wait([f"done/{1 - rank}"])
    print("sum", t.item(), s.get(f"done/{1 - rank}").decode(), s.add("n", 1) > 0, flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
async def test_torch_accepts_the_store_for_a_gloo_process_group(tmp_path: Path) -> None:
    """Two real ranks build a gloo process group on elasticd.worker.store() and all-reduce."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with store_server(TOKEN) as served:
        env = {
            "ELASTICD_URL": served,
            "ELASTICD_TOKEN_FILE": str(token_file),
            "ELASTICD_JOB_ID": "gloo",
        }
        procs = [await spawn(TORCH_WORKER, child_env({**env, "RANK": str(r)})) for r in (0, 1)]
        try:
            async with asyncio.timeout(90):
                outs = [await p.communicate() for p in procs]
        finally:
            for p in procs:
                await finish(p)
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err.decode()[-2000:]
        assert out.decode().split() == ["sum", "3.0", "3.0", "True"]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_worker_rides_out_a_daemon_whose_store_answers_503(tmp_path: Path) -> None:
    """A daemon whose store is not up yet answers /store with 503: the daemon's own client
    (FAIL_FAST) raises at once, a worker's client keeps asking and succeeds once it is up."""
    store_port = free_port()
    cluster = LocalCluster(tmp_path, store_url=f"http://127.0.0.1:{store_port}")
    with cluster:
        late = cluster.start("late")
        cluster.store_url = None  # the next node hosts the store, on store_port
        async with cluster.client("late") as c:
            deadline = time.monotonic() + 60
            while True:  # until the daemon answers, with its store still missing
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/healthz")).status_code == 200:
                        break
                assert time.monotonic() < deadline, cluster.logs()
                await asyncio.sleep(0.05)
        fast = BlockingStore(late.url, CLUSTER_TOKEN)
        worker = ClusterStoreClient(late.url, CLUSTER_TOKEN, "jobs/w/torch/0/", timeout=90)
        with fast, worker:
            with pytest.raises(StoreUnavailable, match="503"):
                fast.get("jobs/w/probe")
            writing = asyncio.ensure_future(asyncio.to_thread(worker.set, "k", b"after"))
            # Let the worker ask for a second (pauses 0.05, 0.1, 0.2, 0.4 s: four 503s or
            # more); a worker that gave up on a 503 is done by then with its error.
            await asyncio.wait([writing], timeout=1.0)
            with pytest.raises(StoreUnavailable, match="503"):
                fast.get("jobs/w/probe")  # still no store: what the worker got was 503s
            assert not writing.done()
            cluster.start("n0", port=store_port)
            await asyncio.wait_for(writing, 90)
            assert worker.get_now("k") == b"after"
