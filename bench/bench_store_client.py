"""The store client's own cost (issue 24): its request path, and a worker's operation.

``path``: :class:`~elasticd.store.http.HttpStore` with its transport answering
at once in this process, so that only the client's code runs (request
building, the gate, the answer's reading): 500 concurrent callers each doing
a get, a put and a compare-and-set; the median of 20 passes of the client's
CPU per call, and the young collections per 1,000 calls (which do not depend
on the machine's load). Runs against any tree whose ``HttpStore`` has the
wire client (``PYTHONPATH`` picks the tree).

``worker``: the workers' ``ClusterStoreClient`` against a real store server
(uvicorn on loopback, in a thread of this process): sequential set + get,
the p50 and p90 of one operation, and the CPU per operation (client and
server, one process).

Usage::

    PYTHONPATH=$PWD .venv/bin/python bench/bench_store_client.py [path | worker] [--ops 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ENTRY = b'{"entry":{"key":"k/a","value":"eHh4","version":3,"created":1,"lease":null}}'
CAS = b'{"ok":true,"entry":{"key":"k/a","value":"eHh4","version":4,"created":1,"lease":null}}'


def path(callers: int = 500, passes: int = 20) -> dict[str, Any]:
    from elasticd.store.http import HttpStore
    from elasticd.store.wire import WireResponse

    async def answer(method: str, path: str, **_: Any) -> WireResponse:
        await asyncio.sleep(0)  # one suspension, as a real answer has
        return WireResponse(200, "OK", {}, CAS if path == "/store/cas" else ENTRY)

    async def main() -> tuple[float, float]:
        store = HttpStore("http://127.0.0.1:1", "token")
        store._wire.request = answer  # type: ignore[union-attr, method-assign]

        async def one() -> None:
            await store.get("k/a")
            await store.put("k/a", b"xxx")
            await store.compare_and_set("k/a", b"y", 3)

        await asyncio.gather(*(one() for _ in range(callers)))  # warm
        young = gc.get_stats()[0]["collections"]
        times = []
        for _ in range(passes):
            started = time.process_time()
            await asyncio.gather(*(one() for _ in range(callers)))
            times.append(time.process_time() - started)
        calls = 3 * callers * passes
        collected = gc.get_stats()[0]["collections"] - young
        return statistics.median(times) / (3 * callers), collected / calls * 1000

    cpu, young = asyncio.run(main())
    return {
        "client_cpu_us_per_call": round(cpu * 1e6, 2),
        "young_gc_per_1000_calls": round(young, 2),
    }


@contextmanager
def store_server(token: str) -> Iterator[str]:
    from api.store_server import serve_store
    from elasticd.store.memory import MemoryStore

    urls: list[str] = []
    listening = threading.Event()
    stop: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        event = asyncio.Event()
        stop.append((asyncio.get_running_loop(), event))

        def on_listening(url: str) -> None:
            urls.append(url)
            listening.set()

        await serve_store(
            MemoryStore(), host="127.0.0.1", port=0, token=token, stop=event,
            on_listening=on_listening,
        )  # fmt: skip

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    if not listening.wait(30):
        raise RuntimeError("the store server did not start")
    try:
        yield urls[0]
    finally:
        loop, event = stop[0]
        loop.call_soon_threadsafe(event.set)
        thread.join(10)


def worker(ops: int) -> dict[str, Any]:
    from elasticd.worker.store import ClusterStoreClient

    with store_server("token") as url, ClusterStoreClient(url, "token", "jobs/b/") as client:
        client.set("warm", b"1")
        samples = []
        started = time.process_time()
        for i in range(ops // 2):
            t = time.perf_counter()
            client.set(f"k{i % 50}", b"x" * 64)
            client.get_now(f"k{i % 50}")
            samples.append((time.perf_counter() - t) / 2)
        cpu = time.process_time() - started
    return {
        "p50_us": round(statistics.median(samples) * 1e6),
        "p90_us": round(statistics.quantiles(samples, n=10)[-1] * 1e6),
        "cpu_us_per_op": round(cpu / ops * 1e6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["path", "worker"], help="default: both")
    parser.add_argument("--ops", type=int, default=4000, help="worker: operations")
    args = parser.parse_args()
    if args.what in (None, "path"):
        print(json.dumps({"path": path()}))
    if args.what in (None, "worker"):
        print(json.dumps({"worker": worker(args.ops)}))


if __name__ == "__main__":
    main()
