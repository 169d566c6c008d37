"""The `elasticd` parser: every flag explains itself, the bash completion made from it works in
a real bash, and `logs --rank` finds a global rank's node and local rank."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticd import cli, cli_commands
from elasticd.completion import command_flags
from elasticd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def walk(parser: argparse.ArgumentParser, path: str = "elasticd"):
    """(command path, action) for every argument of every command, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_flag_and_argument_has_help():
    """No option or positional of any command is left without a help text."""
    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, action in walk(cli.build_parser())
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert missing == []


def test_the_help_walk_sees_a_flag_without_help():
    """The walk above can fail: a flag added without help is reported."""
    parser = cli.build_parser()
    parser.add_argument("--bare")
    assert any(action.dest == "bare" and not action.help for _, action in walk(parser))


def test_max_restarts_help_says_why_run_and_submit_differ():
    """run defaults to 0 (torchrun's) and submit to 3 (a service's); each help says both."""
    parser = cli.build_parser()
    assert parser.parse_args(["run", "--", "true"]).max_restarts == 0
    for text in (cli.RUN_MAX_RESTARTS_HELP, cli_commands.SUBMIT_MAX_RESTARTS_HELP):
        assert "0" in text and "3" in text and "torchrun" in text


def workers_view(*groups: tuple[str, list[tuple[int, int]]]) -> SimpleNamespace:
    return SimpleNamespace(
        job_id="j",
        groups=[
            SimpleNamespace(
                node=node, workers=[SimpleNamespace(rank=r, local_rank=lr) for r, lr in ranks]
            )
            for node, ranks in groups
        ],
    )


def test_a_global_rank_is_found_on_its_node():
    """Global rank 3 of two 2-worker nodes is local rank 1 on the second node."""
    view = workers_view(("n0", [(0, 0), (1, 1)]), ("n1", [(2, 0), (3, 1)]))
    assert cli_commands.rank_location(view, 3) == ("n1", 1)
    assert cli_commands.rank_location(view, 0) == ("n0", 0)
    with pytest.raises(ConfigError, match="no rank 4 in its current round \\(ranks 0-3\\)"):
        cli_commands.rank_location(view, 4)
    with pytest.raises(ConfigError, match="no workers yet"):
        cli_commands.rank_location(workers_view(), 0)


def test_logs_rank_and_local_rank_exclude_each_other(capsys):
    """--rank is the global rank; giving it with --local-rank is refused by the parser."""
    parser = cli.build_parser()
    assert parser.parse_args(["logs", "j", "--rank", "5"]).rank == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["logs", "j", "--rank", "5", "--local-rank", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def complete(script: Path, *words: str) -> list[str]:
    """What the completion offers for the last of ``words``, asked of a real bash."""
    line = " ".join(f"'{w}'" for w in words)
    program = (
        f"source {script}\n"
        f"COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n"
        "_elasticd; printf '%s\\n' \"${COMPREPLY[@]}\"\n"
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.splitlines() if w]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completion_from_the_parser_completes_commands_flags_and_choices(tmp_path):
    """`elasticd completion bash`, sourced in bash: registered for elasticd, and it completes
    commands, a command's flags and a flag's choices, all read from the parser."""
    made = subprocess.run(
        [sys.executable, "-m", "elasticd", "completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert made.returncode == 0, made.stderr
    script = tmp_path / "elasticd.bash"
    script.write_text(made.stdout)
    registered = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", f"source {script}; complete -p elasticd"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert registered.stdout.strip() == "complete -o filenames -F _elasticd elasticd"

    top = [*(c for c in command_flags(cli.build_parser()) if c), "--help", "--verbose"]
    assert sorted(complete(script, "elasticd", "")) == sorted([*top, "--version", "-h", "-v"])
    assert complete(script, "elasticd", "de") == ["delete"]
    assert complete(script, "elasticd", "logs", "j", "--n") == ["--node"]
    assert complete(script, "elasticd", "logs", "j", "--stream", "") == ["stdout", "stderr"]
    assert complete(script, "elasticd", "install-service", "--d") == ["--dry-run"]
    assert "--max-restarts" in complete(script, "elasticd", "run", "--max")
    assert complete(script, "elasticd", "completion", "") == ["bash", "zsh", "fish"]  # choices
