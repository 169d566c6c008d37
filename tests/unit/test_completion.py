"""`elasticd completion bash|zsh|fish`, run in the real shells: commands, flags, choices,
and job ids asked of a live daemon (nothing, and no error, when none answers)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd import cli
from elasticd.client import Client
from elasticd.completion import job_commands
from tests.conftest import PY
from tests.observability.support import live_daemon, url_of

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

#: Stand-ins for zsh's completion builtins outside a completion widget: what would be
#: offered is printed, one a line (``_files`` as FILES).
ZSH_STUBS = """
compadd() { while [[ $1 == -* && $1 != -- ]]; do shift; done; [[ $1 == -- ]] && shift
            printf '%s\\n' "$@"; }
_files() { print FILES; }
compdef() { :; }
"""


def _env(url: str, token_file: Path | None = None) -> dict[str, str]:
    """The shell's environment: this elasticd first on PATH, told where the daemon is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["ELASTICD_URL"] = url
    if token_file is not None:
        env["ELASTICD_TOKEN_FILE"] = str(token_file)
    return env


def script(shell: str, tmp_path: Path) -> Path:
    made = subprocess.run(
        [sys.executable, "-m", "elasticd", "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env("http://127.0.0.1:1"),
    )
    assert made.returncode == 0, made.stderr
    path = tmp_path / f"elasticd.{shell}"
    path.write_text(made.stdout)
    return path


def offered(shell: str, path: Path, env: dict[str, str], *words: str) -> list[str]:
    """What ``shell`` offers for the last of ``words`` (the line typed so far)."""
    if shell == "bash":
        line = " ".join(f"'{w}'" for w in words)
        program = (
            f"source {path}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n"
            '_elasticd; printf "%s\\n" "${COMPREPLY[@]}"\n'
        )
        argv = ["bash", "--norc", "--noprofile", "-c", program]
    elif shell == "zsh":
        line = " ".join(f"'{w}'" for w in words)
        program = f"{ZSH_STUBS}source {path}\nwords=({line}); CURRENT={len(words)}\n_elasticd\n"
        argv = ["zsh", "-f", "-c", program]
    else:
        typed = " ".join(words)
        argv = ["fish", "--no-config", "-c", f"source {path}; complete -C '{typed}'"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    found = [line.split("\t")[0] for line in done.stdout.splitlines() if line]
    # zsh's compadd filters by what is typed; its stand-in does not.
    return sorted(w for w in found if shell != "zsh" or w.startswith(words[-1]) or w == "FILES")


def _shell(name: str) -> pytest.param:
    """A shell to run the script in: skipped where it is missing, except in CI (.ci/run
    installs zsh and fish), where a missing shell fails its tests."""
    missing = shutil.which(name) is None and not os.environ.get("CI")
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"no {name}"))


SHELLS = [_shell("bash"), _shell("zsh"), _shell("fish")]


@pytest.mark.parametrize("shell", SHELLS)
def test_every_shell_completes_commands_flags_and_choices(shell, tmp_path):
    """Each shell's script, run in that shell, completes commands, a command's flags and a
    flag's or positional's choices, all read from the parser."""
    path = script(shell, tmp_path)
    env = _env("http://127.0.0.1:1")
    assert offered(shell, path, env, "elasticd", "de") == ["delete"]
    assert offered(shell, path, env, "elasticd", "logs", "j", "--n") == ["--node"]
    assert offered(shell, path, env, "elasticd", "logs", "j", "--stream", "") == [
        "stderr",
        "stdout",
    ]
    assert "--progress-timeout" in offered(shell, path, env, "elasticd", "submit", "--pro")
    assert offered(shell, path, env, "elasticd", "completion", "") == ["bash", "fish", "zsh"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_commands_that_take_a_job_id_are_read_from_the_parser():
    """Every command whose first positional is the job id, and no other."""
    assert job_commands(cli.build_parser()) == [
        "cancel",
        "delete",
        "events",
        "goodput",
        "logs",
        "status",
        "workers",
    ]


@pytest.mark.parametrize("shell", SHELLS)
async def test_job_ids_complete_from_the_daemon_and_nothing_when_it_is_away(shell, tmp_path):
    """`elasticd status <TAB>` offers the daemon's job ids (not once the id is typed, nor as
    a flag's value); with no daemon it offers nothing and prints no error."""
    path = script(shell, tmp_path)
    d = live_daemon(tmp_path)
    async with asyncio.timeout(60):
        await d.start()
        try:
            with Client(url_of(d), token=d.token) as c:
                for job_id in ("train-a", "train-b"):
                    await asyncio.to_thread(
                        c.submit, {"id": job_id, "entrypoint": PY, "args": ["-c", "pass"]}
                    )
            env = _env(url_of(d), d.token_path)

            def ask(*words: str) -> list[str]:
                return offered(shell, path, env, "elasticd", *words)

            assert await asyncio.to_thread(ask, "status", "") == ["train-a", "train-b"]
            assert await asyncio.to_thread(ask, "logs", "--follow", "train-") == [
                "train-a",
                "train-b",
            ]
            assert "train-a" not in await asyncio.to_thread(ask, "status", "train-a", "")
            assert "train-a" not in await asyncio.to_thread(ask, "logs", "--node", "")
        finally:
            await d.shutdown()
    away = _env(f"http://127.0.0.1:{closed_port()}")
    assert offered(shell, path, away, "elasticd", "cancel", "") in ([], ["FILES"])
