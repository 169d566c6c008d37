"""What the daemon asks of its host at start: its GPUs, its descriptor limit, its
listening socket.

Which side of the boundary: the daemon (``nvidia-smi`` runs as any child does, without
the daemon's secrets).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import signal
import socket
from collections.abc import Mapping
from pathlib import Path

from elasticd.errors import ConfigError, WorkerSpawnError
from elasticd.supervise.spawn import start_process

log = logging.getLogger("elasticd.node.daemon")


async def detect_gpus(
    nvidia_smi: str | None = None, environ: Mapping[str, str] | None = None
) -> list[str] | None:
    """GPU indices from ``nvidia-smi -L``, or None on a node without NVIDIA GPUs.

    ``nvidia_smi`` is the configured path; else it is looked up on the daemon's own PATH.
    """
    environ = os.environ if environ is None else environ
    exe = shutil.which(nvidia_smi or "nvidia-smi", path=environ.get("PATH", os.defpath))
    if exe is None:
        return None
    try:
        # Started like every child: the daemon's secrets (WITHHELD) never reach it.
        proc = await start_process(
            [exe, "-L"],
            environ,
            identity=None,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except WorkerSpawnError:
        return None
    try:
        async with asyncio.timeout(10):
            out, _ = await proc.communicate()
    except TimeoutError:
        return None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
    ids = [
        line.split(":", 1)[0].removeprefix("GPU ").strip()
        for line in out.decode(errors="replace").splitlines()
        if line.startswith("GPU ")
    ]
    return ids or None


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; (soft, hard) after.

    The common soft limit of 1,024 is a default for ``select()`` programs,
    not a budget for a daemon that holds connections, pipes and files for
    every worker (issue 23: a flood of idle connections took all 1,024 and
    jobs failed to start). Where the kernel refuses, the limit stays as it is.
    The workers inherit the raised limit, as under systemd's ``LimitNOFILE``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard
    if hard == resource.RLIM_INFINITY:  # Linux refuses an infinite soft limit here
        wanted = _nr_open()
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, wanted, exc)
        return soft, hard
    return wanted, hard


def _nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound before the server starts so that errors are clear."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: with protocol 0 asyncio does not recognise the accepted
    # sockets as TCP and never sets TCP_NODELAY, so every response waits ~40 ms (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
