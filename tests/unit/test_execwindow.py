"""The re-exec's window (elasticd.node.execwindow): signals held across a real ``execve``, the
hand-over read early without taking it, the test hook's delay, and the state lock adopted
only where it is that folder's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.node.execwindow import HandoverPeek, peek_handover, slow_image_delay
from elasticd.node.reexec import ADOPTS, Preflight, check_install
from elasticd.node.statelock import StateLock

#: Holds the signals, has SIGTERM and SIGHUP sent to itself (a thread is running, as in the
#: daemon), pends what it noted and execs into a program that prints what is pending.
EXECS_HOLDING = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from elasticd.node.execwindow import HeldSignals
    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
    held = HeldSignals()
    held.hold()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(0.2)  # a thread may take them: the handler notes them on the main thread
    held.pend()
    after = "import signal; print(sorted(int(s) for s in signal.sigpending()))"
    os.execv(sys.executable, [sys.executable, "-c", after])
    """
)


def test_signals_held_before_an_exec_are_pending_after_it() -> None:
    """SIGTERM and SIGHUP sent while held reach the exec'd program as pending signals (not
    lost, not fatal), whichever thread the kernel handed them to."""
    done = subprocess.run(
        [sys.executable, "-c", EXECS_HOLDING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == sorted([1, 15]), done


@pytest.mark.parametrize(
    ("doc", "peek"),
    [
        ({"lease": 7, "renewed_at": 1.5, "exec_at": 2.0}, HandoverPeek(7, 1.5, 2.0)),
        ({"lease": None}, HandoverPeek(None, None, None)),
        ("not a manifest", None),
    ],
)
def test_the_handover_is_read_early_without_taking_it(doc: object, peek: object) -> None:
    """The early start reads the lease and the times from the hand-over's descriptor and
    leaves it where it is (take_manifest reads it again)."""
    fd = os.memfd_create("test-handover", 0)
    try:
        os.write(fd, json.dumps(doc).encode())
        assert peek_handover({"ELASTICD_REEXEC_FD": str(fd)}) == peek
        assert os.pread(fd, 100, 0) == json.dumps(doc).encode()[:100]
    finally:
        os.close(fd)
    assert peek_handover({}) is None


@pytest.mark.parametrize(
    ("value", "delay"), [(None, 0.0), ("", 0.0), ("2.5", 2.5), ("-1", 0.0), ("soon", 0.0)]
)
def test_the_slow_image_delay_is_a_number_of_seconds(value: str | None, delay: float) -> None:
    environ = {} if value is None else {"ELASTICD_TEST_REEXEC_DELAY": value}
    assert slow_image_delay(environ) == delay


def test_the_state_lock_is_adopted_only_from_that_folders_lock(tmp_path: Path) -> None:
    """The descriptor handed over is adopted where it is the folder's locked lock file (made
    close-on-exec again); another file's descriptor is refused (and closed)."""
    held = StateLock(tmp_path / "a").acquire()
    copy = os.dup(held.fileno())
    os.set_inheritable(copy, True)
    adopted = StateLock.adopt(tmp_path / "a", copy)
    assert adopted.held and not os.get_inheritable(adopted.fileno())
    with pytest.raises(ConfigError, match="busy|in use"):
        StateLock(tmp_path / "a").acquire()
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    with pytest.raises(ConfigError, match="is not the lock file"):
        StateLock.adopt(tmp_path / "a", other)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(other)  # closed
    adopted.release()
    held.release()


#: An image that does not adopt held signals (one from before issue 34) gets none held:
#: SIGHUP is ignored across the exec, nothing stays blocked, nothing is carried.
EXECS_TO_AN_OLDER_IMAGE = textwrap.dedent(
    """
    import os, signal, sys
    from elasticd.node.execwindow import HeldSignals
    held = HeldSignals.ignoring_reloads()
    held.hold()
    assert held.carry() is None
    held.pend([signal.SIGTERM])  # a stop asked meanwhile: not sent to this image
    after = '''
    import os, signal
    os.kill(os.getpid(), signal.SIGHUP)  # a second reload in the window: ignored, not fatal
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(sorted(int(s) for s in blocked), "ELASTICD_REEXEC_SIGNALS_FD" in os.environ)
    '''
    os.execv(sys.executable, [sys.executable, "-c", after])
    """
)


def test_an_image_that_does_not_adopt_held_signals_is_not_left_blocking_them() -> None:
    """Issue 34, downgrade: an older image would keep HUP, TERM and INT blocked for good
    (nothing unblocks them there); it gets them unblocked, with SIGHUP ignored until it
    installs its handler, so a reload storm across the exec does not kill it."""
    done = subprocess.run(
        [sys.executable, "-c", EXECS_TO_AN_OLDER_IMAGE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done
    assert done.stdout.split() == ["[]", "False"], done


@pytest.mark.parametrize(
    ("output", "version", "adopts"),
    [
        ("elasticd 0.1.0\n", "0.1.0", frozenset()),  # an image from before issue 34
        (
            "elasticd-adopts: held_signals,lock_fd\nelasticd 0.2.0\n",
            "0.2.0",
            frozenset({"held_signals", "lock_fd"}),
        ),
        ("some warning\nelasticd-adopts: lock_fd\nelasticd 0.3\n", "0.3", frozenset({"lock_fd"})),
        ("", "unknown", frozenset()),
    ],
)
def test_the_preflight_says_what_the_new_image_adopts(
    output: str, version: str, adopts: frozenset[str]
) -> None:
    assert Preflight.parse(output) == Preflight(version, adopts)


def test_this_image_adopts_everything_it_hands_over(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--check`` announces each thing the re-exec hands over (so an upgrade from this
    image to this image keeps the window closed)."""
    from elasticd.config import load_config

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = load_config({"state_dir": str(state), "node_name": "n", "port": 0}, environ={})
    assert check_install(config) == 0, capsys.readouterr()
    assert Preflight.parse(capsys.readouterr().out).adopts == frozenset(ADOPTS)
