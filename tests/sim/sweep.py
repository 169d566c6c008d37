"""Sweeps of the simulation: many seeds, one verdict each; the CLI behind ``make sim``.

A sweep runs seeds ``first .. first + count - 1`` in ``jobs`` processes (each
schedule is independent and replays alone from its seed). A violation prints
the seed, the invariant, and the tail of its trace; ``--seed N`` replays it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tests.sim.agent import simulate_agent
from tests.sim.fleet import simulate_fleet
from tests.sim.goodput import simulate_goodput
from tests.sim.outcome import Outcome
from tests.sim.rendezvous import simulate


@dataclass(frozen=True)
class Verdict:
    seed: int
    ok: bool
    summary: str
    rounds: int
    virtual_s: float
    tail: str


def _rendezvous(seed: int, steps: int, large: bool | None) -> Verdict:
    outcome = simulate(seed, steps, large)
    plan = outcome.plan
    shape = f"{plan.nodes} nodes, min {plan.min_nodes}, max {plan.max_nodes}"
    violation = outcome.violation
    return Verdict(
        seed,
        violation is None,
        f"{shape}: {violation}" if violation is not None else shape,
        outcome.rounds,
        outcome.virtual_s,
        outcome.tail() if violation is not None else "",
    )


def _pure(
    simulate_part: Callable[[int, int], Outcome],
) -> Callable[[int, int, bool | None], Verdict]:
    """A pure part's schedules as verdicts (sizes are the rendezvous's alone)."""

    def run(seed: int, steps: int, large: bool | None) -> Verdict:
        outcome = simulate_part(seed, steps)
        ok = outcome.violation is None
        tail = "" if ok else outcome.tail()
        return Verdict(seed, ok, outcome.violation or "", outcome.count, 0.0, tail)

    return run


#: Each part of the control plane the simulation drives, by name.
PARTS: Mapping[str, Callable[[int, int, bool | None], Verdict]] = {
    "rendezvous": _rendezvous,
    "fleet": _pure(simulate_fleet),
    "agent": _pure(simulate_agent),
    "goodput": _pure(simulate_goodput),
}


#: What a part counts in a schedule (its ``Verdict.rounds``).
UNITS = {
    "rendezvous": "rounds joined",
    "fleet": "plan passes",
    "agent": "machine steps",
    "goodput": "attempts folded",
}


def _one(args: tuple[str, int, int, bool | None]) -> Verdict:
    part, seed, steps, large = args
    return PARTS[part](seed, steps, large)


def sweep(
    part: str, first: int, count: int, steps: int, large: bool | None, jobs: int = 1
) -> list[Verdict]:
    """Every seed's verdict, in seed order."""
    work = [(part, seed, steps, large) for seed in range(first, first + count)]
    if jobs <= 1:
        return [_one(w) for w in work]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return list(pool.imap(_one, work, chunksize=16))


def main(parser: argparse.ArgumentParser, parts: Mapping[str, object]) -> int:
    parser.add_argument("--part", choices=sorted(parts), default="rendezvous")
    parser.add_argument("--seed", type=int, help="replay this one seed and print its trace")
    parser.add_argument("--seeds", type=int, default=300, help="how many seeds to sweep")
    parser.add_argument("--from", dest="first", type=int, default=0, help="the first seed")
    parser.add_argument("--steps", type=int, default=300, help="fault steps per schedule")
    parser.add_argument("--size", choices=["mixed", "small", "large"], default="mixed")
    parser.add_argument("--jobs", type=int, default=1)
    ns = parser.parse_args()
    large = {"mixed": None, "small": False, "large": True}[ns.size]
    if ns.seed is not None:
        verdict = PARTS[ns.part](ns.seed, ns.steps, large)
        print(f"seed {ns.seed}: {'ok' if verdict.ok else 'VIOLATION'}: {verdict.summary}")
        if not verdict.ok:
            print(verdict.tail)
        return 0 if verdict.ok else 1
    started = time.monotonic()
    verdicts = sweep(ns.part, ns.first, ns.seeds, ns.steps, large, ns.jobs)
    bad = [v for v in verdicts if not v.ok]
    for v in bad[:10]:
        print(f"seed {v.seed}: {v.summary}\n{v.tail}\n", file=sys.stderr)
    rounds = sum(v.rounds for v in verdicts)
    virtual = sum(v.virtual_s for v in verdicts)
    print(
        f"{ns.part}: {len(verdicts)} schedules (seeds {ns.first}..{ns.first + ns.seeds - 1}, "
        f"{ns.steps} steps, {ns.size}), {len(bad)} violations; {rounds} {UNITS[ns.part]}, "
        f"{virtual:.0f} virtual s, {time.monotonic() - started:.0f} s"
    )
    if bad:
        print("replay: python -m tests.sim --part", ns.part, "--seed", bad[0].seed)
    return 1 if bad else 0
