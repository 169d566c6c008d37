"""One torchrun's side of the rendezvous, synchronous and torch-free."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from pydantic import ValidationError

from elasticd.errors import (
    LeaseNotFound,
    RendezvousError,
    StoreAuthError,
    StoreError,
)
from elasticd.eventkinds import EventKind
from elasticd.keys import event_key, group_key, job_key
from elasticd.models import Event, EventSource, GroupView, Job, JobSpec, incarnation_tag
from elasticd.rendezvous import Change, RoundInfo, StoreRendezvous
from elasticd.states import JobState, WorkerState
from elasticd.store import Store
from elasticd.store.blocking import LoopThread
from elasticd.store.http import HttpStore
from elasticd.tokens import read_token_file
from elasticd.torchrun_backend.config import BackendConfig, address_towards, node_name
from elasticd.torchrun_backend.edits import RunStep, run_edit, waiting_nodes

log = logging.getLogger("elasticd.torchrun")

#: Pause between tries while the store cannot be reached during a watch.
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
#: Tries of one compare-and-set on the run's document against other torchruns' writes.
_CAS_ATTEMPTS = 50
#: Longest a shutdown waits for the run's record to be written.
_RECORD_DRAIN = 5.0


class TorchrunRendezvous:
    """One torchrun's side of the rendezvous, synchronous and torch-free.

    The torch handler (:func:`create_handler`) wraps it; tests drive it
    directly. ``store`` is injected in tests; by default it is an
    :class:`~elasticd.store.http.HttpStore` of ``config.url``, made on the
    backend's own loop. With ``spec`` (what the torchrun command runs), the
    run is recorded where operators look (:meth:`_record`); without, only
    the rendezvous happens.
    """

    def __init__(
        self,
        config: BackendConfig,
        *,
        node: str | None = None,
        store: Callable[[], Store] | None = None,
        spec: JobSpec | None = None,
    ) -> None:
        self.config = config
        self.node = node or node_name(socket.gethostname(), os.getpid(), secrets.token_hex(3))
        self.token = (
            None
            if config.token_file is None
            else read_token_file(config.token_file, what="elasticd token file")
        )
        self.addr = config.local_addr or address_towards(config.url)
        self._make_store = store or (lambda: HttpStore(config.url, self.token))
        self._spec = spec
        self._lease_id: int | None = None
        self._lease_lock: asyncio.Lock | None = None
        self._waiting = 0
        self._closed_seen = False
        self._round: RoundInfo | None = None
        self._registered = False
        self._seq = 0  # this node's events, in its order (as a daemon's local seq)
        #: Which job of the run's id its events are about (the document last read or written).
        self._tag: str | None = None
        self._watch: concurrent.futures.Future[None] | None = None
        self._stopped = False
        self._thread = LoopThread(f"elasticd-rdzv-{config.run_id}")
        try:
            self._store, self._rdzv, self._tasks = self._thread.call(self._open())
        except BaseException:
            self._thread.stop()
            raise

    async def _open(self) -> tuple[Store, StoreRendezvous, list[asyncio.Task[None]]]:
        self._lease_lock = asyncio.Lock()
        self._notes: asyncio.Queue[Callable[[], Coroutine[Any, Any, None]]] = asyncio.Queue()
        store = self._make_store()
        rdzv = StoreRendezvous(
            store,
            self.config.run_id,
            node=self.node,
            role="default",
            # torch's agent assigns its workers' ranks itself; the rendezvous only
            # needs to know that each torchrun is one node.
            local_world_size=1,
            advertise_addr=self.addr,
            settings=self.config.settings,
            lease=self._lease,
        )
        tasks = [
            asyncio.create_task(self._keep_alive(store), name="elasticd-rdzv-keepalive"),
            asyncio.create_task(self._publish(), name="elasticd-rdzv-record"),
        ]
        return store, rdzv, tasks

    # -- the lease -------------------------------------------------------------

    async def _lease(self) -> int:
        """This node's live lease, granted when it has none (first use, or lost)."""
        assert self._lease_lock is not None
        async with self._lease_lock:
            if self._lease_id is None:
                self._lease_id = await self._store.grant(self.config.lease_ttl)
            return self._lease_id

    async def _keep_alive(self, store: Store) -> None:
        """Renew the lease every third of its TTL; after a failure, retry soon.

        A lost lease is forgotten: the watch then finds this node's presence
        key gone (``FENCED``), torch re-forms, and the next announcement
        is made under a fresh lease.
        """
        interval = self.config.lease_ttl / 3
        retry = min(interval, 0.2)
        pause = interval
        while True:
            await asyncio.sleep(pause)
            lease = self._lease_id
            if lease is None:
                pause = interval
                continue
            try:
                await store.keep_alive(lease)
                pause = interval
            except LeaseNotFound:
                log.warning("%s: the lease expired; announcing again under a new one", self.node)
                if self._lease_id == lease:
                    self._lease_id = None
                pause = interval
            except StoreError as exc:
                log.warning("%s: keep-alive failed: %s", self.node, exc)
                pause = retry

    # -- the record operators see -------------------------------------------------

    async def _publish(self) -> None:
        """Write queued notes one after the other, off torch's path (a failed one is logged)."""
        while True:
            note = await self._notes.get()
            try:
                await note()
            except (StoreError, ValidationError, ValueError) as exc:
                log.warning("%s: could not record the run: %s", self.node, exc)
            finally:
                self._notes.task_done()

    def _note(
        self, step: RunStep, kind: EventKind | None, message: str, group: WorkerState
    ) -> None:
        """Queue (from the loop's thread) the record of ``step``, an event and the group view."""
        if self._spec is None:
            return
        info = self._round

        async def note() -> None:
            await self._record(step)
            if kind is not None:
                await self._emit("rendezvous", kind, message, state=group.value)
            await self._publish_group(group, info)

        self._notes.put_nowait(note)

    async def _record(self, step: RunStep) -> None:
        """Apply ``step`` to the run's job document by compare-and-set (see :func:`run_edit`)."""
        assert self._spec is not None
        key = job_key(self.config.run_id)
        for _ in range(_CAS_ATTEMPTS):
            entry = await self._store.get(key)
            current = None if entry is None else Job.model_validate_json(entry.value)
            if current is not None:
                self._tag = incarnation_tag(current)
            new = run_edit(
                current,
                step,
                run_id=self.config.run_id,
                spec=self._spec,
                node=self.node,
                now=time.time(),
            )
            if new is None:
                return
            version = None if entry is None else entry.version
            result = await self._store.compare_and_set(key, new.model_dump_json().encode(), version)
            if not result.ok:
                continue  # another torchrun wrote it meanwhile: decide again on theirs
            self._tag = incarnation_tag(new)
            if current is None:
                await self._emit(
                    "agent",
                    EventKind.JOB_SUBMITTED,
                    f"torchrun run {self.config.run_id} registered by {self.node}",
                    state=new.state.value,
                )
            before = JobState.PENDING if current is None else current.state
            if before is not new.state:
                why = f": {new.reason}" if new.reason else ""
                await self._emit(
                    "agent",
                    EventKind.JOB_STATE,
                    f"job {before.value} -> {new.state.value}{why}",
                    state=new.state.value,
                )
            return

    async def _emit(
        self, source: EventSource, kind: EventKind, message: str, **fields: Any
    ) -> None:
        """One event of this node under ``ev/<run>/<node>/<seq>``, as a daemon publishes its own."""
        self._seq += 1
        event = Event(
            seq=self._seq,
            time=time.time(),
            job_id=self.config.run_id,
            node=self.node,
            source=source,
            kind=kind.value,
            message=message,
            job_tag=self._tag,
            **fields,
        )
        await self._store.put(
            event_key(self.config.run_id, self.node, self._seq), event.model_dump_json().encode()
        )

    async def _publish_group(self, state: WorkerState, info: RoundInfo | None) -> None:
        """This node in ``GET /jobs/{id}/workers``: round and rank (not torch's workers)."""
        view = GroupView(
            node=self.node,
            state=state,
            role="default",
            group_rank=-1 if info is None else info.group_rank,
            group_world_size=0 if info is None else info.group_world_size,
            attempt=-1 if info is None else info.round,
            round=-1 if info is None else info.round,
            restart_count=0,
            master_addr=None if info is None else info.master_addr,
            master_port=None if info is None else info.master_port,
            updated_at=time.time(),
            job_tag=self._tag,
        )
        key = group_key(self.config.run_id, self.node)
        await self._store.put(key, view.model_dump_json().encode())

    async def _register(self) -> None:
        """Make the run's document (PENDING) before joining; refuse a daemons' job's id."""
        if self._spec is None:
            return
        try:
            await self._record(RunStep(JobState.PENDING))
        except ValueError as exc:  # run_edit's refusal (ValidationError: a malformed doc)
            raise RendezvousError(str(exc)) from None
        await self._publish_group(WorkerState.INIT, None)

    # -- the watch on the round --------------------------------------------------

    async def _follow(self, my_round: int) -> None:
        """Wait for a reason to re-form ``my_round``; say "leaving" first, then record it."""
        pause = _RETRY_FIRST
        while True:
            try:
                change = await self._rdzv.wait_for_change(my_round)
                break
            except StoreAuthError as exc:
                # A refused token never heals by retrying: the lease lapses too, and the
                # others re-form without this node. Tell torch to re-form now.
                log.warning("%s: the daemon refuses this run's token: %s", self.node, exc)
                change = Change.FENCED
                break
            except StoreError as exc:
                log.debug("%s: watch failed: %s", self.node, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RETRY_MAX)
        if change is Change.CLOSED:
            self._closed_seen = True
        else:
            with contextlib.suppress(StoreError):
                await self._rdzv.leaving(my_round)
            log.info("%s: round %d must re-form: %s", self.node, my_round, change.value)
            self._note(
                RunStep(JobState.RESTARTING, my_round, change.value),
                EventKind.RENDEZVOUS_CHANGE,
                f"round {my_round} re-forms: {change.value}",
                WorkerState.STOPPED,
            )
        self._waiting = waiting_nodes(change)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError, Exception):
                self._watch.result()
            self._watch = None

    # -- what the torch handler calls --------------------------------------------

    def next_round(self) -> RoundInfo:
        """Leave the current round if in one, and block until the next one completes."""
        self._stop_watch()
        if not self._registered:
            self._thread.call(self._register())
            self._registered = True
        if self._round is not None and self._waiting == 0:
            # torch asks for a new round though the watch saw no reason: its own workers
            # failed (num_nodes_waiting was 0, so it was not told to re-form).
            self._thread.loop.call_soon_threadsafe(
                self._note,
                RunStep(
                    JobState.RESTARTING,
                    self._round.round,
                    f"the workers on {self.node} failed",
                    failed=True,
                ),
                EventKind.RENDEZVOUS_CHANGE,
                f"round {self._round.round} re-forms: the workers on {self.node} failed",
                WorkerState.FAILED,
            )
        info = self._thread.call(self._rdzv.next_round())
        self._round, self._waiting = info, 0
        self._thread.loop.call_soon_threadsafe(
            self._note,
            RunStep(JobState.RUNNING, info.round),
            EventKind.RENDEZVOUS_COMPLETE,
            f"round {info.round}: {self.node} is group rank {info.group_rank} of "
            f"{info.group_world_size}, master {info.master_addr}:{info.master_port}",
            WorkerState.HEALTHY,
        )
        self._watch = self._thread.submit(self._follow(info.round))
        return info

    def num_nodes_waiting(self) -> int:
        return self._waiting

    def is_closed(self) -> bool:
        if self._closed_seen:
            return True
        state, _, _, _ = self._thread.call(self._rdzv.snapshot())
        return state.closed

    def set_closed(self) -> None:
        self._thread.call(self._rdzv.close())
        self._closed_seen = True

    def shutdown(self, close: bool = True, failure: str | None = None) -> None:
        """Record the end (``failure``: why it failed; None: it succeeded), close the
        rendezvous (``close``), give up the lease, stop the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_watch()
        try:
            if close:
                self._thread.call(self._rdzv.close())
        finally:
            if self._registered:
                ended = JobState.SUCCEEDED if failure is None else JobState.FAILED
                self._thread.loop.call_soon_threadsafe(
                    self._note,
                    RunStep(ended, reason=failure),
                    None,
                    "",
                    WorkerState.SUCCEEDED if failure is None else WorkerState.FAILED,
                )
            self._thread.call(self._close_store())
            self._thread.stop()

    async def _close_store(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_RECORD_DRAIN):
                await self._notes.join()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._lease_id is not None:
            with contextlib.suppress(StoreError):
                await self._store.revoke(self._lease_id)  # our presence key goes at once
            self._lease_id = None
        await self._store.close()
