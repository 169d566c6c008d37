"""The daemon's supervision of worker processes: the local group of one job attempt.

This is the daemon's side of the process boundary (it runs as root, in the
daemon); its counterpart inside the training process is :mod:`elasticd.worker`.
The agent decides *when* workers start and stop; this package is *how*. It
is torch's ``SubprocessContext`` (``PContext``) rebuilt for a long-lived
asyncio daemon, and differs from it where a daemon needs it to.

Process groups
    Every worker is spawned with ``asyncio.create_subprocess_exec(...,
    start_new_session=True)``: a session and a process group of its own,
    whose id is the worker's pid. Signals go to the group (``os.killpg``),
    so the processes a worker starts (data-loader workers, compilers, a
    shell's children) get them too, and a Ctrl-C aimed at a daemon running
    in a terminal does not reach the workers behind the daemon's back.

No polling
    torch checks ``Popen.poll()`` every ``monitor_interval`` seconds. Here a
    task per worker awaits ``Process.wait()``, which asyncio's child watcher
    (a thread blocked in ``waitpid``) completes when the kernel reports the
    exit; the
    agent's ``on_exit`` callback runs a few loop iterations later (about
    0.3 ms, see ``bench/bench_exit_detection.py``).
    :meth:`WorkerGroupProcesses.wait` returns at the first failure, or when
    all succeeded, without touching the other workers: stopping is a
    separate decision.

One termination routine
    :meth:`WorkerGroupProcesses.stop` is the only way workers end: SIGTERM to
    every group, wait up to the grace, SIGKILL to what is left, await every
    exit. It runs as one task that callers await through ``asyncio.shield``:
    a cancelled caller still waits for it to finish before its cancellation
    goes on, calling it twice (or from ``__aexit__``) joins the same run,
    and exits it causes are marked ``stopped`` so the real root cause stays
    the first failure. A worker's group is signalled even after the worker
    itself exited, to reap leftovers, unless the worker's pid is taken by
    another process (the id could then name someone else's group).

Output through the daemon, by pipes
    torchrun redirects a worker's stdout and stderr to files and implements
    tee by tailing those files on a timer. The daemon instead gives each
    stream a pipe and appends what arrives to ``<log_dir>/stdout.log`` and
    ``stderr.log`` itself. That makes the daemon the single writer of the
    log files, turns tee (console forwarding per local rank) into a
    callback per line with no polling and no extra reader of the file, and
    lets the logs API follow output as it arrives. The price of pipes and
    how it is paid:

    * A worker blocks when its pipe is full. The loop reads each pipe as soon
      as it is readable and writes each chunk to the file unbuffered; the
      pipe holds 256 KiB, so a worker printing as fast as it can is limited
      by the disk, not by the daemon.
    * Output must not be lost at exit. The exit and the pipe's EOF are
      tracked apart: exits are reported at once, and ``stop()`` drains each
      pipe to EOF before closing the files, so the last lines always land.
    * A grandchild may keep the pipe open after the worker has exited. With
      asyncio's own pipes, Python 3.11's ``Process.wait()`` only returns
      once the pipes close (checked: a worker that forks a child holding
      stdout and exits is reported only when that child exits). So the
      pipes are created here and handed to the child as plain descriptors;
      the subprocess transport owns no pipe and ``wait()`` returns at the
      exit itself. The grandchild is then ended with the worker's group, or
      with the attempt's cgroup if it left the group.
    * If the daemon dies, the workers die with it (below); a child of a
      worker that outlives it loses its reader and gets ``SIGPIPE`` at its
      next write, so it does not run on unsupervised either.

No orphans, and the right user
    Each worker is exec'd through ``setpriv --pdeathsig KILL`` (or a tiny
    Python fallback), so the kernel kills it when the daemon dies; a job
    that runs as another user is switched between fork and exec, before the
    signal is set, and its entrypoint and ``cwd`` are then looked up and
    entered by the child itself, as that user, never probed by the daemon
    (the same path starts a job's health check). Every spawn is recorded
    in the daemon's database and the next start kills what is left
    (:mod:`.spawn`). Only the worker's own log folder is handed to its user;
    log files are opened with ``O_NOFOLLOW`` (:mod:`elasticd.security`), and
    every file of that folder the daemon reads (logs, error files) is opened
    through :func:`.files.open_worker_file`: relative to the folder's
    descriptor, never through a link, never blocking on a FIFO, a regular
    file with one link or nothing.

Containment
    Each attempt's workers are born in a cgroup v2 of the attempt's own, so a
    process that leaves its worker's process group (``setsid()``) is still
    killed when the attempt stops, and reported as a stray; the start-up
    sweep finds leftovers by cgroup. Without cgroups, the daemon is a child
    subreaper and says containment is partial (:mod:`.cgroup`).

Error files
    Each worker's ``TORCHELASTIC_ERROR_FILE`` is read when it fails, in
    torch's ``@record`` format, as untrusted JSON (:mod:`.errorfile`), and
    failures are ordered by its timestamp as torch does ("first failure").

Modules: :mod:`.process` (the group), :mod:`.output` (pipes to log files),
:mod:`.errorfile` (error files), :mod:`.files` (reading what a worker can
write), :mod:`.env` (the environment contract),
:mod:`.spawn` (the exec wrapper, the spawn policy and the orphan sweep),
:mod:`.cgroup` (containment of an attempt's processes).
Nothing here imports torch.
"""

from elasticd.supervise.errorfile import WorkerError, read_error_file
from elasticd.supervise.output import OutputSink, Stream
from elasticd.supervise.process import (
    DEFAULT_STOP_GRACE,
    GroupResult,
    WorkerExit,
    WorkerGroupProcesses,
    WorkerLaunch,
)

__all__ = [
    "DEFAULT_STOP_GRACE",
    "GroupResult",
    "OutputSink",
    "Stream",
    "WorkerError",
    "WorkerExit",
    "WorkerGroupProcesses",
    "WorkerLaunch",
    "read_error_file",
]
