"""The plan of an attempt (elasticd.agent.attempt): pure, built before anything is spawned."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.agent.attempt import NodeFacts, plan_attempt
from elasticd.errors import WorkerSpawnError
from elasticd.logs import LogLayout
from elasticd.models import JobSpec
from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.protocol import NodeInfo, State, seats
from elasticd.rendezvous.ranks import NodeSlot
from elasticd.states import WorkerState


def round_of(sizes: list[int], me: int, number: int = 4) -> RoundInfo:
    return RoundInfo(
        round=number,
        group_rank=me,
        group_world_size=len(sizes),
        nodes=[NodeSlot(i, "default", n) for i, n in enumerate(sizes)],
        master_addr="10.0.0.1",
        master_port=29500,
        participants={f"n{i}": i for i in range(len(sizes))},
    )


def facts(tmp_path: Path) -> NodeFacts:
    return NodeFacts(
        node="n1",
        logs=LogLayout(tmp_path),
        base_env={"PATH": "/usr/bin"},
        daemon_url="http://127.0.0.1:7070",
    )


def spec(**kw: object) -> JobSpec:
    return JobSpec.model_validate({"entrypoint": "train", "nproc_per_node": 2, **kw})


def test_the_plan_has_ranks_env_paths_and_view_and_touches_no_file(tmp_path: Path) -> None:
    plan = plan_attempt(
        "j",
        spec(args=["--local_rank=${local_rank}"], max_restarts=5),
        round_of([2, 2], me=1),
        restart_count=2,
        spawn_seq=3,
        node=facts(tmp_path),
        state=WorkerState.INIT,
        now=100.0,
    )
    assert list(tmp_path.iterdir()) == []  # pure: nothing created
    assert plan.tag == "4.2" and plan.spawn_seq == 3
    assert [r.rank for r in plan.ranks] == [2, 3]
    first, second = plan.launches
    assert second.argv == ["train", "--local_rank=1"]
    assert first.log_dir == tmp_path / "j" / "attempt_3" / "0"
    env = second.env
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == (
        "3",
        "1",
        "4",
        "1",
    )
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_MAX_RESTARTS"] == "5"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["ELASTICD_ATTEMPT"] == "4.2"
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "j/attempt_3/1/error.json")
    assert plan.heartbeats[1] == tmp_path / "j/attempt_3/1/heartbeat"
    assert plan.view.round == 4 and plan.view.group_rank == 1 and plan.view.updated_at == 100.0
    assert [w.state for w in plan.view.workers] == [WorkerState.INIT] * 2


@pytest.mark.parametrize("sizes", [[2, 3], [2, 1], [2, 0]])
def test_a_round_that_gives_this_node_another_worker_count_is_refused(
    tmp_path: Path, sizes: list[int]
) -> None:
    """The round document is shared state: never start more or fewer workers than asked."""
    with pytest.raises(WorkerSpawnError, match="refusing the round"):
        plan_attempt(
            "j",
            spec(),
            round_of(sizes, me=1),
            restart_count=0,
            spawn_seq=0,
            node=facts(tmp_path),
            state=WorkerState.INIT,
            now=0.0,
        )


def test_a_large_rounds_seat_gives_the_same_ranks_as_the_node_list(tmp_path: Path) -> None:
    """A large job's round carries this node's seat, not the node list: same ranks and env."""
    listed = round_of([2, 2, 2], me=1)
    state = State(
        round=4,
        complete=True,
        participants=listed.participants,
        nodes={n: NodeInfo("10.0.0.1", "default", 2, 29500) for n in listed.participants},
    )
    seated = RoundInfo.of_seat(seats(state)["n1"])
    assert seated.nodes == [] and seated.seat is not None

    def plan(round_: RoundInfo):
        return plan_attempt(
            "j",
            spec(),
            round_,
            restart_count=0,
            spawn_seq=1,
            node=facts(tmp_path),
            state=WorkerState.INIT,
            now=1.0,
        )

    assert plan(seated).ranks == plan(listed).ranks
    assert [w.env["RANK"] for w in plan(seated).launches] == ["2", "3"]
