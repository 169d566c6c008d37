"""Replica groups' decisions (elasticd.node.jobs.groups, elasticd.replicas), as tables:
what a parent's children are, the parent's derived state, a pass's plan, and the
merged page of a parent's and its groups' events."""

from __future__ import annotations

import pytest

from elasticd.models import Event, Job, JobOwner, JobSpec, Launcher, RootCause
from elasticd.node.jobs.documents import apply_edit
from elasticd.node.jobs.groups import (
    belongs,
    children_of,
    derive_parent,
    group_views,
    parent_of_spec,
    plan_groups,
    taken_edit,
)
from elasticd.node.jobs.merged import page
from elasticd.states import JobState

P, R, F, S, C, X = (
    JobState.PENDING,
    JobState.RUNNING,
    JobState.FAILED,
    JobState.SUCCEEDED,
    JobState.CANCELLED,
    JobState.RESTARTING,
)


def parent(groups: int = 3, least: int | None = None, state: JobState = P) -> Job:
    spec = JobSpec(
        id="ft",
        entrypoint="python",
        args=["train.py"],
        replica_groups=groups,
        min_replicas=least,
        max_restarts=2,
        priority=5,
        user="alice",
    )
    job = Job(
        id="ft",
        spec=spec,
        state=state,
        max_restarts=2,
        created_at=100.0,
        submitted_to="n0",
        owner=JobOwner(name="alice", local=True),
    )
    return parent_of_spec(job)


def groups_in(job: Job, *states: JobState | None) -> dict[int, Job]:
    """The parent's groups in these states (None: not written), failures with a cause."""
    out = {}
    for child, state in zip(children_of(job), states, strict=True):
        if state is None:
            continue
        error = RootCause(message=f"exit 7 in {child.id}", rank=0) if state is F else None
        assert child.replica_group is not None
        out[child.replica_group] = child.model_copy(
            update={"state": state, "error": error, "finished_at": 200.0 + child.replica_group}
        )
    return out


def test_children_are_the_parents_spec_less_its_groups_one_job_each():
    """Each group is an ordinary job `<id>.g<k>`: the parent's spec (its budget, user and
    priority) less replica_groups/min_replicas, its owner, and the parent's creation."""
    job = parent(3)
    kids = children_of(job)
    assert [c.id for c in kids] == ["ft.g0", "ft.g1", "ft.g2"]
    for k, child in enumerate(kids):
        assert (child.replica_group, child.group_of, child.num_replica_groups) == (k, "ft", 3)
        assert child.launcher is Launcher.ELASTICD and not child.is_parent
        assert child.spec.id == child.id
        assert child.spec.replica_groups is None and child.spec.min_replicas is None
        replicas = {"id", "replica_groups", "min_replicas"}
        assert child.spec.model_dump(exclude=replicas) == job.spec.model_dump(exclude=replicas)
        assert (child.max_restarts, child.spec.priority, child.spec.user) == (2, 5, "alice")
        assert child.owner == job.owner and child.state is P
        assert belongs(child, job)
        Job.model_validate_json(child.model_dump_json())  # a valid stored document
    assert job.is_parent and job.spec.min_replicas == 2  # a majority by default
    ordinary = job.model_copy(update={"spec": job.spec.model_copy(update={"replica_groups": None})})
    assert children_of(ordinary) == []


def test_another_job_at_a_groups_id_is_not_the_parents():
    """A job that took a group's id, or a group of an earlier job of the parent's id, is
    not the parent's."""
    job = parent(2)
    child = children_of(job)[0]
    assert not belongs(child.model_copy(update={"created_at": 99.0}), job)
    assert not belongs(child.model_copy(update={"owner": JobOwner(name="bob")}), job)
    assert not belongs(child.model_copy(update={"submitted_to": "n1"}), job)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"replica_groups": 3, "min_replicas": 4}, "must not exceed replica_groups"),
        ({"min_replicas": 1}, "goes with replica_groups"),
        ({"replica_groups": 0}, "greater than or equal to 1"),
        ({"replica_groups": 257}, "less than or equal to 256"),
        ({"replica_groups": 11, "id": "x" * 125}, "at most 124 characters"),
        ({"replica_groups": 10, "id": "x" * 125}, None),
        ({"replica_groups": 1}, None),
    ],
)
def test_the_specs_replica_fields_are_bounded(spec, problem):
    """N in 1..256, M in 1..N (default N//2+1), and a parent's id leaves room for `.g<k>`."""
    if problem is None:
        assert JobSpec(entrypoint="python", **spec).min_replicas == spec["replica_groups"] // 2 + 1
        return
    with pytest.raises(ValueError, match=problem):
        JobSpec(entrypoint="python", **spec)


@pytest.mark.parametrize(
    ("update", "problem"),
    [
        ({"group_of": None}, "go together"),
        ({"replica_group": 3, "group_of": "ft", "num_replica_groups": 3}, "below"),
        ({"replica_group": 1, "group_of": "other", "num_replica_groups": 3}, "'<group_of>.g"),
    ],
)
def test_a_stored_groups_fields_must_agree(update, problem):
    """A group's document read back from the store is refused unless its fields agree
    (anyone with the store's credentials may write one)."""
    raw = children_of(parent(3))[1].model_dump() | update
    with pytest.raises(ValueError, match=problem):
        Job.model_validate(raw)


# (parent state, min_replicas, groups' states) -> (the state written, a word of its reason)
DERIVED = [
    # before M groups run: PENDING, saying how many run
    (P, None, (None, None, None), None, "0 of 3 replica groups run, 2 needed"),
    (P, None, (R, P, P), None, "1 of 3"),
    (P, None, (R, R, P), R, None),
    (P, 3, (R, R, P), None, "2 of 3 replica groups run, 3 needed"),
    (P, 1, (R, None, None), R, None),
    # RUNNING while M run; a group that restarts or failed with M left changes nothing
    (R, None, (R, X, R), None, None),
    (R, None, (R, F, R), None, None),
    (R, None, (F, R, R), None, None),
    # below M after it ran, but M can still run: RESTARTING
    (R, None, (R, X, X), X, "1 of 3"),
    (X, None, (R, R, X), R, None),
    (R, 3, (R, F, R), F, "fewer than 3 can run"),
    # fewer than M can run: FAILED, naming each lost group and its cause
    (R, None, (F, F, R), F, "group 0 (ft.g0) FAILED: rank 0: exit 7 in ft.g0"),
    (P, None, (F, F, P), F, "2 of 3 replica groups ended, fewer than 2 can run"),
    (R, 1, (F, F, R), None, None),
    (R, 1, (F, F, F), F, "3 of 3"),
    # every group ended and M did not fail: SUCCEEDED (one step at a time from PENDING)
    (R, None, (S, S, S), S, None),
    (R, None, (S, F, S), S, None),
    (R, None, (S, S, R), None, None),  # the last still runs: RUNNING (2 healthy)
    (P, None, (S, S, S), R, None),
    (X, None, (S, S, S), S, None),
    # a cancelled group counts as lost
    (R, None, (C, C, R), F, "group 0 (ft.g0) CANCELLED"),
    # a parent that ended stays ended
    (C, None, (R, R, R), None, None),
    (F, None, (S, S, S), None, None),
]


@pytest.mark.parametrize(("now", "least", "states", "target", "reason"), DERIVED)
def test_the_parents_state_is_derived_from_its_groups(now, least, states, target, reason):
    """The derived state: RUNNING while M groups run, FAILED only once fewer than M can,
    SUCCEEDED once all ended and M did not fail; terminal states are final."""
    job = parent(3, least, now)
    kids = groups_in(job, *states)
    edit = derive_parent(job, kids)
    assert edit.get("state") == target
    if reason is not None:
        assert reason in (edit.get("reason") or "")
    if target is F:
        error = edit["error"]
        assert error is not None and error.message.startswith("group ")
    # Each write is a legal transition, and the next pass writes nothing more (but the
    # second step of a PENDING parent whose groups all succeeded).
    applied = apply_edit(job, edit, 300.0)
    assert derive_parent(applied, kids).get("state") == (S if (now, states[0]) == (P, S) else None)


def test_the_parents_restart_count_is_its_groups():
    """The parent's restart_count is the sum of its groups' (each has its own budget)."""
    job = parent(3, None, R)
    kids = groups_in(job, R, R, R)
    kids[1] = kids[1].model_copy(update={"restart_count": 2})
    kids[2] = kids[2].model_copy(update={"restart_count": 1})
    assert derive_parent(job, kids) == {"restart_count": 3}


def test_a_pass_writes_missing_groups_and_ends_a_finished_parents():
    """A pass writes the groups not written yet (while the parent is active), ends the
    active groups of a parent that was cancelled or failed, and fails a parent whose
    group ids are other jobs'."""
    job = parent(3)
    kids = children_of(job)
    plan = plan_groups(job, {kids[0].id: kids[0]})
    assert [c.id for c in plan.create] == ["ft.g1", "ft.g2"] and not plan.end
    assert not plan_groups(job.model_copy(update={"state": R}), {c.id: c for c in kids}).create
    running = {c.id: c.model_copy(update={"state": R}) for c in kids}
    done = running | {"ft.g0": running["ft.g0"].model_copy(update={"state": C})}
    cancelled = plan_groups(job.model_copy(update={"state": C}), done)
    assert [c.id for c in cancelled.end] == ["ft.g1", "ft.g2"] and not cancelled.create
    assert not cancelled.edit
    foreign = kids[1].model_copy(update={"owner": JobOwner(name="bob")})
    taken = plan_groups(job, {kids[0].id: kids[0], foreign.id: foreign})
    assert taken.taken == ["ft.g1"] and not taken.create
    edit = taken_edit(job, taken.taken)
    assert edit["state"] is F and "ft.g1" in (edit["reason"] or "")
    failed = job.model_copy(update={"state": F})
    assert not plan_groups(failed, {kids[0].id: kids[0], foreign.id: foreign}).taken
    assert not plan_groups(job.model_copy(update={"state": R}), running)  # nothing to do
    ordinary = kids[0]
    assert not plan_groups(ordinary, {})


def test_the_groups_as_served_say_each_childs_state_restarts_and_nodes():
    """``groups`` of a served parent: one entry per group, an unwritten one stateless."""
    job = parent(2)
    first = children_of(job)[0].model_copy(update={"state": R, "restart_count": 1})
    views = group_views(job, {first.id: first})
    assert [(v.group, v.job, v.state, v.restart_count) for v in views] == [
        (0, "ft.g0", R, 1),
        (1, "ft.g1", None, 0),
    ]


def _event(seq: int, job_id: str) -> Event:
    return Event(seq=seq, time=0.0, job_id=job_id, node="n", source="daemon", kind="job.state")


@pytest.mark.parametrize(
    ("parts", "limit", "expected"),
    [
        # merged in seq order; ties (one store revision) keep the sources' order
        ([([1, 5], False), ([2, 5, 9], False)], None, [1, 2, 5, 5, 9]),
        # a page never splits one seq
        ([([1, 5], False), ([2, 5, 9], False)], 3, [1, 2]),
        ([([1, 5], False), ([2, 5, 9], False)], 4, [1, 2, 5, 5]),
        # nothing past what a read cut at the limit may still hold
        ([([1, 2], True), ([3, 4], True)], 2, [1, 2]),
        ([([1, 8], True), ([3, 4], False)], 2, [1, 3]),
        ([([5, 6], True), ([1, 2, 3], False)], 2, [1, 2]),
        ([], 10, []),
    ],
)
def test_a_parents_events_page_merges_its_groups_in_order(parts, limit, expected):
    """The merged page of a parent's and its groups' events (see ``page``)."""
    given = [([_event(s, f"j{i}") for s in seqs], cut) for i, (seqs, cut) in enumerate(parts)]
    assert [e.seq for e in page(given, limit)] == expected
