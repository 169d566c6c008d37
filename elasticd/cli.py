"""The ``elasticd`` command: ``serve`` runs the node daemon, ``run`` is torchrun --standalone.

``elasticd serve`` flags have ``ELASTICD_*`` environment equivalents and a
TOML config file (``--config``); see :mod:`elasticd.config`.

``elasticd run [options] -- python train.py ...`` starts an embedded daemon in
this process, submits the job, streams the workers' output with rank
prefixes, and exits with the job's result (0 on success, 1 on failure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from elasticd import __version__
from elasticd.config import DEFAULT_PORT, load_config
from elasticd.errors import ConfigError
from elasticd.models import JobSpec
from elasticd.states import JobState

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
    p.add_argument("--token-file", help="0600 file holding the bearer token")
    p.add_argument("--store-url", help="http://host:port of another daemon's store, or etcd://")
    p.add_argument("--config", help="TOML config file")


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

    run = sub.add_parser(
        "run",
        help="run one job on this node, like torchrun --standalone",
        description="Example: elasticd run --nproc-per-node 2 -- python train.py --epochs 3",
    )
    run.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    run.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    run.add_argument("--role", default="default")
    run.add_argument("--redirects", "-r", default="none")
    run.add_argument("--tee", "-t", default="none")
    run.add_argument("--local-ranks-filter", "--local_ranks_filter", default=None)
    run.add_argument("--termination-grace", type=float, default=30.0)
    run.add_argument("--master-addr", "--master_addr", default=None)
    run.add_argument("--master-port", "--master_port", type=int, default=None)
    run.add_argument("--run-id", "--run_id", default=None, help="the job id")
    run.add_argument("--state-dir", help="state folder (default: a temporary one)")
    run.add_argument("--log-dir", "--log_dir", help="worker logs (default: a temporary folder)")
    run.add_argument("--port", type=int, default=0, help="HTTP port (default: any free port)")
    run.add_argument("program", nargs=argparse.REMAINDER, help="-- program and its arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "run":
            return asyncio.run(_run(args))
    except ConfigError as exc:
        print(f"elasticd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2  # pragma: no cover - argparse requires a command


async def _serve(args: argparse.Namespace) -> int:
    from elasticd.daemon import Daemon

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
            "store_url",
            "config",
        )
    }
    config = load_config(flags)
    if args.store_only:
        config.store_only = True
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    await daemon.start()
    print(f"elasticd listening on http://{config.host}:{config.port}", flush=True)
    await daemon.serve()
    return 0


def _command(words: list[str]) -> list[str]:
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise ConfigError("elasticd run needs a command: elasticd run [options] -- python train.py")
    if words[0].endswith(".py"):  # torchrun's form: a script path runs under this Python
        return [sys.executable, "-u", *words]
    return words


def _console(job_id: str, rank: int, stream: str, line: bytes) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    text = line.decode("utf-8", errors="replace")
    out.write(f"[rank{rank}]:{text}")
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()


async def _run(args: argparse.Namespace) -> int:
    from elasticd.daemon import Daemon

    command = _command(list(args.program))
    with contextlib.ExitStack() as stack:
        state_dir = args.state_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="elasticd-run-")
        )
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="elasticd-logs-")
        config = load_config(
            {
                "host": "127.0.0.1",
                "port": args.port,
                "state_dir": state_dir,
                "log_dir": log_dir,
                "node_name": "localhost",
                "slots": max(args.nproc_per_node, 1),
            },
            environ={},
        )
        try:
            spec = JobSpec(
                id=args.run_id,
                entrypoint=command[0],
                args=command[1:],
                cwd=os.getcwd(),
                nproc_per_node=args.nproc_per_node,
                max_restarts=args.max_restarts,
                role=args.role,
                redirects=args.redirects,
                tee=args.tee,
                local_ranks_filter=args.local_ranks_filter,
                termination_grace=args.termination_grace,
                master_addr=args.master_addr,
                master_port=args.master_port,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        daemon = Daemon(config, console=_console)
        daemon.install_signal_handlers()
        async with daemon:
            job, _ = daemon.jobs.submit(spec)
            _note(f"job {job.id} submitted; API at {config.url}, logs in {config.logs / job.id}")
            follower = asyncio.create_task(_print_events(daemon, job.id))
            waiter = asyncio.create_task(daemon.jobs.wait(job.id))
            stop = asyncio.create_task(daemon._stop.wait())
            await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not waiter.done():
                _note("interrupted: stopping the workers")
                waiter.cancel()
                await daemon.shutdown()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            final = daemon.db.get_job(job.id) if daemon.db._conn else None
            if final is None:
                return 130
        return _report(final.model_dump())


def _note(text: str) -> None:
    print(f"[elasticd] {text}", file=sys.stderr, flush=True)


async def _print_events(daemon: Any, job_id: str) -> None:
    shown = {
        "group.restarting",
        "workers.started",
        "worker.exited",
        "job.state",
        "workers.spawn_failed",
    }
    after = 0
    while True:
        events = await daemon.events.follow(job_id, after, 60)
        for event in events:
            after = event.seq
            if event.kind in shown:
                _note(event.message)


def _report(job: dict[str, Any]) -> int:
    state = JobState(job["state"])
    if state is JobState.SUCCEEDED:
        _note(f"job {job['id']} SUCCEEDED after {job['restart_count']} restart(s)")
        return 0
    error = job.get("error") or {}
    _note(f"job {job['id']} {state.value}: {job.get('reason') or ''}")
    if error.get("traceback"):
        print(error["traceback"], file=sys.stderr)
    return 1


def entry() -> None:  # pragma: no cover
    raise SystemExit(main())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
