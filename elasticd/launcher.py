"""``elasticd.launch``: run a Python function as a job's workers, like torch's ``elastic_launch``.

::

    import elasticd

    def train(lr: float, epochs: int) -> dict:      # top level of an importable module
        ...
        return {"loss": 0.1}

    if __name__ == "__main__":
        results = elasticd.launch(train, nproc_per_node=2, max_restarts=3)(0.01, epochs=5)
        print(results[0])                              # {rank: return value}

It starts an embedded daemon in this process (as ``elasticd run`` does: its
own state and store in a temporary folder, its API on a free loopback port
behind a token made for this run, see :func:`write_run_token`),
submits one job whose workers run ``python -m elasticd.launch_worker``, and
waits. The workers get torchrun's whole environment contract, and the job
runs under the same agent and restart policy as a submitted job: a failing
rank restarts the whole group while the budget lasts. The call returns
``{global rank: return value}``, or raises :class:`LaunchError` with the
root-cause failure (rank, exit code or signal, the worker's traceback).

Differences from torch, on purpose:

* **Nothing is pickled.** The function travels by name (module and
  qualified name); arguments and return values travel as JSON. So the
  function must be defined at the top level of a module the workers can
  import (or of the ``__main__`` script, which the workers re-run under the
  name ``__mp_main__``, as multiprocessing's spawn does: guard your entry
  point with ``if __name__ == "__main__":``). Lambdas, closures and
  functions defined inside functions are refused. Arguments and results
  must be JSON values: tuples come back as lists, dict keys as strings.
* One node (``torchrun --standalone``); multi-node launches submit a job to
  the daemons instead.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import secrets
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticd.console import write_line
from elasticd.errors import ConfigError, ElasticdError
from elasticd.models import Job, JobSpec, RootCause, format_umask
from elasticd.security import set_private_umask
from elasticd.states import JobState

__all__ = ["LaunchError", "Launcher", "launch"]

#: Set in the workers' environment: the JSON file describing the call.
CALL_ENV = "ELASTICD_LAUNCH_CALL"
#: Put on the workers' PYTHONPATH so that ``-m elasticd.launch_worker`` imports this elasticd.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class LaunchError(ElasticdError):
    """A launched function failed: ``root_cause`` says which rank and why; ``job`` is the job."""

    def __init__(self, message: str, *, job: Job | None = None) -> None:
        super().__init__(message)
        self.job = job
        self.root_cause: RootCause | None = job.error if job is not None else None


def _function_ref(fn: Callable[..., Any]) -> dict[str, Any]:
    """How a worker finds ``fn``: module, qualified name and file; refuses what it cannot."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(f"elasticd.launch needs a function, not {type(fn).__name__}")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"elasticd.launch cannot run {qualname!r}: the workers import the function by "
            "name and nothing is pickled, so it must be defined at the top level of a module "
            "(not a lambda, closure or nested function)"
        )
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if module == "__main__" and not file:
        raise TypeError(
            f"elasticd.launch cannot run {qualname!r} from an interactive session: "
            "define it in a module or a script file"
        )
    target: Any = mod
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not fn:
        raise TypeError(
            f"elasticd.launch cannot run {module}.{qualname}: that name does not lead back "
            "to this function (is it decorated without functools.wraps, or redefined?)"
        )
    return {
        "module": module,
        "qualname": qualname,
        "file": str(Path(file).resolve()) if file else None,
    }


def _json_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    call = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        json.dumps(call, allow_nan=False)
        return call
    except (TypeError, ValueError) as exc:
        raise TypeError(
            "elasticd.launch passes arguments to the workers as JSON (never pickle): "
            f"{exc}; pass numbers, strings, lists and dicts, e.g. a path instead of an object"
        ) from None


#: The embedded daemon's token file, in its state folder.
RUN_TOKEN_FILE = "run-token"


def write_run_token(state_dir: Path, token: str | None = None) -> Path:
    """A new random bearer token for an embedded daemon, in a 0600 file in ``state_dir``.

    An embedded daemon (``elasticd run``, :func:`launch`) listens on
    loopback, where every local user can reach it; without a token any of
    them could list its job, read its logs and cancel it. So each run makes
    its own token: the file is this user's alone (the state folder is made
    0700 if new), its workers get its path as ``ELASTICD_TOKEN_FILE`` as
    from any daemon, and the same user's CLI can pass it with ``--token-file``.
    A token file left by an earlier run is replaced, never reused or followed.
    ``token``: this one instead of a random one (a Slurm step's, derived).
    """
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = state_dir / RUN_TOKEN_FILE
    fresh = state_dir / f".{RUN_TOKEN_FILE}.{secrets.token_hex(8)}"
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, ((token or secrets.token_urlsafe(32)) + "\n").encode())
    finally:
        os.close(fd)
    os.replace(fresh, path)  # a name replaced atomically: never opens what was there
    return path


def _failure_message(name: str, job: Job) -> str:
    error = job.error
    if error is None:
        return f"{name} failed: {job.reason or job.state.value}"
    what = f"rank {error.rank} (local rank {error.local_rank}, attempt {error.attempt})"
    text = f"{name} failed on {what}: {error.message}"
    if error.source == "log":
        text += " (from its stderr.log)"
    if job.reason:
        text += f"\n{job.reason}"
    if error.log_dir:
        text += f"\nlogs: {error.log_dir}"
    if error.traceback:
        text += "\n\n" + error.traceback.rstrip()
    return text


class Launcher:
    """``launch(fn, ...)``'s result: call it with the arguments (or ``await run_async(...)``)."""

    def __init__(self, fn: Callable[..., Any], settings: dict[str, Any]) -> None:
        self._ref = _function_ref(fn)
        self._name = f"{self._ref['module']}.{self._ref['qualname']}"
        self._settings = settings

    def __call__(self, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Run the workers and wait: ``{global rank: return value}``, or :class:`LaunchError`."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.run_async(*args, **kwargs))
        raise RuntimeError(
            "elasticd.launch(...)(...) blocks until the workers finish; inside a running "
            "event loop use `await elasticd.launch(...).run_async(...)`"
        )

    async def run_async(self, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """The same, in the caller's event loop.

        While it runs, the process's umask is 077, so the embedded daemon's files are
        born private; the workers get the umask the caller had (as torchrun's inherit
        it), and the caller's is back when this returns or raises.
        """
        payload = _json_args(args, kwargs)
        caller_umask = set_private_umask()
        try:
            return await self._run(payload, caller_umask)
        finally:
            os.umask(caller_umask)

    async def _run(self, payload: dict[str, Any], caller_umask: int) -> dict[int, Any]:
        from elasticd.config import load_config
        from elasticd.node.daemon import Daemon
        from elasticd.supervise.reaper import RunReaper

        s = self._settings
        nproc: int = s["nproc_per_node"]
        keep_logs = s["log_dir"] is not None
        log_dir = Path(s["log_dir"] or tempfile.mkdtemp(prefix="elasticd-launch-logs-"))
        succeeded = False
        with tempfile.TemporaryDirectory(prefix="elasticd-launch-") as tmp:
            work = Path(tmp)
            results = work / "results"
            results.mkdir()
            call_file = work / "call.json"
            call = {**self._ref, "sys_path": list(sys.path), "results": str(results)}
            call_file.write_text(json.dumps({**call, "call": payload}))
            python_path = os.pathsep.join(
                p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p
            )
            try:
                spec = JobSpec(
                    # Known before the submission: the run's reaper names its processes by it.
                    id=s["run_id"] or uuid.uuid4().hex[:12],
                    entrypoint=sys.executable,
                    args=["-m", "elasticd.launch_worker"],
                    env={**s["env"], CALL_ENV: str(call_file), "PYTHONPATH": python_path},
                    cwd=s["cwd"] or os.getcwd(),
                    nproc_per_node=nproc,
                    umask=format_umask(caller_umask),
                    **{
                        k: v
                        for k, v in s.items()
                        if k
                        in (
                            "max_restarts",
                            "role",
                            "redirects",
                            "tee",
                            "local_ranks_filter",
                            "termination_grace",
                            "master_addr",
                            "master_port",
                        )
                        and v is not None
                    },
                )
            except ValueError as exc:
                raise ConfigError(f"elasticd.launch: {exc}") from None
            config = load_config(
                {
                    "host": "127.0.0.1",
                    "port": 0,
                    "state_dir": str(work / "state"),
                    "log_dir": str(log_dir),
                    "node_name": "localhost",
                    "slots": nproc,
                    "token_file": str(write_run_token(work / "state")),
                },
                environ={},
            )
            reaper: RunReaper | None = None
            try:
                # Its one job is the caller's own: the caller's environment passes on whole.
                async with Daemon(config, console=write_line, pass_environment=True) as daemon:
                    # Outlives this process: if it is killed (kill -9 too), the reaper kills
                    # what the job left and removes the temporary folder (elasticd.supervise.
                    # reaper); told "done" below, once the daemon has stopped cleanly.
                    reaper = RunReaper(
                        cgroup=daemon.containment.base,
                        match={"ELASTICD_URL": config.url, "ELASTICD_JOB_ID": str(spec.id)},
                        remove=work,
                    ).start()
                    job, _ = await daemon.jobs.submit(spec)
                    final = await daemon.jobs.wait(job.id, s["timeout"])
                reaper.done()
                if final.state is not JobState.SUCCEEDED:
                    raise LaunchError(_failure_message(self._name, final), job=final)
                values = self._results(results, nproc, final)
                succeeded = True
                return values
            finally:
                if reaper is not None:
                    reaper.done()  # a second call does nothing
                if succeeded and not keep_logs:
                    shutil.rmtree(log_dir, ignore_errors=True)

    def _results(self, folder: Path, world_size: int, job: Job) -> dict[int, Any]:
        values: dict[int, Any] = {}
        for rank in range(world_size):
            path = folder / f"rank_{rank}.json"
            try:
                values[rank] = json.loads(path.read_text(encoding="utf-8"))["value"]
            except (OSError, ValueError, KeyError) as exc:
                raise LaunchError(
                    f"{self._name}: rank {rank} exited 0 but left no result ({exc})", job=job
                ) from None
        return values


def launch(
    fn: Callable[..., Any],
    *,
    nproc_per_node: int = 1,
    max_restarts: int | None = None,
    role: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    termination_grace: float | None = None,
    redirects: str | None = None,
    tee: str | None = None,
    local_ranks_filter: Sequence[int] | str | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    run_id: str | None = None,
    log_dir: str | Path | None = None,
    timeout: float | None = None,
) -> Launcher:
    """Prepare to run ``fn`` on ``nproc_per_node`` workers; call the result with the arguments.

    ``max_restarts`` defaults to a submitted job's default (3); the other
    settings are the job spec's (see the README). Worker logs go to
    ``log_dir`` (kept), else to a temporary folder that is removed after a
    success and kept after a failure (its path is in the error). ``timeout``
    bounds the whole run (``TimeoutError``; the workers are stopped).
    """
    settings = {
        "nproc_per_node": nproc_per_node,
        "max_restarts": max_restarts,
        "role": role,
        "env": dict(env or {}),
        "cwd": cwd,
        "termination_grace": termination_grace,
        "redirects": redirects,
        "tee": tee,
        "local_ranks_filter": local_ranks_filter,
        "master_addr": master_addr,
        "master_port": master_port,
        "run_id": run_id,
        "log_dir": str(log_dir) if log_dir is not None else None,
        "timeout": timeout,
    }
    return Launcher(fn, settings)


def resolve(call: Mapping[str, Any]) -> Callable[..., Any]:
    """In a worker: the function a call file names (imported by name; nothing unpickled)."""
    module, qualname, file = call["module"], call["qualname"], call.get("file")
    if module == "__main__":
        import runpy

        if not file:
            raise ImportError("the launcher's __main__ has no file to load the function from")
        namespace: Any = runpy.run_path(file, run_name="__mp_main__")
        first, *rest = qualname.split(".")
        target: Any = namespace[first]
    else:
        try:
            target = importlib.import_module(module)
        except ModuleNotFoundError:
            if not file:
                raise
            target = _load_file(module, file)
        rest = qualname.split(".")
    for part in rest:
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{module}.{qualname} is not callable")
    return target  # type: ignore[no-any-return]


def _load_file(module: str, file: str) -> Any:
    spec = importlib.util.spec_from_file_location(module, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {module} from {file}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)
    return mod
