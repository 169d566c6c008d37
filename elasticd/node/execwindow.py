"""The re-exec's window (issue 34): from the old image's decision to exec until the new image
has taken everything back, nothing of the node is left unguarded.

An ``execve`` of a loaded interpreter is followed by 1 to 8.5 s of imports and start-up
before the new image has its signal handlers, its state lock and its lease renewal. What
guards each meanwhile (this module is the stdlib's only: the new image uses it before its
heavy imports):

- **Signals** (:class:`HeldSignals`, :class:`EarlySignals`): the old image blocks SIGHUP,
  SIGTERM and SIGINT before the exec (the mask and the pending set survive ``execve``);
  one that reached it meanwhile (another thread took it, or the loop saw it) is made
  pending again on the exec'ing thread. The new image installs its handlers first thing,
  then unblocks: a second reload coalesces into one more, a stop is the normal stop
  (workers get SIGTERM and the grace, ``daemon.stopped`` is written).
- **The state-folder lock**: its descriptor crosses the exec (``Manifest.lock_fd``) and
  the new image adopts it (:meth:`elasticd.node.statelock.StateLock.adopt`, which checks
  it is the lock of that folder) instead of locking again: the folder is never free.
- **The lease** (:class:`LeaseKeeper`): renewed right before the exec (a whole TTL), then
  by the new image from before its heavy imports, in a thread of its own (imports hold
  the main thread), until the node's own keep-alive runs again.

:func:`peek_handover` reads what the early start needs from the hand-over (without taking
it: :func:`elasticd.node.reexec.take_manifest` does, later). ``ELASTICD_TEST_REEXEC_DELAY``
(:func:`slow_image_delay`): seconds a re-executed image sleeps where its heavy imports start, for
the tests of a slow new image; read only by a re-executed image. ``ELASTICD_TEST_REEXEC_LINGER``
(:func:`linger_delay`): seconds the old image lingers past its wait for the agents, before the
hand-over, for the tests of what the agents it did not wait for do meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elasticd.config import Config
    from elasticd.store import Store

__all__ = [
    "HELD_SIGNALS",
    "EarlySignals",
    "HandoverPeek",
    "HeldSignals",
    "LeaseKeeper",
    "TEST_DELAY_ENV",
    "TEST_LINGER_ENV",
    "configured_store",
    "early_lease_keeper",
    "linger_delay",
    "peek_handover",
    "slow_image_delay",
]

log = logging.getLogger("elasticd.node.execwindow")

#: The signals that ask the daemon something: held across the exec, never lost, never fatal.
HELD_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
#: The hand-over's descriptor (:data:`elasticd.node.reexec.ENV_FD`; repeated: stdlib only).
_ENV_FD = "ELASTICD_REEXEC_FD"
#: The descriptor of the signals that reached the old image in its last moments (see
#: :meth:`HeldSignals.carry`): a pipe's read end, one byte per signal number.
ENV_SIGNALS_FD = "ELASTICD_REEXEC_SIGNALS_FD"
#: A test hook: seconds a re-executed image waits before its heavy imports (a slow image).
TEST_DELAY_ENV = "ELASTICD_TEST_REEXEC_DELAY"
#: A test hook: seconds the old image lingers past its wait for the agents, before the
#: hand-over (what an agent it did not wait for does meanwhile is cut off by the exec).
TEST_LINGER_ENV = "ELASTICD_TEST_REEXEC_LINGER"
#: Bytes of the hand-over read at the early start (it is a few KiB; the rest is for later).
_PEEK_MAX = 1 << 22


class HeldSignals:
    """The old image's side: from :meth:`hold` to the exec, the signals of
    :data:`HELD_SIGNALS` wait (blocked on the exec'ing thread) for the next image.

    Blocking on one thread is not enough while other threads run (the kernel hands a
    process-directed signal to a thread that does not block it): Python then runs the
    handler on the main thread, and :meth:`_record` notes the signal; :meth:`pend` makes
    each one noted pending again on this thread, where it survives the exec."""

    def __init__(self, *, block: bool = True) -> None:
        """``block`` False: :meth:`ignoring_reloads`."""
        self.caught: list[int] = []
        self._previous: dict[int, object] = {}
        self._held = False
        self._block = block
        self._carry: tuple[int, int, int] | None = None  # (read end, write end, old wakeup fd)

    @property
    def blocking(self) -> bool:
        """Whether the signals are held for the next image (else :meth:`ignoring_reloads`)."""
        return self._block

    @classmethod
    def ignoring_reloads(cls) -> HeldSignals:
        """For a new image that does not adopt held signals (one from before issue 34: it
        would keep them blocked for good): nothing is blocked or carried; SIGHUP is ignored
        across the exec (an ignored signal stays ignored in the new image until it installs
        its handler), so a second reload is lost instead of killing the daemon, and a stop
        meanwhile ends it at once, as such an image always did."""
        return cls(block=False)

    def hold(self) -> None:
        """Block them here (the main thread) and note any that reaches the process."""
        if not self._block:
            self._previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, signal.SIG_IGN)
            self._held = True
            return
        for sig in HELD_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        self._held = True

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.caught.append(signum)

    def pend(self, extra: Iterable[int] = ()) -> None:
        """Right before the exec: each signal noted, and ``extra`` (what the daemon was
        asked meanwhile by a signal its loop already took), pending on this thread."""
        if not self._block:
            return  # nothing is blocked: a signal sent now would be handled here, not there
        for sig in dict.fromkeys([*self.caught, *extra]):
            signal.pthread_kill(threading.get_ident(), sig)

    def carry(self) -> int | None:
        """Right before the exec: from now on each signal another thread takes writes its
        number into a pipe whose read end (returned) crosses the exec, for the new image
        (:class:`EarlySignals` reads it): one taken as the exec starts is not lost with the
        Python handler that would have noted it. None: nothing is carried
        (:meth:`ignoring_reloads`)."""
        if not self._block:
            return None
        read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        os.set_inheritable(read, True)
        self._carry = (read, write, old)
        return read

    def release(self) -> None:
        """The exec failed: the handlers as they were, unblocked (what is pending is
        delivered to them now; what was noted, again)."""
        if self._carry is not None:
            read, write, old = self._carry
            self._carry = None
            signal.set_wakeup_fd(old)
            self.caught += [b for b in _drain(read) if b in HELD_SIGNALS]
            os.close(read)
            os.close(write)
        if not self._held:
            return
        self._held = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if self._block:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
        caught, self.caught = self.caught, []
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


class EarlySignals:
    """The new image's handlers from its first line: each signal is noted until the daemon
    exists (:meth:`hand_to`), then unblocked, so what the exec held is delivered now."""

    def __init__(self) -> None:
        self.noted: list[signal.Signals] = []
        self._handed = False

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in HELD_SIGNALS:
            loop.add_signal_handler(sig, self._note, sig)
        carried = os.environ.pop(ENV_SIGNALS_FD, None)
        if carried is not None:  # what reached the old image as it exec'd
            with contextlib.suppress(OSError, ValueError):
                fd = int(carried)
                self.noted += [signal.Signals(b) for b in _drain(fd) if b in HELD_SIGNALS]
                os.close(fd)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)

    def _note(self, sig: signal.Signals) -> None:
        if not self._handed:  # past it, one the daemon has no handler for is ignored
            self.noted.append(sig)

    def hand_to(
        self, stop: Callable[[signal.Signals], None], reload: Callable[[], None] | None
    ) -> None:
        """The daemon's handlers are installed (they replaced these): what was noted is
        given to them, in order (a reload without ``reload``: ignored, as it is then)."""
        noted, self.noted, self._handed = self.noted, [], True
        for sig in noted:
            if sig is signal.SIGHUP:
                if reload is not None:
                    reload()
            else:
                stop(sig)


def _drain(fd: int) -> bytes:
    """What a non-blocking pipe holds now."""
    got = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 4096):
            got += chunk
    return got


@dataclass(frozen=True)
class HandoverPeek:
    """What the early start of a re-executed image needs from the hand-over."""

    lease: int | None
    renewed_at: float | None
    exec_at: float | None


def peek_handover(environ: dict[str, str] | None = None) -> HandoverPeek | None:
    """The hand-over's lease, last renewal and exec time, read without taking it (None: a
    plain start, or one it cannot read: :func:`~elasticd.node.reexec.take_manifest` says)."""
    value = (os.environ if environ is None else environ).get(_ENV_FD)
    if value is None:
        return None
    try:
        doc = json.loads(os.pread(int(value), _PEEK_MAX, 0))
        lease, renewed, at = doc.get("lease"), doc.get("renewed_at"), doc.get("exec_at")
        return HandoverPeek(
            lease=None if lease is None else int(lease),
            renewed_at=None if renewed is None else float(renewed),
            exec_at=None if at is None else float(at),
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def slow_image_delay(environ: dict[str, str] | None = None) -> float:
    """Seconds a re-executed image waits before its heavy imports (a test's slow image)."""
    return _test_seconds(TEST_DELAY_ENV, environ)


def linger_delay(environ: dict[str, str] | None = None) -> float:
    """Seconds the old image lingers between its wait for the agents and the hand-over
    (a test's slow quiesce: the agents it did not wait for go on meanwhile)."""
    return _test_seconds(TEST_LINGER_ENV, environ)


def _test_seconds(name: str, environ: dict[str, str] | None) -> float:
    value = (os.environ if environ is None else environ).get(name, "")
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


class LeaseKeeper:
    """The new image's renewals of the node's lease, every ``ttl / 3`` (0.2 s after one that
    failed) in a thread with its own loop and store client, from before the heavy imports
    until :meth:`stop` (the node's keep-alive runs again). A lease found gone ends it."""

    def __init__(
        self,
        open_store: Callable[[], Store],
        lease: int,
        ttl: float,
        *,
        renewed_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._open_store = open_store
        self.lease = lease
        self.ttl = ttl
        #: When the last renewal that got through was sent (``CLOCK_MONOTONIC``).
        self.renewed_at = renewed_at
        #: When this image's first renewal that got through was sent.
        self.first_renewal: float | None = None
        self.renewals = 0
        self._clock = clock
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # A daemon thread: it never keeps a failed image's process alive (renewing its lease).
        self._thread = threading.Thread(target=self._run, name="elasticd-lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run(self._keep())

    async def _keep(self) -> None:
        from elasticd.errors import LeaseNotFound, StoreError

        self._loop = asyncio.get_running_loop()
        store = self._open_store()
        try:
            while not self._stopping.is_set():
                sent = self._clock()
                try:
                    async with asyncio.timeout(self.ttl / 3):
                        await store.keep_alive(self.lease)
                except LeaseNotFound:
                    log.warning("the lease %x lapsed across the re-exec", self.lease)
                    return
                except (StoreError, TimeoutError):
                    wait = min(0.2, self.ttl / 3)
                else:
                    self.renewed_at = max(sent, self.renewed_at or sent)
                    self.first_renewal = self.first_renewal or sent
                    self.renewals += 1
                    wait = self.ttl / 3
                await asyncio.to_thread(self._stopping.wait, wait)
        finally:
            with contextlib.suppress(Exception):
                await store.close()

    def stop(self) -> None:
        """No renewal after this returns (bounded: one in flight is cut off)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(self.ttl)


def configured_store(config: Config, *, token: str | None, password: str | None) -> Store:
    """The store ``config`` names, as the daemon opens it (the daemon's, and the new image's
    early one: :func:`early_lease_keeper`)."""
    from elasticd.store import EtcdOptions, open_store

    return open_store(
        config.store_url,
        token=token,
        state_dir=config.state_dir,
        max_value_bytes=config.store_max_value_bytes,
        max_list_bytes=config.store_max_list_bytes,
        etcd=EtcdOptions(
            username=config.store_username,
            password=password,
            ca_file=config.store_ca_file,
            cert_file=config.store_cert_file,
            key_file=config.store_key_file,
            prefix=config.store_prefix,
        ),
        lease_ttl=config.lease_ttl,
        history_keep=config.store_history_seconds,
    )


def early_lease_keeper(
    config: Config, peek: HandoverPeek | None, environ: dict[str, str] | None = None
) -> LeaseKeeper | None:
    """A running :class:`LeaseKeeper` for a re-executed image whose node holds a lease in
    another daemon's store or etcd (None otherwise: a plain start; the store is this
    daemon's own, down with it; or its credentials cannot be read: the start says why)."""
    if peek is None or peek.lease is None or config.store_url is None or config.store_only:
        return None
    from elasticd.config import own_token, read_cluster_token, read_store_password, read_token
    from elasticd.errors import ElasticdError

    try:
        token = read_cluster_token(config) or read_token(config, environ)
        token = token or own_token(config.state_dir)[0]
        password = read_store_password(config)
    except (ElasticdError, OSError) as exc:
        log.warning("no renewal of the lease before the start-up: %s", exc)
        return None
    keeper = LeaseKeeper(
        lambda: configured_store(config, token=token, password=password),
        peek.lease,
        config.lease_ttl,
        renewed_at=peek.renewed_at,
    )
    keeper.start()
    return keeper
