"""A cluster of real `elasticd serve` processes on 127.0.0.1, for end-to-end tests.

Node ``n0`` serves the embedded store; the others point ``--store-url`` at it.
All share one bearer token from a 0600 file. Every daemon runs in its own
session so that a test can ``kill -9`` one daemon and its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TOKEN = "e2e-cluster-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class LocalCluster:
    root: Path
    lease_ttl: float = 2.0
    nodes: dict[str, Node] = field(default_factory=dict)
    store_url: str | None = None
    daemon_flags: tuple[str, ...] = ()
    slots: int = 2

    def __post_init__(self) -> None:
        self.token_file = self.root / "token"
        self.token_file.write_text(TOKEN)
        self.token_file.chmod(0o600)

    def start(
        self,
        name: str,
        *extra: str,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        port: int | None = None,
    ) -> Node:
        port = port or free_port()
        state = self.root / name
        state.mkdir(parents=True, exist_ok=True)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
        environ["ELASTICD_LEASE_TTL"] = str(self.lease_ttl)
        environ["ELASTICD_ALLOW_ROOT"] = "true"  # CI runs as root: jobs run as the test's user
        if self.store_url is not None and self.store_url.startswith("etcd"):
            # The test's etcd has no users (etcd's default): a root daemon refuses it unless
            # told every local user is trusted, which holds on a CI machine.
            environ["ELASTICD_ALLOW_INSECURE_STORE"] = "true"
        environ.update(env or {})
        args = [
            sys.executable,
            "-m",
            "elasticd",
            "serve",
            "--port",
            str(port),
            "--node-name",
            name,
            "--state-dir",
            str(state),
            "--slots",
            str(self.slots),
            "--token-file",
            str(self.token_file),
            *extra,
        ]
        if self.store_url is not None:
            args += ["--store-url", self.store_url]
        if netns is not None:
            args = ["ip", "netns", "exec", netns, *args]
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                args, env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = Node(name, port, proc, log)
        self.nodes[name] = node
        if self.store_url is None:
            self.store_url = node.url
        return node

    async def start_store(self, name: str, timeout: float = 60) -> Node:
        """A store-only daemon (``--store-only``: the cluster's store, no agents), ready."""
        node = self.start(name, "--store-only")
        async with self.client(name) as c, asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/readyz")).status_code == 200:
                        return node
                await asyncio.sleep(0.05)

    def client(self, name: str = "n0") -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.nodes[name].url,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=70,
        )

    async def wait_ready(self, name: str, timeout: float = 30, via: str | None = None) -> None:
        """Until the node answers /readyz and is registered (asking ``via`` if it is unreachable)."""
        node = self.nodes[name]
        deadline = time.monotonic() + timeout
        async with self.client(via or name) as c:
            while True:
                if node.proc.poll() is not None:
                    raise AssertionError(f"{name} exited: {node.log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if via is not None or (await c.get("/readyz")).status_code == 200:
                        names = {n["name"] for n in (await c.get("/nodes")).json()}
                        if name in names:
                            return
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name} not ready: {node.log.read_text()[-2000:]}")
                await asyncio.sleep(0.05)

    async def start_all(self, *names: str) -> None:
        for name in names:
            self.start(name)
            if name == names[0]:
                await self.wait_ready(name)
        await asyncio.gather(*(self.wait_ready(n) for n in names[1:]))

    def kill9(self, name: str, pids: list[int]) -> None:
        """kill -9 the daemon and its workers (a node lost with everything on it)."""
        node = self.nodes[name]
        node.proc.send_signal(signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.proc.wait(10)

    def stop_all(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            try:
                node.proc.wait(30)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def logs(self) -> str:
        return "\n".join(f"== {n.name}\n{n.log.read_text()[-3000:]}" for n in self.nodes.values())


async def follow_until(
    client: httpx.AsyncClient, job_id: str, predicate: Any, timeout: float
) -> list[dict[str, Any]]:
    """Follow the merged events until ``predicate(events_so_far)`` is true."""
    seen: list[dict[str, Any]] = []
    after = 0
    async with asyncio.timeout(timeout):
        while not predicate(seen):
            r = await client.get(f"/jobs/{job_id}/events", params={"after": after, "wait": 10})
            batch = r.json()
            if batch:
                after = batch[-1]["seq"]
                seen.extend(batch)
    return seen


def job_ended(events: list[dict[str, Any]]) -> bool:
    return any(
        e["kind"] == "job.state" and e["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")
        for e in events
    )


def read_notes(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
