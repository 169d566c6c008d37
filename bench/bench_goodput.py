"""Goodput accounting against the ground truth, and the cost of ``ping(step=)`` (issue 26).

**The scenario.** One job under a real ``elasticd serve``: a worker that
makes ``--steps`` steps of ``--step-ms`` each, checkpoints every
``--every`` steps (``elasticd.worker.checkpointed``), and crashes once at
each step of ``--crash-at``; a restarted attempt resumes from its own last
checkpoint. The worker notes the wall time of every step and checkpoint:
the ground truth. From it: the failures, the steps lost at each crash (past
the last checkpoint) and their time (from that checkpoint's step to the
crash), the last checkpoint and the highest step. ``GET /jobs/{id}/goodput``
must match: lost steps, failures and checkpoint exactly, lost work within
15 % (it is measured at the attempt's own step rate), productive + badput =
wall within 5 %.

**The cost.** ``ping(step=N)`` and ``ping()`` are timed in this process on a
heartbeat file made the way the daemon makes it, per call, over
``--calls`` calls (best of 5 runs).

Usage: ``python bench/bench_goodput.py [--steps 400] [--step-ms 20] [--every 50]
[--crash-at 130 290] [--calls 1000000] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, ElasticdServer, fmt, md_table, scratch  # noqa: E402

WORKER = """
import json, sys, time
from pathlib import Path
from elasticd.worker import checkpointed, ping

here, steps, step_s, every = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
crash_at = [int(s) for s in sys.argv[5:]]
notes = (here / "notes.jsonl").open("a")
ckpt = here / "ckpt"
start = int(ckpt.read_text()) if ckpt.exists() else 0
attempt = len(list(here.glob("crashed-*")))
for step in range(start + 1, steps + 1):
    time.sleep(step_s)
    ping(step=step)
    notes.write(json.dumps({"attempt": attempt, "step": step, "t": time.time()}) + "\\n")
    if step % every == 0:
        ckpt.write_text(str(step))
        checkpointed(step)
        notes.write(json.dumps({"attempt": attempt, "checkpoint": step, "t": time.time()}) + "\\n")
    notes.flush()
    if step in crash_at and not (here / f"crashed-{step}").exists():
        (here / f"crashed-{step}").write_text("")
        sys.exit(3)
"""


def ground_truth(notes: list[dict[str, Any]], step_s: float) -> dict[str, Any]:
    """What the worker's own notes say each figure is."""
    steps: dict[int, dict[int, float]] = {}
    checkpoints: list[tuple[int, int]] = []  # (attempt, step)
    for n in notes:
        if "step" in n:
            steps.setdefault(n["attempt"], {})[n["step"]] = n["t"]
        else:
            checkpoints.append((n["attempt"], n["checkpoint"]))
    lost_steps, lost_s = 0, 0.0
    attempts = sorted(steps)
    for attempt in attempts[:-1]:  # every attempt but the last crashed
        made = steps[attempt]
        crash = max(made)
        base = max((s for a, s in checkpoints if a <= attempt and s <= crash), default=0)
        lost_steps += crash - base
        # The wall time of the lost steps: from the checkpoint's step to the crash (one step
        # before the attempt's first when the checkpoint is an earlier attempt's).
        first = min(made)
        lost_s += made[crash] - made[base] if base in made else made[crash] - made[first] + step_s
    return {
        "failures": len(attempts) - 1,
        "lost_steps": lost_steps,
        "lost_work_s": lost_s,
        "checkpoint_step": max(s for _, s in checkpoints),
        "max_step": max(max(m) for m in steps.values()),
    }


def run_scenario(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    work = root / "work"
    work.mkdir()
    worker = root / "worker.py"
    worker.write_text(textwrap.dedent(WORKER))
    spec = {
        "entrypoint": sys.executable,
        "args": [
            str(worker),
            str(work),
            str(args.steps),
            str(args.step_ms / 1000),
            str(args.every),
            *map(str, args.crash_at),
        ],
        "max_restarts": len(args.crash_at) + 1,
        # A served daemon passes a login shell's environment: the workers import this tree.
        "env": {"PYTHONPATH": str(ROOT)},
    }
    with ElasticdServer(root) as server:
        job = server.submit(spec)
        done = server.wait_terminal(job["id"], timeout=600)
        r = server.client.get(f"/jobs/{job['id']}/goodput")
        r.raise_for_status()
        g = r.json()
    truth = ground_truth(
        [json.loads(line) for line in (work / "notes.jsonl").read_text().splitlines()],
        args.step_ms / 1000,
    )
    return {"state": done["state"], "goodput": g, "truth": truth}


def ping_cost(calls: int) -> dict[str, float]:
    """ns per call of ping(step=) and ping(), on a real heartbeat file (best of 5)."""
    from elasticd.worker import heartbeat

    with scratch("elasticd-ping-") as folder:
        path = folder / "hb"
        heartbeat.create_heartbeat_file(path)
        os.environ[heartbeat.ENV_VAR] = str(path)
        heartbeat._reset_for_tests()
        try:
            heartbeat.ping(step=0)  # maps the file
            out = {}
            for name, call in (
                ("ping(step=N)", lambda i: heartbeat.ping(step=i)),
                ("ping()", lambda i: heartbeat.ping()),
            ):
                best = float("inf")
                for _ in range(5):
                    started = time.perf_counter_ns()
                    for i in range(calls):
                        call(i)
                    best = min(best, (time.perf_counter_ns() - started) / calls)
                out[name] = best
            value = heartbeat.read_heartbeat(path)
            if value is None or value.step != calls - 1:
                raise RuntimeError(f"the pings did not land: {value}")
        finally:
            heartbeat._reset_for_tests()
            os.environ.pop(heartbeat.ENV_VAR, None)
    return out


def check(result: dict[str, Any]) -> list[str]:
    """The differences from the ground truth that break the goals (empty: all met)."""
    g, truth = result["goodput"], result["truth"]
    problems = []
    if result["state"] != "SUCCEEDED":
        problems.append(f"the job ended {result['state']}")
    for key in ("failures", "lost_steps", "checkpoint_step", "max_step"):
        if g["steps"][key] != truth[key]:
            problems.append(f"{key}: {g['steps'][key]} != {truth[key]}")
    lost, expected = g["badput_s"]["lost_work"], truth["lost_work_s"]
    if abs(lost - expected) > 0.15 * expected + 0.05:
        problems.append(f"lost_work {lost:.3f}s vs {expected:.3f}s")
    total = g["productive_s"] + sum(g["badput_s"].values())
    if abs(total - g["wall_s"]) > 0.05 * g["wall_s"]:
        problems.append(f"productive + badput {total:.3f}s vs wall {g['wall_s']:.3f}s")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--crash-at", type=int, nargs="*", default=[130, 290])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with scratch() as root:
        result = run_scenario(root, args)
    g, truth = result["goodput"], result["truth"]
    rows = [
        ["failures", str(g["steps"]["failures"]), str(truth["failures"])],
        ["lost_steps", str(g["steps"]["lost_steps"]), str(truth["lost_steps"])],
        ["checkpoint_step", str(g["steps"]["checkpoint_step"]), str(truth["checkpoint_step"])],
        ["max_step", str(g["steps"]["max_step"]), str(truth["max_step"])],
        ["lost_work (s)", fmt(g["badput_s"]["lost_work"], 3), fmt(truth["lost_work_s"], 3)],
    ]
    print(md_table(["figure", "elasticd", "ground truth"], rows))
    print()
    split = [["productive", fmt(g["productive_s"], 3)]]
    split += [[k, fmt(v, 3)] for k, v in g["badput_s"].items()]
    split += [["wall", fmt(g["wall_s"], 3)], ["goodput", fmt(g["goodput"], 3)]]
    print(md_table(["time", "seconds"], split))
    print()
    cost = ping_cost(args.calls)
    print(md_table(["call", "ns per call"], [[k, fmt(v, 1)] for k, v in cost.items()]))
    problems = check(result)
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "ping_ns": cost, "problems": problems}))
    for p in problems:
        print("GOAL MISSED:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
