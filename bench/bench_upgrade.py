"""The upgrade figure (issue 25): what a running job loses when its daemon is upgraded.

One run, one ``elasticd serve``, one job of two workers that ping their
heartbeat and print the ``CLOCK_MONOTONIC`` of each ping (every 10 ms):

1. **re-exec** (``SIGHUP``, ``systemctl reload``): the daemon re-executes in place
   and takes the workers up;
2. **stop-and-resume**, today's upgrade (``systemctl restart``): ``SIGTERM``, a new
   ``elasticd serve`` on the same state folder; the job resumes as a new attempt
   (every worker restarted, no restart charged).

For each it reports the longest pause in the workers' heartbeats around the
upgrade (from their own record: the pings are the job's progress), whether
the worker pids survived, how long the daemon's API was away (from the
signal until ``/readyz`` answers 200 again; for the re-exec that includes the
pre-flight check, while the old image still serves) and the longest time
``/healthz`` got no answer at all (what a node using this daemon's store sees). A real training job pays on top
of the stop-and-resume pause its own start-up: imports, NCCL init and a
checkpoint reload; the re-exec pause does not include any of that.

    python bench/bench_upgrade.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench._common import PYTHON, ROOT, ElasticdServer, poll_until  # noqa: E402

BEATER = """
import time
from elasticd.worker import ping
while True:
    ping()
    print(f"beat {time.monotonic():.6f}", flush=True)
    time.sleep(0.01)
"""


def beats(log_dir: Path) -> list[float]:
    """Every ping time the workers printed, in every attempt, sorted."""
    out = []
    for path in log_dir.glob("attempt_*/*/stdout.log"):
        for line in path.read_text().splitlines():
            if line.startswith("beat "):
                out.append(float(line.split()[1]))
    return sorted(out)


def worst_pause(times: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive pings that overlaps [start, end]."""
    pairs = zip(times, times[1:], strict=False)
    return max((b - a for a, b in pairs if b >= start and a <= end), default=float("nan"))


def healthy_pids(server: ElasticdServer, job_id: str, n: int) -> list[int]:
    def ready() -> list[int] | None:
        try:
            view = server.client.get(f"/jobs/{job_id}/workers", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return None
        for group in view.get("groups", []):
            pids = [w["pid"] for w in group["workers"] if w.get("pid")]
            if group["state"] == "HEALTHY" and len(pids) == n:
                return pids
        return None

    pids: list[int] = poll_until(ready, 120, f"job {job_id} healthy", 0.02)
    return pids


def ready_again(server: ElasticdServer, since_started: float | None) -> float:
    """Until /readyz is 200 from a program image that started after ``since_started``; the
    longest time meanwhile that /healthz went unanswered (polled every 10 ms)."""
    last_answer, worst = time.monotonic(), 0.0

    def ok() -> bool | None:
        nonlocal last_answer, worst
        try:
            health = server.client.get("/healthz", timeout=1).json()
        except (httpx.HTTPError, ValueError):
            return None
        now = time.monotonic()
        worst, last_answer = max(worst, now - last_answer), now
        if since_started is not None and health.get("started_at") == since_started:
            return None
        try:
            return True if server.client.get("/readyz", timeout=1).status_code == 200 else None
        except httpx.HTTPError:
            return None

    poll_until(ok, 120, "the daemon ready again", 0.01)
    return worst


def measure(server: ElasticdServer, job_id: str, upgrade: str, work: Path) -> dict[str, Any]:
    server.submit(
        {
            "id": job_id,
            "entrypoint": PYTHON,
            "args": [str(work / "beater.py")],
            "env": {"PYTHONPATH": str(ROOT)},
            "nproc_per_node": 2,
            "termination_grace": 2,
        }
    )
    pids = healthy_pids(server, job_id, 2)
    time.sleep(1.0)  # a steady run before the upgrade
    assert server.proc is not None
    started_at = server.client.get("/healthz").json()["started_at"]
    t0 = time.monotonic()
    if upgrade == "reexec":
        server.proc.send_signal(signal.SIGHUP)
        unanswered = ready_again(server, started_at)
    else:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(120)
        server.spawn("ab")
        unanswered = ready_again(server, None)
    api_away = time.monotonic() - t0
    after = healthy_pids(server, job_id, 2)
    time.sleep(1.0)  # the workers run on (or again) for a while
    t1 = time.monotonic()
    times = beats(server.state_dir / "logs" / job_id)
    server.cancel(job_id)
    server.wait_terminal(job_id, 60)
    return {
        "upgrade": upgrade,
        "worst_heartbeat_pause_s": round(worst_pause(times, t0, t1), 4),
        "api_away_s": round(api_away, 3),
        "http_unanswered_s": round(unanswered, 3),
        "pids_kept": after == pids,
        "job": server.job(job_id)["restart_count"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-upgrade-") as tmp:
        work = Path(tmp)
        (work / "beater.py").write_text(BEATER)
        with ElasticdServer(work, name="upgrade") as server:
            rows = [
                measure(server, "via-reexec", "reexec", work),
                measure(server, "via-restart", "restart", work),
            ]
    for row in rows:
        row["restart_count"] = row.pop("job")
        print(
            f"{row['upgrade']:8} worst heartbeat pause {row['worst_heartbeat_pause_s'] * 1000:8.1f}"
            f" ms, API away {row['api_away_s']:.2f} s (no answer at all "
            f"{row['http_unanswered_s']:.2f} s), pids kept: {row['pids_kept']}, "
            f"restarts charged: {row['restart_count']}"
        )
    summary = {"rows": rows}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
