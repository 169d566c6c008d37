"""The fleet scheduler under seeded churn: the real :func:`elasticd.sched.plan.schedule`.

One seed draws a fleet (nodes with slots and labels) and a stream of changes:
jobs submitted (sizes, priorities, selectors, owners with quotas, some that may
not preempt) and ended, nodes joining, leaving and coming back. After every
change the plan is computed again from the previous one, as the daemon's loop
does, and checked:

* no node holds more slots than it has (placed nodes and hot spares);
* gangs are whole: a placed job has ``min_nodes`` to ``max_nodes`` distinct live
  nodes that match its selector, at most one spare, never one of its own nodes;
* every active job is placed or queued, once; nothing else is;
* a job preempted in this pass was stopped by a placed job of higher priority;
* no starvation: once the fleet is quiet the plan settles, and the first job of the
  queue waiting for capacity does not fit in what the placed jobs leave free.
"""

from __future__ import annotations

import random
from dataclasses import replace

from elasticd.sched.plan import SPARES_PER_JOB, Demand, FleetPlan, NodeCapacity, schedule
from tests.sim.outcome import Outcome


def _check(plan: FleetPlan, jobs: dict[str, Demand], nodes: dict[str, NodeCapacity],
           before: FleetPlan) -> str | None:  # fmt: skip
    used: dict[str, int] = dict.fromkeys(nodes, 0)
    for job_id, placement in plan.placements.items():
        job = jobs.get(job_id)
        if job is None:
            return f"{job_id} is placed but not active"
        held = [*placement.nodes, *placement.spares]
        if len(set(held)) != len(held):
            return f"{job_id} holds a node twice: {held}"
        if not job.min_nodes <= len(placement.nodes) <= job.max_nodes:
            return f"{job_id} runs on {len(placement.nodes)} nodes, not {job.min_nodes}..{job.max_nodes}"
        if len(placement.spares) > SPARES_PER_JOB:
            return f"{job_id} has {len(placement.spares)} spares"
        for name in held:
            node = nodes.get(name)
            if node is None:
                return f"{job_id} is placed on {name}, which is not live"
            if not job.matches(node):
                return f"{job_id} is placed on {name}, which its selector does not match"
            used[name] += job.nproc
    for name, n in used.items():
        if n > nodes[name].slots:
            return f"node {name} holds {n} slots of {nodes[name].slots}"
    queued = [e.job for e in plan.queue]
    if len(set(queued)) != len(queued):
        return f"a job is queued twice: {queued}"
    if set(queued) & set(plan.placements):
        return f"jobs both placed and queued: {set(queued) & set(plan.placements)}"
    missing = set(jobs) - set(queued) - set(plan.placements)
    if missing:
        return f"active jobs neither placed nor queued: {sorted(missing)}"
    for job_id, why in plan.preempted.items():
        if job_id in before.preempted or job_id not in before.placements:
            continue
        if why.by not in plan.placements:
            return f"{job_id} was preempted by {why.by}, which is not placed"
        if job_id in jobs and jobs[why.by].priority <= jobs[job_id].priority:
            return f"{job_id} was preempted by {why.by}, of no higher priority"
    return None


def _starved(
    plan: FleetPlan, jobs: dict[str, Demand], nodes: dict[str, NodeCapacity]
) -> str | None:
    free = {n.name: n.slots for n in nodes.values()}
    for job_id, placement in plan.placements.items():
        for name in [*placement.nodes, *placement.spares]:
            free[name] -= jobs[job_id].nproc
    waiting = [e for e in plan.queue if e.reason == "capacity"]
    if not waiting:
        return None
    first = jobs[waiting[0].job]
    if first.slot_quota is not None:
        return None  # its owner's other jobs may be what holds it back
    fits = [n for n in nodes.values() if first.matches(n) and free[n.name] >= first.nproc]
    if len(fits) >= first.min_nodes:
        return f"{first.id} waits first in the queue, but {len(fits)} nodes have room for it"
    return None


def simulate_fleet(seed: int, steps: int = 300) -> Outcome:
    rng = random.Random(f"fleet-{seed}")
    trace: list[str] = []
    nodes_all = {
        f"h{i}": NodeCapacity(f"h{i}", rng.choice([1, 2, 4, 8]), {"zone": rng.choice("ab")})
        for i in range(rng.randint(2, 12))
    }
    live = dict(nodes_all)
    jobs: dict[str, Demand] = {}
    plan, now, passes = FleetPlan(), 1_000.0, 0

    def replan(what: str) -> str | None:
        nonlocal plan, passes
        before = plan
        plan = schedule(plan, list(jobs.values()), list(live.values()), now).plan
        passes += 1
        trace.append(
            f"{now:8.1f} {what}: placed {sorted(plan.placements)} queued {[e.job for e in plan.queue]}"
        )
        return _check(plan, jobs, live, before)

    for step in range(steps):
        now += rng.uniform(0.1, 5.0)
        r = rng.random()
        if r < 0.45 or not jobs:
            lo = rng.randint(1, 3)
            job = Demand(
                id=f"j{step}",
                nproc=rng.choice([1, 1, 2, 4]),
                min_nodes=lo,
                max_nodes=lo + rng.choice([0, 0, 1, 3]),
                priority=rng.choice([0, 0, 1, 5]),
                created_at=now,
                selector=rng.choice([{}, {}, {"zone": "a"}]),
                owner=rng.choice([None, "alice", "bob"]),
                may_preempt=rng.random() < 0.8,
                slot_quota=rng.choice([None, None, 8]),
            )
            jobs[job.id] = replace(job, slot_quota=None) if job.owner is None else job
            what = f"{job.id} submitted ({job.nproc}x{job.min_nodes}..{job.max_nodes}, p{job.priority})"
        elif r < 0.75:
            gone = rng.choice(sorted(jobs))
            del jobs[gone]
            what = f"{gone} ends"
        elif r < 0.87 and len(live) > 1:
            gone = rng.choice(sorted(live))
            del live[gone]
            what = f"node {gone} leaves"
        else:
            back = sorted(set(nodes_all) - set(live))
            if not back:
                continue
            name = rng.choice(back)
            live[name] = nodes_all[name]
            what = f"node {name} comes back"
        problem = replan(what)
        if problem is not None:
            trace.append(f"VIOLATION: {problem}")
            return Outcome(seed, f"seed {seed}: {problem}", trace, passes)
    for _ in range(5):  # the fleet is quiet: the plan settles
        now += 1.0
        settled = plan
        problem = replan("a quiet pass")
        if problem is not None:
            return Outcome(seed, f"seed {seed}: {problem}", trace, passes)
        if plan.placements == settled.placements:
            break
    problem = _starved(plan, jobs, live)
    if problem is not None:
        trace.append(f"VIOLATION: {problem}")
        return Outcome(seed, f"seed {seed}: starvation: {problem}", trace, passes)
    return Outcome(seed, None, trace, passes)
