"""A throwaway 3-member etcd cluster on loopback for e2e tests (issue 12: leader and quorum loss).

Test side only. Members keep their data dirs and ports across ``kill`` (SIGKILL)
and ``start``, so a test can take the leader or quorum away and give it back.
Raft timers are short (heartbeat 50 ms, election 500 ms) so that leader loss
and quorum loss show within a second or two, as on a real cluster with its
timers scaled down. Each cluster has its own token, so a member never joins
another test's cluster on a reused port. Every member is killed at the end.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.e2e.cluster import LocalCluster

from tests.e2e.cluster import LocalCluster
from tests.store.etcd_server import etcd_binary, free_port


class EtcdMember:
    """One member of an :class:`EtcdCluster`."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.data_dir = root / name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.log = root / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self) -> dict[str, Any] | None:
        """This member's maintenance status (its id and its leader's), or None if it is down."""
        request = urllib.request.Request(self.url + "/v3/maintenance/status", data=b"{}")
        try:
            with urllib.request.urlopen(request, timeout=1) as response:
                return dict(json.loads(response.read()))
        except OSError:
            return None

    def kill(self) -> None:
        """SIGKILL the member and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


class EtcdCluster:
    """Three etcd members on 127.0.0.1 forming one cluster."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.binary = etcd_binary()
        self._root, self._size = root, size
        self._members(0)

    def _members(self, generation: int) -> None:
        """Fresh members: ports, data dirs, the cluster's token (``generation`` names them)."""
        root = self._root / f"g{generation}" if generation else self._root
        root.mkdir(parents=True, exist_ok=True)
        self.members = [EtcdMember(f"m{i}", root) for i in range(self._size)]
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self._token = f"elasticd-test-{uuid.uuid4().hex}"

    def start(self, member: EtcdMember | None = None) -> None:
        """Start one member (or all of them); returns once they answer a linearizable read."""
        targets = [member] if member is not None else self.members
        for m in targets:
            args = [
                self.binary,
                f"--name={m.name}",
                f"--data-dir={m.data_dir}",
                f"--listen-client-urls={m.url}",
                f"--advertise-client-urls={m.url}",
                f"--listen-peer-urls={m.peer_url}",
                f"--initial-advertise-peer-urls={m.peer_url}",
                f"--initial-cluster={self._initial}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token={self._token}",
                "--heartbeat-interval=50",
                "--election-timeout=500",
                "--logger=zap",
                "--log-outputs=stderr",
                "--log-level=error",
            ]
            with m.log.open("ab") as out:
                m.process = subprocess.Popen(
                    args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
        if member is None or self.quorate():
            self.wait_healthy(targets)

    def quorate(self) -> bool:
        return sum(m.running for m in self.members) > len(self.members) // 2

    def wait_healthy(self, members: list[EtcdMember], deadline: float = 30.0) -> None:
        """Poll each member's /health (a quorum read) until it answers healthy."""
        until = time.monotonic() + deadline
        for m in members:
            while True:
                assert m.process is not None and m.process.poll() is None, m.log.read_text()
                try:
                    with urllib.request.urlopen(m.url + "/health", timeout=2) as response:
                        if b'"true"' in response.read():
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > until:
                    raise RuntimeError(f"etcd {m.name} not healthy within {deadline}s")
                time.sleep(0.05)

    def current_leader(self) -> EtcdMember | None:
        """The live member every live member names as leader now (None: no agreement)."""
        ids: dict[str, EtcdMember] = {}
        named: set[str] = set()
        for m in self.members:
            status = m.status() if m.running else None
            if status is None:
                continue
            ids[status["header"]["member_id"]] = m
            named.add(str(status.get("leader", "")))
        if len(named) != 1:
            return None
        return ids.get(named.pop())

    def leader(self, deadline: float = 20.0) -> EtcdMember:
        """The leader, once the live members agree on a live one (polled every 20 ms)."""
        until = time.monotonic() + deadline
        while (found := self.current_leader()) is None:
            if time.monotonic() > until:
                raise RuntimeError(f"no etcd leader agreed on within {deadline}s")
            time.sleep(0.02)
        return found

    def endpoints(self, first: int = 0) -> str:
        """An ``etcd://`` store URL listing every member, starting at member ``first``."""
        n = len(self.members)
        hosts = [self.members[(first + i) % n].url.removeprefix("http://") for i in range(n)]
        return "etcd://" + ",".join(hosts)

    def kill_all(self) -> None:
        for m in self.members:
            m.kill()

    def __enter__(self) -> EtcdCluster:
        # A free port is only free when it is picked: another process (a test beside this
        # one) may bind it before etcd does. Then start afresh on other ports, twice at most.
        for generation in range(3):
            try:
                self.start()
                return self
            except AssertionError as exc:
                self.kill_all()
                if "address already in use" not in str(exc) or generation == 2:
                    raise
                self._members(generation + 1)
        raise AssertionError("unreachable")  # pragma: no cover

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


def own_events(cluster: LocalCluster, node: str, job_id: str) -> list[tuple[str, float, str]]:
    """A daemon's own record of a job's events, in its order (read-only from its SQLite)."""
    path = cluster.root / node / "elasticd.sqlite3"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT doc FROM events WHERE job_id = ? ORDER BY seq", (job_id,)
        ).fetchall()
    docs = [json.loads(doc) for (doc,) in rows]
    return [(d["kind"], d["time"], d["message"]) for d in docs]


def shown_events(merged: list[dict[str, Any]], node: str) -> list[tuple[str, float, str]]:
    """One node's events in a merged /events answer, in the merged order."""
    return [(e["kind"], e["time"], e["message"]) for e in merged if e["node"] == node]


def daemons_on(tmp_path: Path, lease_ttl: float) -> LocalCluster:
    """A LocalCluster beside the ``etcd`` fixture's folder (use it as a context manager)."""
    (tmp_path / "daemons").mkdir()
    return LocalCluster(tmp_path / "daemons", lease_ttl=lease_ttl)
