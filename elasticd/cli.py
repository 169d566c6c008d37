"""The ``elasticd`` command: ``serve`` runs the node daemon, ``run`` is torchrun --standalone.

``elasticd serve`` flags have ``ELASTICD_*`` environment equivalents and a
TOML config file (``--config``); see :mod:`elasticd.config`.

``elasticd run [options] -- python train.py ...`` starts an embedded daemon in
this process, submits the job, streams the workers' output with rank
prefixes, and exits with the job's result (0 on success, 1 on failure). Its
API needs a token made for the run (:func:`elasticd.launcher.write_run_token`;
the path is printed), so other local users cannot reach the job.

The client commands (:mod:`elasticd.cli_commands`) talk to a running daemon over
its REST API (:mod:`elasticd.client`): ``submit``, ``jobs``, ``queue``, ``status``,
``workers``, ``events [-f]``, ``logs [-f]`` (``--rank``: the global rank; or
``--node`` and ``--local-rank``), ``cancel``, ``delete``, ``nodes``. Each takes ``--url`` and
``--token-file`` (defaults: ``$ELASTICD_URL``, ``$ELASTICD_TOKEN_FILE``, else
http://127.0.0.1:7070 and no token), prints tables for people or ``--json``
for scripts, and exits 1 with the server's problem message on an error.

``elasticd install-service`` writes the systemd unit, the service user, its
folders and token (:mod:`elasticd.service`); ``elasticd completion bash``
prints a completion script made from this parser (:mod:`elasticd.completion`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import __version__
from elasticd.cli_commands import (
    CLIENT_COMMANDS,
    GRACE_HELP,
    MASTER_ADDR_HELP,
    MASTER_PORT_HELP,
    RANKS_FILTER_HELP,
    REDIRECTS_HELP,
    ROLE_HELP,
    RUN_MAX_RESTARTS_HELP,
    TEE_HELP,
    add_client_commands,
    add_job_flags,
    client_main,
    job_flag_fields,
    note,
    report,
)
from elasticd.completion import SHELLS
from elasticd.config import DEFAULT_PORT, load_config
from elasticd.console import write_line
from elasticd.errors import ConfigError, SlurmStepError, StoreAuthError
from elasticd.eventkinds import EventKind
from elasticd.models import JobSpec, format_umask
from elasticd.security import refuse_foreign_state, set_private_umask
from elasticd.slurm.allocation import AllocationRun, store_environ
from elasticd.tasks import cancel_and_wait, race

log = logging.getLogger("elasticd")


def _serve_flags(p: argparse.ArgumentParser, *, port_default: int | None) -> None:
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=port_default,
        help=f"port to listen on (default {DEFAULT_PORT})",
    )
    p.add_argument("--node-name", help="this node's name (default: the hostname)")
    p.add_argument("--advertise-addr", help="address peers and workers use to reach this node")
    p.add_argument("--state-dir", help="where the database lives (default /var/lib/elasticd)")
    p.add_argument("--log-dir", help="where worker logs go (default STATE_DIR/logs)")
    p.add_argument("--slots", type=int, help="worker slots (default: GPUs, else CPU cores)")
    p.add_argument("--labels", help="node labels, key=value,key=value")
    p.add_argument(
        "--token-file",
        help="0600 file holding the admin's bearer token (default: made in STATE_DIR/token)",
    )
    p.add_argument(
        "--identities",
        dest="identities_file",
        help="TOML file of token identities and local users' rights (see docs/hardening.md)",
    )
    p.add_argument(
        "--cluster-token-file",
        help="0600 file holding the daemons' and the store's credential (default: the token)",
    )
    p.add_argument("--store-url", help="http://host:port of another daemon's store, or etcd://")
    p.add_argument("--config", help="TOML config file")
    p.add_argument(
        "--unix-socket",
        help="the unix socket local users call without a token (default: "
        "STATE_DIR/run/elasticd.sock; a root daemon's is open to every local user, each "
        "served as itself)",
    )
    p.add_argument(
        "--run-as",
        help="user jobs run as (root daemon; default: 'elasticd'); 'dynamic': each job a uid "
        "of its own from dynamic_uids",
    )
    p.add_argument("--allowed-users", help="users a job may ask to run as, comma-separated")
    p.add_argument(
        "--allow-root",
        action="store_const",
        const=True,
        default=None,
        help="allow running jobs as root",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elasticd", description="Run, watch and restart distributed PyTorch jobs."
    )
    parser.add_argument("--version", action="version", version=f"elasticd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the node daemon")
    _serve_flags(serve, port_default=None)
    serve.add_argument(
        "--store-only", action="store_true", help="serve only the cluster store, run no jobs"
    )
    serve.add_argument(
        "--check",
        action="store_true",
        help="import everything the daemon runs and validate the configuration, print the "
        "version, exit (the pre-flight of a re-exec: elasticd reload)",
    )

    run = sub.add_parser(
        "run",
        help="run one job on this node, like torchrun --standalone",
        description="Example: elasticd run --nproc-per-node 2 -- python train.py --epochs 3",
    )
    run.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help="workers on this node: a number, or auto, cpu or gpu (as torchrun)",
    )
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help=RUN_MAX_RESTARTS_HELP,
    )
    run.add_argument(
        "--standalone", action="store_true", help="accepted for torchrun's form (always true)"
    )
    run.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the program as it is, even a .py path (torchrun's --no-python)",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="the program is a module: python -u -m MODULE (torchrun's -m)",
    )
    run.add_argument("--role", default="default", help=ROLE_HELP)
    run.add_argument("--redirects", "-r", default="none", help=REDIRECTS_HELP)
    run.add_argument("--tee", "-t", default="none", help=TEE_HELP)
    run.add_argument(
        "--local-ranks-filter", "--local_ranks_filter", default=None, help=RANKS_FILTER_HELP
    )
    run.add_argument("--termination-grace", type=float, default=30.0, help=GRACE_HELP)
    run.add_argument("--master-addr", "--master_addr", default=None, help=MASTER_ADDR_HELP)
    run.add_argument(
        "--master-port", "--master_port", type=int, default=None, help=MASTER_PORT_HELP
    )
    run.add_argument("--run-id", "--run_id", default=None, help="the job id")
    run.add_argument("--state-dir", help="state folder (default: a temporary one)")
    run.add_argument(
        "--log-dir",
        "--log_dir",
        help="worker logs, kept (default: a temporary folder, removed at the end unless the "
        "job fails or is stopped, or --keep-logs)",
    )
    run.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the temporary log folder also when the job succeeds (its path is printed)",
    )
    run.add_argument(
        "--port",
        type=int,
        default=0,
        help="HTTP port (default: any free port; inside a Slurm step with --nnodes, the store "
        "host's, derived from the job and step ids)",
    )
    run.add_argument(
        "--nnodes",
        metavar="MIN[:MAX]",
        help="inside a Slurm step (srun --ntasks-per-node=1 elasticd run ...): run one job "
        "across the step's nodes, on MIN to MAX of them (the rest are spares); the tasks find "
        "each other from Slurm's environment",
    )
    run.add_argument(
        "--store-url",
        help="with --nnodes: the cluster store (etcd://...; default: hosted by the daemon on "
        "the step's first node)",
    )
    run.add_argument(
        "--token-file",
        help="with --nnodes: the 0600 secret file the step's tasks share, whose HMAC for the "
        "step is its daemons' token (default: ~/.config/elasticd/slurm-token, made if "
        "missing; the home must be shared)",
    )
    run.add_argument("--umask", help="the workers' umask, octal (default: this shell's)")
    add_job_flags(run)
    run.add_argument(
        "-q",
        "--quiet",
        dest="console",
        action="store_const",
        const="quiet",
        default="normal",
        help="print only the workers' output, errors and a failure or stop "
        "(default: also the start, each restart with its cause, and the end)",
    )
    run.add_argument(
        "--verbose",
        dest="console",
        action="store_const",
        const="verbose",
        help="also every event (worker starts and exits, state changes, recovery phases) "
        "and the daemon's info log (elasticd -v run: debug)",
    )
    run.add_argument("program", nargs=argparse.REMAINDER, help="-- program and its arguments")
    _torchrun_env_defaults(run)
    identity = sub.add_parser(
        "identity",
        help="make a token identity for the identities file",
        description="Print a new identity's [[identity]] entry (its token's SHA-256) for the "
        "daemon's identities file, and write its token to --token-file (0600) or print it. "
        "Example: elasticd identity alice-ci --user alice --max-priority 5 "
        "--token-file ~/.config/elasticd/token",
    )
    identity.add_argument("name", help="the identity's name (what `owner` shows)")
    identity.add_argument(
        "--user",
        action="append",
        default=[],
        help="a Unix user its jobs may run as (repeatable; the first is the default)",
    )
    identity.add_argument(
        "--max-priority", type=int, default=0, help="the highest job priority it may ask for"
    )
    identity.add_argument(
        "--may-preempt", action="store_true", help="its jobs may preempt lower-priority ones"
    )
    identity.add_argument("--slot-quota", type=int, help="most slots its jobs may hold at once")
    identity.add_argument("--admin", action="store_true", help="it may do anything (an admin)")
    identity.add_argument("--token-file", help="write the token here (0600), not to stdout")
    add_client_commands(sub)
    install = sub.add_parser(
        "install-service",
        help="install the systemd unit, the service user, its folders and token",
        description="Write elasticd.service with ExecStart pointing at this elasticd, create "
        "the service user and the state and config folders, and make the token; a second "
        "run changes nothing. Then: systemctl daemon-reload && systemctl enable --now elasticd",
    )
    install.add_argument(
        "--root",
        default="/",
        help="install under this folder instead of / (a package build, a test)",
    )
    install.add_argument(
        "--unit-dir",
        default="/etc/systemd/system",
        help="where the unit goes, under --root (default /etc/systemd/system)",
    )
    install.add_argument(
        "--exec", dest="exec_path", help="the elasticd to run (default: this one, absolute)"
    )
    install.add_argument(
        "--user", default="elasticd", help="the service user to create (default elasticd)"
    )
    install.add_argument(
        "--dry-run", action="store_true", help="say what would change, change nothing"
    )
    slurm = sub.add_parser(
        "slurm",
        help="Slurm's node hooks (slurm.conf)",
        description="Example: Prolog=/usr/local/sbin/elasticd-prolog in slurm.conf, a script "
        "that runs `exec elasticd slurm prolog`",
    )
    hooks = slurm.add_subparsers(dest="hook", required=True)
    prolog = hooks.add_parser(
        "prolog",
        help="run the node's health checks; exit 1 (Slurm drains the node) when one fails",
    )
    prolog.add_argument("--config", help="the node daemon's TOML config file (its health_check)")
    epilog = hooks.add_parser(
        "epilog",
        help="cancel the Slurm job's elasticd jobs on the node's daemon; exit 1 if any of "
        "their processes is left on this node",
    )
    epilog.add_argument("--url", help="the node daemon's URL (default: as elasticd submit)")
    epilog.add_argument("--socket", help="the node daemon's unix socket")
    epilog.add_argument("--token-file", help="file holding the bearer token")
    completion = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh, fish)",
        description="Examples: source <(elasticd completion bash) (or save it as "
        "/etc/bash_completion.d/elasticd); source <(elasticd completion zsh); "
        "elasticd completion fish | source. Job ids complete from the daemon.",
    )
    completion.add_argument("shell", nargs="?", choices=SHELLS, help="the shell: bash, zsh or fish")
    completion.add_argument(
        "--job-ids",
        action="store_true",
        help="print the daemon's job ids, one a line, or nothing when it cannot be asked "
        "(what the scripts run to complete a job id)",
    )
    return parser


def _identity(args: argparse.Namespace) -> int:
    """``elasticd identity``: a token and its [[identity]] entry (only the hash is kept)."""
    from elasticd.identity import IdentityTable, hash_token, new_token

    token = new_token()
    lines = [
        "[[identity]]",
        f"name = {json.dumps(args.name)}",
        f'token_sha256 = "{hash_token(token)}"',
        f"users = {json.dumps(args.user)}",
        f"max_priority = {args.max_priority}",
        f"may_preempt = {'true' if args.may_preempt else 'false'}",
    ]
    if args.slot_quota is not None:
        lines.append(f"slot_quota = {args.slot_quota}")
    if args.admin:
        lines.append("admin = true")
    entry = "\n".join(lines) + "\n"
    import tomllib

    try:  # the entry must be one the daemon accepts
        IdentityTable.parse(tomllib.loads(entry), daemon_uid=os.geteuid(), where="the entry")
    except ValueError as exc:
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    if args.token_file:
        path = Path(args.token_file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        print(f"# the token is in {path} (0600); add this to the daemon's identities file:")
    else:
        print(f"# token (give it to {args.name}; only its hash is kept): {token}")
    print(entry, end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client_command = args.command in CLIENT_COMMANDS
    logging.basicConfig(
        level=logging.DEBUG
        if args.verbose
        else logging.WARNING
        if client_command
        else _run_log_level(args.console)
        if args.command == "run"
        else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if client_command:
        return client_main(args)
    try:
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "run":
            return asyncio.run(_run(args))
        if args.command == "identity":
            return _identity(args)
        if args.command == "install-service":
            from elasticd.service import install_service_command

            return install_service_command(args)
        if args.command == "completion":
            return _completion(args)
        if args.command == "slurm" and args.hook == "epilog":
            return _epilog(args)
        if args.command == "slurm":
            from elasticd.slurm.hooks import prolog

            return asyncio.run(prolog(load_config({"config": args.config}), os.environ))
    except (ConfigError, StoreAuthError) as exc:  # a store that refuses us is misconfigured
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2  # pragma: no cover - argparse requires a command


def _epilog(args: argparse.Namespace) -> int:
    """``elasticd slurm epilog``: see :mod:`elasticd.slurm.node`."""
    from elasticd.client import Client, ClientError, find_daemon
    from elasticd.slurm.node import epilog

    try:
        found = find_daemon(args.url, args.socket, args.token_file)
        with Client(found.url, socket=found.socket, token_file=found.token_file) as client:
            return epilog(client, os.environ)
    except ClientError as exc:
        print(f"elasticd slurm epilog: {exc}", file=sys.stderr)
        return 1


def _completion(args: argparse.Namespace) -> int:
    """``elasticd completion SHELL``: the script; ``--job-ids``: what it completes a job
    id from (nothing, exit 0, when no daemon answers: a shell shows no error)."""
    from elasticd.completion import completion_script, job_ids

    if args.job_ids:
        sys.stdout.write("".join(f"{job_id}\n" for job_id in job_ids()))
        return 0
    if args.shell is None:
        print("elasticd completion: name a shell (bash, zsh or fish)", file=sys.stderr)
        return 2
    sys.stdout.write(completion_script(args.shell, build_parser()))
    return 0


#: ``elasticd serve``'s exit when a re-executed image cannot start: one systemd restarts (2, a
#: configuration error, is the unit's RestartPreventExitStatus).
REEXEC_START_FAILED = 1


async def _serve(args: argparse.Namespace) -> int:
    from elasticd.node import execwindow

    # First thing (a re-executed image comes here with SIGHUP, SIGTERM and SIGINT blocked
    # since before its exec): handlers, then unblocked, so what was held is delivered.
    early = execwindow.EarlySignals()
    early.install(asyncio.get_running_loop())
    handlers_at = time.monotonic()
    set_private_umask()  # before anything is created: every file of the daemon is born private
    flags = {
        k: getattr(args, k)
        for k in (
            "host",
            "port",
            "node_name",
            "advertise_addr",
            "state_dir",
            "log_dir",
            "slots",
            "labels",
            "token_file",
            "identities_file",
            "cluster_token_file",
            "store_url",
            "config",
            "unix_socket",
            "run_as",
            "allowed_users",
            "allow_root",
        )
    }
    config = load_config(flags)
    if args.store_only:
        config.store_only = True
    if config.allow_root is None:
        config.allow_root = False  # the service never runs jobs as root unless told to
    if args.check:
        from elasticd.node.reexec import check_install

        return check_install(config)
    # A re-executed image renews the node's lease before its heavy imports (issue 34).
    peek = execwindow.peek_handover()
    keeper = execwindow.early_lease_keeper(config, peek)
    try:
        if peek is not None and (delay := execwindow.slow_image_delay()):
            # A test's slow new image: blocking, as the imports it stands for are.
            time.sleep(delay)  # noqa: ASYNC251
        from elasticd.node.daemon import Daemon
        from elasticd.node.reexec import take_manifest
        from elasticd.supervise.adopt import use_loop_child_watcher

        manifest = take_manifest()
        daemon = Daemon(config, handover=manifest, lease_keeper=keeper)
    except BaseException as exc:
        if keeper is not None:
            keeper.stop()
        if peek is not None and isinstance(exc, (ConfigError, StoreAuthError)):
            return _reexec_failed(exc)
        raise
    daemon.handlers_at = handlers_at
    # Children reaped on the loop's thread only: nothing may reap one across a re-exec.
    daemon.can_reexec = use_loop_child_watcher()
    daemon.install_signal_handlers()
    early.hand_to(daemon.request_stop, daemon.request_reload if daemon.can_reexec else None)
    try:
        await daemon.start()
    except (ConfigError, StoreAuthError) as exc:
        if manifest is None:
            raise
        return _reexec_failed(exc)
    print(f"elasticd listening on http://{config.host}:{config.port}", flush=True)
    print(f"elasticd dashboard at {dashboard_url(config.url)}", flush=True)
    await daemon.serve()
    return 0


def dashboard_url(api_url: str) -> str:
    """The dashboard's URL on the daemon at ``api_url``."""
    from api.routes.ui import DASHBOARD_PATH

    return api_url.rstrip("/") + DASHBOARD_PATH


def _reexec_failed(exc: Exception) -> int:
    """A re-exec never ends in an exit systemd will not restart: the workers die with this
    image (their parent-death signal), and a restart resumes their jobs."""
    print(f"elasticd: the re-executed daemon cannot start: {exc}", file=sys.stderr)
    return REEXEC_START_FAILED


#: `elasticd run` options that torchrun also reads from ``PET_<NAME>`` (its env defaults).
TORCHRUN_ENV_OPTIONS = frozenset(
    {
        "nproc_per_node",
        "max_restarts",
        "role",
        "redirects",
        "tee",
        "local_ranks_filter",
        "master_addr",
        "master_port",
        "run_id",
        "log_dir",
        "standalone",
        "no_python",
        "module",
    }
)


def _torchrun_env_defaults(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """torchrun's rule: ``PET_<OPTION>`` is an option's default; the command line wins."""
    env = os.environ if environ is None else environ
    for dest in sorted(TORCHRUN_ENV_OPTIONS):
        value = env.get(f"PET_{dest.upper()}")
        if value is None:
            continue
        if isinstance(parser.get_default(dest), bool):  # a flag: set unless "0", "false", ...
            parser.set_defaults(**{dest: value.strip().lower() not in ("", "0", "false", "no")})
        else:
            parser.set_defaults(**{dest: value})  # a string default goes through the type


def local_world_size(value: str, gpus: int | None, cpus: int) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto`` (pure)."""
    value = str(value).strip()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    if value == "cpu":
        return cpus
    if value == "gpu":
        if not gpus:
            raise ConfigError("--nproc-per-node gpu: this node has no NVIDIA GPU (nvidia-smi -L)")
        return gpus
    if value == "auto":
        return gpus or cpus
    raise ConfigError(
        f"--nproc-per-node {value!r}: give a number of workers (at least 1), or auto, cpu or gpu"
    )


def _command(words: list[str], *, no_python: bool = False, module: bool = False) -> list[str]:
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise ConfigError("elasticd run needs a command: elasticd run [options] -- python train.py")
    if no_python and module:
        raise ConfigError("--no-python and -m/--module cannot be used together (as in torchrun)")
    if module:
        return [sys.executable, "-u", "-m", *words]
    if words[0].endswith(".py") and not no_python:
        return [sys.executable, "-u", *words]  # torchrun's form: a script runs under this Python
    return words


async def _nproc_per_node(value: str) -> int:
    gpus = None
    if value in ("gpu", "auto"):
        from elasticd.node.host import detect_gpus

        found = await detect_gpus()
        gpus = len(found) if found else None
    return local_world_size(value, gpus, len(os.sched_getaffinity(0)))


def _stdin_for_workers() -> int | None:
    """A copy of this process's stdin for the workers, as torchrun's inherit it (None: closed).

    A copy, not 0 itself: a worker's 0 is its spawn verdict pipe until its
    program runs. Only ``elasticd run`` passes stdin on: its embedded daemon
    runs as the user who typed the command, never as root for another user.
    """
    try:
        return os.dup(0)
    except OSError:
        return None


async def _run(args: argparse.Namespace) -> int:
    from elasticd.launcher import write_run_token
    from elasticd.node.daemon import Daemon
    from elasticd.node.statelock import StateLock
    from elasticd.slurm import run as slurm_run
    from elasticd.supervise.reaper import RunReaper

    # The caller's umask is the job's (as torchrun's workers inherit it); the daemon's own
    # files are born private from here on.
    caller_umask = set_private_umask()
    if args.verbose:  # elasticd -v run: debug logging, and every event
        args.console = "verbose"
    # Each event reaches the console once: as an [elasticd] line, not also as the log
    # lines that say the same (every event's, and the workers' starts and exits).
    for name in ("elasticd.node.events", "elasticd.supervise.process"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.root.level))
    command = _command(list(args.program), no_python=args.no_python, module=args.module)
    nproc = await _nproc_per_node(args.nproc_per_node)
    allocation = _allocation_run(args)
    with contextlib.ExitStack() as stack:
        state_dir = args.state_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="elasticd-run-")
        )
        # Locked before this run writes anything there (its token): a --state-dir that a
        # live daemon holds is refused, exit 2 naming its pid.
        if args.state_dir:  # one of the caller's choosing: it must be the caller's own
            refuse_foreign_state(Path(state_dir))
        state_lock = stack.enter_context(StateLock(Path(state_dir)))
        run_logs = None
        log_dir = args.log_dir
        if not log_dir:  # a folder of the run's own: gone at its end unless needed
            run_logs = RunLogs(Path(tempfile.mkdtemp(prefix="elasticd-logs-")))
            stack.callback(run_logs.close)
            log_dir = str(run_logs.path)
        flags: dict[str, object] = {
            "host": "127.0.0.1",
            "port": _api_port(args.port, args.master_port),
            "state_dir": state_dir,
            "log_dir": log_dir,
            "node_name": "localhost",
            # Every replica group runs on this one node, side by side.
            "slots": nproc * (args.replica_groups or 1),
        }
        nodes: dict[str, int] = {}
        if allocation is None:
            flags["token_file"] = str(write_run_token(Path(state_dir)))
        else:
            secret = slurm_run.shared_token(Path(args.token_file) if args.token_file else None)
            token = slurm_run.step_token_file(allocation, secret, Path(state_dir))
            flags.update(slurm_run.daemon_flags(allocation, token))
            nodes = {"min_nodes": allocation.min_nodes, "max_nodes": allocation.max_nodes}
            store_url = str(flags.get("store_url") or "")
            if allocation.store_url is None and not allocation.hosts_store:
                # Task 0's daemon, at a port anyone may hold: it proves itself first.
                step_token = token.read_text().strip()
                await slurm_run.verify_store_host(store_url, step_token)
            elif store_url.startswith("http"):
                await slurm_run.wait_for_store(store_url)
        # The user's ELASTICD_* variables are for their own daemon, never this one; in a
        # Slurm step, but for the store's credentials (an etcd's user, its TLS files).
        config = load_config(flags, environ={} if allocation is None else store_environ(os.environ))
        try:
            spec = JobSpec(
                # Known before the submission: the run's reaper names the job's processes by it.
                id=allocation.job_id if allocation else args.run_id or uuid.uuid4().hex[:12],
                **nodes,
                entrypoint=command[0],
                args=command[1:],
                cwd=os.getcwd(),
                nproc_per_node=nproc,
                max_restarts=args.max_restarts,
                role=args.role,
                redirects=args.redirects,
                tee=args.tee,
                local_ranks_filter=args.local_ranks_filter,
                termination_grace=args.termination_grace,
                master_addr=args.master_addr,
                master_port=args.master_port,
                umask=args.umask if args.umask is not None else format_umask(caller_umask),
                **job_flag_fields(args),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # Inside a Slurm step only task 0 has srun's stdin: the workers get none.
        stdin = _stdin_for_workers() if allocation is None else None
        if stdin is not None:
            stack.callback(os.close, stdin)
        daemon = Daemon(
            config,
            console=write_line,
            worker_stdin=stdin,
            pass_environment=True,
            state_lock=state_lock,
        )
        daemon.install_signal_handlers()
        daemon.slurm_store_host = allocation is not None and allocation.hosts_store
        async with daemon:
            # Outlives this process: if it is killed (even kill -9), the reaper kills what the
            # job left (its attempt cgroups, else its processes) and removes the temporary
            # state. Entered last, so it is told "done" first, after the daemon's own clean stop.
            stack.enter_context(
                RunReaper(
                    cgroup=daemon.containment.base,
                    # A job of replica groups: its groups' processes name their own job
                    # (<id>.g<k>); this run's daemon URL names them all.
                    match={"ELASTICD_URL": config.url}
                    if spec.replica_groups
                    else {"ELASTICD_URL": config.url, "ELASTICD_JOB_ID": str(spec.id)},
                    remove=None if args.state_dir else Path(state_dir),
                    keep_fd=state_lock.fileno(),
                )
            )
            if allocation is None or allocation.submits:
                job, _ = await daemon.jobs.submit(spec)
                if args.console != "quiet":
                    note(
                        f"job {job.id} submitted: {nproc} worker(s) of {' '.join(command)}; "
                        f"API at {config.url} (token in {config.token_file}), dashboard at "
                        f"{dashboard_url(config.url)}, logs in {config.logs / job.id}"
                    )
            job_id = str(spec.id)
            if allocation is not None:
                slurm_run.handle_warnings(daemon, job_id)
            follower = asyncio.create_task(_print_events(daemon, job_id, args.console))
            if allocation is None or allocation.submits:
                waiter = asyncio.create_task(daemon.jobs.wait(job_id))
            else:
                waiter = asyncio.create_task(slurm_run.wait_submitted(daemon, allocation))
            with contextlib.suppress(SlurmStepError):  # said below, after the daemon's stop
                await race(asyncio.shield(waiter), daemon.stop_requested())
            if allocation is not None and allocation.hosts_store and waiter.done():
                # The others read the end from this daemon's store: it leaves last.
                await race(slurm_run.wait_others_left(daemon), daemon.stop_requested())
            if not waiter.done():
                note("interrupted: stopping the workers")
                await cancel_and_wait(waiter)
                await daemon.shutdown()
            await cancel_and_wait(follower)
            stopped = not waiter.done() or waiter.cancelled() or waiter.exception() is not None
        lost = None if not waiter.done() or waiter.cancelled() else waiter.exception()
        if isinstance(lost, SlurmStepError):
            if run_logs is not None:
                run_logs.keep = keep_run_logs(succeeded=False, asked=args.keep_logs)
                note(run_logs.kept_line(job_id))
            note(str(lost))
            return 1
        if stopped:
            # Stopped by a signal: 128 + its number, as a shell reports it (SIGTERM 143,
            # Ctrl-C 130). torchrun exits 1 here; a scheduler must tell a stop from a failure.
            # Said last, after the daemon's own stop, so it is the last line the user sees.
            sig = signal.Signals(daemon.stop_signal or signal.SIGINT)
            if run_logs is not None:
                run_logs.keep = keep_run_logs(succeeded=False, asked=args.keep_logs)
                note(run_logs.kept_line(job_id))
            note(stopped_line(job_id, sig))
            return 128 + sig
        code = report(waiter.result().model_dump(), args.console)
        if run_logs is not None:
            run_logs.keep = keep_run_logs(succeeded=code == 0, asked=args.keep_logs)
            if run_logs.keep and (code != 0 or args.console != "quiet"):
                note(run_logs.kept_line(job_id))
        return code


def _allocation_run(args: argparse.Namespace) -> AllocationRun | None:
    """With ``--nnodes``: this task's part in a job across the Slurm step (else None)."""
    from elasticd.slurm.allocation import plan_allocation_run, task_from_env

    if args.nnodes is None:
        if args.store_url or args.token_file:
            raise ConfigError("--store-url and --token-file go with --nnodes (a Slurm step)")
        return None
    task = task_from_env(os.environ)
    if task is None:
        raise ConfigError(
            "elasticd run --nnodes runs inside a Slurm step: srun --ntasks-per-node=1 "
            "elasticd run --nnodes MIN:MAX ... (elsewhere, run the daemons and elasticd submit)"
        )
    if args.run_id:
        raise ConfigError("--run-id: inside a Slurm step the job's id is slurm-JOB.STEP")
    return plan_allocation_run(task, args.nnodes, store_url=args.store_url, port=args.port)


def keep_run_logs(*, succeeded: bool, asked: bool) -> bool:
    """Whether an ``elasticd run`` keeps its temporary log folder (pure).

    Removed when the job succeeded: the workers' output was on the console. Kept when
    it failed or was stopped, as its logs are the evidence (the failed rank's
    stderr.log, a hung rank's last lines, an error file's traceback), or when the user
    asked (``--keep-logs``); the run then says where they are.
    """
    return asked or not succeeded


@dataclass
class RunLogs:
    """The temporary log folder of an ``elasticd run`` given no ``--log-dir``: removed
    when the run ends (also when it could not start) unless :func:`keep_run_logs`."""

    path: Path
    keep: bool = False

    def kept_line(self, job_id: str) -> str:
        return (
            f"the workers' logs are kept in {self.path / job_id} (remove the folder "
            f"{self.path} when done; --log-dir chooses where they go)"
        )

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


#: The events ``elasticd run`` prints, by its console level. The default is torchrun's
#: few lines: what starts (the submission line), each restart with its cause, what ends
#: (:func:`~elasticd.cli_commands.report`); a failure's own exit is in the restart's or
#: the end's line.
RUN_EVENTS: dict[str, frozenset[str]] = {
    "quiet": frozenset(),
    "normal": frozenset(
        {
            EventKind.GROUP_RESTARTING,
            EventKind.WORKERS_SPAWN_FAILED,
            EventKind.WORKER_HANG,
            EventKind.JOB_CHECKPOINT_REQUESTED,
        }
    ),
    "verbose": frozenset(EventKind),  # every event, once
}

#: A rendezvous of one node forms in milliseconds: the status line shows only a wait this long.
PENDING_NOTICE_AFTER = 5.0


def _run_log_level(console: str) -> int:
    """The daemon's log level under ``elasticd run``: its news reach the user as events."""
    return {"quiet": logging.ERROR, "normal": logging.WARNING}.get(console, logging.INFO)


def stopped_line(job_id: str, sig: signal.Signals) -> str:
    """The last line of a run stopped by a signal (pure)."""
    who = "by the user (Ctrl-C)" if sig is signal.SIGINT else f"by {sig.name}"
    return f"job {job_id} stopped {who}: its workers were stopped; exit {128 + sig}"


async def _print_events(daemon: Any, job_id: str, console: str = "normal") -> None:
    """Print the job's notable events once each; while a rendezvous waits, a status line."""
    shown = RUN_EVENTS[console]
    status = StatusLine(sys.stderr)
    pending_since: float | None = time.monotonic()  # a new job waits for its first round
    after = 0
    while True:
        # The 1 s timeout only refreshes the status line on screen; events wake us at once.
        events = await daemon.events.follow(job_id, after, 1.0 if pending_since else 60.0)
        for event in events:
            after = event.seq
            if event.kind == EventKind.RENDEZVOUS_COMPLETE:
                pending_since = None
                status.clear()
            elif event.kind in (EventKind.GROUP_RESTARTING, EventKind.RENDEZVOUS_CHANGE):
                pending_since = time.monotonic()
            if event.kind in shown:
                status.clear()
                note(f"{event.kind}: {event.message}" if console == "verbose" else event.message)
        waited = 0.0 if pending_since is None else time.monotonic() - pending_since
        if shown and waited >= PENDING_NOTICE_AFTER:
            status.show(f"[elasticd] rendezvous pending: {waited:.0f}s")


class StatusLine:
    """One line redrawn in place on a terminal; at most every 5 s otherwise."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._tty = bool(getattr(out, "isatty", lambda: False)())
        self._shown = False
        self._last = 0.0

    def show(self, text: str) -> None:
        if self._tty:
            self._out.write("\r\033[K" + text)
            self._out.flush()
            self._shown = True
        elif time.monotonic() - self._last >= 5.0:
            self._last = time.monotonic()
            print(text, file=self._out, flush=True)

    def clear(self) -> None:
        if self._tty and self._shown:
            self._out.write("\r\033[K")
            self._out.flush()
            self._shown = False


def _api_port(port: int, master_port: int | None) -> int:
    """The embedded daemon's API port: any free one, never the workers' ``--master-port``.

    With port 0 the kernel may hand the API the very port the user chose for
    the workers' store (free until rank 0 binds it): the workers then fail
    with EADDRINUSE. Picked here instead, avoiding that port.
    """
    if port != 0 or master_port is None:
        return port
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            picked = int(probe.getsockname()[1])
        if picked != master_port:
            return picked


def entry() -> None:  # pragma: no cover
    raise SystemExit(main())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
