"""The goodput ledger (elasticd.goodput): tables of timelines with hand-computed figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from elasticd.goodput import (
    BADPUT_KINDS,
    MAX_ATTEMPTS,
    MAX_SAMPLES,
    AttemptFacts,
    End,
    JobFacts,
    NodeGoodput,
    Observation,
    StepPoint,
    account,
    add_sample,
    begin_attempt,
    end_attempt,
    job_facts,
    merge_nodes,
    observe,
    walk_end,
)
from elasticd.models import Event, Job, JobSpec
from elasticd.states import JobState


def attempt(
    round_: int,
    spawned: float,
    first: float | None = None,
    steps: tuple[tuple[int, float], tuple[int, float]] | None = None,
    checkpoints: tuple[tuple[int, float], ...] = (),
    end: End | None = None,
    ended_at: float | None = None,
    last: float | None = None,
) -> AttemptFacts:
    """An attempt; ``steps``: (first step, its time), (max step, its time)."""
    (s0, t0), (s1, t1) = steps if steps is not None else ((None, None), (None, None))
    return AttemptFacts(
        round=round_,
        spawned_at=spawned,
        first_progress_at=first,
        first_step=s0,
        first_step_at=t0,
        max_step=s1,
        max_step_at=t1,
        last_progress_at=last if last is not None else t1,
        checkpoints=[StepPoint(step=s, t=t) for s, t in checkpoints],
        end=end,
        ended_at=ended_at,
    )


@dataclass
class Case:
    name: str
    job: JobFacts
    attempts: list[AttemptFacts]
    now: float
    productive: float
    bad: dict[str, float]
    lost_steps: int | None = 0
    failures: int = 0
    max_step: int | None = None
    checkpoint_step: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


CASES = [
    Case(
        # queue [0,5) startup [5,10) productive [10,100)
        "one attempt, no steps, still running",
        JobFacts(submitted_at=0, placed_at=5),
        [attempt(0, 7, first=10)],
        now=100,
        productive=90,
        bad={"queue": 5, "startup": 5},
    ),
    Case(
        # startup [0,4); productive [4,15) of which 50 steps past the checkpoint at
        # 0.1 s/step = 5 s lost; recovery [15,20); productive [20,31).
        "crash after a checkpoint, then success",
        JobFacts(submitted_at=0, finished_at=31),
        [
            attempt(
                0,
                2,
                first=4,
                steps=((0, 4), (100, 14)),
                checkpoints=((50, 9),),
                end=End.FAILED,
                ended_at=15,
            ),
            attempt(
                1,
                17,
                first=20,
                steps=((50, 20), (150, 30)),
                checkpoints=((100, 25),),
                end=End.FINISHED,
                ended_at=31,
            ),
        ],  # fmt: skip
        now=99,
        productive=17,
        bad={"startup": 4, "lost_work": 5, "recovery": 5},
        lost_steps=50,
        failures=1,
        max_step=150,
        checkpoint_step=100,
    ),
    Case(
        # startup [0,1); productive [1,11) all lost (no checkpoint, 20 steps at
        # 0.5 s/step); hang [11,21); recovery [21,25); productive [25,30).
        "a hang without a checkpoint, then a new attempt running",
        JobFacts(submitted_at=0),
        [
            attempt(0, 0, first=1, steps=((0, 1), (20, 11)), end=End.HUNG, ended_at=21),
            attempt(1, 23, first=25, steps=((0, 25), (4, 27))),
        ],
        now=30,
        productive=5,
        bad={"startup": 1, "lost_work": 10, "hang": 10, "recovery": 4},
        lost_steps=20,
        failures=1,
        max_step=20,
    ),
    Case(
        # queue [0,10) startup [10,12) productive [12,25) (checkpointed at its last
        # step: nothing lost) preempted [25,40) startup [40,42) productive [42,50).
        "preempted after a checkpoint, placed again",
        JobFacts(submitted_at=0, placed_at=10, preempted_at=(24,)),
        [
            attempt(
                0,
                11,
                first=12,
                steps=((0, 12), (10, 22)),
                checkpoints=((10, 22),),
                end=End.STOPPED,
                ended_at=25,
            ),
            attempt(1, 40, first=42),
        ],  # fmt: skip
        now=50,
        productive=21,
        bad={"queue": 10, "startup": 4, "preempted": 15},
        max_step=10,
        checkpoint_step=10,
    ),
    Case(
        # startup [0,2) productive [2,10) recovery [10,13) productive [13,20): the
        # failure's attempt reported no step, so its lost work is unknown.
        "a failure of a job that reports no steps",
        JobFacts(submitted_at=0, finished_at=20),
        [
            attempt(0, 0, first=2, end=End.FAILED, ended_at=10),
            attempt(1, 11, first=13, end=End.FINISHED, ended_at=20),
        ],
        now=20,
        productive=15,
        bad={"startup": 2, "recovery": 3},
        lost_steps=None,
        failures=1,
    ),
    Case(
        # productive [0,10) (5 steps past checkpoint 5 at 1 s/step: 5 s lost)
        # then the job failed for good at 12: other [10,12).
        "the last failure spends the budget",
        JobFacts(submitted_at=0, finished_at=12),
        [
            attempt(
                0,
                0,
                first=0,
                steps=((0, 0), (10, 10)),
                checkpoints=((5, 5),),
                end=End.FAILED,
                ended_at=10,
            )
        ],  # fmt: skip
        now=50,
        productive=5,
        bad={"lost_work": 5, "other": 2},
        lost_steps=5,
        failures=1,
        max_step=10,
        checkpoint_step=5,
    ),
    Case(
        "a recovery still under way",
        JobFacts(submitted_at=0),
        [attempt(0, 0, first=1, end=End.FAILED, ended_at=10)],
        now=15,
        productive=9,
        bad={"startup": 1, "recovery": 5},
        lost_steps=None,
        failures=1,
    ),
    Case(
        "waiting in the queue", JobFacts(submitted_at=0), [], now=8, productive=0, bad={"queue": 8}
    ),  # fmt: skip
    Case(
        # other [10,30) after a daemon stop until the next spawn, startup [30,31).
        "a daemon stop and a resume",
        JobFacts(submitted_at=0, finished_at=40),
        [
            attempt(0, 0, first=0, end=End.STOPPED, ended_at=10),
            attempt(1, 30, first=31, end=End.FINISHED, ended_at=40),
        ],
        now=40,
        productive=19,
        bad={"other": 20, "startup": 1},
    ),
    Case(
        # A worker that never pings: nothing shows progress, start-up lasts to its end.
        "no progress reported at all",
        JobFacts(submitted_at=0, placed_at=1, finished_at=10),
        [attempt(0, 2, end=End.FINISHED, ended_at=10)],
        now=10,
        productive=0,
        bad={"queue": 1, "startup": 9},
        extra={"progress_reported": False},
    ),
    Case(
        # startup [0,10) recovery [10,30): the restart never showed progress (issue 33:
        # it was productive from its spawn at 12).
        "a restart of a job that never pings, still running",
        JobFacts(submitted_at=0),
        [attempt(0, 0, end=End.FAILED, ended_at=10), attempt(1, 12)],
        now=30,
        productive=0,
        bad={"startup": 10, "recovery": 20},
        lost_steps=None,
        failures=1,
        extra={"progress_reported": False},
    ),
    Case(
        # startup [0,2) productive [2,10) recovery [10,25): the restarted attempt (spawned
        # at 12) has shown no progress yet, and it ended so (stopped at 25): other [25,30).
        "a restart that shows no progress before it stops",
        JobFacts(submitted_at=0),
        [
            attempt(0, 0, first=2, end=End.FAILED, ended_at=10),
            attempt(1, 12, end=End.STOPPED, ended_at=25),
        ],
        now=30,
        productive=8,
        bad={"startup": 2, "recovery": 15, "other": 5},
        lost_steps=None,
        failures=1,
    ),
    Case(
        # The daemon's wall clock stepped back an hour after the submission (3600): the
        # facts are steady (on the clock of before the step), the job's end is not (20
        # after the step is 3620 - 3600). The end is the finishing attempt's: startup
        # [3600,3602) productive [3602,3610) recovery [3610,3612) productive [3612,3630);
        # attempt 0 lost 10 steps past checkpoint 40 (at 1 step/s) to lost_work.
        "a backward step of the wall clock before the job's end",
        JobFacts(submitted_at=3600, finished_at=20),
        [
            attempt(
                0,
                3601,
                first=3602,
                steps=((1, 3602), (50, 3610)),
                checkpoints=((20, 3605), (40, 3608)),
                end=End.FAILED,
                ended_at=3610,
            ),
            attempt(
                1,
                3611,
                first=3612,
                steps=((41, 3612), (100, 3629)),
                checkpoints=((60, 3615), (100, 3629)),
                end=End.FINISHED,
                ended_at=3630,
            ),
        ],  # fmt: skip
        now=25,
        productive=8 - 8 * 10 / 49 + 18,
        bad={"startup": 2, "recovery": 2, "lost_work": 8 * 10 / 49},
        lost_steps=10,
        failures=1,
        max_step=100,
        checkpoint_step=100,
    ),
    Case(
        # Stamps out of order (a stepped clock, two nodes' clocks): attempt 1's checkpoint
        # is timed before attempt 0's, yet it is the later one; attempt 0's failure lost
        # its steps past its own checkpoint 30, not past 80.
        "checkpoints ordered by their attempts, not their times",
        JobFacts(submitted_at=0, finished_at=40),
        [
            attempt(
                0,
                0,
                first=0,
                steps=((0, 0), (40, 10)),
                checkpoints=((30, 9),),
                end=End.FAILED,
                ended_at=10,
            ),
            attempt(
                1,
                10,
                first=10,
                steps=((30, 10), (90, 40)),
                checkpoints=((80, 5),),
                end=End.FINISHED,
                ended_at=40,
            ),
        ],  # fmt: skip
        now=40,
        productive=10 - 10 * 10 / 40 + 30,
        bad={"lost_work": 10 * 10 / 40},
        lost_steps=10,
        failures=1,
        max_step=90,
        checkpoint_step=80,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_account_matches_the_hand_computed_figures(case: Case) -> None:
    """Each timeline's time lands in the kinds computed by hand, and adds up to wall time."""
    g = account("j", case.job, case.attempts, case.now)
    assert g.productive_s == pytest.approx(case.productive)
    assert g.badput_s == pytest.approx({k: case.bad.get(k, 0.0) for k in BADPUT_KINDS})
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)
    assert g.goodput == pytest.approx(case.productive / g.wall_s)
    assert g.steps.lost_steps == case.lost_steps
    assert g.lost_work_known is (case.lost_steps is not None)
    assert g.steps.failures == case.failures
    assert g.steps.max_step == case.max_step
    assert g.steps.checkpoint_step == case.checkpoint_step
    assert g.wall_s >= 0
    for name, value in case.extra.items():
        assert getattr(g, name) == value, name


def test_overlapping_facts_still_add_up() -> None:
    """Facts out of order (an attempt spawned before the last one's end) never count twice."""
    attempts = [
        attempt(0, 0, first=1, end=End.FAILED, ended_at=10),
        attempt(1, 5, first=3, end=End.FINISHED, ended_at=8),
    ]
    g = account("j", JobFacts(submitted_at=0, finished_at=12), attempts, 12)
    # The job ends with its finishing attempt (at 8), but never before its last fact (10).
    assert g.wall_s == pytest.approx(10)
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(10)
    assert all(v >= 0 for v in g.badput_s.values())


WALL_CLOCK_STEPS = [
    # (why, submitted, finished_at, last attempt's end and when, now, the walk's end)
    ("running: now", 0.0, None, None, None, 50.0, 50.0),
    ("finished: its end", 0.0, 40.0, End.FAILED, 30.0, 99.0, 40.0),
    ("finished with its attempt: the attempt's end", 0.0, 41.0, End.FINISHED, 40.0, 99.0, 40.0),
    ("a step back before the end: not before the last fact", 0.0, 5.0, End.FAILED, 30.0, 0, 30.0),
    ("a step back before now: not before the last fact", 0.0, None, End.FAILED, 30.0, 3.0, 30.0),
    ("a step forward before the end: the finishing attempt's", 0.0, 3640.0, End.FINISHED, 40.0,
     3650.0, 40.0),
    ("a step back before anything: not before the submission", 100.0, 50.0, None, None, 50.0,
     100.0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("why", "submitted", "finished", "end", "ended_at", "now", "walk"),
    WALL_CLOCK_STEPS,
    ids=[row[0] for row in WALL_CLOCK_STEPS],
)
def test_the_walk_ends_at_the_job_end_never_before_its_facts(
    why: str,
    submitted: float,
    finished: float | None,
    end: End | None,
    ended_at: float | None,
    now: float,
    walk: float,
) -> None:
    """The end of the walk, from wall stamps a clock's step may have put anywhere: never
    before the submission or the last fact, so no interval is negative (issue 33)."""
    attempts = [] if end is None else [attempt(0, 1, first=2, end=end, ended_at=ended_at)]
    job = JobFacts(submitted_at=submitted, finished_at=finished)
    assert walk_end(job, attempts, now) == walk, why
    g = account("j", job, attempts, now)
    assert g.wall_s == pytest.approx(walk - submitted)
    assert min([g.productive_s, *g.badput_s.values()]) >= 0
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s)


def test_merge_joins_one_round_over_nodes() -> None:
    """Two nodes' views of one round: earliest spawn and detection, highest step and checkpoint."""
    a = NodeGoodput(
        node="a",
        attempts=[
            attempt(3, 10, first=12, steps=((5, 12), (40, 20)), checkpoints=((30, 18),),
                    end=End.STOPPED, ended_at=22),
        ],
    )  # fmt: skip
    b = NodeGoodput(
        node="b",
        attempts=[
            attempt(2, 1, first=2, end=End.FINISHED, ended_at=3),
            attempt(3, 11, first=11.5, steps=((6, 13), (42, 21)), end=End.FAILED, ended_at=21.5),
        ],
    )
    merged = merge_nodes([a, b])
    assert [m.round for m in merged] == [2, 3]
    r3 = merged[1]
    assert (r3.spawned_at, r3.first_progress_at) == (10, 11.5)
    assert (r3.max_step, r3.max_step_at, r3.first_step) == (42, 21, 5)
    assert (r3.end, r3.ended_at) == (End.FAILED, 21.5)
    assert [c.step for c in r3.checkpoints] == [30]


def test_samples_are_thinned_and_bounded() -> None:
    """A long attempt keeps at most MAX_SAMPLES samples, the first and the newest among them."""
    samples: list[StepPoint] = []
    for step in range(10 * MAX_SAMPLES):
        add_sample(samples, StepPoint(t=float(step), step=step))
    assert len(samples) <= MAX_SAMPLES
    assert samples[0].step == 0
    assert samples[-1].step == 10 * MAX_SAMPLES - 1
    add_sample(samples, StepPoint(t=1e9, step=samples[-1].step))  # the same step again
    assert samples[-1].t != 1e9


def test_observe_takes_first_progress_steps_and_checkpoints() -> None:
    """Reads of the heartbeats: the first ping and first step are urgent, a higher step is a
    sample (its time the ping's), a new checkpoint is urgent and timed at the read."""
    a = AttemptFacts(round=0, spawned_at=0)
    a, urgent = observe(a, [Observation(None)], now=1)
    assert (a.first_progress_at, urgent) == (None, False)
    a, urgent = observe(a, [Observation(2.0), Observation(None)], now=2.5)
    assert (a.first_progress_at, a.first_step, urgent) == (2.0, None, True)
    a, urgent = observe(a, [Observation(3.0, step=5), Observation(2.9, step=4)], now=3.5)
    assert (a.first_step, a.first_step_at, a.max_step, urgent) == (5, 3.0, 5, True)
    a, urgent = observe(a, [Observation(4.0, step=9)], now=4.5)
    assert (a.max_step, a.max_step_at, a.last_progress_at, urgent) == (9, 4.0, 4.0, False)
    a, urgent = observe(a, [Observation(5.0, step=10, checkpoint_step=10)], now=5.5)
    assert ([(c.step, c.t) for c in a.checkpoints], urgent) == ([(10, 5.5)], True)
    a, urgent = observe(a, [Observation(6.0, step=11, checkpoint_step=10)], now=6.5)
    assert (len(a.checkpoints), urgent) == (1, False)
    assert [p.step for p in a.samples] == [5, 9, 10, 11]


def test_attempts_begin_and_end_once() -> None:
    """A new attempt closes one left open (a daemon that stopped unawares) at its last sign
    of life; the first end said is kept; the record stays bounded."""
    record = NodeGoodput(node="n")
    record = begin_attempt(record, 0, spawned_at=1)
    open_one = record.attempts[0].model_copy(update={"last_progress_at": 7.0})
    record = begin_attempt(record.model_copy(update={"attempts": [open_one]}), 1, spawned_at=9)
    assert (record.attempts[0].end, record.attempts[0].ended_at) == (End.STOPPED, 7.0)
    ended = end_attempt(record.attempts[1], End.FAILED, 12)
    assert end_attempt(ended, End.STOPPED, 13) == ended
    for n in range(MAX_ATTEMPTS + 5):
        record = begin_attempt(record, n + 2, spawned_at=20 + n)
    assert len(record.attempts) == MAX_ATTEMPTS
    NodeGoodput.model_validate_json(record.model_dump_json())  # within its own bounds


def test_job_facts_come_from_the_document_and_the_events() -> None:
    """Submission and end from the job document (an end only once terminal), the first
    placement and every preemption from its events."""

    def event(kind: str, t: float) -> Event:
        return Event(seq=1, time=t, job_id="j", node="n", source="daemon", kind=kind)

    spec = JobSpec(entrypoint="x")
    running = Job(id="j", spec=spec, state=JobState.RUNNING, max_restarts=3, created_at=1.0)
    events = [event("job.placed", 3.0), event("job.preempted", 9.0), event("job.placed", 12.0)]
    assert job_facts(running.model_copy(update={"finished_at": 20.0}), events) == JobFacts(
        submitted_at=1.0, placed_at=3.0, finished_at=None, preempted_at=(9.0,)
    )
    done = running.model_copy(update={"state": JobState.SUCCEEDED, "finished_at": 20.0})
    assert job_facts(done, []).finished_at == 20.0


def test_two_nodes_facts_merge_to_step_0_in_either_order() -> None:
    """A node that saw step 0 and one that saw no step merge to step 0, whichever comes
    first (``(max_step or -1)`` read step 0 as none: the merge kept None in one order)."""
    from elasticd.goodput import _merge_two

    none = AttemptFacts(round=0, spawned_at=0.0)
    zero = AttemptFacts(
        round=0, spawned_at=0.0, first_step=0, first_step_at=1.0, max_step=0, max_step_at=1.0
    )
    for a, b in [(none, zero), (zero, none)]:
        merged = _merge_two(a, b)
        assert (merged.max_step, merged.max_step_at) == (0, 1.0)
