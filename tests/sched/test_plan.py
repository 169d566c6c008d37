"""The fleet scheduler's pure decisions, case by case (elasticd.sched.plan.schedule)."""

from __future__ import annotations

import pytest

from elasticd.sched.plan import Demand, FleetPlan, NodeCapacity, Placement, schedule


def nodes(n: int, slots: int = 1, **labels: str) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", slots, dict(labels)) for i in range(n)]


def job(
    jid: str,
    nproc: int = 1,
    lo: int = 1,
    hi: int | None = None,
    prio: int = 0,
    t: float = 0.0,
    **sel: str,
) -> Demand:
    return Demand(jid, nproc, lo, hi or lo, prio, t, dict(sel))


def run(jobs, fleet, plan=None, now=10.0):
    return schedule(plan or FleetPlan(), jobs, fleet, now)


def placed(plan: FleetPlan) -> dict[str, list[str]]:
    return {j: p.nodes for j, p in plan.placements.items()}


def kinds(outcome) -> list[tuple[str, str, str | None]]:
    return sorted((n.job, n.kind, n.by) for n in outcome.notices)


def test_single_node_jobs_spread_over_the_fleet():
    """50 one-slot jobs on 3 nodes x 2 slots: every slot busy, 2 jobs per node, the rest queued in order."""
    out = run([job(f"j{i:02}", t=i) for i in range(50)], nodes(3, slots=2))
    per_node = {}
    for p in out.plan.placements.values():
        for n in p.nodes:
            per_node[n] = per_node.get(n, 0) + 1
    assert per_node == {"n0": 2, "n1": 2, "n2": 2}
    assert sorted(out.plan.placements) == [f"j{i:02}" for i in range(6)]
    assert [e.job for e in out.plan.queue] == [f"j{i:02}" for i in range(6, 50)]
    assert [e.position for e in out.plan.queue] == list(range(1, 45))


def test_least_loaded_then_fewest_jobs():
    fleet = [NodeCapacity("a", 4), NodeCapacity("b", 4)]
    plan = FleetPlan(placements={"x": Placement(nodes=["a"], placed_at=0)})
    out = run([job("x", nproc=2), job("y", nproc=1, t=1)], fleet, plan)
    assert placed(out.plan)["y"] == ["b"]


def test_gang_admission_two_jobs_cannot_split_the_fleet():
    """Two jobs of min_nodes=3 on 4 nodes: one takes 3 nodes whole, the other waits whole."""
    out = run([job("a", lo=3, t=1), job("b", lo=3, t=1)], nodes(4))
    assert placed(out.plan) == {"a": ["n0", "n1", "n2"]}
    (entry,) = out.plan.queue
    assert entry.job == "b" and entry.reason == "capacity"
    assert entry.message == "needs 3 nodes with 1 free slot; 1 matching node has them now"
    # a ends: b is placed in the very next pass.
    out = run([job("b", lo=3, t=1)], nodes(4), out.plan)
    assert len(placed(out.plan)["b"]) == 3 and out.plan.queue == []
    assert ("b", "placed", None) in kinds(out)


def test_spares_take_only_what_nothing_else_wants():
    """A spare stands by on a free node and is given back the moment a queued job needs it."""
    fleet = nodes(3)
    out = run([job("a", lo=2)], fleet)
    assert out.plan.placements["a"].nodes == ["n0", "n1"]
    assert out.plan.placements["a"].spares == ["n2"]
    out = run([job("a", lo=2), job("b", t=1)], fleet, out.plan)
    assert out.plan.placements["a"].spares == []
    assert placed(out.plan)["b"] == ["n2"]
    assert ("a", "shrunk", "b") in kinds(out)


def test_three_two_node_jobs_on_four_one_slot_nodes_run_two_at_once():
    out = run([job(j, lo=2, t=i) for i, j in enumerate("abc")], nodes(4))
    assert sorted(placed(out.plan)) == ["a", "b"]
    assert all(p.spares == [] for p in out.plan.placements.values())
    assert [e.job for e in out.plan.queue] == ["c"]


def test_an_elastic_job_shrinks_to_min_nodes_for_a_waiting_job():
    fleet = nodes(4)
    out = run([job("a", lo=1, hi=4)], fleet)
    assert len(placed(out.plan)["a"]) == 4
    out = run([job("a", lo=1, hi=4), job("b", lo=3, t=1)], fleet, out.plan)
    assert len(placed(out.plan)["a"]) == 1 and len(placed(out.plan)["b"]) == 3
    assert kinds(out).count(("a", "shrunk", "b")) == 3


def test_lent_nodes_stay_while_taking_them_back_would_not_help():
    """No churn: a waiting job that would not fit even with the lent nodes leaves them lent."""
    fleet = nodes(4)
    out = run([job("a", lo=2, hi=4)], fleet)
    out = run([job("a", lo=2, hi=4), job("b", lo=3, t=1)], fleet, out.plan)
    assert len(placed(out.plan)["a"]) == 4
    assert out.plan.queue[0].job == "b"
    assert not [n for n in out.notices if n.kind == "shrunk"]


def test_a_higher_priority_job_preempts_the_newest_lowest_priority_job():
    fleet = nodes(3)
    plan = FleetPlan(
        placements={
            "old": Placement(nodes=["n0"], placed_at=0),
            "new": Placement(nodes=["n1"], placed_at=0),
            "mid": Placement(nodes=["n2"], placed_at=0),
        }
    )
    jobs = [job("old", t=1), job("new", t=2), job("mid", prio=1, t=3), job("hi", prio=5, t=4)]
    out = run(jobs, fleet, plan)
    assert placed(out.plan) == {"old": ["n0"], "mid": ["n2"], "hi": ["n1"]}
    assert out.plan.preempted["new"].by == "hi"
    assert ("new", "preempted", "hi") in kinds(out)
    (entry,) = out.plan.queue
    assert (
        entry.job == "new" and entry.preempted_by == "hi" and "preempted by job hi" in entry.message
    )
    # Capacity returns: the preempted job is placed again and no longer marked.
    out = run([job("old", t=1), job("new", t=2), job("mid", prio=1, t=3)], fleet, out.plan)
    assert "new" in out.plan.placements and out.plan.preempted == {}


def test_no_preemption_of_equal_priority_or_when_it_would_not_help():
    fleet = nodes(2)
    plan = FleetPlan(placements={"a": Placement(nodes=["n0"], placed_at=0)})
    out = run([job("a", t=1), job("b", lo=2, t=2)], fleet, plan)
    assert "a" in out.plan.placements and out.plan.preempted == {}
    # Higher priority but unable to fit even on an empty fleet of this size: nobody is stopped.
    out = run([job("a", t=1), job("c", lo=2, nproc=2, prio=9, t=3)], fleet, plan)
    assert "a" in out.plan.placements and out.plan.preempted == {}
    assert out.plan.entry("c").reason == "unplaceable"


def test_preemption_stops_no_more_jobs_than_needed():
    fleet = nodes(2, slots=2)
    plan = FleetPlan(
        placements={
            "x": Placement(nodes=["n0"], placed_at=0),
            "y": Placement(nodes=["n1"], placed_at=0),
        }
    )
    jobs = [job("x", nproc=2, t=1), job("y", nproc=1, t=2), job("h", nproc=1, prio=1, t=3)]
    out = run(jobs, fleet, plan)
    assert placed(out.plan) == {"x": ["n0"], "y": ["n1"], "h": ["n1"]}  # room on n1: nobody stops
    jobs = [job("x", nproc=2, t=1), job("y", nproc=1, t=2), job("h", nproc=2, prio=1, t=3)]
    out = run(jobs, fleet, plan)
    assert out.plan.preempted.keys() == {"y"}
    assert placed(out.plan)["h"] == ["n1"]


def test_unplaceable_job_is_flagged_once_with_the_numbers():
    fleet = nodes(2, slots=2, gpu="a100")
    out = run([job("big", nproc=3)], fleet)
    (entry,) = out.plan.queue
    assert entry.reason == "unplaceable"
    assert (
        "needs 1 node with 3 slots" in entry.message
        and "the cluster has 0 such nodes" in entry.message
    )
    assert kinds(out) == [("big", "unplaceable", None)]
    again = run([job("big", nproc=3)], fleet, out.plan, now=20.0)
    assert again.notices == [] and again.plan.queue[0].since == 10.0
    sel = run([job("h", gpu="h100")], fleet)
    assert (
        "matching gpu=h100" in sel.plan.queue[0].message
        and "0 live nodes" in sel.plan.queue[0].message
    )


def test_backfill_uses_only_what_the_waiting_job_cannot_use():
    """A small job behind a blocked big one starts on slots the big one will never need."""
    fleet = nodes(3, slots=2)
    plan = FleetPlan(placements={"run": Placement(nodes=["n0"], placed_at=0)})
    jobs = [
        job("run", nproc=2, t=0),
        job("big", nproc=1, lo=3, t=1),
        job("small", nproc=1, t=2),
        job("wide", nproc=2, t=3),
    ]
    out = run(jobs, fleet, plan)
    assert out.plan.entry("big").reserved == ["n0", "n1", "n2"]
    assert "small" in out.plan.placements  # backfilled on a slot big leaves free
    assert out.plan.entry("wide").reason == "capacity"  # would take a slot big waits for
    # run ends: big starts at once, not delayed by the backfilled job.
    out = run(jobs[1:], fleet, out.plan)
    assert len(placed(out.plan)["big"]) == 3


def test_queue_order_is_priority_then_fifo():
    out = run(
        [
            job("a", lo=5, t=1),
            job("b", lo=5, t=2, prio=3),
            job("c", lo=5, t=0),
            job("d", lo=5, t=0, prio=3),
        ],
        nodes(4),
    )
    assert [e.job for e in out.plan.queue] == ["d", "b", "c", "a"]


def test_a_lost_node_is_replaced_and_a_spare_is_promoted():
    plan = FleetPlan(placements={"a": Placement(nodes=["n0", "n1"], spares=["n2"], placed_at=1)})
    fleet = [n for n in nodes(4) if n.name != "n1"]
    out = run([job("a", lo=2)], fleet, plan)
    assert out.plan.placements["a"].nodes == ["n0", "n2"]
    assert out.plan.placements["a"].spares == ["n3"]
    assert out.plan.placements["a"].placed_at == 1


@pytest.mark.parametrize("seed", range(5))
def test_a_plan_is_stable_when_nothing_changes(seed):
    fleet = nodes(4, slots=2)
    jobs = [
        job(f"j{i}", nproc=1 + (i + seed) % 2, lo=1 + (i * seed) % 3, hi=3, prio=i % 2, t=i)
        for i in range(7)
    ]
    first = run(jobs, fleet)
    second = run(jobs, fleet, first.plan, now=99.0)
    assert second.plan == first.plan
    assert second.notices == []


def test_slots_are_never_overcommitted():
    fleet = nodes(3, slots=3)
    jobs = [job(f"j{i}", nproc=1 + i % 3, lo=1 + i % 2, hi=3, t=i) for i in range(12)]
    out = run(jobs, fleet)
    use = {n.name: 0 for n in fleet}
    need = {j.id: j.nproc for j in jobs}
    for jid, p in out.plan.placements.items():
        for n in p.nodes + p.spares:
            use[n] += need[jid]
    assert all(v <= 3 for v in use.values()), use


def test_two_gangs_short_of_nodes_give_them_back_and_wait_whole():
    """Found in review: two placed gangs that each lost a node held the rest and waited forever."""
    fleet = [NodeCapacity(n, 1) for n in "ABCDEF"]
    jobs = [job("j1", lo=3, t=1), job("j2", lo=3, t=2)]
    out = run(jobs, fleet)
    assert placed(out.plan) == {"j1": ["A", "B", "C"], "j2": ["D", "E", "F"]}
    lost = [n for n in fleet if n.name not in ("C", "F")]
    out = run(jobs, lost, out.plan)
    assert placed(out.plan) == {} and [e.job for e in out.plan.queue] == ["j1", "j2"]
    out = run(jobs, lost, out.plan)  # the next pass places the first whole
    assert placed(out.plan) == {"j1": ["A", "B", "D"]}
    assert out.plan.entry("j2").reason == "capacity"


def test_a_short_gang_is_topped_up_from_free_nodes():
    plan = FleetPlan(placements={"a": Placement(nodes=["n0", "n1"], placed_at=1)})
    fleet = [n for n in nodes(3) if n.name != "n1"]
    out = run([job("a", lo=2)], fleet, plan)
    assert placed(out.plan) == {"a": ["n0", "n2"]}


def test_a_reservation_stays_put_so_backfill_cannot_delay_the_head_job():
    """Found in review: the reservation moved to the node that freed first, and a later job
    backfilled the node the head job had been waiting for."""
    fleet = [NodeCapacity("A", 4), NodeCapacity("B", 4)]
    x, y = job("X", nproc=2, t=1), job("Y", nproc=3, t=2)
    head, j, k = job("H", nproc=4, t=3), job("J", nproc=1, t=4), job("K", nproc=2, t=5)
    plan = FleetPlan(
        placements={
            "X": Placement(nodes=["A"], placed_at=0),
            "Y": Placement(nodes=["B"], placed_at=0),
        }
    )
    out = run([x, y, head, j], fleet, plan)
    assert out.plan.entry("H").reserved == ["A"]
    out = run([x, head, j], fleet, out.plan)  # Y ends: B frees first
    assert out.plan.entry("H").reserved == ["A"]
    out = run([x, head, j, k], fleet, out.plan)  # K arrives: backfills B, never A
    assert "A" not in placed(out.plan).get("K", [])
    out = run([head, j, k], fleet, out.plan)  # X ends: H starts at once on A
    assert placed(out.plan)["H"] == ["A"]


def test_a_stored_plan_can_never_overcommit_a_node():
    """The plan is read from the store: shares beyond a node's slots are dropped, not kept."""
    fleet = [NodeCapacity("A", 4)]
    plan = FleetPlan(
        placements={
            "X": Placement(nodes=["A"], placed_at=0),
            "Y": Placement(nodes=["A", "A"], placed_at=0),
        }
    )
    out = run([job("X", nproc=4, t=0), job("Y", nproc=4, t=1)], fleet, plan)
    assert placed(out.plan) == {"X": ["A"]}
    assert out.plan.entry("Y").reason == "capacity"


def test_lending_keeps_what_was_lent_before_taking_new():
    """Found in review: a job earlier in the order took another job's lent node (churn)."""
    fleet = [NodeCapacity(n, 1) for n in "ABCD"]
    plan = FleetPlan(
        placements={
            "L": Placement(nodes=["A", "B"], placed_at=0),
            "H": Placement(nodes=["C"], placed_at=0),
        }
    )
    jobs = [job("L", lo=1, hi=2, t=2), job("H", lo=1, hi=2, prio=1, t=1)]
    out = run(jobs, fleet, plan)
    assert placed(out.plan) == {"L": ["A", "B"], "H": ["C", "D"]}
    assert not [n for n in out.notices if n.kind == "shrunk"]


def test_a_victim_placed_again_at_once_gets_one_notice_saying_so():
    """Found in review: a victim moved in the same pass was told it waits, and 'shrunk' twice."""
    a100 = {"gpu": "a100"}
    fleet = [NodeCapacity("A", 1, a100), NodeCapacity("B", 1, a100), NodeCapacity("C", 1)]
    low, high = job("L", t=1), job("H", lo=2, prio=5, t=2, gpu="a100")
    out = run([low], fleet)
    assert placed(out.plan) == {"L": ["A"]}
    out = run([low, high], fleet, out.plan)
    assert placed(out.plan) == {"H": ["A", "B"], "L": ["C"]}
    (notice,) = [n for n in out.notices if n.job == "L"]
    assert notice.kind == "preempted" and notice.by == "H"
    assert "placed again at once on C" in notice.message


def test_a_node_that_declined_a_job_is_not_given_it_again():
    fleet = [NodeCapacity("A", 1, declined=frozenset({"j"})), NodeCapacity("B", 1)]
    out = run([job("j")], fleet)
    assert placed(out.plan) == {"j": ["B"]}
    out = run([job("j")], fleet[:1])
    assert out.plan.entry("j").reason == "unplaceable"


def test_a_stored_plan_with_bad_names_or_numbers_does_not_parse():
    import pydantic

    for raw in (
        '{"placements": {"j": {"nodes": ["A"], "placed_at": NaN}}}',
        '{"preempted": {"v": {"by": "' + "x" * 300 + '", "at": 0}}}',
        '{"placements": {"j": {"nodes": ["../etc"], "placed_at": 0}}}',
        '{"queue": [], "extra": 1}',
    ):
        with pytest.raises(pydantic.ValidationError):
            FleetPlan.model_validate_json(raw)


class _Exploding(dict):
    """A selector whose items cannot be read: any exception while planning one job."""

    def items(self):
        raise RuntimeError("boom")


class _Unmatchable(Demand):
    """A job whose planning raises past the field checks (in the middle of the pass)."""

    def matches(self, node: NodeCapacity) -> bool:
        raise ZeroDivisionError("while matching")


def owned(jid: str, owner: str, nproc: int = 1, prio: int = 0, t: float = 0.0, **kw) -> Demand:
    return Demand(jid, nproc, priority=prio, created_at=t, owner=owner, **kw)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (job("bad", sel="x" * 3000), "node_selector['sel'] must be a string of at most 256"),
        (job("bad", **{f"k{i}": "v" for i in range(65)}), "more than 64 labels"),
        (Demand("bad", 0), "nproc_per_node must be an integer from 1 to 1024"),
        (Demand("bad", 1, 3, 2), "min_nodes must not exceed max_nodes"),
        (Demand("bad", 1, priority=10**6), "priority must be an integer"),
        (Demand("bad", 1, created_at=float("nan")), "created_at must be a finite number"),
        (Demand("bad", 1, selector=_Exploding()), "RuntimeError"),
        (_Unmatchable("bad", 1), "planning it failed: ZeroDivisionError: while matching"),
    ],
)
def test_a_job_that_cannot_be_planned_is_flagged_and_the_others_are_placed(bad, why):
    """A job whose fields break planning is unplaceable with the reason; the pass places the rest."""
    out = run([bad, job("good", t=1)], nodes(1))
    assert placed(out.plan) == {"good": ["n0"]}
    entry = out.plan.entry("bad")
    assert entry is not None and entry.reason == "unplaceable"
    assert why in entry.message and "cannot be planned" in entry.message
    assert len(entry.message) <= 2000
    assert ("bad", "unplaceable", None) in kinds(out)


def test_a_long_selector_is_clipped_in_the_queue_message():
    """64 long selector labels (within the API's bounds) make a message the plan can still hold."""
    sel = {f"key{i:03}": "v" * 256 for i in range(64)}
    out = run([job("wide", **sel), job("good", t=1)], nodes(1))
    entry = out.plan.entry("wide")
    assert entry is not None and entry.reason == "unplaceable" and len(entry.message) <= 2000
    assert placed(out.plan) == {"good": ["n0"]}


@pytest.mark.parametrize(
    ("jobs", "fleet_slots", "placed_jobs", "waiting"),
    [
        # alice holds 8 of her 8 slots: her next job waits with the reason quota.
        (
            [owned("a1", "alice", 8, slot_quota=8), owned("a2", "alice", 1, t=1, slot_quota=8)],
            16,
            ["a1"],
            {"a2": ("quota", "owner alice holds 8 of its 8 slots")},
        ),
        # Several jobs of one owner: 3 + 3 placed, the third (3 more) would pass 8.
        (
            [owned(f"a{i}", "alice", 3, t=i, slot_quota=8) for i in range(3)],
            16,
            ["a0", "a1"],
            {"a2": ("quota", "owner alice holds 6 of its 8 slots; this job needs 3 more")},
        ),
        # Another owner is not counted against alice's quota.
        (
            [owned("b", "bob", 8), owned("a", "alice", 4, t=1, slot_quota=4)],
            16,
            ["a", "b"],
            {},
        ),
        # No owner (a job from before identities): no quota.
        ([job("x", nproc=8), job("y", nproc=8, t=1)], 16, ["x", "y"], {}),
    ],
)
def test_slot_quota(jobs, fleet_slots, placed_jobs, waiting):
    """A job past its owner's slot quota waits with the reason quota and a message that says so."""
    out = run(jobs, [NodeCapacity("n0", fleet_slots)])
    assert sorted(out.plan.placements) == placed_jobs
    got = {e.job: (e.reason, e.message) for e in out.plan.queue}
    assert got == waiting


def test_a_job_over_quota_neither_preempts_nor_reserves():
    """A high-priority job over its owner's quota stops nobody and holds no slots."""
    fleet = [NodeCapacity("n0", 2)]
    plan = FleetPlan(
        placements={
            "mine": Placement(nodes=["n0"], placed_at=0),
            "low": Placement(nodes=["n0"], placed_at=0),
        }
    )
    jobs = [
        owned("mine", "alice", 1, slot_quota=1),
        job("low", prio=-5, t=1),
        owned("hi", "alice", 1, prio=9, t=2, slot_quota=1),
    ]
    out = run(jobs, fleet, plan)
    assert sorted(out.plan.placements) == ["low", "mine"] and out.plan.preempted == {}
    entry = out.plan.entry("hi")
    assert entry is not None and entry.reason == "quota" and entry.reserved == []


def test_lending_stops_at_the_quota():
    """An elastic job grows toward max_nodes only while its owner stays within the quota."""
    out = run([Demand("e", 2, 1, 4, owner="alice", slot_quota=4)], nodes(4, slots=2))
    assert len(out.plan.placements["e"].nodes) == 2 and out.plan.placements["e"].spares == []


@pytest.mark.parametrize(
    ("may_preempt", "owner", "preempts"),
    [(False, "alice", False), (True, "alice", True), (True, None, True)],
)
def test_only_an_owner_that_may_preempt_stops_other_jobs(may_preempt, owner, preempts):
    """A job whose owner may not preempt waits for capacity instead of stopping a lower job."""
    plan = FleetPlan(placements={"low": Placement(nodes=["n0"], placed_at=0)})
    hi = Demand("hi", 1, priority=9, created_at=1, owner=owner, may_preempt=may_preempt)
    out = run([job("low", prio=0), hi], nodes(1), plan)
    assert ("hi" in out.plan.placements) is preempts
    assert ("low" in out.plan.preempted) is preempts
    if not preempts:
        assert out.plan.entry("hi").reason == "capacity"


@pytest.mark.parametrize(
    ("allowed", "lo", "hi", "fleet", "want"),
    [
        # An allocation of 3 of 5 nodes: the job runs on exactly those 3.
        ({"n1", "n2", "n3"}, 3, 3, 5, {"n1", "n2", "n3"}),
        # MIN:MAX within the allocation: at most its nodes, never one outside.
        ({"n0", "n4"}, 1, 3, 5, {"n0", "n4"}),
        # An allocation node that is not live: the job waits rather than spill over.
        ({"n1", "n9"}, 2, 2, 3, set()),
    ],
)
def test_a_job_restricted_to_nodes_is_placed_only_on_them(allowed, lo, hi, fleet, want):
    """``nodes`` (a Slurm allocation) bounds the placement: only those nodes, or a wait."""
    restricted = Demand("slurm", 1, lo, hi, nodes=frozenset(allowed))
    out = run([restricted], nodes(fleet))
    got = out.plan.placements.get("slurm")
    assert set(got.nodes if got else []) == want
    if not want:
        entry = out.plan.entry("slurm")
        assert entry is not None and "among n1,n9" in entry.message


def test_nodes_that_cannot_be_read_make_the_job_unplaceable():
    """A ``nodes`` that is not a set of names (a store writer's) is refused, the rest placed."""
    bad = Demand("bad", 1, nodes=frozenset({1, 2}))  # type: ignore[arg-type]
    out = run([bad, job("good", t=1)], nodes(1))
    assert placed(out.plan) == {"good": ["n0"]}
    entry = out.plan.entry("bad")
    assert entry is not None and "nodes must be a set" in entry.message
