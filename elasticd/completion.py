"""Shell completion for the ``elasticd`` command, generated from its argparse parser.

``elasticd completion bash|zsh|fish`` prints the script (``source <(elasticd
completion bash)``; zsh: ``source <(elasticd completion zsh)`` or save it as
``_elasticd`` on ``$fpath``; fish: ``elasticd completion fish | source`` or save
it as ``~/.config/fish/completions/elasticd.fish``). It is made from the parser
each time, so a new command or flag completes without a change here: commands
after ``elasticd``, each command's flags after ``-``, a flag's choices
(``--stream stdout|stderr``), a positional's choices (``completion bash``),
job ids where a command takes one (``status``, ``logs``, ``cancel``, ...), and
file names elsewhere.

Job ids come from the daemon: the script runs ``elasticd completion
--job-ids``, which asks the daemon the CLI would ask (``$ELASTICD_URL``, the
node's socket, ...) with a short timeout and prints one id a line, or nothing
at all when no daemon answers (:func:`job_ids`): a completion never prints an
error into the user's command line.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SHELLS",
    "bash_completion",
    "command_flags",
    "completion_script",
    "fish_completion",
    "job_commands",
    "job_ids",
    "zsh_completion",
]

#: The shells ``elasticd completion`` writes a script for.
SHELLS = ("bash", "zsh", "fish")

#: Seconds the daemon has to list its jobs for a completion: a shell must not hang on it.
JOB_IDS_TIMEOUT = 2.0

#: The most job ids a completion offers (the newest first, as ``elasticd jobs``).
MAX_JOB_IDS = 1000


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(
        option
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        for option in action.option_strings
        if option.startswith("--") or len(option) == 2
    )


def _choices(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {
        option: [str(c) for c in action.choices]
        for action in parser._actions
        if action.option_strings and action.choices
        for option in action.option_strings
    }


def _positional_choices(parser: argparse.ArgumentParser) -> list[str]:
    return [
        str(c)
        for action in parser._actions
        if not action.option_strings
        and action.choices
        and not isinstance(action, argparse._SubParsersAction)
        for c in action.choices
    ]


def _value_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The flags that take a value (the next word is theirs, not a positional)."""
    return sorted(
        option
        for action in parser._actions
        if action.option_strings and action.nargs != 0
        for option in action.option_strings
    )


def job_commands(parser: argparse.ArgumentParser) -> list[str]:
    """The commands whose first positional is a job id (pure: read from the parser)."""
    return sorted(
        name
        for name, sub in _subcommands(parser).items()
        if any(not a.option_strings and a.dest == "job_id" for a in sub._actions)
    )


def job_ids(find: Callable[[], Any] | None = None) -> list[str]:
    """The job ids the daemon the CLI would ask has, newest first; none when it cannot be
    asked (no daemon, no token, a refusal, a timeout): a completion stays quiet."""
    from elasticd.client import Client, ClientError, find_daemon
    from elasticd.errors import ConfigError

    try:
        found = (find or find_daemon)()
        with Client(
            found.url, socket=found.socket, token_file=found.token_file, timeout=JOB_IDS_TIMEOUT
        ) as client:
            return [job.id for job in client.list_jobs(limit=MAX_JOB_IDS).jobs]
    except (ClientError, ConfigError, OSError, ValueError):
        return []


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for ``shell`` (one of :data:`SHELLS`)."""
    return {"bash": bash_completion, "zsh": zsh_completion, "fish": fish_completion}[shell](parser)


def command_flags(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Every command's flags, ``""`` for the top level (pure: read from the parser)."""
    table = {"": _flags(parser)}
    for name, sub in _subcommands(parser).items():
        table[name] = _flags(sub)
    return table


def _words(values: list[str]) -> str:
    return shlex.quote(" ".join(values))


@dataclass(frozen=True)
class _Command:
    """What a script completes for one command, read from its parser."""

    name: str
    flags: list[str]
    words: list[str]  # its positionals' choices
    vflags: list[str]  # its flags that take a value
    ids: bool  # its first positional is a job id
    choices: dict[str, list[str]]  # a flag's choices


def _commands(parser: argparse.ArgumentParser) -> list[_Command]:
    with_ids = set(job_commands(parser))
    return [
        _Command(
            name,
            _flags(sub),
            _positional_choices(sub),
            _value_flags(sub),
            name in with_ids,
            dict(sorted(_choices(sub).items())),
        )
        for name, sub in sorted(_subcommands(parser).items())
    ]


def _function(prog: str) -> str:
    return "_" + "".join(c if c.isalnum() else "_" for c in prog)


# The parts of the bash and zsh scripts that read the same in both shells.


def _find_command(words: str, first: int, current: str) -> str:
    """Shell: ``cmd`` and its index ``i``, the first word that is no flag."""
    return f"""  for ((i = {first}; i < {current}; i++)); do
    case "${{{words}[i]}}" in
      -*) ;;
      *) cmd="${{{words}[i]}}"; break ;;
    esac
  done"""


def _cases(
    parser: argparse.ArgumentParser,
    quote: Callable[[list[str]], str],
    words: str,
    offer: Callable[[list[str]], str],
) -> str:
    """Shell: a flag's choices (``offer``, then done), else the command's ``flags``,
    ``words`` (its positionals' choices), ``vflags`` and ``ids``, each value ``quote``d."""
    commands = _commands(parser)
    choice_cases = [
        f"    {shlex.quote(c.name + ' ' + option)}) {offer(values)}; return ;;"
        for c in commands
        for option, values in c.choices.items()
    ]
    flag_cases = [
        f"    {shlex.quote(c.name)}) flags={quote(c.flags)} {words}={quote(c.words)} "
        f"vflags={quote(c.vflags)} ids={'1' if c.ids else ''} ;;"
        for c in commands
    ]
    return f"""  case "$cmd $prev" in
{chr(10).join(choice_cases)}
  esac
  case "$cmd" in
{chr(10).join(flag_cases)}
  esac"""


def _count_positionals(words: str, current: str, is_value_flag: str) -> str:
    """Shell: ``n``, the positionals typed after the command (a value flag's value is not
    one); ``skip`` set when the word being completed is a value flag's."""
    return f"""  for ((j = i + 1; j < {current}; j++)); do
    w="${{{words}[j]}}"
    if [[ -n "$skip" ]]; then skip=""; continue; fi
    if {is_value_flag}; then skip=1; continue; fi
    [[ "$w" == -* ]] || n=$((n + 1))
  done"""


def _bash_offer(values: list[str]) -> str:
    return f'COMPREPLY=($(compgen -W {_words(values)} -- "$cur"))'


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash script that completes ``parser``'s commands, flags, flag choices and job ids."""
    prog = parser.prog
    func = _function(prog)
    commands = _subcommands(parser)
    top = [*sorted(commands), *_flags(parser)]
    return f"""# bash completion for {prog}, generated by `{prog} completion bash`
{func}() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="" cmd="" i j w n=0 skip=""
  local flags="" words="" vflags="" ids=""
  [ "$COMP_CWORD" -gt 0 ] && prev="${{COMP_WORDS[COMP_CWORD-1]}}"
{_find_command("COMP_WORDS", 1, "COMP_CWORD")}
  if [ -z "$cmd" ]; then
    COMPREPLY=($(compgen -W {_words(top)} -- "$cur"))
    return
  fi
{_cases(parser, _words, "words", _bash_offer)}
{_count_positionals("COMP_WORDS", "COMP_CWORD", '[[ " $vflags " == *" $w "* ]]')}
  if [[ "$cur" == -* ]]; then
    COMPREPLY=($(compgen -W "$flags" -- "$cur"))
  elif [ -n "$skip" ]; then
    COMPREPLY=($(compgen -f -- "$cur"))
  elif [ -n "$ids" ] && [ "$n" -eq 0 ]; then
    COMPREPLY=($(compgen -W "$({prog} completion --job-ids 2>/dev/null)" -- "$cur"))
  elif [ -n "$words" ]; then
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
  else
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}}
complete -o filenames -F {func} {prog}
"""


def _array(values: list[str]) -> str:
    return "(" + " ".join(map(shlex.quote, values)) + ")"


def _zsh_offer(values: list[str]) -> str:
    return "compadd -- " + " ".join(map(shlex.quote, values))


def zsh_completion(parser: argparse.ArgumentParser) -> str:
    """A zsh script (native ``compadd``; no bashcompinit) that completes what bash's does."""
    prog = parser.prog
    func = _function(prog)
    commands = _subcommands(parser)
    top = " ".join(map(shlex.quote, [*sorted(commands), *_flags(parser)]))
    return f"""#compdef {prog}
# zsh completion for {prog}, generated by `{prog} completion zsh`
{func}() {{
  local cur="${{words[CURRENT]}}" prev="${{words[CURRENT-1]}}" cmd="" i j w n=0 skip="" ids=""
  local -a flags choices vflags
{_find_command("words", 2, "CURRENT")}
  if [[ -z "$cmd" ]]; then
    compadd -- {top}
    return
  fi
{_cases(parser, _array, "choices", _zsh_offer)}
{_count_positionals("words", "CURRENT", "(( ${vflags[(Ie)$w]} ))")}
  if [[ "$cur" == -* ]]; then
    compadd -- $flags
  elif [[ -n "$skip" ]]; then
    _files
  elif [[ -n "$ids" && $n -eq 0 ]]; then
    compadd -- ${{(f)"$({prog} completion --job-ids 2>/dev/null)"}}
  elif (( $#choices )); then
    compadd -- $choices
  else
    _files
  fi
}}
if [[ "$funcstack[1]" == "{func}" ]]; then
  {func} "$@"
else
  compdef {func} {prog}
fi
"""


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_help(help_text: str | None) -> str:
    """A help text's first clause, short enough for fish's pager, quoted."""
    text = " ".join((help_text or "").split()).split(";")[0].split(" (")[0]
    return _fish_quote(text if len(text) <= 60 else text[:59] + "…")


def fish_completion(parser: argparse.ArgumentParser) -> str:
    """A fish script: commands, each command's flags (with their help), choices, job ids."""
    prog = parser.prog
    fn = "_" + _function(prog)
    commands = _subcommands(parser)
    helps = _command_help(parser)
    with_ids = set(job_commands(parser))
    lines = [
        f"# fish completion for {prog}, generated by `{prog} completion fish`",
        f"function {fn}_no_positional_yet",
        "    # true when no positional follows the command (argv: its value flags)",
        "    set -l words (commandline -opc)",
        "    set -l seen 0; set -l skip 0; set -l n 0",
        "    for w in $words[2..-1]",
        "        if test $skip = 1; set skip 0; continue; end",
        "        if test $seen = 0",
        "            string match -q -- '-*' $w; or set seen 1",
        "            continue",
        "        end",
        "        if contains -- $w $argv; set skip 1",
        "        else if not string match -q -- '-*' $w; set n (math $n + 1); end",
        "    end",
        "    test $n = 0 -a $skip = 0",
        "end",
        f"complete -c {prog} -f -n __fish_use_subcommand",
    ]
    for name, sub in sorted(commands.items()):
        about = helps.get(name)
        lines.append(
            f"complete -c {prog} -n __fish_use_subcommand -a {shlex.quote(name)}"
            + (f" -d {_fish_help(about)}" if about else "")
        )
        seen = f"'__fish_seen_subcommand_from {name}'"
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            spec = " ".join(
                f"-l {o[2:]}" if o.startswith("--") else f"-s {o[1:]}"
                for o in action.option_strings
                if o.startswith("--") or len(o) == 2
            )
            takes = action.nargs != 0
            values = (
                f" -xa {_fish_quote(' '.join(str(c) for c in action.choices))}"
                if action.choices
                else " -r"
                if takes
                else ""
            )
            lines.append(
                f"complete -c {prog} -n {seen} {spec}{values} -d {_fish_help(action.help)}"
            )
        if choices := _positional_choices(sub):
            lines.append(f"complete -c {prog} -n {seen} -f -a {_fish_quote(' '.join(choices))}")
        if name in with_ids:
            vflags = " ".join(_value_flags(sub))
            lines.append(
                f"complete -c {prog} -n '__fish_seen_subcommand_from {name}; and "
                f"{fn}_no_positional_yet {vflags}' -f "
                f"-a '({prog} completion --job-ids 2>/dev/null)'"
            )
    return "\n".join(lines) + "\n"
