"""Goodput's accounting under seeded timelines: the real :func:`elasticd.goodput.account`.

One seed draws a job's life as the nodes' records would hold it: attempts of
rounds 0.., each spawned, with or without a first progress, steps and
checkpoints, ended by a failure, a hang, a preemption, a stop or the job's
end, on 1-4 nodes whose records are merged (:func:`merge_nodes`), with the
job's submission, placement, end and preemptions. Stamps come from wall
clocks that may step (up to an hour either way), so nothing is in order.
Folded at a drawn ``now``, the figures must hold the doc's promises:

* ``wall_s`` and every part are non-negative, and the parts add up to ``wall_s``;
* goodput lies in 0..1;
* a job with no progress reported has no productive time, and says so;
* the steps: ``checkpoint_step`` and ``max_step`` are steps some attempt saw,
  ``lost_steps`` is non-negative, and known only when every failure's attempt
  reported steps;
* the failures counted are the attempts that ended by a failure or a hang.
"""

from __future__ import annotations

import math
import random

from elasticd.goodput import (
    AttemptFacts,
    End,
    JobFacts,
    NodeGoodput,
    StepPoint,
    account,
    merge_nodes,
)
from tests.sim.outcome import Outcome


def _stamp(rng: random.Random, t: float) -> float:
    """``t`` as a node's wall clock shows it: mostly right, sometimes stepped."""
    r = rng.random()
    if r < 0.9:
        return t + rng.uniform(-0.05, 0.05)
    return t + rng.choice([-3600.0, -60.0, 5.0, 3600.0])


def simulate_goodput(seed: int, steps: int = 300) -> Outcome:
    rng = random.Random(f"goodput-{seed}")
    trace: list[str] = []
    t = 1_000_000.0
    submitted = t
    t += rng.choice([0.0, rng.uniform(0, 100)])
    placed = _stamp(rng, t) if rng.random() < 0.7 else None
    nodes = [f"n{i}" for i in range(rng.randint(1, 4))]
    records: dict[str, list[AttemptFacts]] = {n: [] for n in nodes}
    step, reports = 0, rng.random() < 0.8
    preempted: list[float] = []
    rounds = rng.randint(1, min(12, max(1, steps // 25)))
    finished_at: float | None = None
    for round_ in range(rounds):
        t += rng.uniform(0.1, 30)
        spawned = t
        first = t + rng.uniform(0.1, 20) if reports and rng.random() < 0.85 else None
        with_steps = first is not None and rng.random() < 0.8
        start_step = step
        t_end = (first or spawned) + rng.uniform(0.1, 300)
        if with_steps:
            step += rng.randint(0, 200)
        last = round_ == rounds - 1
        end = rng.choice([End.FAILED, End.HUNG, End.PREEMPTED, End.STOPPED])
        if last:
            end = rng.choice([End.FINISHED, End.FAILED, None])
        if end is End.PREEMPTED:
            preempted.append(_stamp(rng, t_end))
        checkpoints = []
        if with_steps and step > start_step:
            for c in sorted(rng.sample(range(start_step, step + 1), k=min(3, step - start_step))):
                frac = (c - start_step) / max(1, step - start_step)
                assert first is not None
                checkpoints.append(StepPoint(t=_stamp(rng, first + frac * (t_end - first)), step=c))
        for node in nodes:
            facts = AttemptFacts(
                round=round_,
                spawned_at=_stamp(rng, spawned),
                first_progress_at=None if first is None else _stamp(rng, first),
                first_step=start_step if with_steps else None,
                first_step_at=_stamp(rng, first) if with_steps and first else None,
                max_step=step if with_steps else None,
                max_step_at=_stamp(rng, t_end) if with_steps else None,
                last_progress_at=None if first is None else _stamp(rng, t_end),
                checkpoints=checkpoints,
                end=end,
                ended_at=None if end is None else _stamp(rng, t_end + rng.uniform(0, 5)),
            )
            records[node].append(facts)
        trace.append(f"round {round_}: spawned {spawned:.1f} first {first} steps "
                     f"{start_step}..{step if with_steps else None} end {end}")  # fmt: skip
        t = t_end
        if last and end is not None:
            finished_at = _stamp(rng, t + 1)
    job = JobFacts(submitted_at=submitted, placed_at=placed, finished_at=finished_at,
                   preempted_at=tuple(sorted(preempted)))  # fmt: skip
    now = _stamp(rng, t + rng.uniform(0, 60))
    attempts = merge_nodes(NodeGoodput(node=n, attempts=a) for n, a in records.items())
    g = account("job", job, attempts, now)
    trace.append(f"account: wall {g.wall_s:.2f} productive {g.productive_s:.2f} "
                 f"badput {g.badput_s} steps {g.steps}")  # fmt: skip
    problem = _check(g, attempts)
    if problem is not None:
        trace.append(f"VIOLATION: {problem}")
        return Outcome(seed, f"seed {seed}: {problem}", trace, len(attempts))
    return Outcome(seed, None, trace, len(attempts))


def _check(g, attempts: list[AttemptFacts]) -> str | None:  # type: ignore[no-untyped-def]
    parts = [g.productive_s, *g.badput_s.values()]
    if g.wall_s < 0 or any(p < -1e-9 for p in parts):
        return f"a negative figure: wall {g.wall_s}, parts {parts}"
    if not math.isclose(sum(parts), g.wall_s, rel_tol=1e-9, abs_tol=1e-6):
        return f"the parts add up to {sum(parts)}, not wall_s {g.wall_s}"
    if not 0 <= g.goodput <= 1:
        return f"goodput {g.goodput} outside 0..1"
    progressed = any(a.first_progress_at is not None for a in attempts)
    if not progressed and (g.productive_s > 0 or g.progress_reported):
        return f"no progress was reported, yet productive {g.productive_s}"
    seen = {a.max_step for a in attempts} | {c.step for a in attempts for c in a.checkpoints}
    if g.steps.max_step is not None and g.steps.max_step not in seen:
        return f"max_step {g.steps.max_step} was never seen"
    if g.steps.checkpoint_step is not None and g.steps.checkpoint_step not in seen:
        return f"checkpoint_step {g.steps.checkpoint_step} was never seen"
    if g.steps.lost_steps is not None and g.steps.lost_steps < 0:
        return f"lost_steps {g.steps.lost_steps} is negative"
    failed = [a for a in attempts if a.end in (End.FAILED, End.HUNG)]
    if g.steps.failures != len(failed):
        return f"{g.steps.failures} failures counted, {len(failed)} attempts failed or hung"
    unknown = any(
        a.max_step is None for a in attempts if a.end in (End.FAILED, End.HUNG, End.PREEMPTED)
    )
    if g.lost_work_known and unknown:
        return "lost work called known though a failed attempt reported no step"
    return None
