"""How a worker process is started so that it never outlives the daemon, and who it runs as.

Parent-death signal
    Every worker is exec'd through a tiny wrapper that asks the kernel for
    ``SIGKILL`` the moment its parent dies (``prctl(PR_SET_PDEATHSIG)``) and
    then execs the worker itself, which keeps the pid, the process group and
    the signal. The wrapper is util-linux ``setpriv --pdeathsig KILL --``
    (a C program: no start-up cost worth measuring); where ``setpriv`` is
    missing or too old, ``python -I -S -c`` with ``ctypes`` does the same
    and also closes the race ``setpriv`` leaves open (the daemon dying
    between fork and prctl) by checking its parent afterwards.
    ``preexec_fn`` is not used: it is unsafe in a process with threads.

    The signal is tied to the *thread* that forked, not the process: asyncio
    forks on the event loop's thread, which in the daemon is the main thread
    and lives as long as the daemon. A loop run in another thread would take
    its workers with it when that thread ends, which is when the loop ends.

Who the worker runs as
    When the job runs as another user (:mod:`elasticd.security`), the root
    stage below switches groups, gid and uid (with or without a cgroup to
    join), and only then is the parent-death signal set (``setpriv``, or the
    stage itself): the kernel clears the signal on a credential change. The
    job's environment (``LD_PRELOAD`` and friends) is never seen by a process
    with more privilege than the job itself: the stage runs with an empty
    environment and hands the job's on after the switch.

On the event loop's thread
    Workers are forked on the loop's thread (above), so the fork must be
    cheap: ``subprocess`` (CPython 3.11's ``_posixsubprocess``) uses
    ``vfork()`` (no copy of the daemon's page tables; the parent resumes as
    soon as the child execs) unless given ``preexec_fn`` or
    ``user``/``group``/``extra_groups``, when it uses ``fork()`` and then
    waits on its error pipe until the child has exec'd (about 8 ms of the
    loop's time per start on a busy machine). So :func:`start_process` passes
    none of them: a start as another user goes through the root stage, like a
    start into a cgroup, and every start is a ``vfork()``. The umask and the
    new session are set in the child by ``_posixsubprocess`` either way.

One way to start anything: :func:`start_process`
    Workers and a job's own health check are started the same way (the
    operator's checks too, as the daemon): the environment less
    :data:`~elasticd.supervise.env.WITHHELD`, the user switch, the wrapper,
    then :data:`RESOLVER`, a few lines of ``/bin/sh`` that run *as the
    process's user*: enter the working folder, find the program on the
    environment's ``PATH``, check that it can be run, exec it. The daemon
    never enters, looks up or even stats a job-chosen path itself: as root
    it would reach folders the job cannot, and an EACCES-or-ENOENT answer
    would tell the job about them. (``subprocess``'s own ``cwd=`` is not
    used for that reason: it changes folder *before* the user switch.) The
    shell reports a failure through its stdin, the write end of a pipe the
    daemon reads to EOF; the exec replaces stdin with ``/dev/null`` (or, for
    ``elasticd run``'s workers, the launcher's stdin: ``SpawnPolicy.worker_stdin``),
    so EOF with nothing written means the program runs. A failure becomes a clear
    :class:`~elasticd.errors.WorkerSpawnError` (ENOENT, ENOTDIR or EACCES
    and the path, as the user sees them). The program's ``argv[0]`` is the
    path it was found at.

The start-up sweep
    Every spawn is also recorded (:class:`WorkerRegistry`); what a previous run
    left is killed by :func:`elasticd.supervise.sweep.sweep_orphans`.

Into a cgroup, or as another user: :data:`PERL_STAGE`, else :data:`CGROUP_STAGE`
    Given a ``cgroup.procs`` descriptor or another user, :func:`start_process`
    execs a short stage first, as root with an empty environment: it joins the
    cgroup (if given) and closes the descriptor, switches user itself (and, in
    Perl, checks the switch in ``/proc/self/status``), sets the parent-death signal and execs
    the resolver with the job's environment (passed in a memfd). The job's
    environment thus still never reaches a process with more privilege than
    the job. The stage is ``perl -e`` where perl is usable (~2 ms to start,
    where ``python -I -S`` takes ~8 ms, paid on every start and restart),
    else ``python -I -S``; a step that fails after the join is reported on
    the verdict pipe (a clear :class:`~elasticd.errors.WorkerSpawnError`),
    and nothing of the job runs. Either reads as ``elasticd-stage`` in ``ps``:
    Perl sets ``$0``; Python runs its program from a memfd of the daemon's (no
    file anyone else could write), the arguments written into the program, so
    its command line is the interpreter, ``/proc/self/fd/N`` and the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from elasticd.errors import SpawnStage, WorkerSpawnError
from elasticd.security import Identity, JobUsers
from elasticd.supervise.env import WITHHELD
from elasticd.supervise.records import WorkerRecord

if TYPE_CHECKING:
    from elasticd.supervise.cgroup import Containment

log = logging.getLogger(__name__)

__all__ = [
    "RESOLVER",
    "SpawnPolicy",
    "WorkerRegistry",
    "DEFAULT_POLICY",
    "live_children",
    "process_env",
    "start_argv",
    "start_process",
    "track",
    "wrap_argv",
]

#: The fallback wrapper: argv is ``ppid executable argv0 args...``. Set the
#: parent-death signal, make sure the parent did not die before that, exec.
PY_WRAPPER = (
    "import ctypes,os,sys\n"
    "if ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)!=0:\n"
    " sys.exit('elasticd: prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid()!=int(sys.argv[1]):os.kill(os.getpid(),9)\n"
    "import _signal as s  # built in: nothing to read, as root or as the job\n"
    "for n in (s.SIGPIPE,s.SIGXFSZ):s.signal(n,s.SIG_DFL)  # as Python set them: not for the job\n"
    "try:os.execv(sys.argv[2],sys.argv[3:])\n"
    "except OSError as e:sys.exit(f'elasticd: cannot start {sys.argv[2]!r}: {e}')\n"
)


#: The first program of a process started into a cgroup or as another user, run as root
#: with an EMPTY environment. Its arguments are ``a``, a list literal written in ahead of
#: it (:func:`python_stage`): ``stage_fd procs_fd env_fd ppid uid gid groups setpriv
#: executable argv0 args...`` (procs_fd -1: no cgroup; uid -1: no switch; setpriv "":
#: none). Program and arguments come in the memfd ``stage_fd``, run by path
#: (:func:`python_stage_argv`), so ``ps`` shows ``python -I -S /proc/self/fd/N
#: elasticd-stage``, not 3 KB of program and the resolver's text; the stage closes that
#: descriptor first, so nothing of the job inherits it. It joins the cgroup through the
#: daemon's descriptor and closes it, reads the environment from ``env_fd`` (``K=V``
#: NUL-separated), switches user, and execs with that environment: through ``setpriv
#: --pdeathsig KILL`` (as :func:`wrap_argv` does; saves importing ctypes here), else
#: setting the parent-death signal itself (after the switch, which clears it) and making
#: sure the parent did not die before that. A failure to join is reported on stdin (the
#: verdict pipe) like the resolver's.
CGROUP_STAGE = (
    "import os,sys\n"
    "os.close(int(a[0]))\n"
    "if int(a[1])>=0:\n"
    " try:os.write(int(a[1]),b'0')\n"
    " except OSError as e:\n"
    "  import errno;n=errno.errorcode.get(e.errno or 5,'EIO').encode()\n"
    "  os.write(0,b'cgroup\\0'+n+b'\\0');sys.exit(127)\n"
    " os.close(int(a[1]))\n"
    "with open(int(a[2]),'rb') as f:d=f.read()\n"
    "env=dict(x.split(b'=',1) for x in d.split(b'\\0') if b'=' in x)\n"
    "if not a[7]:import ctypes  # before the switch: the job's user may not read the stdlib\n"
    "u,g=int(a[4]),int(a[5])\n"
    "def no(w,n):os.write(0,w+b'\\0'+n+b'\\0');sys.exit(127)  # the verdict, as Perl's\n"
    "if u>=0:\n"
    " try:\n"
    "  os.setgroups([int(x) for x in a[6].split(',') if x])\n"
    "  os.setresgid(g,g,g);os.setresuid(u,u,u)\n"
    " except OSError:no(b'user',b'EPERM')\n"
    " if os.getresuid()!=(u,u,u) or os.getresgid()!=(g,g,g):no(b'user',b'EPERM')\n"
    "if a[7]:exe,argv=a[7],[a[7],'--pdeathsig','KILL','--',a[8],*a[10:]]\n"
    "else:\n"
    " if ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)!=0:no(b'pdeathsig',b'EIO')\n"
    " if os.getppid()!=int(a[3]):os.kill(os.getpid(),9)\n"
    " exe,argv=a[8],a[9:]\n"
    "import _signal as s  # built in: nothing to read, as root or as the job\n"
    "for n in (s.SIGPIPE,s.SIGXFSZ):s.signal(n,s.SIG_DFL)  # as Python set them: not for the job\n"
    "try:os.execve(exe,argv,env)\n"
    "except (OSError,ValueError) as e:sys.exit(f'elasticd: cannot start {exe!r}: {e}')\n"
)


#: The Linux system call numbers :data:`PERL_STAGE` needs, by ``uname -m`` (other machines
#: use :data:`CGROUP_STAGE`). ``getpid`` only checks the table on this machine (:func:`find_perl`).
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"setgroups": 116, "setresuid": 117, "setresgid": 119, "prctl": 157, "getpid": 39},
    "aarch64": {"setgroups": 159, "setresuid": 147, "setresgid": 149, "prctl": 167, "getpid": 172},
}

#: :data:`CGROUP_STAGE` in Perl (``perl -e``, ~2 ms to start where ``python -I -S`` takes
#: ~8 ms, on every worker start and restart), with the same argv, the same steps and the same
#: verdicts. Run as root with an EMPTY environment (no ``PERL5LIB``/``PERL5OPT``), it loads no
#: module. The user switch is the kernel's own calls, checked afterwards in
#: ``/proc/self/status`` (real, effective and saved ids, and the supplementary groups), so a
#: process that could regain root never runs anything of the job. Its first statement names
#: the process ``elasticd-stage`` (Perl's ``$0``: the argument area is overwritten, ``comm``
#: set), run as it is parsed: ``ps`` shows the name, not 3 KB of program text.
PERL_STAGE = r"""
BEGIN { $0 = "elasticd-stage" }  # what ps shows of it: a name, not this program's text
my ($pfd, $efd, $ppid, $u, $g, $gs, $sp, $exe, @rest) = @ARGV;
sub fail {  # a verdict on the pipe (fd 0), as the Python stage and the resolver give one
  my ($what, $n) = @_;
  my $v;  # declared apart: a "my" is not visible until the statement after it
  open($v, ">&=", 0) and syswrite($v, "$what\0$n\0");
  exit 127;
}
my %name = (1, "EPERM", 2, "ENOENT", 20, "ENOTDIR", 13, "EACCES");
if ($pfd >= 0) {
  my $p;
  (open($p, ">&=", $pfd) and syswrite($p, "0")) or fail("cgroup", $name{$! + 0} || "EIO");
  close($p);
}
my ($e, $d, $got) = (undef, "", 0);
open($e, "<&=", $efd) or fail("env", "EIO");
while ($got = sysread($e, $d, 65536, length $d)) {}
defined $got or fail("env", "EIO");
close($e);
my %env;
for (split /\0/, $d) { my @kv = split /=/, $_, 2; $env{$kv[0]} = $kv[1] if @kv == 2 }
if ($u >= 0) {
  my @g = grep { length } split /,/, $gs;
  syscall(SETGROUPS, scalar(@g), pack("L*", @g)) == 0 or fail("user", "EPERM");
  syscall(SETRESGID, $g + 0, $g + 0, $g + 0) == 0 or fail("user", "EPERM");
  syscall(SETRESUID, $u + 0, $u + 0, $u + 0) == 0 or fail("user", "EPERM");
  my $s;
  open($s, "<", "/proc/self/status") or fail("user", "EIO");
  my $st = do { local $/; <$s> };
  close($s);
  my ($ids) = $st =~ /^Uid:\s+(.*)$/m;
  my ($gids) = $st =~ /^Gid:\s+(.*)$/m;
  my ($sup) = $st =~ /^Groups:[ \t]*(.*)$/m;
  my @want = sort { $a <=> $b } @g;
  my @have = sort { $a <=> $b } split " ", ($sup // "");
  my @caps = $st =~ /^Cap(?:Prm|Eff|Amb):\s+([0-9a-f]+)$/mg;
  fail("user", "EPERM")
    unless join(" ", split " ", $ids // "") eq "$u $u $u $u"
    and join(" ", split " ", $gids // "") eq "$g $g $g $g"
    and "@want" eq "@have"
    and ($u == 0 or (@caps == 3 and !grep { /[^0]/ } @caps));
}
my @argv;
if (length $sp) {
  @argv = ($sp, "--pdeathsig", "KILL", "--", $exe, @rest[1 .. $#rest]);
  $exe = $sp;
} else {
  syscall(PRCTL, 1, 9, 0, 0, 0) == 0 or fail("pdeathsig", "EIO");
  kill 9, $$ if getppid() != $ppid;
  @argv = @rest;
}
$exe =~ m{^/} or fail("exec", "ENOENT");  # exec {} would search PATH for a bare name
%ENV = %env;
exec { $exe } @argv;
print STDERR "elasticd: cannot start '$exe': $!\n";
exit 1;
"""


def perl_stage() -> str | None:
    """:data:`PERL_STAGE` with this machine's system call numbers; None on another machine."""
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return None
    text = PERL_STAGE
    for name, number in numbers.items():
        text = text.replace(name.upper(), str(number))
    return text


@functools.cache
def find_perl() -> str | None:
    """``perl`` if it is installed and its system calls are this machine's (getpid checked)."""
    stage = perl_stage()
    exe = shutil.which("perl", path=os.defpath + ":/usr/bin:/bin")
    if stage is None or exe is None:
        return None
    getpid = SYSCALLS[os.uname().machine]["getpid"]
    try:
        out = subprocess.run(
            [exe, "-e", f'print syscall({getpid}) == $$ ? "ok" : "no"'],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
            env={},
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if out == "ok" else None


def stage_args(
    executable: str,
    argv: Sequence[str],
    *,
    procs_fd: int,
    env_fd: int,
    identity: Identity | None,
    setpriv: str | None,
) -> list[str]:
    """The arguments of either root stage (:data:`PERL_STAGE`, :data:`CGROUP_STAGE`) that runs
    ``argv`` (program ``executable``); ``procs_fd`` -1: join no cgroup."""
    uid, gid, groups = (
        (-1, -1, "")
        if identity is None
        else (identity.uid, identity.gid, ",".join(str(g) for g in identity.groups))
    )
    return [
        str(procs_fd),
        str(env_fd),
        str(os.getpid()),
        str(uid),
        str(gid),
        groups,
        setpriv or "",
        executable,
        *argv,
    ]


def python_stage(stage_fd: int, args: Sequence[str]) -> bytes:
    """The program the memfd ``stage_fd`` holds: :data:`CGROUP_STAGE` with ``a``, its
    arguments, written in ahead of it (``repr`` of strings: literals, never code)."""
    if any("\0" in arg for arg in args):
        raise ValueError("embedded null byte")  # as on a command line: nothing is cut short
    return f"a={[str(stage_fd), *args]!r}\n{CGROUP_STAGE}".encode()


def python_stage_argv(stage_fd: int) -> list[str]:
    """The command line of :data:`CGROUP_STAGE` held in the memfd ``stage_fd``: the
    interpreter runs it by path (read whole, and closed, before the first statement runs)
    and ``ps`` shows this, a name; ``argv[0]`` stays the interpreter's path, which an
    interpreter that is not where it was built needs to find its standard library."""
    return [sys.executable, "-I", "-S", f"/proc/self/fd/{stage_fd}", "elasticd-stage"]


#: Every process :func:`start_process` started, while the daemon holds it: a child of
#: the daemon that is not one of these was adopted (the subreaper's strays).
_started: weakref.WeakSet[asyncio.subprocess.Process] = weakref.WeakSet()


def live_children() -> set[int]:
    """Pids of the processes :func:`start_process` started that asyncio has not reaped."""
    return {p.pid for p in list(_started) if p.returncode is None}


def track(process: asyncio.subprocess.Process) -> asyncio.subprocess.Process:
    """Count a child started another way (a tool of the daemon's, not a job's: py-spy) among
    :func:`live_children`: its own waiter reaps it, and a re-exec kills it (nobody would
    read its result)."""
    _started.add(process)
    return process


@functools.cache
def find_setpriv() -> str | None:
    """``setpriv`` if it is installed and knows ``--pdeathsig`` (util-linux 2.33 or later)."""
    exe = shutil.which("setpriv", path=os.defpath + ":/usr/bin:/bin")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--help"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if "--pdeathsig" in out else None


def wrap_argv(executable: str, argv: Sequence[str], *, setpriv: str | None) -> list[str]:
    """The command line that runs ``argv`` (program ``executable``) under the parent-death signal.

    With ``setpriv`` the worker's ``argv[0]`` becomes ``executable`` (the path
    it was resolved to); the Python fallback keeps ``argv[0]`` as given.
    """
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "KILL", "--", executable, *argv[1:]]
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        PY_WRAPPER,
        str(os.getpid()),
        executable,
        *argv,
    ]


#: The shell :data:`RESOLVER` runs in (POSIX: always there, runnable by every user).
SH = "/bin/sh"

#: Runs after the wrapper, as the process's own user: ``$1`` is the descriptor
#: the program gets as its stdin ("" for /dev/null), ``$2`` the working folder
#: ("" to stay), ``$3`` the program, the rest its arguments. A failure is
#: written to stdin (a pipe the daemon reads) as ``what NUL ERRNO-NAME NUL
#: path`` and, where a folder on the way is closed to the user (a venv whose
#: ``python`` links into root's 0700 home), ``NUL folder NUL target NUL
#: candidate``: what ``reach`` saw as that user (``[ -d ]``, ``[ -x ]``,
#: ``readlink``), nothing the user could not see itself. The exec swaps stdin
#: for /dev/null (or the descriptor, which it then closes), so EOF alone means
#: it started.
#: ``CDPATH`` never applies (a relative folder gets ``./``); an empty ``PATH``
#: entry is the working folder, as for ``execvp``.
RESOLVER = r"""fail() {
  printf '%s\0%s\0%s\0%s\0%s\0%s' "$1" "$2" "$3" "$4" "$5" "$6" >&0; exit 127; }
reach() {  # why this user cannot reach $1: blk, a folder on the way (after links) it may not
  tgt=$1; blk=; n=0  # enter, and tgt, where the links lead; blk "" when no such folder is seen
  while [ -L "$tgt" ] && [ "$n" -lt 40 ]; do
    l=; for r in /usr/bin/readlink /bin/readlink; do
      [ -x "$r" ] && { l=$("$r" -- "$tgt"); break; }; done
    [ -n "$l" ] || break
    case $l in /*) tgt=$l ;; *) tgt=${tgt%/*}/$l ;; esac; n=$((n + 1))
  done
  case $tgt in /*) p=; r=${tgt#/} ;; *) p=${PWD%/}; r=$tgt ;; esac
  while [ -d "${p:-/}" ]; do
    [ -x "${p:-/}" ] || { blk=${p:-/}; return; }
    [ -n "$r" ] || return
    case $r in */*) c=${r%%/*}; r=${r#*/} ;; *) c=$r; r= ;; esac
    [ -z "$c" ] || p=$p/$c
  done
}
in=$1; cwd=$2; shift 2; blk=; tgt=
case $in in ''|[0-9]) ;; *) fail stdin EBADF "$in" ;; esac
if [ -n "$cwd" ]; then
  case $cwd in /*) dir=$cwd ;; *) dir=./$cwd ;; esac
  cd -- "$dir" 2>/dev/null || {
    reach "$dir"; [ -z "$blk" ] || fail cwd EACCES "$cwd" "$blk" "$tgt" "$dir"
    [ -e "$dir" ] || fail cwd ENOENT "$cwd"; [ -d "$dir" ] || fail cwd ENOTDIR "$cwd"
    fail cwd EACCES "$cwd"; }
fi
case $1 in
*/*) exe=$1 ;;
*) exe=; IFS=:; set -f
  for dir in $PATH; do
    if [ -f "${dir:-.}/$1" ] && [ -x "${dir:-.}/$1" ]; then exe=${dir:-.}/$1; break; fi
  done
  if [ -z "$exe" ]; then  # only on a failure: does a folder closed to this user hide it?
    for dir in $PATH; do reach "${dir:-.}/$1"; [ -z "$blk" ] || { at=${dir:-.}/$1; break; }; done
  fi
  unset IFS; set +f
  [ -n "$exe" ] || [ -z "$blk" ] || fail path EACCES "$1" "$blk" "$tgt" "$at"
  [ -n "$exe" ] || fail path ENOENT "$1" ;;
esac
[ -e "$exe" ] || { reach "$exe"; [ -z "$blk" ] || fail program EACCES "$exe" "$blk" "$tgt" "$exe"; }
[ -e "$exe" ] || fail program ENOENT "$exe"
[ -d "$exe" ] && fail program EACCES "$exe"
[ -x "$exe" ] || fail program EACCES "$exe"
shift
[ -z "$in" ] && exec "$exe" "$@" </dev/null
eval "exec \"\$exe\" \"\$@\" <&$in $in<&-"
"""
#: How long the daemon waits for the resolver's verdict; past it the program
#: counts as started (only the job's own code, e.g. its LD_PRELOAD, can delay it).
VERDICT_TIMEOUT = 30.0

#: The most of a verdict that is read.
_VERDICT_BYTES = 8192

#: The errors :data:`RESOLVER` reports, by name.
_VERDICT_ERRORS = {"ENOENT": errno.ENOENT, "ENOTDIR": errno.ENOTDIR, "EACCES": errno.EACCES}

#: The steps of :data:`PERL_STAGE` after the cgroup's that report a failure, as a verdict.
_STAGE_STEPS = {
    "env": "read the job's environment",
    "user": "switch to the job's user (or the switch did not hold)",
    "pdeathsig": "set the parent-death signal",
    "exec": "find its next program",
}


#: Where :data:`STDIN_MOVER` puts a worker's stdin for the resolver: dash (``/bin/sh``
#: on Debian) names only descriptors 0 to 9 in a redirection.
STDIN_SLOT = 9

#: Run before the resolver when a worker gets a stdin: argv is ``fd program args...``;
#: moves ``fd`` (any number) to :data:`STDIN_SLOT` and execs the rest. Nothing else is
#: open in the child by then (the cgroup stage has closed its descriptors).
STDIN_MOVER = (
    "import os,sys\n"
    "n=int(sys.argv[1])\n"
    f"if n!={STDIN_SLOT}:os.dup2(n,{STDIN_SLOT});os.close(n)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


def resolver_argv(
    argv: Sequence[str], cwd: str | None, stdin: int | None = None
) -> tuple[str, list[str]]:
    """(program, argv) that start ``argv`` in ``cwd`` through :data:`RESOLVER`, with
    ``stdin`` (None: /dev/null) moved to 0 by :data:`STDIN_MOVER` and the resolver."""
    if stdin is None:
        return SH, [SH, "-c", RESOLVER, "elasticd-start", "", cwd or "", *argv]
    resolver = [SH, "-c", RESOLVER, "elasticd-start", str(STDIN_SLOT), cwd or "", *argv]
    return sys.executable, [sys.executable, "-I", "-S", "-c", STDIN_MOVER, str(stdin), *resolver]


def start_argv(argv: Sequence[str], cwd: str | None, *, setpriv: str | None) -> list[str]:
    """The command line that starts ``argv`` in ``cwd`` through the wrapper and :data:`RESOLVER`."""
    return wrap_argv(*resolver_argv(argv, cwd), setpriv=setpriv)


async def start_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    identity: Identity | None,
    cwd: str | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    policy: SpawnPolicy | None = None,
    cgroup_procs: int | None = None,
    stdin: int | None = None,
    umask: int | None = None,
) -> asyncio.subprocess.Process:
    """Start ``argv`` as ``identity`` (None: as the daemon), the one way anything is started.

    ``env`` is the complete environment, less :data:`WITHHELD` (plus the
    user's ``HOME``, ``USER``, ``LOGNAME`` when switching). The process leads
    its own session (so its own process group) and gets the parent-death
    signal. ``argv[0]`` without a slash is looked up on ``env["PATH"]``, and
    ``cwd`` entered, by the process itself, as its user. Returns once the
    program runs; raises :class:`~elasticd.errors.WorkerSpawnError` (its
    cause an ``OSError`` when there is one) when it cannot be started.
    ``stdout``/``stderr`` are file descriptors or ``asyncio.subprocess`` constants.
    ``cgroup_procs``, a descriptor of a cgroup's ``cgroup.procs`` opened by the
    daemon, puts the process in that cgroup before anything of the job runs
    (:data:`CGROUP_STAGE`; :mod:`elasticd.supervise.cgroup`). ``stdin``, a
    descriptor, becomes the program's stdin (None: ``/dev/null``); it is
    passed down under its own number and moved to 0 just before the program
    runs (:data:`STDIN_MOVER`, then the resolver), because until then the
    process's 0 is the verdict pipe. ``umask`` (None: the daemon's own) is set in
    the child between fork and exec, in C, so every program after it has it: the
    wrapper, the root stage (Perl or Python) and the user switch keep a umask
    (``execve`` and ``setresuid`` never change it), and so the job's program
    starts with it on each path.
    """
    if umask is not None and not 0 <= umask <= 0o777:
        raise ValueError(f"umask {umask:#o} is out of range")
    policy = policy or DEFAULT_POLICY
    argv = [str(arg) for arg in argv]
    full_env = process_env(env, identity)
    program, resolver = resolver_argv(argv, cwd, stdin)
    env_fd: int | None = None
    stage_fd: int | None = None
    pass_fds: tuple[int, ...] = () if stdin is None else (stdin,)
    if cgroup_procs is None and identity is None:
        command = wrap_argv(program, resolver, setpriv=policy.wrapper())
        exec_env = full_env
    else:
        # The stage runs as root: it gets an empty environment, the job's comes in a
        # memfd, and the user switch is the stage's own, never subprocess's (its
        # user=/group=/extra_groups= make it fork() where it would vfork(): see the
        # module docstring, "On the event loop's thread").
        try:
            env_fd = _memfd("elasticd-env", lambda _fd: _env_bytes(full_env))
        except OSError as exc:  # EMFILE, ENOMEM: the node's, not the job's
            raise WorkerSpawnError(
                f"cannot start {argv[0]!r}: no memfd for its environment: {exc}",
                stage=SpawnStage.FORK,
            ) from exc
        args = stage_args(
            program,
            resolver,
            procs_fd=-1 if cgroup_procs is None else cgroup_procs,
            env_fd=env_fd,
            identity=identity,
            setpriv=policy.wrapper(),
        )
        perl = policy.perl()
        perl_text = perl_stage() if perl is not None else None
        if perl is not None and perl_text is not None:
            command = [perl, "-e", perl_text, "--", *args]
        else:
            try:
                stage_fd = _memfd("elasticd-stage", functools.partial(python_stage, args=args))
            except (OSError, ValueError) as exc:  # no memfd (the node's), a NUL in argv
                os.close(env_fd)
                raise WorkerSpawnError(
                    f"cannot start {argv[0]!r}: {exc}", stage=SpawnStage.FORK
                ) from exc
            command = python_stage_argv(stage_fd)
            pass_fds = (*pass_fds, stage_fd)
        exec_env = {}
        pass_fds = (*pass_fds, *(() if cgroup_procs is None else (cgroup_procs,)), env_fd)
    try:
        verdict_r, verdict_w = os.pipe()
    except OSError as exc:  # EMFILE, ENFILE: the node's, not the job's
        for fd in (env_fd, stage_fd):
            if fd is not None:
                os.close(fd)
        raise WorkerSpawnError(
            f"cannot start {argv[0]!r}: no pipe for its start: {exc}", stage=SpawnStage.FORK
        ) from exc
    try:
        try:
            process = await asyncio.create_subprocess_exec(
                command[0],
                *command[1:],
                stdin=verdict_w,
                stdout=stdout,
                stderr=stderr,
                env=exec_env,
                # Own session, so own process group: signals reach the program's
                # children too, and a terminal's Ctrl-C on the daemon does not.
                start_new_session=True,
                pass_fds=pass_fds,
                umask=-1 if umask is None else umask,
            )
        except (OSError, ValueError) as exc:
            raise WorkerSpawnError(
                f"cannot start {argv[0]!r}: {exc}", stage=SpawnStage.FORK
            ) from exc
        finally:
            os.close(verdict_w)  # the child has its copy; ours would keep EOF away
            for fd in (env_fd, stage_fd):
                if fd is not None:
                    os.close(fd)
        _started.add(process)
        try:
            verdict = await _read_verdict(verdict_r)
        except BaseException:
            await _discard(process)  # cancelled: leave no process behind
            raise
    finally:
        os.close(verdict_r)
    if not verdict:
        return process
    await _discard(process)  # the resolver exits 127 right after its verdict
    user = identity.user if identity is not None else _my_name()
    raise _verdict_error(verdict, argv, cwd, full_env.get("PATH", os.defpath), user)


def process_env(env: Mapping[str, str], identity: Identity | None) -> dict[str, str]:
    """The environment a process started as ``identity`` with ``env`` gets (pure)."""
    full_env = {k: v for k, v in env.items() if k not in WITHHELD}
    if identity is not None:
        full_env.update(identity.env())
    return full_env


def _env_bytes(env: Mapping[str, str]) -> bytes:
    """``env`` as the stages read it: ``K=V`` NUL-separated."""
    return b"\0".join(f"{k}={v}".encode("utf-8", "surrogateescape") for k, v in env.items())


def _memfd(name: str, content: Callable[[int], bytes]) -> int:
    """A memfd holding ``content(fd)`` (given its own number), read from the start by a stage."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(content(fd))
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _discard(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await asyncio.shield(process.wait())


async def _read_verdict(fd: int) -> bytes:
    """Everything written to the pipe ``fd`` until EOF (or :data:`VERDICT_TIMEOUT`)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = bytearray()
    eof: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            data.extend(chunk[: max(0, _VERDICT_BYTES - len(data))])
        elif not eof.done():
            eof.set_result(None)

    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(VERDICT_TIMEOUT):
            await eof
    except TimeoutError:
        log.warning(
            "no word from a starting process within %g s; taking it as started", VERDICT_TIMEOUT
        )
    finally:
        loop.remove_reader(fd)
    return bytes(data)


def _verdict_error(
    verdict: bytes, argv: Sequence[str], cwd: str | None, search_path: str, user: str
) -> WorkerSpawnError:
    # Written by a process of the job's (its LD_PRELOAD could write anything): parse, never trust.
    parts = verdict.decode("utf-8", "replace").split("\0")
    what, name, path, closed, target, candidate = (parts + [""] * 6)[:6]
    code = _VERDICT_ERRORS.get(name, errno.EACCES)
    cause = OSError(code, os.strerror(code), path)
    if what == "cgroup":
        error = WorkerSpawnError(
            f"cannot start {argv[0]!r}: cannot join its cgroup: {cause}",
            stage=SpawnStage.JOIN_CGROUP,
        )
        error.__cause__ = cause
        return error
    if what in _STAGE_STEPS:
        return WorkerSpawnError(
            f"cannot start {argv[0]!r}: the start stage failed to {_STAGE_STEPS[what]}",
            stage=SpawnStage.STAGE,
        )
    unreachable = _unreachable(user, closed, target, candidate) if closed else ""
    if what == "path":
        return WorkerSpawnError(
            f"cannot start {argv[0]!r} as user {user}: no executable of that name on its PATH "
            f"({search_path}){unreachable}",
            stage=SpawnStage.PROGRAM,
        )
    where = "the working folder" if what == "cwd" else "the program"
    error = WorkerSpawnError(
        f"cannot start {argv[0]!r} (cwd {cwd!r}) as user {user}: {where}: "
        f"{unreachable.removeprefix(': ') or cause}",
        stage=SpawnStage.CWD if what == "cwd" else SpawnStage.PROGRAM,
    )
    error.__cause__ = cause
    return error


def _unreachable(user: str, closed: str, target: str, candidate: str) -> str:
    """Why ``user`` cannot reach ``candidate``: ``closed``, a folder on the way to ``target``
    (where its links lead), is one it may not enter. Only what the user sees itself."""
    via = f"{candidate}, which leads to {target}" if candidate and candidate != target else target
    return (
        f": it may be there, but user {user} cannot reach {via}: {user} may not enter "
        f"{closed}; put the program (a venv, its python) where {user} can reach it, or run "
        "the job as a user who can"
    )


# -- the registry of spawned workers -----------------------------------------------


class WorkerRegistry(Protocol):
    """Where spawned workers are recorded (the daemon's :class:`elasticd.node.db.Database`)."""

    def record_worker(self, record: WorkerRecord) -> None: ...

    def forget_workers(self, pids: Sequence[tuple[int, int]]) -> None: ...

    def recorded_workers(self) -> list[WorkerRecord]: ...


@dataclass(frozen=True)
class SpawnPolicy:
    """What the daemon decides about every worker spawn on this node."""

    users: JobUsers | None = None
    """Who jobs run as; None: as the daemon itself, whatever they ask."""
    registry: WorkerRegistry | None = None
    """Records every spawn for the start-up sweep; None: nothing recorded."""
    setpriv: str | None | bool = True
    """True: ``setpriv`` when usable, else the Python wrapper; a path; False: always Python."""
    containment: Containment | None = None
    """Puts each worker group in a cgroup of its own (or says it cannot); None: nothing."""
    stage: str | bool = True
    """The root stage of a start into a cgroup: True: :data:`PERL_STAGE` when ``perl`` is
    usable (:func:`find_perl`), else :data:`CGROUP_STAGE`; a path to perl; False: Python."""
    worker_stdin: int | None = None
    """A descriptor every worker gets as its stdin; None: ``/dev/null``. Only ``elasticd
    run``'s embedded daemon sets it (its own stdin, the same user's, as torchrun passes
    it on); a daemon serving jobs never does: it would hand its terminal to a job."""

    def wrapper(self) -> str | None:
        if self.setpriv is True:
            return find_setpriv()
        if self.setpriv is False:
            return None
        return self.setpriv

    def warm(self) -> None:
        """Probe the wrapper and the root stage now (cached), so no spawn waits for it."""
        self.wrapper()
        if self.containment is not None:
            self.perl()

    def perl(self) -> str | None:
        if self.stage is True:
            return find_perl()
        if self.stage is False:
            return None
        return self.stage

    def identity_for(
        self,
        requested: str | None,
        *,
        owner_user: str | None = None,
        job_id: str | None = None,
    ) -> Identity | None:
        """Who the job ``job_id``, asking for ``requested``, runs as (:meth:`JobUsers.for_job`)."""
        if self.users is None:
            if requested is not None and requested != _my_name():
                raise WorkerSpawnError(
                    f"the job asks to run as {requested!r}; this daemon runs jobs as itself",
                    stage=SpawnStage.USER,
                )
            return None
        return self.users.for_job(requested, owner_user=owner_user, job_id=job_id)

    def release_job(self, job_id: str) -> None:
        """The job's agent on this node has ended: its own uid, if it had one, is free again."""
        if self.users is not None:
            self.users.release(job_id)


def _my_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


#: The policy of a spawn that names none: jobs run as the spawner, nothing recorded or contained.
DEFAULT_POLICY = SpawnPolicy()
