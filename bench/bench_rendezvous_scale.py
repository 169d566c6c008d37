"""Issue #4's scale figure: N simulated nodes complete one rendezvous round.

Each simulated node is one :class:`~elasticd.rendezvous.StoreRendezvous` (the
executor the daemon's agents use, unchanged) driven by one asyncio task, with
its own lease, in this one process. ``min_nodes = max_nodes = N``, so the
round completes the moment the N-th node is placed. The figure is the wall
time from starting every node's ``next_round()`` to the last one returning
(leases are granted before the clock starts, with a TTL longer than the
round may take, and not kept alive: leases and their keep-alives are the
daemon's, one per node whatever it runs, not the rendezvous's). Every
returned round is checked: world size N, group ranks
0..N-1 each exactly once, one master.

Backends (``--backends``):

``embedded``  :class:`EmbeddedStore` in this process (the daemon's default
              store: memory + SQLite journal, ``synchronous=FULL``), shared
              by every node;
``memory``    :class:`MemoryStore` in this process (no disk; a reference);
``http``      a real ``python -m api.store_server`` subprocess (embedded
              store, FULL) reached through :class:`HttpStore`; with ``N``
              nodes in one process the nodes share ``--http-clients`` HttpStore
              instances (default 1: one keep-alive connection pool, one
              connection per request in flight, long-polls included);
``etcd``      a real single-member ``etcd`` on loopback, through
              :class:`EtcdStore` (JSON gateway), shared the same way.

Every node talks to the store through its own counting proxy, so the
figures include store requests per node (mean and max, and per operation),
the CAS races lost, and how many entries the node's ``list`` calls returned
(the data a node reads, which is what grows with N).

Sizes run in increasing order; a size that does not finish within
``--budget`` seconds is recorded as such and the larger ones are skipped for
that backend (so the largest N that fits and the growth trend are reported).
Smaller sizes repeat (median reported) while they fit in a per-size time
budget.

Usage::

    .venv/bin/python bench/bench_rendezvous_scale.py [--quick] [--backends embedded,http,etcd]
        [--sizes 10,100,1000] [--budget 60] [--json out.json]
    .venv/bin/python bench/bench_rendezvous_scale.py --profile embedded:300   # cProfile one run

The collector: the simulation's own objects are frozen out of it, and full
collections wait for the end of each round (``--full-gc``: they run during
it); see :func:`one_round`. Young collections are timed ("of which GC"), and
so is the full collection right after the round ("full GC after").

Only loopback is used; every process started is in its own session and is
killed at the end. No torch.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from _common import (  # noqa: E402
    PYTHON,
    fmt,
    free_port,
    machine_info,
    md_table,
    proc_cpu_seconds,
    scratch,
    stop_process,
)

from elasticd.rendezvous import (  # noqa: E402
    Change,
    Settings,
    StoreRendezvous,
)
from elasticd.rendezvous.interface import RoundInfo  # noqa: E402
from elasticd.rendezvous.layout import state_key  # noqa: E402
from elasticd.store.base import CasResult, Entry, Listing, Store, WatchEvent  # noqa: E402

TOKEN = "bench-scale-token"
BACKENDS = ("embedded", "memory", "http", "etcd")


# -- a store proxy that counts what one node asks --------------------------------------


class CountingStore(Store):
    """Forwards to ``inner`` and counts each call in ``counts`` (one proxy per node)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.counts: collections.Counter[str] = collections.Counter()
        self.listed_entries = 0
        self.cas_lost = 0

    async def get(self, key: str) -> Entry | None:
        self.counts["get"] += 1
        return await self.inner.get(key)

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int | None, *, lease: int | None = None
    ) -> CasResult:
        self.counts["cas"] += 1
        result = await self.inner.compare_and_set(key, value, expected_version, lease=lease)
        if not result.ok:
            self.cas_lost += 1
        return result

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> Entry:
        self.counts["put"] += 1
        return await self.inner.put(key, value, lease=lease)

    async def put_batch(self, items: Sequence[tuple[str, bytes]]) -> list[Entry]:
        self.counts["put_batch"] += 1
        return await self.inner.put_batch(items)

    async def add(self, key: str, delta: int = 1) -> int:
        self.counts["add"] += 1
        return await self.inner.add(key, delta)

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        self.counts["delete"] += 1
        return await self.inner.delete(key, expected_version)

    async def list(self, prefix: str) -> Listing:
        self.counts["list"] += 1
        listing = await self.inner.list(prefix)
        self.listed_entries += len(listing.entries)
        return listing

    async def grant(self, ttl: float) -> int:
        self.counts["grant"] += 1
        return await self.inner.grant(ttl)

    async def keep_alive(self, lease: int) -> None:
        self.counts["keep_alive"] += 1
        await self.inner.keep_alive(lease)

    async def revoke(self, lease: int) -> None:
        self.counts["revoke"] += 1
        await self.inner.revoke(lease)

    async def watch(
        self, key: str, after_version: int, timeout: float, *, prefix: bool = False
    ) -> list[WatchEvent]:
        self.counts["watch"] += 1
        return await self.inner.watch(key, after_version, timeout, prefix=prefix)

    async def close(self) -> None:  # the shared inner store is closed by its owner
        pass

    def reset(self) -> None:
        self.counts.clear()
        self.listed_entries = 0
        self.cas_lost = 0


# -- backends -------------------------------------------------------------------------------


@dataclass
class Backend:
    """Store clients for the simulated nodes, and the server process (if any)."""

    name: str
    clients: list[Store]
    describe: str
    server: subprocess.Popen[bytes] | None = None
    cleanup: list[Callable[[], Any]] = field(default_factory=list)

    def client_for(self, node: int) -> Store:
        return self.clients[node % len(self.clients)]

    def server_cpu(self) -> float | None:
        if self.server is None or self.server.poll() is not None:
            return None
        try:
            return proc_cpu_seconds(self.server.pid)
        except OSError:
            return None

    async def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                await client.close()
        for step in reversed(self.cleanup):
            with contextlib.suppress(Exception):
                step()


def start_store_server(
    root: Path, profile: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m api.store_server`` on a free loopback port; (process, url).

    With ``profile`` the server runs under cProfile and writes its stats there when
    it stops (SIGTERM ends it normally).
    """
    token_file = root / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    log = root / "store-server.log"
    proc = subprocess.Popen(
        [
            PYTHON,
            *(["-m", "cProfile", "-o", profile] if profile else []),
            "-m",
            "api.store_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--state-dir",
            str(root / "store"),
            "--token-file",
            str(token_file),
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
        start_new_session=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    url = None
    os.set_blocking(proc.stdout.fileno(), False)
    buffer = b""
    while time.monotonic() < deadline and url is None:
        if proc.poll() is not None:
            raise RuntimeError(f"store server exited: {log.read_text()[-2000:]}")
        chunk = proc.stdout.read() or b""
        buffer += chunk
        for line in buffer.decode(errors="replace").splitlines():
            if line.startswith("listening on "):
                url = line.split("listening on ", 1)[1].strip()
        time.sleep(0.02)
    if url is None:
        stop_process(proc, grace=2)
        raise RuntimeError("store server did not say where it listens within 30 s")
    return proc, url


def start_etcd(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A single-member etcd on free loopback ports (as tests/store/etcd_server.py); (proc, url)."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("etcd is not installed (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = root / "etcd.log"
    proc = subprocess.Popen(
        [
            binary,
            "--name=bench",
            f"--data-dir={root / 'etcd-data'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=bench={peer_url}",
            "--heartbeat-interval=10",
            "--election-timeout=50",
            "--max-request-bytes=8388608",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=error",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited: {log.read_text()[-2000:]}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url + "/health", timeout=1) as response,
        ):
            if b'"true"' in response.read():
                return proc, url
        if time.monotonic() > deadline:
            stop_process(proc, grace=2)
            raise RuntimeError("etcd not healthy within 20 s")
        time.sleep(0.05)


async def open_backend(
    name: str, root: Path, http_clients: int, server_profile: str | None = None
) -> Backend:
    os.makedirs(root, exist_ok=True)
    if name == "memory":
        from elasticd.store.memory import MemoryStore

        return Backend(name, [MemoryStore()], "MemoryStore, in this process")
    if name == "embedded":
        from elasticd.store.embedded import EmbeddedStore

        store = EmbeddedStore(root / "embedded" / "store.sqlite3")
        return Backend(name, [store], "EmbeddedStore (SQLite, synchronous=FULL), in this process")
    if name == "http":
        from elasticd.store.http import HttpStore

        proc, url = start_store_server(root, server_profile)
        backend = Backend(
            name,
            [HttpStore(url, TOKEN, timeout=60) for _ in range(http_clients)],
            f"python -m api.store_server (EmbeddedStore, FULL) + {http_clients} shared "
            "HttpStore client(s)",
            server=proc,
        )
        backend.cleanup.append(lambda: stop_process(proc, grace=5))
        return backend
    if name == "etcd":
        from elasticd.store.etcd import EtcdStore

        proc, url = start_etcd(root)
        backend = Backend(
            name,
            [EtcdStore([url], timeout=60) for _ in range(http_clients)],
            f"etcd (single member, loopback) + {http_clients} shared EtcdStore client(s)",
            server=proc,
        )
        backend.cleanup.append(lambda: stop_process(proc, grace=5))
        return backend
    raise ValueError(f"unknown backend {name!r}")


class GcClock:
    """A ``gc.callbacks`` entry that adds up the time collections take."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.spent += time.process_time() - self._start


# -- one round --------------------------------------------------------------------------------


@dataclass
class RoundResult:
    backend: str
    nodes: int
    ok: bool
    seconds: float | None
    """Wall time from starting every next_round() to the last one returning."""
    error: str | None = None
    requests_mean: float | None = None
    requests_max: int | None = None
    per_op_mean: dict[str, float] = field(default_factory=dict)
    cas_lost_mean: float | None = None
    listed_entries_mean: float | None = None
    client_cpu_s: float | None = None
    server_cpu_s: float | None = None
    node_p50_s: float | None = None
    gc_s: float | None = None
    """Of the client CPU: CPython's cyclic garbage collector, during the timed round."""
    deferred_gc_s: float | None = None
    """The full collection run right after the round (not in client_cpu_s): see one_round."""


#: The full-collection threshold during a timed round: never (see one_round).
DEFERRED = 1 << 30
GC_NOTE = (
    "Collector: the simulation's own objects (the N agents, proxies, leases) are frozen "
    "out of it, and full collections wait for the end of each round (in one process they "
    "walk all N nodes' in-flight tasks); young collections run as usual. 'of which GC' is "
    "the collector's time during the round, 'full GC after' the one full collection run "
    "right after it (not in client CPU). --full-gc keeps full collections in the round."
)
GC_NOTE_FULL = (
    "Collector: the simulation's own objects (the N agents, proxies, leases) are frozen "
    "out of it; every collection runs during the round ('of which GC')."
)


async def one_round(
    backend: Backend,
    n: int,
    budget: float,
    lease_ttl: float,
    restart: bool = False,
    defer_full_gc: bool = True,
) -> RoundResult:
    """N nodes, one rendezvous round; bounded by ``budget`` seconds.

    With ``restart`` the round measured is the *second*: the first completes
    untimed, every node then watches it as a running node does
    (``wait_for_change``), one node fails (calls ``next_round`` as its agent
    does after a worker crash), and the clock runs from that call to the last
    node back in the new round. Requests are counted from the failure on.
    """
    job = f"scale-{n}-{uuid.uuid4().hex[:8]}"
    gate = asyncio.Semaphore(64)

    async def grant(i: int) -> int:
        async with gate:
            return await backend.client_for(i).grant(lease_ttl)

    leases = await asyncio.gather(*(grant(i) for i in range(n)))
    proxies = [CountingStore(backend.client_for(i)) for i in range(n)]
    settings = Settings(min_nodes=n, max_nodes=n, join_timeout=budget + 30, last_call_timeout=1.0)

    def node(i: int) -> StoreRendezvous:
        lease = leases[i]

        async def my_lease() -> int:
            return lease

        return StoreRendezvous(
            proxies[i],
            job,
            node=f"n{i:05d}",
            role="default",
            local_world_size=1,
            advertise_addr="127.0.0.1",
            settings=settings,
            lease=my_lease,
        )

    nodes = [node(i) for i in range(n)]
    finished: list[float] = [0.0] * n

    async def run(i: int) -> RoundInfo:
        info = await nodes[i].next_round()
        finished[i] = time.perf_counter()
        return info

    starters: list[Callable[[int], Awaitable[RoundInfo]]] = [run] * n
    watching: list[asyncio.Task[Change]] = []
    if restart:
        async with asyncio.timeout(budget):
            first = await asyncio.gather(*(nodes[i].next_round() for i in range(n)))
        for p in proxies:
            p.reset()  # so that the wait below sees the survivors' watches, not the round's
        watching = [
            asyncio.create_task(nodes[i].wait_for_change(first[i].round)) for i in range(1, n)
        ]
        async with asyncio.timeout(budget):  # every survivor is watching before the failure
            while any(proxies[i].counts["watch"] == 0 for i in range(1, n)):
                await asyncio.sleep(0.01)
        for p in proxies:
            p.reset()

        async def rejoin(i: int) -> RoundInfo:
            await watching[i - 1]
            return await run(i)

        starters = [run] + [rejoin] * (n - 1)  # node 0 fails; the others notice
    # The simulation's own state (N agents, proxies, leases, the watching tasks) goes
    # to the collector's permanent generation: in a cluster each node is its own
    # process, and the collector walking ten thousand agents' objects at every full
    # collection is the harness's cost, not the rendezvous's. What the round itself
    # allocates is still collected, and that time is reported (gc_s).
    # The same goes for what the N nodes hold while the round runs (10,000 tasks,
    # their coroutines, closures and contexts: ~180,000 objects at N=10,000): a
    # full collection walks them all, so in one process its cost grows with N and
    # the number of full collections with it, where a real node's process holds one
    # node's. So full collections wait for the end of the round (young ones still
    # run: they cost what the round allocates); the one run then is timed and
    # reported (deferred_gc_s), not hidden.
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    if defer_full_gc:
        gc.set_threshold(thresholds[0], thresholds[1], DEFERRED)
    collecting = GcClock()
    gc.callbacks.append(collecting)
    server_cpu0 = backend.server_cpu()
    cpu0 = time.process_time()
    started = time.perf_counter()
    tasks = [asyncio.create_task(starters[i](i)) for i in range(n)]
    result = RoundResult(backend.name, n, ok=False, seconds=None)
    try:
        async with asyncio.timeout(budget):
            rounds = await asyncio.gather(*tasks)
        result.seconds = time.perf_counter() - started
        ranks = sorted(r.group_rank for r in rounds)
        worlds = {r.group_world_size for r in rounds}
        masters = {(r.master_addr, r.master_port) for r in rounds}
        if ranks != list(range(n)) or worlds != {n} or len(masters) != 1:
            result.error = f"inconsistent rounds: worlds {worlds}, {len(masters)} masters"
        else:
            result.ok = True
        result.node_p50_s = statistics.median(f - started for f in finished)
    except TimeoutError:
        done = sum(1 for t in tasks if t.done() and not t.cancelled())
        result.error = f"not complete within {budget:.0f} s ({done}/{n} nodes finished)"
    except Exception as exc:  # a store error: report it, go on with the next case
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        for t in tasks:
            t.cancel()
        for w in watching:
            w.cancel()
        await asyncio.gather(*tasks, *watching, return_exceptions=True)
    result.client_cpu_s = time.process_time() - cpu0
    gc.callbacks.remove(collecting)
    result.gc_s = collecting.spent
    gc.set_threshold(*thresholds)
    deferred = time.process_time()
    gc.collect()  # what the round left for a full collection (with the threshold restored)
    result.deferred_gc_s = time.process_time() - deferred
    gc.unfreeze()
    server_cpu1 = backend.server_cpu()
    if server_cpu0 is not None and server_cpu1 is not None:
        result.server_cpu_s = server_cpu1 - server_cpu0
    totals = [sum(p.counts.values()) for p in proxies]
    result.requests_mean = statistics.fmean(totals)
    result.requests_max = max(totals)
    ops = sorted({op for p in proxies for op in p.counts})
    result.per_op_mean = {op: statistics.fmean(p.counts[op] for p in proxies) for op in ops}
    result.cas_lost_mean = statistics.fmean(p.cas_lost for p in proxies)
    result.listed_entries_mean = statistics.fmean(p.listed_entries for p in proxies)
    # Clean up outside the measurement: the leases (and their presence keys) and the state.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(60):
            sem = asyncio.Semaphore(64)

            async def revoke(i: int) -> None:
                async with sem:
                    await backend.client_for(i).revoke(leases[i])

            await asyncio.gather(*(revoke(i) for i in range(n)))
            await backend.client_for(0).delete(state_key(job))
    return result


# -- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    repeats: int
    """Runs per size at most (the median is reported)."""
    repeat_budget: float
    """Stop repeating a size once its runs took this long in total."""
    budget: float
    """One round must complete within this many seconds, else larger sizes are skipped."""


FULL = Plan(sizes=(10, 30, 100, 300, 600, 1000), repeats=5, repeat_budget=20.0, budget=60.0)
QUICK = Plan(sizes=(10, 100, 1000), repeats=3, repeat_budget=6.0, budget=20.0)


def summarise(runs: list[RoundResult]) -> RoundResult:
    """The run with the median time (a failed run if every run failed)."""
    good = [r for r in runs if r.ok and r.seconds is not None]
    if not good:
        return runs[-1]
    good.sort(key=lambda r: r.seconds or 0.0)
    return good[(len(good) - 1) // 2]


async def run_backend(
    name: str,
    plan: Plan,
    root: Path,
    http_clients: int,
    lease_ttl: float,
    log: Any,
    restart: bool = False,
    defer_full_gc: bool = True,
) -> tuple[str, list[tuple[RoundResult, int]]]:
    backend = await open_backend(name, root / name, http_clients)
    rows: list[tuple[RoundResult, int]] = []
    try:
        for n in plan.sizes:
            runs: list[RoundResult] = []
            spent = 0.0
            while len(runs) < plan.repeats and (not runs or spent < plan.repeat_budget):
                t = time.monotonic()
                r = await one_round(backend, n, plan.budget, lease_ttl, restart, defer_full_gc)
                spent += time.monotonic() - t
                runs.append(r)
                print(
                    f"  {name:8s} N={n:5d} run {len(runs)}: "
                    + (f"{r.seconds:.3f} s" if r.ok else f"FAILED ({r.error})")
                    + f", {r.requests_mean:.1f} req/node (max {r.requests_max})",
                    file=log,
                    flush=True,
                )
                if not r.ok:
                    break
            best = summarise(runs)
            rows.append((best, sum(1 for r in runs if r.ok)))
            if not best.ok:
                break  # larger sizes would not fit either
        return backend.describe, rows
    finally:
        await backend.close()


def table(results: dict[str, tuple[str, list[tuple[RoundResult, int]]]]) -> str:
    headers = [
        "backend",
        "N",
        "runs",
        "round time p50 (s)",
        "node p50 (s)",
        "req/node mean",
        "req/node max",
        "per op (mean/node)",
        "CAS lost/node",
        "entries listed/node",
        "client CPU (s)",
        "of which GC (s)",
        "full GC after (s)",
        "server CPU (s)",
    ]
    rows = []
    for name, (_, results_) in results.items():
        for r, ok_runs in results_:
            rows.append(
                [
                    name,
                    str(r.nodes),
                    str(ok_runs),
                    fmt(r.seconds, 3) if r.ok else f"**{r.error}**",
                    fmt(r.node_p50_s, 3),
                    fmt(r.requests_mean, 1),
                    str(r.requests_max),
                    " ".join(f"{op} {v:.1f}" for op, v in r.per_op_mean.items()),
                    fmt(r.cas_lost_mean, 2),
                    fmt(r.listed_entries_mean, 0),
                    fmt(r.client_cpu_s, 2),
                    fmt(r.gc_s, 2),
                    fmt(r.deferred_gc_s, 2),
                    fmt(r.server_cpu_s, 2),
                ]
            )
    return md_table(headers, rows)


def total_cpu(r: RoundResult) -> float | None:
    """Client plus server CPU of a round (the server's where there is one)."""
    if r.client_cpu_s is None:
        return None
    return r.client_cpu_s + (r.server_cpu_s or 0.0)


def growth(results: dict[str, tuple[str, list[tuple[RoundResult, int]]]]) -> str:
    """Per backend: time and requests/node ratios between successive sizes ×10 (or as run)."""
    lines = []
    for name, (_, rows) in results.items():
        good = [r for r, _ in rows if r.ok and r.seconds]
        steps = []
        for a, b in zip(good, good[1:], strict=False):
            assert a.seconds is not None
            assert b.seconds is not None
            cpu = ""
            cpu_a, cpu_b = total_cpu(a), total_cpu(b)
            if cpu_a and cpu_b:
                cpu = f", CPU (client+server) ×{cpu_b / cpu_a:.1f}"
            steps.append(
                f"N {a.nodes}→{b.nodes} (×{b.nodes / a.nodes:g}): time ×{b.seconds / a.seconds:.1f}"
                f", req/node {a.requests_mean:.1f}→{b.requests_mean:.1f}{cpu}"
            )
        if len(good) > 2 and total_cpu(good[0]) and total_cpu(good[-1]):
            first, last = good[0], good[-1]
            steps.append(
                f"N {first.nodes}→{last.nodes}: CPU (client+server) "
                f"×{(total_cpu(last) or 0) / (total_cpu(first) or 1):.1f}"
            )
        largest = good[-1].nodes if good else 0
        failed = [r for r, _ in rows if not r.ok]
        tail = f"; N={failed[0].nodes}: {failed[0].error}" if failed else ""
        lines.append(f"* {name}: largest N completed: {largest}{tail}. " + "; ".join(steps))
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if args.sizes:
        plan = Plan(
            tuple(int(s) for s in args.sizes.split(",")),
            plan.repeats,
            plan.repeat_budget,
            plan.budget,
        )
    if args.budget:
        plan = Plan(plan.sizes, plan.repeats, plan.repeat_budget, args.budget)
    if args.lease_ttl is None:
        args.lease_ttl = plan.budget + 120.0
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; expected some of {', '.join(BACKENDS)}")
    mode = "quick" if args.quick else "full"
    what = "re-rendezvous after one node fails" if args.restart else "first round"
    print(f"# rendezvous scale ({mode}; {what})", flush=True)
    print(GC_NOTE if not args.full_gc else GC_NOTE_FULL, flush=True)
    print(json.dumps(machine_info()), flush=True)
    results: dict[str, tuple[str, list[tuple[RoundResult, int]]]] = {}
    errors: dict[str, str] = {}
    with scratch("elasticd-scale-", keep=args.keep) as root:
        for name in backends:
            try:
                results[name] = await run_backend(
                    name,
                    plan,
                    root,
                    args.http_clients,
                    args.lease_ttl,
                    sys.stdout,
                    args.restart,
                    not args.full_gc,
                )
            except Exception:
                errors[name] = traceback.format_exc()
                print(f"{name}: measurement failed:\n{errors[name]}", flush=True)
    print()
    for name, (describe, _) in results.items():
        print(f"* {name}: {describe}")
    print()
    print(table(results))
    print()
    print(growth(results))
    if args.json:
        await asyncio.to_thread(
            Path(args.json).write_text,
            json.dumps(
                {
                    "machine": machine_info(),
                    "plan": plan.__dict__,
                    "results": {
                        k: {"backend": d, "rows": [dict(r.__dict__, ok_runs=c) for r, c in rows]}
                        for k, (d, rows) in results.items()
                    },
                    "errors": errors,
                },
                indent=2,
            ),
        )
    return 2 if errors else 0


def profile(spec: str, args: argparse.Namespace) -> int:
    """cProfile one round (``backend:N``) in this process; print where the time went."""
    name, _, size = spec.partition(":")
    n = int(size or "300")
    if args.lease_ttl is None:
        args.lease_ttl = (args.budget or 120.0) + 120.0

    async def go() -> RoundResult:
        with scratch("elasticd-scale-prof-", keep=args.keep) as root:
            backend = await open_backend(name, root / name, args.http_clients, args.server_profile)
            try:
                profiler = cProfile.Profile()
                profiler.enable()
                try:
                    return await one_round(
                        backend,
                        n,
                        args.budget or 120.0,
                        args.lease_ttl,
                        args.restart,
                        not args.full_gc,
                    )
                finally:
                    profiler.disable()
                    out = io.StringIO()
                    stats = pstats.Stats(profiler, stream=out)
                    stats.sort_stats("tottime").print_stats(25)
                    stats.sort_stats("cumulative").print_stats(r"elasticd", 25)
                    print(out.getvalue())
                    if args.json:
                        stats.dump_stats(args.json)
            finally:
                await backend.close()

    result = asyncio.run(go())
    print(
        f"{name} N={n}: "
        + (f"{result.seconds:.3f} s" if result.ok else f"FAILED: {result.error}")
        + f"; {result.requests_mean:.1f} requests/node, per op {result.per_op_mean}, "
        f"{result.listed_entries_mean:.0f} entries listed/node"
    )
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="sizes 10,100,1000, 20 s budget")
    parser.add_argument("--backends", default="embedded,http,etcd", help=",".join(BACKENDS))
    parser.add_argument(
        "--sizes", help="comma-separated N (default 10,30,100,300,600,1000; quick 10,100,1000)"
    )
    parser.add_argument("--budget", type=float, help="seconds one round may take (60; quick 20)")
    parser.add_argument("--http-clients", type=int, default=1, help="shared store clients")
    parser.add_argument(
        "--lease-ttl", type=float, help="each node's lease TTL (default: the budget + 120 s)"
    )
    parser.add_argument("--profile", metavar="BACKEND:N", help="cProfile one round and exit")
    parser.add_argument(
        "--server-profile",
        metavar="PATH",
        help="with --profile http:N: run the store server under cProfile, stats to PATH",
    )
    parser.add_argument("--json", help="write the figures (or, with --profile, the pstats) here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument(
        "--full-gc",
        action="store_true",
        help="let full collections run during the round (default: deferred to its end)",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="time the re-rendezvous after one node fails (the second round) instead of the first",
    )
    args = parser.parse_args(argv)
    # Whatever happens, this process group's children die with us on SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.profile:
        return profile(args.profile, args)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
