"""systemd's notify protocol, spoken directly (no libsystemd).

``Type=notify`` units learn that the daemon is ready, stopping, or alive
through datagrams on the socket named by ``NOTIFY_SOCKET`` (a path, or an
abstract socket when it starts with ``@``). Outside systemd, every call is a
no-op.

The watchdog: with ``WatchdogSec=`` in the unit, systemd passes
``WATCHDOG_USEC`` (and ``WATCHDOG_PID``) and kills the daemon if it is not
told ``WATCHDOG=1`` within that time. :func:`watchdog` pings from a task on
the daemon's event loop, at half the interval, so a ping proves that the loop
itself still runs (a loop stuck in a blocking call stops the pings and
systemd restarts the daemon; its workers die with it, by their parent-death
signal and the unit's cgroup).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping

log = logging.getLogger("elasticd.node.systemd")


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd. True if it was sent."""
    environ = os.environ if environ is None else environ
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings systemd expects, or None when the watchdog is off."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1_000_000 / 2
    except ValueError:
        return None


async def watchdog(
    interval: float,
    environ: Mapping[str, str] | None = None,
    *,
    alive: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Send ``WATCHDOG=1`` every ``interval`` seconds, forever (cancel to stop).

    Each ping is sent from the event loop after ``interval`` seconds of
    sleeping on it; with ``alive``, only when that check also passes (a
    daemon that cannot do its work should be restarted, not kept).
    """
    late_after = interval / 2  # past a full interval late, systemd gives up on us
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(interval)  # the ping is periodic by nature
        lag = loop.time() - before - interval
        if lag > late_after:
            log.warning("event loop was blocked for %.1fs (watchdog interval %.1fs)", lag, interval)
        if alive is not None:
            try:
                ok = await alive()
            except Exception:
                log.exception("watchdog liveness check failed")
                ok = False
            if not ok:
                continue
        notify("WATCHDOG=1", environ)
