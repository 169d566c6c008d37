"""Shared helpers of the benchmark scripts: statistics, processes, a daemon, tables.

Everything that starts a process here bounds it by time and ends it in a
``finally``: processes are started in their own session (so their process
group can be signalled as a whole), and every process a benchmark starts
carries ``ELASTICD_BENCH_TAG`` in its environment, which the daemon and
torchrun pass on to their workers, so :func:`reap_tagged` can find and end
whatever a crashed supervisor left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
WORKERS = BENCH / "workers"
#: The interpreter running the benchmark (the venv's): workers and daemons use it too.
PYTHON = sys.executable
TAG_VAR = "ELASTICD_BENCH_TAG"

T = TypeVar("T")


# -- statistics -----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: always one of the values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


@dataclass(frozen=True)
class Stats:
    """Summary of a sample, in the unit it was given in."""

    n: int
    p50: float
    p99: float
    min: float
    max: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Stats:
        """Summarise ``values``, each multiplied by ``scale`` (1000 for s -> ms)."""
        scaled = [v * scale for v in values]
        if not scaled:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            n=len(scaled),
            p50=percentile(scaled, 50),
            p99=percentile(scaled, 99),
            min=min(scaled),
            max=max(scaled),
            mean=statistics.fmean(scaled),
        )

    def as_dict(self) -> dict[str, float | int]:
        return {
            "n": self.n,
            "p50": self.p50,
            "p99": self.p99,
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
        }


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table; an em dash when there is none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def ratio(theirs: float | None, ours: float | None) -> str:
    """``theirs / ours`` as "12.3×" (how many times faster elasticd is); a dash if unknown."""
    if theirs is None or ours is None or math.isnan(theirs) or math.isnan(ours) or ours <= 0:
        return "—"
    return f"{theirs / ours:.1f}×"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# -- time -------------------------------------------------------------------------


class Deadline:
    """A point in monotonic time that loops must not pass."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def poll_until(
    check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02
) -> T:
    """Call ``check`` until it returns something other than None; TimeoutError after ``timeout``."""
    deadline = Deadline(timeout)
    while True:
        result = check()
        if result is not None:
            return result
        if deadline.expired():
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(min(interval, deadline.remaining()))


# -- processes ----------------------------------------------------------------------


def free_port() -> int:
    """A loopback TCP port that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def new_tag() -> str:
    """A fresh value for ``ELASTICD_BENCH_TAG``."""
    return uuid.uuid4().hex


def tagged_env(tag: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus the benchmark tag (and ``extra``)."""
    env = dict(os.environ)
    env[TAG_VAR] = tag
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    if extra:
        env.update(extra)
    return env


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a process started in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_process(proc: subprocess.Popen[Any], grace: float = 10.0, group: bool = True) -> int:
    """SIGTERM (to the group, or the process), ``grace`` seconds, then SIGKILL; returns the code."""
    if proc.poll() is None:
        if group:
            signal_group(proc.pid, signal.SIGTERM)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    signal_group(proc.pid, signal.SIGKILL)  # leftovers in the group, if any
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return proc.wait(timeout=30)


def reap_tagged(tag: str) -> list[int]:
    """SIGKILL every process (and its group) that carries ``ELASTICD_BENCH_TAG=tag``.

    The safety net for workers whose supervisor died; returns their pids.
    """
    marker = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    my_group = os.getpgid(0)
    killed: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker not in environ.split(b"\0"):
            continue
        pid = int(entry.name)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(pid)
            if pgid != my_group:
                os.killpg(pgid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (1/CLK_TCK resolution)."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    """VmRSS of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def proc_wakeups(pid: int) -> int:
    """Context switches of every thread of a process so far (each one is a wake-up or a preemption)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                total += int(line.split()[1])
    return total


def torchrun_path() -> str:
    """The torchrun next to this interpreter (the venv's), else the one on PATH."""
    local = Path(PYTHON).parent / "torchrun"
    if local.exists():
        return str(local)
    found = shutil.which("torchrun")
    if found is None:
        raise RuntimeError("torchrun not found next to the interpreter or on PATH")
    return found


@dataclass
class Finished:
    """A finished command: exit code, wall time, its output."""

    code: int | None
    """None when it ran past its timeout and was killed."""
    elapsed: float
    output: str


def run_bounded(
    argv: Sequence[str], timeout: float, tag: str, log_path: Path, cwd: Path = ROOT
) -> Finished:
    """Run ``argv`` in its own session with stdout+stderr to ``log_path``, at most ``timeout`` s.

    On timeout the whole process group gets SIGTERM, then SIGKILL. Whatever
    the outcome, tagged leftovers are reaped.
    """
    started = time.monotonic()
    code: int | None = None
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=tagged_env(tag),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_process(proc, grace=5.0)
            reap_tagged(tag)
    return Finished(code, time.monotonic() - started, log_path.read_text(errors="replace"))


# -- the daemon ------------------------------------------------------------------------


class ElasticdServer:
    """``elasticd serve`` on a free loopback port with a fresh state dir, as a context manager.

    ``with ElasticdServer(root) as server:`` starts it and waits for ``/healthz``;
    leaving the block sends SIGTERM (the daemon stops its workers), waits,
    then SIGKILLs what is left and reaps tagged workers.
    """

    def __init__(self, root: Path, name: str = "bench", start_timeout: float = 60.0) -> None:
        self.state_dir = root / f"state-{name}"
        self.log_path = root / f"daemon-{name}.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = new_tag()
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        #: The daemon's token (ELASTICD_TOKEN): every caller has an identity.
        self.token = secrets.token_urlsafe(32)
        self.client = httpx.Client(
            base_url=self.url, timeout=30.0, headers={"Authorization": f"Bearer {self.token}"}
        )
        self.exit_code: int | None = None

    @property
    def proc_env(self) -> dict[str, str]:
        """The daemon's environment (its token, the bench's tag)."""
        return {**tagged_env(self.tag), "ELASTICD_TOKEN": self.token}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            PYTHON,
            "-m",
            "elasticd",
            "serve",
            "--port",
            str(self.port),
            "--state-dir",
            str(self.state_dir),
            "--node-name",
            "bench",
            # As root the daemon refuses root jobs unless told; the bench runs as the caller.
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ]

    def spawn(self, mode: str = "wb") -> None:
        """Start ``elasticd serve`` (again, with ``mode="ab"``: its log goes on)."""
        with self.log_path.open(mode) as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=self.proc_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> ElasticdServer:
        self.spawn()
        try:
            poll_until(self._healthy, self.start_timeout, f"elasticd on {self.url}", 0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"elasticd exited with {self.proc.returncode} while starting; "
                f"log:\n{self.log_path.read_text(errors='replace')[-3000:]}"
            )
        try:
            return True if self.client.get("/healthz", timeout=2).status_code == 200 else None
        except httpx.TransportError:
            return None

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM the daemon (not its group: it stops its own workers), bounded; idempotent."""
        try:
            if self.proc is not None and self.exit_code is None:
                self.exit_code = stop_process(self.proc, grace=grace, group=False)
        finally:
            reap_tagged(self.tag)
            self.client.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # API helpers

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post("/jobs", json=spec)
        r.raise_for_status()
        return dict(r.json())

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.client.get(f"/jobs/{job_id}")
        r.raise_for_status()
        return dict(r.json())

    def events(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        r = self.client.get(f"/jobs/{job_id}/events", params={"after": after, "limit": 10_000})
        r.raise_for_status()
        return list(r.json())

    def wait_terminal(self, job_id: str, timeout: float) -> dict[str, Any]:
        """Follow the job's events (long-poll) until it is terminal; TimeoutError after ``timeout``."""
        deadline = Deadline(timeout)
        after = 0
        while True:
            job = self.job(job_id)
            if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return job
            if deadline.expired():
                raise TimeoutError(
                    f"job {job_id} still {job['state']} after {timeout:.0f} s\n"
                    + self.diagnose(job_id)
                )
            wait = max(0.1, min(10.0, deadline.remaining()))
            r = self.client.get(
                f"/jobs/{job_id}/events",
                params={"after": after, "wait": wait},
                timeout=wait + 10,
            )
            r.raise_for_status()
            for event in r.json():
                after = max(after, int(event["seq"]))

    def diagnose(self, job_id: str) -> str:
        """The job's state, its last events and the daemon log's tail, for an error message."""
        parts = []
        with contextlib.suppress(httpx.HTTPError, ValueError):
            job = self.job(job_id)
            parts.append(f"job {job_id}: {job['state']} ({job.get('reason')})")
            for e in self.events(job_id)[-8:]:
                parts.append(f"  event {e['seq']} {e['kind']}: {e.get('message', '')}")
        with contextlib.suppress(OSError):
            parts.append("daemon log tail:\n" + self.log_path.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    def cancel(self, job_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self.client.post(f"/jobs/{job_id}/cancel", json={})


def python_job(job_id: str, code: str, *, nproc: int = 1, max_restarts: int = 0) -> dict[str, Any]:
    """The spec of a job whose workers are this interpreter running ``code`` (``-c``)."""
    return {
        "id": job_id,
        "entrypoint": PYTHON,
        "args": ["-c", code],
        "cwd": str(ROOT),
        "nproc_per_node": nproc,
        "max_restarts": max_restarts,
        "termination_grace": 2,
    }


# -- a lean HTTP/1.1 client for load ------------------------------------------------------


class HttpError(Exception):
    """A response this client cannot read, or a connection that failed."""


class RawHttp:
    """A minimal asyncio HTTP/1.1 GET client, so that the load generator costs little CPU.

    With ``keepalive`` it keeps a pool of idle connections and opens a new one
    only when all are busy (like any HTTP client library); without, each
    request opens its own connection and sends ``Connection: close``.
    ``headers`` go with every request (``Authorization``). Only
    ``Content-Length`` bodies are read (what uvicorn sends for JSON). asyncio
    sets ``TCP_NODELAY`` on the connections it opens.
    """

    def __init__(
        self,
        host: str,
        port: int,
        keepalive: bool,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.keepalive = keepalive
        self.timeout = timeout
        self.opened = 0
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        connection = "keep-alive" if keepalive else "close"
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self._head = f"Host: {host}:{port}\r\nConnection: {connection}\r\n{extra}\r\n"

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path``: (status, body). Raises :class:`HttpError` or TimeoutError.

        A pooled connection that the server closed while it was idle (its
        keep-alive timeout) is replaced once, as HTTP clients do.
        """
        while self._idle:
            reader, writer = self._idle.pop()
            try:
                return await self._get(path, reader, writer)
            except HttpError as exc:
                if (
                    not isinstance(exc.__cause__, asyncio.IncompleteReadError)
                    or exc.__cause__.partial
                ):
                    raise
        return await self._get(path, None, None)

    async def _get(
        self,
        path: str,
        reader: asyncio.StreamReader | None,
        writer: asyncio.StreamWriter | None,
    ) -> tuple[int, bytes]:
        if reader is None or writer is None:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.timeout
            )
            self.opened += 1
        try:
            async with asyncio.timeout(self.timeout):
                writer.write(f"GET {path} HTTP/1.1\r\n{self._head}".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                status = int(lines[0].split(b" ", 2)[1])
                length, close = None, not self.keepalive
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value.strip().lower() == b"close":
                        close = True
                    elif name == b"transfer-encoding":
                        raise HttpError(f"unsupported transfer-encoding {value.strip()!r}")
                if length is None:
                    raise HttpError("response without content-length")
                body = await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            raise HttpError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            writer.close()
            raise
        if close:
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, body

    async def aclose(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


# -- records of the tick worker ----------------------------------------------------------


@dataclass(frozen=True)
class StartRecord:
    """What a tick worker wrote when it started."""

    pid: int
    rank: int
    attempt: int
    first_stmt: float
    fork_est: float | None
    proc_start: float


@dataclass(frozen=True)
class ExitRecord:
    """What a tick worker wrote just before ``os._exit``."""

    pid: int
    rank: int
    attempt: int
    why: str
    """crash, sigterm or done."""
    exit_time: float
    signalled_at: float | None
    """For ``sigterm``: when the handler ran."""


def read_records(folder: Path) -> tuple[list[StartRecord], list[ExitRecord]]:
    """The start and exit records a tick worker wrote in ``folder`` (empty exit files skipped)."""
    starts: list[StartRecord] = []
    exits: list[ExitRecord] = []
    for path in sorted(folder.glob("start-*.json")):
        doc = json.loads(path.read_text())
        starts.append(
            StartRecord(
                pid=doc["pid"],
                rank=doc["rank"],
                attempt=doc["attempt"],
                first_stmt=doc["first_stmt"],
                fork_est=doc.get("fork_est"),
                proc_start=doc["proc_start"],
            )
        )
    for path in sorted(folder.glob("exit-*.txt")):
        text = path.read_text().split()
        if not text:
            continue  # a SIGTERM file opened in advance, never used
        attempt, rank, pid, why = path.stem.removeprefix("exit-").split("-")
        times = [float(t) for t in text]
        exits.append(
            ExitRecord(
                pid=int(pid.removeprefix("p")),
                rank=int(rank.removeprefix("r")),
                attempt=int(attempt.removeprefix("a")),
                why=why,
                exit_time=times[-1],
                signalled_at=times[0] if len(times) > 1 else None,
            )
        )
    return starts, exits


def tick_args(out: Path, **options: object) -> list[str]:
    """``python -u bench/workers/tick.py --out OUT --option value ...`` minus the interpreter."""
    args = ["-u", str(WORKERS / "tick.py"), "--out", str(out)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, str(value)]
    return args


# -- torchrun's log ------------------------------------------------------------------------


def glog_time(line: str) -> float | None:
    """The wall-clock time of a torch log line (``W1121 02:22:28.696000 8180 ...``), or None.

    torch's formatter writes local time with millisecond precision and no year;
    the current year is assumed.
    """
    if len(line) < 22 or line[0] not in "VIWEC" or not line[1:5].isdigit():
        return None
    try:
        stamp = dt.datetime.strptime(
            f"{dt.datetime.now().year}{line[1:5]} {line[6:21]}", "%Y%m%d %H:%M:%S.%f"
        )
    except ValueError:
        return None
    return stamp.timestamp()


# -- the machine -------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    """What the figures were measured on."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "loadavg_at_start": load,
    }


@contextlib.contextmanager
def scratch(prefix: str = "elasticd-bench-", keep: bool = False) -> Iterator[Path]:
    """A temporary folder, removed afterwards unless ``keep``."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
