"""This node's torchft Lighthouses (issue 39): one per job of replica groups with a group here.

The agents of a job's replica groups ask :meth:`NodeLighthouses.address` before every
start; the first ask serves the job's Lighthouse (:class:`elasticd.lighthouse.server.
Lighthouse`, on a loopback port of its own, answering only the job's user and root) with
the parent job's ``min_replicas`` and the daemon's ``lighthouse_*`` settings. Once no
group of the job has an agent here (:meth:`prune`, on every change of the job documents),
it is closed and gives up its leadership at once.

Across a re-exec (:meth:`ports`, :meth:`hand_over`) each job keeps its port: the old image
closes its servers without giving up the record or the leadership (both stay on the node's
lease), the new one serves them again on the same ports, and torchft's Managers, which
never re-resolve the address, find it there when they call again (``quorum_retries``).

Which side of the boundary: the daemon (root). Nothing of the job's reaches it but its gRPC
calls, bounded and checked by the server; the job's document is read from the store and
validated like every other.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from elasticd.clock import SYSTEM_CLOCK, Clock
from elasticd.errors import StoreError, WorkerSpawnError
from elasticd.keys import job_key
from elasticd.models import Job, Launcher
from elasticd.node.jobs.documents import parse_job
from elasticd.replicas import majority
from elasticd.security import JobUsers
from elasticd.store.base import Store

if TYPE_CHECKING:
    from elasticd.lighthouse.server import Lighthouse
    from elasticd.lighthouse.state import QuorumDoc

log = logging.getLogger(__name__)

#: Seconds a job's Lighthouse is kept with no group's agent here before it is closed.
CLOSE_AFTER = 10.0

#: What a daemon without the extra says to a job of replica groups.
NO_GRPC = (
    "this daemon has no gRPC (install the extra: pip install 'elasticd[torchft]'), so it "
    "cannot be the job's torchft Lighthouse"
)


class NodeLighthouses:
    """The node's Lighthouses, by parent job id; built lazily (grpcio is an extra)."""

    def __init__(
        self,
        store: Store,
        node: str,
        lease: Callable[[], Awaitable[int]],
        users: JobUsers | None,
        *,
        heartbeat_timeout: float,
        join_timeout: float,
        ports: Mapping[str, int] | None = None,
        running: Callable[[], Iterable[str]] | None = None,
        said: Callable[[Job, str], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.node = node
        self._lease = lease
        self._users = users
        self._heartbeat_timeout = heartbeat_timeout
        self._join_timeout = join_timeout
        #: Ports an earlier image served on (re-exec): each is used once, for its job.
        self._handed_ports = dict(ports or {})
        self._clock = clock
        #: The parents of the agents running here now (a later prune asks again).
        self.running = running
        #: Told each new quorum this node's leader formed for a job, in words (its event).
        self.said = said
        self._lighthouse: Lighthouse | None = None
        self._served: dict[str, str] = {}
        #: Since when (monotonic) each served job has had no group's agent here.
        self._unused: dict[str, float] = {}
        self._lock = asyncio.Lock()
        self._later: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _get(self) -> Lighthouse:
        if self._lighthouse is None:
            try:
                from elasticd.lighthouse.server import Lighthouse
            except ImportError as exc:
                raise LookupError(NO_GRPC) from exc
            self._lighthouse = Lighthouse(self.store, self.node, self._lease, clock=self._clock)
        return self._lighthouse

    async def address(self, parent_id: str) -> str:
        """The ``TORCHFT_LIGHTHOUSE`` of the job's groups' workers on this node (served now
        if it was not). ``LookupError`` with the reason when it cannot be served."""
        from elasticd.lighthouse.rules import Settings

        async with self._lock:
            if parent_id in self._served:
                return self._served[parent_id]
            entry = await self.store.get(job_key(parent_id))
            if entry is None:
                raise LookupError(f"job {parent_id} is gone")
            parent = parse_job(parent_id, entry.value)
            groups = parent.spec.replica_groups
            if parent.launcher != Launcher.GROUPS or groups is None:
                raise LookupError(f"job {parent_id} is not a job of replica groups")
            settings = Settings(
                min_replicas=parent.spec.min_replicas or majority(groups),
                join_timeout=self._join_timeout,
                heartbeat_timeout=self._heartbeat_timeout,
            )
            uid = self._uid_of(parent.spec.user, parent.owner.unix_user if parent.owner else None)
            port = self._handed_ports.pop(parent_id, 0)
            said = self.said
            on_quorum = None
            if said is not None:

                def on_quorum(old: QuorumDoc | None, new: QuorumDoc, parent: Job = parent) -> None:
                    said(parent, quorum_words(old, new))

            address = await self._get().serve(
                parent_id, uid=uid, settings=settings, port=port, on_quorum=on_quorum
            )
            self._served[parent_id] = address
            log.info("job %s: this node's torchft Lighthouse serves at %s", parent_id, address)
            return address

    def _uid_of(self, user: str | None, owner_user: str | None) -> int:
        """The uid the job's workers run as here: the one user (with root) its server answers."""
        users = self._users
        if users is None:
            return os.geteuid()
        if user is None and users.dynamic is not None:
            raise LookupError(
                "run_as = dynamic gives each replica group a uid of its own, and a job's "
                "Lighthouse answers one user: name the job's user to use replica groups"
            )
        try:
            identity = users.for_job(user, owner_user=owner_user)
        except WorkerSpawnError as exc:
            raise LookupError(str(exc)) from None
        return users.daemon_uid if identity is None else identity.uid

    async def prune(self, active: Iterable[str]) -> None:
        """Close the Lighthouse of every job with no group's agent here (``active``: the
        parents of the agents running here) for :data:`CLOSE_AFTER` seconds: its leadership
        goes to another node at once. The wait covers the agents a re-exec hands over, which
        the new image takes up after it serves their Lighthouses again."""
        async with self._lock:
            gone, self._unused = unused_for(
                self._served, set(active), self._unused, self._clock.monotonic(), CLOSE_AFTER
            )
            for job in gone:  # under the lock: an agent's ask waits for the close
                del self._served[job]
                assert self._lighthouse is not None
                await self._lighthouse.close(job)
                log.info("job %s: no group of it runs here; its Lighthouse here is closed", job)
        if self._unused:
            self._wake_prune(active)

    def _wake_prune(self, active: Iterable[str]) -> None:
        """Look again once the oldest unused Lighthouse is due (no job change may come)."""
        if self._later is not None:
            self._later.cancel()
        due = min(self._unused.values()) + CLOSE_AFTER - self._clock.monotonic()
        keep = set(active)
        loop = asyncio.get_running_loop()

        def again() -> None:
            now_running = set(self.running()) if self.running is not None else keep
            task = loop.create_task(self.prune(now_running))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._later = loop.call_later(max(0.0, due) + 0.01, again)

    def _cancel_later(self) -> None:
        if self._later is not None:
            self._later.cancel()
            self._later = None
        self._unused.clear()

    @property
    def served(self) -> bool:
        """Whether any job's Lighthouse is served here."""
        return bool(self._served)

    def ports(self) -> dict[str, int]:
        """Each served job's port (the re-exec manifest carries them)."""
        out = {}
        for job, address in self._served.items():
            _, _, port = address.rpartition(":")
            if port.isdigit():
                out[job] = int(port)
        return out

    async def aclose(self) -> None:
        """Close every server and give up each job's leadership (the daemon stops)."""
        self._cancel_later()
        self._served.clear()
        if self._lighthouse is not None:
            await self._lighthouse.aclose(leave=True)
            self._lighthouse = None

    async def pause(self) -> dict[str, int]:
        """Before a re-exec: close every server, keeping each job's record and leadership on
        the node's lease; returns the ports, for :meth:`serve_again` in the next image."""
        ports = self.ports()
        self._cancel_later()
        self._served.clear()
        if self._lighthouse is not None:
            await self._lighthouse.aclose(leave=False)
            self._lighthouse = None
        return ports

    async def serve_again(self, ports: Mapping[str, int]) -> None:
        """Serve each job's Lighthouse on the port it had (a re-exec, or one undone): its
        workers' Managers call there again. A job that cannot be served is logged."""
        self._handed_ports.update(ports)
        for job in ports:
            try:
                await self.address(job)
            except (LookupError, StoreError, OSError, RuntimeError) as exc:
                log.warning("job %s: its Lighthouse is not served again here: %s", job, exc)

    def status(self, parent_id: str) -> dict[str, object] | None:
        """The job's quorum as this node sees it (None: not served here)."""
        if self._lighthouse is None:
            return None
        quorum = self._lighthouse.quorum(parent_id)
        return None if quorum is None else quorum.status()


def unused_for(
    served: Iterable[str],
    active: set[str],
    unused: Mapping[str, float],
    now: float,
    grace: float,
) -> tuple[list[str], dict[str, float]]:
    """Which served jobs to close at ``now`` (pure): those with no group's agent here for
    ``grace`` seconds; and since when each of the others has had none."""
    close: list[str] = []
    since: dict[str, float] = {}
    for job in served:
        if job in active:
            continue
        first = unused.get(job, now)
        if now - first >= grace:
            close.append(job)
        else:
            since[job] = first
    return close, since


def quorum_words(old: QuorumDoc | None, new: QuorumDoc) -> str:
    """A new quorum in words (pure): its id and size, who joined and who left."""
    before = set(old.members()) if old is not None else set()
    after = set(new.members())
    joined, left = sorted(after - before), sorted(before - after)
    parts = [f"quorum {new.quorum_id}: {len(after)} replica group(s)"]
    if joined:
        parts.append("joined: " + ", ".join(joined))
    if left:
        parts.append("left: " + ", ".join(left))
    return "; ".join(parts)
