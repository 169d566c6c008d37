"""One job's running attempt, carried across the daemon's re-exec (issue 25).

:class:`AgentHandover` is what an agent that is watching its workers run
hands to the next program image of the daemon, as JSON in the hand-over
manifest (:mod:`elasticd.node.reexec`; never pickle: the next image may be
another version): the round it runs in, its attempt number, restart count
and state, the job's token file, the attempt's cgroup and each worker
(:class:`~elasticd.supervise.adopt.HandedWorker`: pid, start time, the
descriptors of its pipes, log files and heartbeat). The next image's agent
takes the attempt up where this one left it (:meth:`JobAgent.run
<elasticd.agent.agent.JobAgent.run>`): no new round, no spawn, nothing
signalled.

Which side of the boundary: the daemon.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.protocol import Seat
from elasticd.rendezvous.ranks import NodeSlot
from elasticd.supervise.adopt import HandedWorker

__all__ = ["AgentHandover", "round_from_json", "round_to_json"]


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
        )

    @property
    def fds(self) -> list[int]:
        return [fd for w in self.workers for fd in w.fds]
