"""One job's running attempt, carried across the daemon's re-exec (issue 25).

:class:`AgentHandover` is what an agent that is watching its workers run
hands to the next program image of the daemon, as JSON in the hand-over
manifest (:mod:`elasticd.node.reexec`; never pickle: the next image may be
another version): the round it runs in, its attempt number, restart count
and state, the job's token file, the attempt's cgroup and each worker
(:class:`~elasticd.supervise.adopt.HandedWorker`: pid, start time, the
descriptors of its pipes, log files and heartbeat), and the recovery still
waiting for the new workers' first ping
(:class:`~elasticd.agent.recovery.FirstProgress`). The next image's agent
takes the attempt up where this one left it (:meth:`JobAgent.run
<elasticd.agent.agent.JobAgent.run>`): no new round, no spawn, nothing
signalled.

:class:`Readoption` is the agent's side of it: whether the agent can hand its
attempt over now (:func:`not_ready`, pure), the hand-over itself, and taking
one up in the next image (the same pids, pipes and heartbeats, then
``job.readopted``). The agent keeps only the calls and its own state.

An agent that is not handed over (mid-start, mid-restart) runs on until the
exec cuts it off: :func:`unrecorded_at_exec` (pure) names the failure it saw,
or its workers met, that is not in the job yet, and :class:`CarriedFailure`
carries it to the next image, which records it before the job resumes.

Which side of the boundary: the daemon.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from elasticd.agent.machine import Effect, Phase, RecordFailure
from elasticd.agent.recovery import FirstProgress
from elasticd.eventkinds import EventKind
from elasticd.models import RootCause
from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.protocol import Seat
from elasticd.rendezvous.ranks import NodeSlot
from elasticd.states import WorkerState
from elasticd.supervise.adopt import HandedWorker, end_handed
from elasticd.supervise.process import GroupResult

if TYPE_CHECKING:
    from elasticd.agent.attempt import AttemptPlan
    from elasticd.agent.context import Emit
    from elasticd.agent.group import LocalGroup
    from elasticd.agent.hooks import Attempt, RecoveryHook
    from elasticd.models import JobProgress
    from elasticd.security import Identity

__all__ = [
    "AgentHandover",
    "CarriedFailure",
    "HandoverFacts",
    "Readoption",
    "not_ready",
    "round_from_json",
    "round_to_json",
    "started_from",
    "unrecorded",
    "unrecorded_at_exec",
]


def round_to_json(round_: RoundInfo) -> dict[str, Any]:
    return asdict(round_)


def round_from_json(doc: dict[str, Any]) -> RoundInfo:
    seat = doc.get("seat")
    return RoundInfo(
        round=int(doc["round"]),
        group_rank=int(doc["group_rank"]),
        group_world_size=int(doc["group_world_size"]),
        nodes=[NodeSlot(**slot) for slot in doc["nodes"]],
        master_addr=str(doc["master_addr"]),
        master_port=int(doc["master_port"]),
        participants={str(k): int(v) for k, v in doc["participants"].items()},
        seat=Seat(**seat) if seat is not None else None,
    )


@dataclass(frozen=True)
class AgentHandover:
    """A running attempt of one job on this node, for the daemon's next program image."""

    job_id: str
    spawn_seq: int
    round: RoundInfo
    restart_count: int
    formed_at: float
    token_file: str | None
    cgroup: str | None
    workers: list[HandedWorker]
    slots: list[int]
    """The node's slots the job held (the same GPUs stay its ``CUDA_VISIBLE_DEVICES``)."""
    recovery: FirstProgress | None = None
    """A recovery whose new workers had not pinged yet: timed to their first ping there."""

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "spawn_seq": self.spawn_seq,
            "round": round_to_json(self.round),
            "restart_count": self.restart_count,
            "formed_at": self.formed_at,
            "token_file": self.token_file,
            "cgroup": self.cgroup,
            "workers": [w.to_json() for w in self.workers],
            "slots": list(self.slots),
            "recovery": self.recovery.to_json() if self.recovery is not None else None,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AgentHandover:
        return cls(
            job_id=str(doc["job_id"]),
            spawn_seq=int(doc["spawn_seq"]),
            round=round_from_json(doc["round"]),
            restart_count=int(doc["restart_count"]),
            formed_at=float(doc["formed_at"]),
            token_file=None if doc.get("token_file") is None else str(doc["token_file"]),
            cgroup=None if doc.get("cgroup") is None else str(doc["cgroup"]),
            workers=[HandedWorker.from_json(w) for w in doc["workers"]],
            slots=[int(s) for s in doc.get("slots", [])],
            recovery=FirstProgress.from_json(r) if (r := doc.get("recovery")) else None,
        )

    @property
    def fds(self) -> list[int]:
        return [fd for w in self.workers for fd in w.fds]


@dataclass(frozen=True)
class CarriedFailure:
    """A failure a job's agent saw and had not recorded in the job when the exec cut it off
    (the job is not handed over): the next program image records it before the job resumes,
    so that it is charged once there (:func:`~elasticd.agent.edits.record_carried_failure`)."""

    round: RoundInfo
    """The failed round, its participants as the agent knew them."""
    root: RootCause
    alone: bool
    """Charged at once when the budget is spent (:func:`~elasticd.agent.edits.record_failure`)."""
    job_tag: str | None
    """Which job of its id failed (:func:`~elasticd.models.incarnation_tag`)."""
    pid: int | None = None
    """The failed worker's pid when nothing said its exit yet (``worker.exited`` is said
    there); None: said already."""
    early_count: int | None = None
    """Workers started early whose round the store had not confirmed at the exec: the
    restart count that round carries once the previous failure is charged. Recorded only
    if the job shows it was (the round formed as predicted); else, as when the store's
    answer differs, nothing of that start is charged."""

    def to_json(self) -> dict[str, Any]:
        return {
            "round": round_to_json(self.round),
            "root": self.root.model_dump(mode="json"),
            "alone": self.alone,
            "job_tag": self.job_tag,
            "pid": self.pid,
            "early_count": self.early_count,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CarriedFailure:
        return cls(
            round=round_from_json(doc["round"]),
            root=RootCause.model_validate(doc["root"]),
            alone=bool(doc.get("alone", False)),
            job_tag=None if doc.get("job_tag") is None else str(doc["job_tag"]),
            pid=None if doc.get("pid") is None else int(doc["pid"]),
            early_count=None if doc.get("early_count") is None else int(doc["early_count"]),
        )


@dataclass(frozen=True)
class HandoverFacts:
    """What decides whether an agent can hand its attempt over (read right before the exec)."""

    phase: Phase
    state: WorkerState
    monitoring: bool
    """Parked awaiting its workers' result, a hang or a round change (nothing half-done)."""
    holding_exits: bool
    """Exits held while a start is unconfirmed (an early start) or an adoption is not done."""
    has_round: bool
    has_workers: bool


def not_ready(facts: HandoverFacts) -> str | None:
    """None when the agent can hand its attempt over now; else why not (pure).

    Only an agent watching its running, healthy workers can: anything else is
    half-way through a start, a restart or a stop, and its job would resume in
    the next image as a new attempt (uncharged, its workers restarted).
    """
    if facts.phase is not Phase.RUNNING or not facts.has_round or not facts.has_workers:
        return f"its workers were not running ({facts.phase.value})"
    if facts.state is not WorkerState.HEALTHY:
        return f"its worker group was {facts.state.value}"
    if facts.holding_exits:
        return "its workers' start was not confirmed yet"
    if not facts.monitoring:
        return "it was handling an event of its workers"
    return None


def unrecorded(queued: Sequence[Effect]) -> RecordFailure | None:
    """The failure an agent saw and has not recorded in the job yet (pure).

    Its ``RecordFailure`` waits behind the survivors' stop, which may take the whole grace;
    the re-exec, which cuts the agent off past its wait, records it first, so the next image
    charges it. The job's edit keeps one failure per round: the runner's own record of it,
    if it comes, changes nothing.
    """
    return next((effect for effect in queued if isinstance(effect, RecordFailure)), None)


def unrecorded_at_exec(
    queued: Sequence[Effect],
    facts: HandoverFacts,
    result: GroupResult | None,
    *,
    inprocess_restart: bool,
    now: float,
) -> RecordFailure | None:
    """The failure an agent that is not handed over saw, or its workers met, and has not
    recorded in the job when the exec cuts it off, wherever it is (pure): its queued
    record (:func:`unrecorded`: behind the survivors' stop, or its write under way), else
    the running attempt's failure (``result``, the exits as they are at the exec: one not
    yet seen by the agent, or not yet reaped) that it would record next; or, forming with
    workers started early (their exits held: ``holding_exits``), theirs, which counts only
    if the store formed their round as predicted (:attr:`CarriedFailure.early_count`). Not
    an in-process restart's (its wrapper's business), nor while an adoption holds exits."""
    queued_failure = unrecorded(queued)
    if queued_failure is not None:
        return queued_failure
    early = facts.phase is Phase.FORMING and facts.holding_exits
    if (
        ((facts.phase not in (Phase.STARTING, Phase.RUNNING) or facts.holding_exits) and not early)
        or inprocess_restart
        or result is None
        or result.root_cause is None
    ):
        return None
    return RecordFailure(result, now)


def started_from(progress: JobProgress, round_: int) -> int | None:
    """The step a taken-up attempt started from: its own, if the job recorded it."""
    current = progress.attempt
    if current is not None and current.round == round_:
        return current.started_from
    return progress.checkpoint_step


class Readoption:
    """One agent's side of the daemon's re-exec: hand its running attempt over, or take one
    up in the next program image (the workers of :class:`LocalGroup` stay as they run)."""

    def __init__(self, node: str, group: LocalGroup, recovery: RecoveryHook, emit: Emit) -> None:
        self._node = node
        self._group = group
        self._recovery = recovery
        self._emit = emit

    def pending_exit(self) -> bool:
        """A worker was reaped and its exit is not delivered yet (the exec waits for it)."""
        processes = self._group.processes
        return processes is not None and processes.pending_exit()

    async def close_standbys(self) -> None:
        """Kill the job's standbys on this node (the next image starts its own)."""
        await self._group.close_standbys()

    def hand_over(self, template: AgentHandover) -> AgentHandover | None:
        """``template`` (the attempt's facts, no workers yet) with the workers' pids, pipes
        and heartbeats and the recovery awaiting their first ping, or None when the
        processes cannot be handed over. No await."""
        processes = self._group.processes
        handed = processes.hand_over() if processes is not None else None
        if handed is None:
            return None
        workers, cgroup = handed
        beats = self._group.progress.hand_over()
        workers = [
            dataclasses.replace(
                w,
                heartbeat_fd=beats.get(w.local_rank, (None, None))[0],
                beat_started=beats.get(w.local_rank, (None, None))[1],
            )
            for w in workers
        ]
        recovery = self._recovery.awaiting
        return dataclasses.replace(template, workers=workers, cgroup=cgroup, recovery=recovery)

    async def take_up(
        self,
        handover: AgentHandover,
        attempt: Attempt,
        plan: AttemptPlan,
        identity: Identity | None,
    ) -> None:
        """Watch the handed workers as this attempt's (same pids, pipes, heartbeats), and
        time their recovery's first ping here; if that fails before anybody watches them,
        they are ended: nothing of it runs on."""
        try:
            await self._group.adopt(attempt, plan, handover, identity)
        except BaseException:
            if self._group.processes is None:
                await asyncio.shield(end_handed(handover.workers))
            raise
        self._recovery.awaiting = handover.recovery

    def readopted(self, handover: AgentHandover) -> None:
        """``job.readopted``: the attempt runs on under this program image; then the exits
        that came through the exec, in order."""
        pids = [w.pid for w in handover.workers]
        self._emit(
            EventKind.JOB_READOPTED,
            f"attempt {handover.spawn_seq} on {self._node} taken up after the daemon's "
            f"re-exec: round {handover.round.round}, restart count {handover.restart_count}, "
            f"pids {', '.join(map(str, pids))}",
            state=WorkerState.HEALTHY.value,
            attempt=handover.spawn_seq,
            pids=pids,
        )
        self._group.release_adopted_exits()
