"""Store throughput and watch latency over loopback, with torch's TCPStore as a reference.

Measures, in one run on this machine:

* CAS writes/s with ``--clients`` concurrent clients, each CAS-ing its own key
  in a loop (every CAS succeeds, so this is write throughput, not contention);
* watch wake-up latency: the time from starting a write to the moment a
  client blocked in ``watch`` on that key returns with it (p50 and p99);

for the embedded store served by ``python -m api.store_server`` (a real
subprocess, SQLite ``synchronous=FULL``), twice: once through a lean raw
HTTP/1.1 load generator (the server's capacity: httpx spends ~10x the CPU per
request that the server does, so through HttpStore the client process
saturates first on a small machine), once through :class:`HttpStore` (what a
daemon sees); for a local single-member etcd through :class:`EtcdStore`; and
``torch.distributed.TCPStore.compare_set`` with as many client threads,
in-process TCPStore server, as a reference.

Run::

    .venv/bin/python bench/bench_store.py            # all three, markdown table
    .venv/bin/python bench/bench_store.py --seconds 3 --skip-etcd --skip-torch

Only loopback is used. The daemon never imports torch; this benchmark does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TCPStore warns per connection
sys.path.insert(0, str(ROOT))

from elasticd.store.base import Store  # noqa: E402
from elasticd.store.etcd import EtcdStore  # noqa: E402
from elasticd.store.http import HttpStore  # noqa: E402

TOKEN = "bench-token"


@dataclass
class Result:
    """One row of the table."""

    name: str
    cas_per_s: float | None
    p50_ms: float | None
    p99_ms: float | None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- workloads -------------------------------------------------------------------


async def cas_throughput(clients: list[Store], tasks: int, seconds: float, tag: str) -> float:
    """Successful CAS writes per second from ``tasks`` concurrent loops over ``clients``."""
    done = 0
    stop_at = 0.0

    async def loop(i: int) -> None:
        nonlocal done
        store = clients[i % len(clients)]
        key = f"/bench/{tag}/cas/{i}"
        version: int | None = None
        value = b"x" * 64
        while time.perf_counter() < stop_at:
            result = await store.compare_and_set(key, value, version)
            assert result.ok
            assert result.entry is not None
            version = result.entry.version
            done += 1

    # Warm up connections and code paths.
    stop_at = time.perf_counter() + 0.5
    await asyncio.gather(*(loop(i) for i in range(tasks)))
    done = 0
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(loop(i + tasks) for i in range(tasks)))
    return done / (time.perf_counter() - started)


async def raw_cas_throughput(url: str, connections: int, seconds: float, tag: str) -> float:
    """Server capacity: CAS/s from a lean HTTP/1.1 keep-alive load generator.

    httpx costs ~10x more CPU per request than the server does on a small
    machine, so with HttpStore the client process saturates first. This sends
    the same requests HttpStore sends, over raw asyncio streams.
    """
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    done = 0
    stop_at = 0.0

    async def loop(i: int) -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection(host, int(port))
        key = f"/bench/{tag}/raw/{i}"
        version: int | None = None
        try:
            while time.perf_counter() < stop_at:
                body = json.dumps(
                    {"key": key, "value": "eHh4" * 16, "expected_version": version, "lease": None}
                ).encode()
                writer.write(
                    b"POST /store/cas HTTP/1.1\r\nhost: bench\r\n"
                    b"authorization: Bearer " + TOKEN.encode() + b"\r\n"
                    b"content-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                answer = json.loads(await reader.readexactly(length))
                assert answer["ok"], answer
                version = answer["entry"]["version"]
                done += 1
        finally:
            writer.close()

    stop_at = time.perf_counter() + 0.5
    await asyncio.gather(*(loop(i) for i in range(connections)))
    done = 0
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(loop(i + connections) for i in range(connections)))
    return done / (time.perf_counter() - started)


async def watch_latency(
    watcher: Store, writer: Store, samples: int, tag: str
) -> tuple[float, float]:
    """p50 and p99 (ms) from starting a put to a pending watch returning with it."""
    key = f"/bench/{tag}/watch"
    entry = await writer.put(key, b"0")
    latencies: list[float] = []
    armed = asyncio.Event()
    started_at = 0.0

    async def watch_loop() -> None:
        after = entry.version
        for _ in range(samples):
            armed.set()
            events = await watcher.watch(key, after, 30)
            latencies.append(time.perf_counter() - started_at)
            after = events[-1].revision

    watching = asyncio.create_task(watch_loop())
    for i in range(samples):
        await armed.wait()
        armed.clear()
        await asyncio.sleep(0.005)  # let the long-poll reach the server
        started_at = time.perf_counter()
        await writer.put(key, str(i).encode())
        while len(latencies) <= i and not watching.done():
            await asyncio.sleep(0)
    await watching
    latencies.sort()
    p50 = statistics.median(latencies) * 1000
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000
    return p50, p99


async def bench_store(name: str, factory: object, args: argparse.Namespace) -> Result:
    """Both figures for the store that ``factory()`` opens clients of."""
    assert callable(factory)
    clients: list[Store] = [factory() for _ in range(args.clients)]  # one client per loop
    try:
        cas = await cas_throughput(clients, args.clients, args.seconds, name)
        watcher, writer = factory(), factory()
        try:
            p50, p99 = await watch_latency(watcher, writer, args.samples, name)
        finally:
            await watcher.close()
            await writer.close()
    finally:
        for client in clients:
            await client.close()
    return Result(name, cas, p50, p99)


# -- servers -----------------------------------------------------------------------


def start_embedded(state_dir: Path, synchronous: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m api.store_server`` on a free port; returns it and its URL."""
    token_file = state_dir / "token"
    token_file.write_text(TOKEN)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "api.store_server",
            "--port",
            "0",
            "--state-dir",
            str(state_dir),
            "--token-file",
            str(token_file),
            "--synchronous",
            synchronous,
        ],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    if not line.startswith("listening on "):
        process.kill()
        raise RuntimeError(f"store server did not start: {line!r}")
    return process, line.split()[-1]


def start_etcd(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A single-member etcd on free loopback ports; returns it and its client URL."""
    binary = shutil.which("etcd")
    if binary is None:
        raise FileNotFoundError("etcd")
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    process = subprocess.Popen(
        [
            binary,
            f"--data-dir={data_dir}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--log-level=error",
            "--logger=zap",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if b'"true"' in response.read():
                    return process, url
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("etcd did not become healthy")
        time.sleep(0.05)


def torch_compare_set(threads: int, seconds: float) -> float | None:
    """TCPStore.compare_set calls per second from ``threads`` client threads."""
    try:
        from datetime import timedelta

        import torch.distributed as dist
    except ImportError:
        return None
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    counts = [0] * threads
    stop_at = 0.0
    ready = threading.Barrier(threads + 1)
    go = threading.Barrier(threads + 1)

    def run(i: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        key = f"cas/{i}"
        current = b""
        ready.wait()
        go.wait()
        while time.perf_counter() < stop_at:
            new = str(counts[i]).encode()
            got = client.compare_set(key, current, new)
            assert got == new, (got, new)
            current = new
            counts[i] += 1

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()  # every client is connected
    started = time.perf_counter()
    stop_at = started + seconds
    go.wait()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    del server
    return sum(counts) / elapsed


# -- main ----------------------------------------------------------------------------


def table(results: list[Result], args: argparse.Namespace) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"| store ({args.clients} clients, {os.cpu_count()} cores, loopback) "
        "| CAS writes/s | watch wake-up p50 (ms) | p99 (ms) |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {fmt(r.cas_per_s, ',.0f')} | {fmt(r.p50_ms, '.2f')} "
            f"| {fmt(r.p99_ms, '.2f')} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        process, url = start_embedded(Path(tmp), args.synchronous)
        try:
            capacity = await raw_cas_throughput(url, args.clients, args.seconds, "raw")
            results.append(
                Result(
                    f"elasticd embedded, server capacity (SQLite {args.synchronous}, "
                    "lean HTTP/1.1 load generator)",
                    capacity,
                    None,
                    None,
                )
            )
            results.append(
                await bench_store(
                    f"elasticd embedded via HttpStore (lean HTTP/1.1 client, SQLite {args.synchronous})",
                    lambda: HttpStore(url, TOKEN),
                    args,
                )
            )
        finally:
            process.terminate()
            process.wait(timeout=30)
        if not args.skip_etcd:
            try:
                etcd, etcd_url = start_etcd(Path(tmp) / "etcd")
            except FileNotFoundError:
                print("etcd not installed: skipping it", file=sys.stderr)
            else:
                try:
                    results.append(
                        await bench_store(
                            "etcd 3.4 (JSON gateway, EtcdStore)",
                            lambda: EtcdStore([etcd_url]),
                            args,
                        )
                    )
                finally:
                    etcd.kill()
                    etcd.wait()
    if not args.skip_torch:
        rate = await asyncio.to_thread(torch_compare_set, args.clients, args.seconds)
        results.append(Result("torch TCPStore compare_set (reference)", rate, None, None))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent CAS loops")
    parser.add_argument("--connections", type=int, default=8, help="HTTP clients the loops share")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each CAS run")
    parser.add_argument("--samples", type=int, default=300, help="watch wake-ups to time")
    parser.add_argument("--synchronous", choices=["FULL", "NORMAL"], default="FULL")
    parser.add_argument("--skip-etcd", action="store_true")
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print(table(results, args))


if __name__ == "__main__":
    main()
