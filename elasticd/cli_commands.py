"""The CLI's client commands: each asks a running daemon through :mod:`elasticd.client`.

``submit``, ``jobs``, ``queue``, ``status``, ``workers``, ``events [-f]``,
``logs [-f]``, ``cancel``, ``delete``, ``nodes`` (see :mod:`elasticd.cli`):
tables for people, ``--json`` for scripts, exit 1 with the server's problem
message on an error. The help texts ``run`` shares with ``submit`` and how a
job's end is reported live here too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from elasticd.cli_follow import WorkerOutput, followed_ranks
from elasticd.client import DEFAULT_URL, Client
from elasticd.errors import ConfigError
from elasticd.goodput import BADPUT_KINDS, Goodput
from elasticd.models import Job, format_umask, known
from elasticd.security import current_umask
from elasticd.states import JobState
from elasticd.terminal import printable

log = logging.getLogger("elasticd")

#: Why ``run`` and a submitted job have different restart budgets (help texts, docs).
RUN_MAX_RESTARTS_HELP = (
    "restarts of the worker group before the job fails (default 0, as torchrun's, so a "
    "torchrun command line behaves the same; a job submitted to a daemon defaults to 3, "
    "as a service keeps a job alive across a few crashes)"
)
SUBMIT_MAX_RESTARTS_HELP = (
    "restarts of the job before it fails (default 3: a daemon keeps a job alive across a "
    "few crashes; `elasticd run` defaults to 0, as torchrun)"
)
ROLE_HELP = "the workers' role name, as torchrun's --role (default 'default')"
REDIRECTS_HELP = (
    "torchrun's --redirects: which of the workers' streams go only to the log files, "
    "0-3, none/out/err/all or 'rank:v,...' (default none); the log files are always written"
)
TEE_HELP = (
    "torchrun's --tee: which streams go to the console and the log files, in the same "
    "forms as --redirects (default none)"
)
RANKS_FILTER_HELP = "local ranks whose output reaches the console, e.g. 0,2 (default: all)"
GRACE_HELP = "seconds from SIGTERM to SIGKILL when the workers are stopped (default 30)"
MASTER_ADDR_HELP = "MASTER_ADDR for the workers (default: chosen by elasticd)"
MASTER_PORT_HELP = "MASTER_PORT for the workers (default: a free port)"


PREWARM_HELP = (
    "keep a standby interpreter per worker that has imported these modules (e.g. torch; "
    "repeatable or comma-separated); a restart hands the round to it instead of starting cold"
)


def _seconds_or_auto(value: str) -> float | str:
    """``--progress-timeout``: seconds, or ``auto`` (sized from the job's own pings)."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'auto', not {value!r}") from None


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The spec fields ``run`` and ``submit`` both set by flag: warm restarts, hang
    detection, health checks. Every default is None: the spec's own default applies
    (:func:`job_flag_fields` sends only what was given)."""
    p.add_argument("--prewarm", action="append", metavar="MODULE[,MODULE...]", help=PREWARM_HELP)
    p.add_argument(
        "--progress-timeout",
        type=_seconds_or_auto,
        metavar="SECONDS|auto",
        help="a worker that has pinged (elasticd.worker.ping) must ping again within this "
        "many seconds, or the group is restarted as hung; 'auto': sized from the job's own "
        "ping intervals (default: off)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds a worker has for its first ping before the group is restarted as hung "
        "(default: off)",
    )
    p.add_argument(
        "--checkpoint-timeout",
        type=float,
        metavar="SECONDS",
        help="while a checkpoint is in progress (elasticd.worker.checkpointing()), the most "
        "seconds it may take, instead of --progress-timeout (default: no deadline)",
    )
    p.add_argument(
        "--max-no-progress-restarts",
        type=int,
        metavar="N",
        help="fail the job after N restarts in a row that made no progress (default: off)",
    )
    p.add_argument(
        "--health-check",
        metavar="COMMAND",
        help="a command run before every (re)start of the group, split as a shell would "
        "(e.g. 'nvidia-smi -L'); a non-zero exit means the node is unhealthy",
    )
    p.add_argument(
        "--health-check-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds the --health-check command may run (default 60)",
    )
    p.add_argument(
        "--no-gpu-health-check",
        dest="gpu_health_check",
        action="store_const",
        const=False,
        help="skip the built-in nvidia-smi check before each start",
    )
    p.add_argument(
        "--inprocess-restart",
        action="store_const",
        const=True,
        help="the program uses elasticd.inprocess.Wrapper: a dead rank is restarted in "
        "process by the others (default: the group is restarted)",
    )
    p.add_argument(
        "--replica-groups",
        "--replica_groups",
        type=int,
        metavar="N",
        help="torchft: run N replica groups, each an independent gang of the job's workers "
        "with its own restarts (jobs <id>.g0 .. <id>.g<N-1>); the workers get "
        "REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE",
    )
    p.add_argument(
        "--min-replicas",
        "--min_replicas",
        type=int,
        metavar="M",
        help="with --replica-groups: the job runs while M groups do, and fails only once "
        "fewer can (default: a majority)",
    )
    p.add_argument(
        "--log-limit-bytes",
        type=int,
        metavar="BYTES",
        help="the most bytes each worker's stdout.log and stderr.log keep per attempt "
        "(later output is counted and dropped)",
    )


def job_flag_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The spec fields :func:`add_job_flags`' flags set (pure): only those given."""
    fields: dict[str, Any] = {
        "progress_timeout": args.progress_timeout,
        "startup_timeout": args.startup_timeout,
        "checkpoint_timeout": args.checkpoint_timeout,
        "max_no_progress_restarts": args.max_no_progress_restarts,
        "health_check_timeout": args.health_check_timeout,
        "gpu_health_check": args.gpu_health_check,
        "inprocess_restart": args.inprocess_restart,
        "log_limit_bytes": args.log_limit_bytes,
        "replica_groups": args.replica_groups,
        "min_replicas": args.min_replicas,
    }
    if args.prewarm:
        fields["prewarm"] = [m for arg in args.prewarm for m in arg.split(",") if m]
    if args.health_check is not None:
        try:
            fields["health_check"] = shlex.split(args.health_check)
        except ValueError as exc:
            raise ConfigError(f"--health-check {args.health_check!r}: {exc}") from None
    return {k: v for k, v in fields.items() if v is not None}


def note(text: str) -> None:
    print(f"[elasticd] {printable(text)}", file=sys.stderr, flush=True)


def report(job: dict[str, Any], console: str = "normal") -> int:
    state = JobState(job["state"])
    if state is JobState.SUCCEEDED:
        if console != "quiet":
            note(f"job {job['id']} SUCCEEDED after {job['restart_count']} restart(s)")
        return 0
    error = job.get("error") or {}
    reason = job.get("reason")
    note(f"job {job['id']} {state.value}" + (f": {reason}" if reason else ""))
    if error.get("traceback"):
        print(printable(error["traceback"], lines=True), file=sys.stderr)
    return 1


# client commands: talk to a running daemon

CLIENT_COMMANDS = frozenset(
    {
        "submit",
        "jobs",
        "queue",
        "status",
        "workers",
        "goodput",
        "events",
        "logs",
        "cancel",
        "delete",
        "nodes",
        "node",
        "reload",
    }
)


def add_client_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        help="the daemon's URL (default: $ELASTICD_URL; else the node's unix socket, "
        f"/run/elasticd/elasticd.sock or your own daemon's; else {DEFAULT_URL}, without "
        "your own daemon's token, which goes only to a URL you give)",
    )
    common.add_argument(
        "--socket",
        help="the daemon's unix socket (default: $ELASTICD_SOCKET): you are who the "
        "kernel says, no token needed",
    )
    common.add_argument(
        "--token-file",
        help="file holding the bearer token (default: $ELASTICD_TOKEN_FILE, else your own "
        "daemon's <state_dir>/token)",
    )
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    submit = sub.add_parser(
        "submit",
        parents=[common],
        help="submit a job to a daemon",
        description="Submit a job: a JSON spec file (or - for stdin), or flags and "
        "-- program args. Example: elasticd submit --nproc-per-node 2 -- python train.py",
    )
    submit.add_argument("--id", "--run-id", dest="job_id", help="job id (makes it idempotent)")
    submit.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, help="workers on each node (default 1)"
    )
    submit.add_argument(
        "--nnodes",
        metavar="MIN[:MAX]",
        help="nodes the job runs on, as torchrun's --nnodes: N, or MIN:MAX to run elastic "
        "(default 1)",
    )
    submit.add_argument("--max-restarts", "--max_restarts", type=int, help=SUBMIT_MAX_RESTARTS_HELP)
    submit.add_argument("--role", help=ROLE_HELP)
    submit.add_argument(
        "--priority",
        type=int,
        help="queue order (default 0): higher is placed first and may preempt lower",
    )
    submit.add_argument("--redirects", "-r", help=REDIRECTS_HELP)
    submit.add_argument("--tee", "-t", help=TEE_HELP)
    submit.add_argument("--local-ranks-filter", "--local_ranks_filter", help=RANKS_FILTER_HELP)
    submit.add_argument("--termination-grace", type=float, help=GRACE_HELP)
    submit.add_argument("--master-addr", "--master_addr", help=MASTER_ADDR_HELP)
    submit.add_argument("--master-port", "--master_port", type=int, help=MASTER_PORT_HELP)
    submit.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="an environment variable for the workers (repeatable)",
    )
    submit.add_argument("--cwd", help="workers' directory (default: this one, for a command)")
    submit.add_argument(
        "--umask", help="the workers' umask, octal (default: this shell's, as torchrun's workers)"
    )
    submit.add_argument(
        "--selector",
        "--node-selector",
        action="append",
        default=[],
        metavar="K=V",
        help="a node label the job needs (repeatable): it runs only on nodes labelled so",
    )
    submit.add_argument(
        "--user", help="run the workers as this user (the node must allow it; default: you)"
    )
    submit.add_argument(
        "--join-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds a round may wait to gather its minimum of nodes (default 600)",
    )
    add_job_flags(submit)
    submit.add_argument(
        "--wait",
        action="store_true",
        help="follow the job: its events and its workers' output (those on this daemon's "
        "node), until it ends; exit 0 if it succeeds, 1 if not",
    )
    submit.add_argument(
        "--slurm",
        action="store_true",
        help="in a Slurm batch script: run only on the allocation's nodes (--nnodes "
        "default: all of them), record the Slurm job on the job; with --wait, Slurm's "
        "SIGTERM (scancel, the time limit) cancels the job within its grace",
    )
    submit.add_argument(
        "-q",
        "--quiet",
        action="count",
        default=0,
        help="with --wait: -q shows the events but not the workers' output; -qq neither, "
        "only how the job ended",
    )
    submit.add_argument("program", nargs=argparse.REMAINDER, help="SPEC.json | - | -- program args")

    jobs = sub.add_parser("jobs", parents=[common], help="list jobs, newest first")
    jobs.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    jobs.add_argument("--limit", type=int, default=50, help="show at most N jobs (default 50)")
    sub.add_parser(
        "queue", parents=[common], help="the fleet's queue in placement order, and why each waits"
    )

    for name, text in (
        ("status", "one job: state, restarts, root cause"),
        ("workers", "a job's worker groups and workers"),
        ("goodput", "where a job's time went: productive, start-up, recovery, lost work..."),
        ("cancel", "stop a job's workers and end it as CANCELLED"),
        ("delete", "forget a job that ended: its record and events (its log files stay)"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("job_id", help="the job's id")
    sub.add_parser(
        "nodes",
        parents=[common],
        help="the cluster's live nodes: address, slots, labels, state (quarantined, drained)",
    )
    node = sub.add_parser("node", parents=[common], help="drain or undrain a node (admins)")
    node.add_argument("action", choices=["drain", "undrain"], help="take it out, or back in")
    node.add_argument("name", help="the node's name")
    node.add_argument("--reason", required=True, help="why (kept in its health record)")
    sub.add_parser(
        "reload",
        parents=[common],
        help="re-execute the daemon in place (the installed version, same pid; jobs run on); "
        "admins only, like systemctl reload elasticd",
    )

    events = sub.add_parser("events", parents=[common], help="a job's events")
    events.add_argument("job_id", help="the job's id")
    events.add_argument("-f", "--follow", action="store_true", help="stream until the job ends")
    events.add_argument("--after", type=int, default=0, help="only events after this seq")

    logs = sub.add_parser(
        "logs",
        parents=[common],
        help="a worker's log",
        description="One worker's log, named by its global --rank (looked up in the job's "
        "current round) or by --node and --local-rank. Example: elasticd logs JOB --rank 3",
    )
    logs.add_argument("job_id", help="the job's id")
    which = logs.add_mutually_exclusive_group()
    which.add_argument(
        "--rank",
        type=int,
        help="the worker's global rank (RANK) in the job's current round: its node and "
        "local rank are looked up",
    )
    which.add_argument(
        "--local-rank", type=int, help="the worker's local rank on --node (default 0)"
    )
    logs.add_argument(
        "--node", help="the node that ran the worker (default: the daemon you talk to)"
    )
    logs.add_argument(
        "--stream",
        choices=("stdout", "stderr"),
        default="stdout",
        help="which of the worker's streams (default stdout)",
    )
    logs.add_argument("--attempt", type=int, help="default: the latest (and, with -f, the next)")
    logs.add_argument("--tail", type=int, help="only the last N lines")
    logs.add_argument("-f", "--follow", action="store_true", help="stream until the job ends")


def client_main(args: argparse.Namespace) -> int:
    from elasticd.client import ClientError, find_daemon

    try:
        found = find_daemon(args.url, args.socket, args.token_file)
        with Client(found.url, socket=found.socket, token_file=found.token_file) as client:
            handler = _HANDLERS[args.command]
            return handler(client, args)
    except ClientError as exc:
        status = f" ({exc.status})" if exc.status else ""
        print(f"elasticd: {printable(exc)}{status}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `elasticd events -f | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the exit-time flush
        return 0


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True), flush=True)


def _table(rows: list[list[str]], header: list[str]) -> str:
    rows = [[printable(c) for c in row] for row in rows]  # cells may hold a job's text
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _age(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _submit_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The job spec from a file/stdin or from the flags and the command."""
    words = list(args.program)
    spec: dict[str, Any] = {}
    if (
        words
        and words[0] != "--"
        and len(words) == 1
        and (words[0] == "-" or words[0].endswith(".json"))
    ):
        source = words[0]
        try:
            text = sys.stdin.read() if source == "-" else Path(source).read_text()
            loaded = json.loads(text)
        except OSError as exc:
            raise ConfigError(f"cannot read {source}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{source} is not JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source} must hold a JSON object (a job spec)")
        spec = loaded
    else:
        if words and words[0] == "--":
            words = words[1:]
        if not words:
            raise ConfigError(
                "elasticd submit needs a spec file, '-' for stdin, or a command: "
                "elasticd submit [options] -- python train.py"
            )
        spec = {"entrypoint": words[0], "args": words[1:], "cwd": os.getcwd()}
    flags = {
        "id": args.job_id,
        "nproc_per_node": args.nproc_per_node,
        "max_restarts": args.max_restarts,
        "role": args.role,
        "redirects": args.redirects,
        "tee": args.tee,
        "local_ranks_filter": args.local_ranks_filter,
        "termination_grace": args.termination_grace,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "cwd": args.cwd,
        "priority": args.priority,
        "umask": args.umask,
        "user": args.user,
        "join_timeout": args.join_timeout,
    }
    if args.slurm:
        from elasticd.slurm.allocation import submission_from_env

        spec.update(submission_from_env(os.environ, args.nnodes).spec_fields())
    spec.update({k: v for k, v in flags.items() if v is not None})
    spec.update(job_flag_fields(args))
    # As torchrun's workers inherit the umask of the shell that started them.
    spec.setdefault("umask", format_umask(current_umask()))
    if args.nnodes and not args.slurm:
        low, _, high = str(args.nnodes).partition(":")
        try:
            spec["min_nodes"] = int(low)
            spec["max_nodes"] = int(high or low)
        except ValueError:
            raise ConfigError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX") from None
    if args.env:
        spec["env"] = {**spec.get("env", {}), **_pairs(args.env, "--env")}
    if args.selector:
        spec["node_selector"] = {
            **spec.get("node_selector", {}),
            **_pairs(args.selector, "--selector"),
        }
    return spec


def _cmd_submit(client: Any, args: argparse.Namespace) -> int:
    if not (args.slurm and args.wait):
        return _submit(client, args)
    from elasticd.slurm.node import SlurmStop, cancel_and_wait, own_submission, stop_on_sigterm

    # The id is chosen here, before the POST, so that a stop during it knows which job is
    # its own: not merely the newest naming the Slurm job, which anyone may name.
    spec = _submit_spec(args)
    spec.setdefault("id", f"slurm-{spec['slurm_job_id']}-{uuid.uuid4().hex[:12]}")
    submitted: list[Job] = []
    try:
        with stop_on_sigterm():
            return _submit(client, args, submitted, spec)
    except SlurmStop:
        if submitted:
            return cancel_and_wait(client, submitted[0])
        # Stopped while submitting: the job may exist all the same.
        mine = own_submission(client, spec)
        return cancel_and_wait(client, mine) if mine is not None else 143


def _submit(
    client: Any,
    args: argparse.Namespace,
    submitted: list[Job] | None = None,
    spec: dict[str, Any] | None = None,
) -> int:
    job = client.submit(spec if spec is not None else _submit_spec(args))
    if submitted is not None:
        submitted.append(job)
    if job.state.is_terminal and not args.json:
        # Same id and spec: the API answers with the existing job (idempotent), which has
        # already ended; say so rather than look like a new run that ended at once.
        note(
            f"job {job.id} already exists and ended {job.state.value}: it was not run again "
            f"(DELETE /jobs/{job.id} forgets it; or choose another --id)"
        )
    if not args.wait:
        if args.json:
            _print_json(job.model_dump(mode="json"))
        elif not job.state.is_terminal:
            print(f"job {job.id} submitted ({job.state.value})")
        return 0
    if not args.json and args.quiet < 2:
        output = None
        if args.quiet == 0:
            ranks = followed_ranks(job.spec.nproc_per_node, job.spec.local_ranks_filter)
            output = WorkerOutput(client, job.id, ranks, role=job.spec.role)
            output.start()
        note(f"job {job.id} submitted; following it (Ctrl-C stops following, not the job)")
        for event in client.follow_events(job.id):
            note(f"{event.kind}: {event.message}")
        if output is not None:
            output.join()
    final = client.wait(job.id)
    if args.json:
        _print_json(final.model_dump(mode="json"))
        return 0 if final.state is JobState.SUCCEEDED else 1
    return report(final.model_dump())


def _cmd_jobs(client: Any, args: argparse.Namespace) -> int:
    page = client.list_jobs(state=args.state, limit=args.limit)
    if args.json:
        _print_json(page.model_dump(mode="json"))
        return 0
    if not page.jobs:
        print("no jobs")
        return 0
    rows = [
        [
            j.id,
            j.state.value,
            f"{j.restart_count}/{j.max_restarts}",
            f"{j.spec.min_nodes}x{j.spec.nproc_per_node}",
            _age(j.created_at),
            _shorten(" ".join([j.spec.entrypoint, *j.spec.args]), 50),
        ]
        for j in page.jobs
    ]
    print(_table(rows, ["ID", "STATE", "RESTARTS", "NODESxPROCS", "AGE", "COMMAND"]))
    if page.next_offset is not None:
        print(f"... {page.total - len(page.jobs)} more (use --limit)")
    return 0


def _cmd_queue(client: Any, args: argparse.Namespace) -> int:
    view = client.queue()
    if args.json:
        _print_json(view.model_dump(mode="json"))
        return 0
    if not view.queue:
        print(f"no job waits ({len(view.placements)} placed)")
        return 0
    rows = [
        [
            str(e.position),
            e.job,
            str(e.priority),
            e.reason,
            _age(e.since),
            e.message,
        ]
        for e in view.queue
    ]
    print(_table(rows, ["POS", "ID", "PRIO", "REASON", "WAITING", "WHY"]))
    return 0


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _cmd_status(client: Any, args: argparse.Namespace) -> int:
    job = client.get(args.job_id)
    if args.json:
        _print_json(job.model_dump(mode="json"))
        return 0
    spec = job.spec
    nodes = spec.max_nodes or spec.min_nodes
    lines = [
        ("job", job.id),
        ("state", job.state.value),
        ("restarts", f"{job.restart_count} of {job.max_restarts}"),
        ("round", str(job.round)),
        ("command", " ".join([spec.entrypoint, *spec.args])),
        (
            "workers",
            f"{spec.nproc_per_node} per node, "
            + (
                f"{spec.min_nodes}-{nodes} nodes" if nodes != spec.min_nodes else f"{nodes} node(s)"
            ),
        ),
        ("created", _when(job.created_at)),
        ("started", _when(job.started_at)),
        ("finished", _when(job.finished_at)),
    ]
    if now := headline(job):
        lines.append(("reason", now))
    if job.error:
        e = job.error
        lines.append(
            (
                "root cause" if job.state is JobState.FAILED else "last failure",
                f"{e.who()}: {e.message}" + (" (from its stderr.log)" if e.source == "log" else ""),
            )
        )
        for c in job.collateral:
            lines.append(
                (
                    "collateral",
                    f"{c.who(attempt=False)}: {c.message} (after the root cause: a consequence)",
                )
            )
    if (r := job.last_recovery) is not None and r.total_s is not None:
        lines.append(("last recovery", f"{r.total_s:.3f}s in all ({r.cause}): {r.phases_text()}"))
    lines += group_lines(job)
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key.ljust(width)}  {printable(value)}")
    if job.error and job.error.traceback:
        print()
        print(printable(job.error.traceback.rstrip(), lines=True))
    return 0


def group_lines(job: Job) -> list[tuple[str, str]]:
    """A job of replica groups: how many must run, and a line per group (pure)."""
    if job.groups is None:
        return []
    least = job.spec.min_replicas
    lines = [("replica groups", f"{len(job.groups)}, at least {least} running")]
    for g in job.groups:
        state = g.state.value if g.state is not None else "not written yet"
        where = f" on {', '.join(g.nodes)}" if g.nodes else ""
        lines.append((f"group {g.group}", f"{g.job} {state}, {g.restart_count} restart(s){where}"))
    return lines


def headline(job: Job) -> str:
    """What the job is doing now, in words (pure), as the dashboard's header says it: its
    ``reason`` only while it applies. A RUNNING job reads "running again after N
    restart(s)" (its document's reason is cleared as it runs; one written before that
    rule may still say "restarting the group")."""
    if job.state is JobState.RUNNING:
        return f"running again after {job.restart_count} restart(s)" if job.restart_count else ""
    if job.state is JobState.RESTARTING:
        return job.reason or "restarting the group"
    return job.reason or ""


def _cmd_workers(client: Any, args: argparse.Namespace) -> int:
    view = client.workers(args.job_id)
    if args.json:
        _print_json(view.model_dump(mode="json"))
        return 0
    print(
        f"job {view.job_id}: {view.state.value}, restarts {view.restart_count} of "
        f"{view.max_restarts} ({view.remaining_restarts} left), round {view.round}"
    )
    if not view.groups:
        print("no worker groups yet")
        return 0
    for g in view.groups:
        print()
        master = f", master {g.master_addr}:{g.master_port}" if g.master_addr else ""
        replica = f"replica group {g.replica_group} ({g.job}), " if g.job is not None else ""
        print(
            printable(
                f"{replica}node {g.node}: group {g.group_rank}/{g.group_world_size} "
                f"{g.state.value}, "
                f"attempt {g.attempt}, round {g.round}{master}"
            )
        )
        rows = []
        for w in g.workers:
            end = "-"
            if w.signal is not None:
                end = f"signal {w.signal}"
            elif w.exit_code is not None:
                end = f"exit {w.exit_code}"
            rows.append([str(w.rank), str(w.local_rank), str(w.pid or "-"), w.state.value, end])
        print(_table(rows, ["RANK", "LOCAL", "PID", "STATE", "EXIT"]))
    return 0


def _cmd_goodput(client: Any, args: argparse.Namespace) -> int:
    g = client.goodput(args.job_id)
    if args.json:
        _print_json(g.model_dump(mode="json"))
        return 0
    print(goodput_text(g))
    return 0


def goodput_text(g: Goodput) -> str:
    """``elasticd goodput JOB``: the split of the wall time, and the steps."""

    def share(seconds: float) -> str:
        return f"{100 * seconds / g.wall_s:.1f}%" if g.wall_s > 0 else "-"

    rows = [["productive", f"{g.productive_s:.1f}", share(g.productive_s)]]
    rows += [[kind, f"{g.badput_s[kind]:.1f}", share(g.badput_s[kind])] for kind in BADPUT_KINDS]
    st = g.steps
    if not g.progress_reported:
        steps = (
            "the job reports no progress (elasticd.worker.ping()): no time is counted as "
            "productive, lost work unknown"
        )
    elif not g.steps_reported:
        steps = "the job reports no steps (elasticd.worker.ping(step=N)): lost work unknown"
    else:
        steps = "steps: " + ", ".join(
            [
                *known(("max", st.max_step)),
                *(known(("checkpoint", st.checkpoint_step)) or ["no checkpoint"]),
                *(known(("lost", st.lost_steps)) or ["lost unknown"]),
            ]
        )
    as_of = "finished" if g.finished else "running"
    return "\n".join(
        [
            f"job {g.job_id}: goodput {100 * g.goodput:.1f}% of {g.wall_s:.1f}s wall ({as_of}), "
            f"{g.attempts} attempt(s), {st.failures} failure(s)",
            _table(rows, ["TIME", "SECONDS", "SHARE"]),
            steps,
        ]
    )


def _event_line(event: Any) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
    extra = f" [{event.duration_s:.3f}s]" if event.duration_s is not None else ""
    line = f"{event.seq:>6}  {stamp}  {event.node}  {event.kind:<20} {event.message}{extra}"
    return printable(line)  # the message may quote a job's error text


def _cmd_events(client: Any, args: argparse.Namespace) -> int:
    if args.follow:
        events = client.follow_events(args.job_id, after=args.after)
    else:
        events = client.events(args.job_id, after=args.after, limit=10_000)
        if args.json:
            _print_json([e.model_dump(mode="json") for e in events])
            return 0
    for event in events:  # with -f, one JSON object per line (NDJSON) for scripts
        # json.dumps escapes every control character, C1 included (pydantic's leaves those).
        text = json.dumps(event.model_dump(mode="json")) if args.json else _event_line(event)
        print(text, flush=True)
    return 0


def rank_location(view: Any, rank: int) -> tuple[str, int]:
    """The (node, local rank) of global ``rank`` in a job's workers view (pure)."""
    ranks = []
    for group in view.groups:
        for worker in group.workers:
            if worker.rank == rank:
                return str(group.node), int(worker.local_rank)
            ranks.append(worker.rank)
    if not ranks:
        raise ConfigError(f"job {view.job_id} has no workers yet: give --node and --local-rank")
    raise ConfigError(
        f"job {view.job_id} has no rank {rank} in its current round (ranks "
        f"{min(ranks)}-{max(ranks)}); give --node and --local-rank for an older attempt"
    )


def _cmd_logs(client: Client, args: argparse.Namespace) -> int:
    node, local_rank = args.node, args.local_rank or 0
    if args.rank is not None:
        if node is not None:
            raise ConfigError(
                "--rank finds the node itself: give --rank, or --node and --local-rank"
            )
        node, local_rank = rank_location(client.workers(args.job_id), args.rank)
    kwargs = {"attempt": args.attempt, "tail": args.tail, "node": node}
    if args.follow:
        for text in client.follow_logs(args.job_id, local_rank, args.stream, **kwargs):
            sys.stdout.write(text)
            sys.stdout.flush()
        return 0
    text = client.logs(args.job_id, local_rank, args.stream, **kwargs)
    if args.json:
        _print_json({"job_id": args.job_id, "node": node, "local_rank": local_rank, "text": text})
    else:
        sys.stdout.write(text)
    return 0


def _cmd_delete(client: Client, args: argparse.Namespace) -> int:
    client.delete(args.job_id)
    if args.json:
        _print_json({"deleted": args.job_id})
    else:
        print(f"job {args.job_id} deleted (its log files stay on disk)")
    return 0


def _cmd_nodes(client: Client, args: argparse.Namespace) -> int:
    nodes = client.nodes()
    if args.json:
        _print_json(nodes)
        return 0
    rows = [
        [
            n["name"],
            n["addr"],
            f"{n['free_slots']}/{n['slots']}",
            str(len(n.get("gpus") or [])),
            ",".join(f"{k}={v}" for k, v in sorted(n.get("labels", {}).items())) or "-",
            n["version"],
            _age(n["started_at"]),
            n.get("state", "ready"),
            printable(n.get("reason") or "-"),
        ]
        for n in sorted(nodes, key=lambda n: n["name"])
    ]
    heads = ["NAME", "ADDR", "FREE/SLOTS", "GPUS", "LABELS", "VERSION", "UP", "STATE", "REASON"]
    print(_table(rows, heads))
    return 0


def _cmd_node(client: Client, args: argparse.Namespace) -> int:
    view = client.drain(args.name, args.reason, undrain=args.action == "undrain")
    if args.json:
        _print_json(view)
    else:
        print(f"node {view['name']}: {view['state']}" + (f" ({args.reason})"))
    return 0


def _cmd_cancel(client: Any, args: argparse.Namespace) -> int:
    job = client.cancel(args.job_id)
    if args.json:
        _print_json(job.model_dump(mode="json"))
    else:
        print(f"job {job.id}: cancel requested ({job.state.value})")
    return 0


def _cmd_reload(client: Any, args: argparse.Namespace) -> int:
    answer = client.reload()
    if args.json:
        _print_json(answer)
    else:
        print(
            f"{answer['node']}: re-exec requested (pid {answer['pid']}, elasticd "
            f"{answer['version']}); its jobs' events say how it went"
        )
    return 0


_HANDLERS = {
    "submit": _cmd_submit,
    "jobs": _cmd_jobs,
    "queue": _cmd_queue,
    "status": _cmd_status,
    "workers": _cmd_workers,
    "goodput": _cmd_goodput,
    "events": _cmd_events,
    "logs": _cmd_logs,
    "cancel": _cmd_cancel,
    "delete": _cmd_delete,
    "nodes": _cmd_nodes,
    "node": _cmd_node,
    "reload": _cmd_reload,
}
