"""A standby interpreter: imports a job's modules, waits, then becomes a worker (issue 27).

The daemon (:mod:`elasticd.supervise.standby`) starts it while an attempt runs,
the way it starts a worker (the job's user, interpreter and options, working
folder, umask), as ``<python> <options> -c <this file's text> <spec>``: its
text is passed, never imported, so the job's interpreter needs no elasticd and
none of it stays in ``sys.modules``. It runs in a namespace of its own, not in
``__main__``, which it leaves as the interpreter made it.

Before the hand-off
    Descriptor 0 is the control socket (a socketpair with the daemon); it is
    moved aside and 0 becomes ``/dev/null``; 1 and 2 are ``/dev/null``: the
    standby writes nothing anywhere and opens no file of the job. It imports
    the spec's modules (never initialising CUDA: it only imports), says
    ``{"ready": true}`` (or why not) as a JSON line, and blocks reading the
    socket. EOF there (the daemon discarded it, or died) ends it.

The hand-off
    A length line and a JSON body (never pickle) come with the descriptors of
    the worker's stdout and stderr pipes (and its stdin, if it has one) as
    ``SCM_RIGHTS``: they become 1, 2 (and 0); ``os.environ`` becomes the
    worker's (the round's variables included), with the edits the start
    shell made to the standby's own; one byte answers, the socket is closed,
    and the program runs as a cold start would have run it: ``sys.argv``,
    ``sys.orig_argv``, ``sys.path[0]``, a pristine ``__main__`` with
    ``__file__`` and its loader (a script), or :mod:`runpy`'s
    ``_run_module_as_main`` (``-m``, what the interpreter itself calls).

Which side of the boundary: the job's (the job's user, the job's interpreter);
standard library only.
"""

from __future__ import annotations

import __main__

PRISTINE = dict(__main__.__dict__)  # before anything of the standby's: as the interpreter made it

import json  # noqa: E402 - after the snapshot above
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

#: The most descriptors a hand-off carries: stdout, stderr, stdin.
MAX_FDS = 3


def path0(kind: str, target: str) -> str | None:
    """What the interpreter puts first on ``sys.path`` for this program (None: nothing)."""
    if sys.flags.safe_path:
        return None
    if kind == "module":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(target))


def environment(
    given: dict[str, str], had: dict[str, str], wanted: dict[str, str]
) -> dict[str, str]:
    """``wanted``, with the start shell's edits: what it changed of ``given`` into ``had``."""
    env = dict(wanted)
    for name, value in had.items():
        if given.get(name) != value:
            env[name] = value  # e.g. PWD, set by the shell's cd
    for name in given:
        if name not in had:
            env.pop(name, None)
    return env


def send(ctl: socket.socket, message: dict[str, Any]) -> None:
    ctl.sendall(json.dumps(message).encode() + b"\n")


def receive(ctl: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The hand-off: its JSON and descriptors; None at EOF (discarded)."""
    data, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 16, MAX_FDS)
    while b"\n" not in data:
        if not data:
            return None
        more = ctl.recv(1 << 16)
        if not more:
            return None
        data += more
    head, _, body = data.partition(b"\n")
    size = int(head)
    while len(body) < size:
        more = ctl.recv(size - len(body))
        if not more:
            return None
        body += more
    return json.loads(body), fds


def main() -> None:
    spec = json.loads(sys.argv[1])
    ctl = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    had = dict(os.environ)
    first = path0(spec["kind"], spec["target"])
    if first is not None and sys.path:
        sys.path[0] = first  # the program's, so the imports find what a cold start finds
    try:
        for name in spec["modules"]:
            __import__(name)
    except BaseException as exc:  # noqa: BLE001 - reported to the daemon, which starts cold
        send(ctl, {"ready": False, "error": f"import {name}: {type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
    send(ctl, {"ready": True})
    got = receive(ctl)
    if got is None:
        raise SystemExit(0)
    message, fds = got
    for target, fd in zip((1, 2, 0), fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environment(message["given"], had, message["env"]))
    ctl.sendall(b"1")
    ctl.close()
    run(spec, message)


def run(spec: dict[str, Any], message: dict[str, Any]) -> None:
    """Run the program as ``python <options> <target> <rest>`` would."""
    kind, target, rest = spec["kind"], spec["target"], list(message["rest"])
    sys.orig_argv[1:] = list(message["args"])
    namespace = __main__.__dict__
    namespace.clear()
    namespace.update(PRISTINE)
    if kind == "module":
        import runpy

        sys.argv[:] = ["-m", *rest]
        try:
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - as the interpreter reports it
            report(exc)
        return
    path = os.path.abspath(target)
    sys.argv[:] = [target, *rest]
    try:
        with open(path, "rb") as source:
            text = source.read()
    except OSError as exc:
        # What the interpreter says (Modules/main.c, pymain_run_file), and its exit code 2.
        sys.stderr.write(
            f"{sys.orig_argv[0]}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n"
        )
        sys.stderr.flush()
        raise SystemExit(2) from None
    # The loader class the interpreter itself uses for a script, without importing anything.
    loader = sys.modules["_frozen_importlib_external"].SourceFileLoader
    namespace.update(__file__=path, __cached__=None, __loader__=loader("__main__", path))
    try:
        exec(compile(text, path, "exec"), namespace)  # a SyntaxError too: as the interpreter
    except Exception as exc:  # noqa: BLE001 - as the interpreter reports it
        report(exc)


def report(exc: BaseException) -> None:
    """An uncaught exception: the hook prints it (without the standby's frames), exit 1."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals is globals():
        tb = tb.tb_next
    # On the exception too: given no traceback (a SyntaxError from compile() has only the
    # standby's frame), the hook would print the exception's own, the standby's frames in it.
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    raise SystemExit(1)


if __name__ == "elasticd_standby":
    main()
