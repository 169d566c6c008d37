"""The README's demo: start a daemon, submit a job with the REST API, watch it recover.

1. starts ``elasticd serve`` on a free loopback port with a fresh state dir;
2. submits a 2-worker gloo job (examples/train_crash_once.py) with ``POST /jobs`` on the
   daemon's unix socket (no token: the kernel names the caller)
   (the equivalent curl command is printed);
3. follows ``GET /jobs/{id}/events`` (long-poll) and prints every event:
   rank 1 crashes on attempt 0, the group is restarted, attempt 1 succeeds;
4. prints ``GET /jobs/{id}/workers`` and the job, then stops the daemon with SIGTERM.

Exits 0 when the job SUCCEEDED after exactly one restart.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(port: int, state: Path, euid: int) -> list[str]:
    """The demo daemon's ``elasticd`` arguments (printed and run as they are)."""
    return [
        "serve",
        "--port",
        str(port),
        "--state-dir",
        str(state),
        "--node-name",
        "demo-node",
        # As root, `elasticd serve` runs jobs as root only when told to.
        *(["--allow-root"] if euid == 0 else []),
    ]


def main() -> int:
    state = Path(tempfile.mkdtemp(prefix="elasticd-demo-"))
    port = free_port()
    serve = serve_args(port, state, os.geteuid())
    # What is printed is what runs: `python -m elasticd` is this venv's `elasticd`.
    print(f"== starting: {shlex.join(['elasticd', *serve])}")
    with (state / "daemon.log").open("wb") as daemon_log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "elasticd", *serve],
            cwd=ROOT,
            stdout=daemon_log,
            stderr=subprocess.STDOUT,
        )
    # Every caller has an identity: on this machine, the daemon's unix socket (the kernel
    # tells the daemon who we are), so no token is needed; over TCP, <state>/token.
    sock = state / "run" / "elasticd.sock"
    print(f"== talking to it on its unix socket {sock} (no token: the kernel names us)")
    try:
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://localhost", timeout=70) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if daemon.poll() is not None or time.monotonic() > deadline:
                    print("the daemon did not come up", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            spec = {
                "id": "demo",
                "entrypoint": sys.executable,
                "args": [str(ROOT / "examples" / "train_crash_once.py")],
                "nproc_per_node": 2,
                "max_restarts": 3,
                "termination_grace": 5,
            }
            print(
                f"== submitting (same as:  curl --unix-socket {sock} -X POST "
                "http://localhost/jobs -H 'content-type: application/json' "
                f"-d '{json.dumps(spec)}')"
            )
            r = client.post("/jobs", json=spec)
            r.raise_for_status()
            print(f"   {r.status_code} Location: {r.headers['location']}")
            after, job = 0, r.json()
            while job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                events = client.get("/jobs/demo/events", params={"after": after, "wait": 30}).json()
                for e in events:
                    after = e["seq"]
                    print(f"   [{e['seq']:>3}] {e['source']:<10} {e['kind']:<20} {e['message']}")
                job = client.get("/jobs/demo").json()
            for e in client.get("/jobs/demo/events", params={"after": after}).json():
                print(f"   [{e['seq']:>3}] {e['source']:<10} {e['kind']:<20} {e['message']}")
            print("== GET /jobs/demo/workers")
            view = client.get("/jobs/demo/workers").json()
            for g in view["groups"]:
                print(
                    f"   node {g['node']} group {g['state']} attempt {g['attempt']} "
                    f"master {g['master_addr']}:{g['master_port']}"
                )
                for w in g["workers"]:
                    print(
                        f"     rank {w['rank']} local {w['local_rank']} pid {w['pid']} "
                        f"{w['state']} exit {w['exit_code']}"
                    )
            print("== rank 0's log of the last attempt:")
            print(client.get("/jobs/demo/logs", params={"local_rank": 0}).text.rstrip())
            print(f"== job demo: {job['state']}, restart_count={job['restart_count']}")
            ok = job["state"] == "SUCCEEDED" and job["restart_count"] == 1
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=60)
        print(f"== daemon stopped (exit {code}); its log and state are in {state}")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
