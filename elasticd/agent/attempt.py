"""What one attempt starts on this node: a pure plan, made before anything is spawned.

:func:`plan_attempt` takes the round this node joined and the job, and
returns an :class:`AttemptPlan`: the ranks of the local workers, each
worker's launch (argv with torchrun's ``${local_rank}`` substituted, the
environment contract with the job's last checkpoint (``progress``), its
folder under the log layout, its console streams), the heartbeat files
and the group view to publish. The agent then acts on it (heartbeat files,
the spawn, events). A round that gives this node more or
fewer workers than the job asks for is refused here: the round document is
shared state that anyone with store access can write.

Which side of the boundary: the daemon; pure (paths are built, not opened).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticd.errors import WorkerSpawnError
from elasticd.logs import LogLayout
from elasticd.models import GroupView, JobProgress, JobSpec, WorkerView, console_streams
from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.ranks import WorkerRanks, assign_ranks, ranks_from
from elasticd.states import WorkerState
from elasticd.supervise.env import AttemptInfo, ReplicaGroup, worker_args, worker_env
from elasticd.supervise.process import WorkerLaunch
from elasticd.worker.flight import FILE as FLIGHT_FILE
from elasticd.worker.flight import FILE_VAR as FLIGHT_FILE_VAR

__all__ = ["AttemptPlan", "NodeFacts", "plan_attempt"]


@dataclass(frozen=True)
class NodeFacts:
    """What the plan needs to know about this node and its daemon."""

    node: str
    logs: LogLayout
    base_env: Mapping[str, str]
    daemon_url: str
    token_file: str | None = None
    cuda_visible_devices: str | None = None
    owner_user: str | None = None
    """The Unix user the job's submitter proved to be (its jobs may run as itself)."""


@dataclass(frozen=True)
class AttemptPlan:
    spawn_seq: int
    """This node's spawn sequence number of the job (the attempt's log folder)."""
    tag: str
    """``ELASTICD_ATTEMPT``: ``<round>.<restart count>``, unique per group start."""
    ranks: list[WorkerRanks]
    launches: list[WorkerLaunch]
    heartbeats: dict[int, Path]
    view: GroupView
    """The group view to publish, workers INIT (pids come with the spawn)."""


def plan_attempt(
    job_id: str,
    spec: JobSpec,
    round_: RoundInfo,
    *,
    restart_count: int,
    spawn_seq: int,
    node: NodeFacts,
    state: WorkerState,
    now: float,
    progress: JobProgress | None = None,
    job_tag: str | None = None,
    replica: ReplicaGroup | None = None,
) -> AttemptPlan:
    """The plan of this node's ``spawn_seq``-th start of the job, in ``round_`` (see the module)."""
    seat = round_.seat
    if seat is None:
        ranks = assign_ranks(round_.nodes, round_.group_rank)
    else:  # computed by the node that completed the round (large jobs)
        ranks = ranks_from(
            base_rank=seat.base_rank,
            world_size=seat.world_size,
            base_role_rank=seat.base_role_rank,
            role_world_size=seat.role_world_size,
            local_world_size=seat.local_world_size,
            group_rank=seat.group_rank,
            group_world_size=seat.group_world_size,
            role=seat.role,
        )
    if len(ranks) != spec.nproc_per_node:
        raise WorkerSpawnError(
            f"the rendezvous round gives {node.node} {len(ranks)} workers; the job "
            f"asks for nproc_per_node = {spec.nproc_per_node}: refusing the round"
        )
    logs = node.logs
    info = AttemptInfo(
        job_id=job_id,
        run_id=job_id,
        master_addr=round_.master_addr,
        master_port=round_.master_port,
        restart_count=restart_count,
        max_restarts=spec.max_restarts,
        daemon_url=node.daemon_url,
        token_file=node.token_file,
        cuda_visible_devices=node.cuda_visible_devices,
        checkpoint_step=progress.checkpoint_step if progress is not None else None,
        checkpoint_path=progress.checkpoint_path if progress is not None else None,
        replica=replica,
    )
    tag = f"{round_.round}.{restart_count}"
    heartbeats = {r.local_rank: logs.heartbeat_file(job_id, spawn_seq, r.local_rank) for r in ranks}
    launches = []
    for r in ranks:
        out, err = console_streams(spec, r.local_rank)
        env = worker_env(
            node.base_env,
            spec.env,
            r,
            info,
            error_file=str(logs.error_file(job_id, spawn_seq, r.local_rank)),
            heartbeat_file=str(heartbeats[r.local_rank]),
        )
        env["ELASTICD_ATTEMPT"] = tag  # in-process restart keys of this group start
        # Where the worker writes its flight recorder's summary (a job that turned it on).
        folder = logs.worker_dir(job_id, spawn_seq, r.local_rank)
        env[FLIGHT_FILE_VAR] = str(folder / FLIGHT_FILE)
        launches.append(
            WorkerLaunch(
                local_rank=r.local_rank,
                argv=[spec.entrypoint, *worker_args(spec.args, r.local_rank)],
                env=env,
                cwd=spec.cwd,
                log_dir=folder,
                console_stdout=out,
                console_stderr=err,
                user=spec.user,
                owner_user=node.owner_user,
                job_id=job_id,
                attempt=spawn_seq,
                log_limit_bytes=spec.log_limit_bytes,
                umask=spec.umask_bits,
            )
        )
    view = GroupView(
        node=node.node,
        state=state,
        role=spec.role,
        group_rank=round_.group_rank,
        group_world_size=round_.group_world_size,
        attempt=spawn_seq,
        round=round_.round,
        restart_count=restart_count,
        master_addr=round_.master_addr,
        master_port=round_.master_port,
        log_dir=str(logs.attempt_dir(job_id, spawn_seq)),
        updated_at=now,
        job_tag=job_tag,
        replica_group=replica.group if replica is not None else None,
        workers=[
            WorkerView(
                local_rank=r.local_rank,
                rank=r.rank,
                role_rank=r.role_rank,
                world_size=r.world_size,
                role_world_size=r.role_world_size,
                local_world_size=r.local_world_size,
                state=WorkerState.INIT,
                replica_group=replica.group if replica is not None else None,
            )
            for r in ranks
        ],
    )
    return AttemptPlan(spawn_seq, tag, ranks, launches, heartbeats, view)
