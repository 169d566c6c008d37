"""A throwaway single-member etcd on loopback for tests: free ports, temp data dir.

Readiness is polled under a deadline (etcd offers no readiness signal on its
stdout that is stable across versions); the process is always killed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def etcd_binary() -> str:
    """The etcd executable; fail under CI (which must install it), skip elsewhere."""
    found = shutil.which("etcd")
    if found is None:
        message = "etcd is not installed (apt-get install etcd-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class EtcdProcess:
    """One etcd member; ``start``/``kill`` may be repeated on the same data dir and ports."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        """``host``: the address clients reach it on (its peer port stays on loopback)."""
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://{host}:{self.client_port}"
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, *, deadline: float = 20.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            # Short raft timers: leases of 1 s are honoured, start-up is quick.
            "--heartbeat-interval=10",
            "--election-timeout=50",
            # Room for DEFAULT_MAX_VALUE_BYTES (4 MiB) as base64 JSON.
            "--max-request-bytes=8388608",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=error",
        ]
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.wait_healthy(deadline)

    def wait_healthy(self, deadline: float) -> None:
        """Poll /health until etcd answers healthy, failing after ``deadline`` seconds."""
        until = time.monotonic() + deadline
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._process.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                    if b'"true"' in response.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > until:
                raise RuntimeError(f"etcd not healthy within {deadline}s; see {self.log}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL etcd and reap it."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)
        self._process = None
