"""`elasticd run` as torchrun runs scripts (issue 15, items 1 and 2).

Real `elasticd run` processes, each with its embedded daemon and real workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

PRINT_THEN_FAIL = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} says hello")  # block-buffered without -u: lost when SIGTERM stops it
if rank == 0:
    time.sleep(1.0)
    sys.exit(1)
time.sleep(600)
"""

SHOW_ARGS = """
import os, sys
print(f"rank {os.environ['LOCAL_RANK']} argv {sys.argv[1:]}")
"""


def run(
    tmp_path, body: str, *args: str, stdin: str | None = None, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.pop("PYTHONUNBUFFERED", None)  # the repro: the user's shell does not set it
    env["ELASTICD_ALLOW_ROOT"] = "true"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            *flags,
            "--nproc-per-node",
            "2",
            "--termination-grace",
            "2",
            "--state-dir",
            str(tmp_path / "state"),
            "--",
            "python3",  # not a path ending in .py: the form the README shows
            str(script),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
    )


def test_output_of_a_worker_stopped_by_the_agent_is_not_lost(tmp_path):
    done = run(tmp_path, PRINT_THEN_FAIL)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "rank 0 says hello" in out, out
    assert "rank 1 says hello" in out, out  # rank 1 was stopped with SIGTERM


def test_local_rank_macro_is_substituted_in_worker_arguments(tmp_path):
    done = run(tmp_path, SHOW_ARGS, "--local_rank=${local_rank}", "plain")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "rank 0 argv ['--local_rank=0', 'plain']" in out, out
    assert "rank 1 argv ['--local_rank=1', 'plain']" in out, out


@pytest.mark.parametrize(
    ("value", "gpus", "expected"),
    [
        ("3", None, 3),
        ("cpu", 8, 2),
        ("gpu", 8, 8),
        ("auto", 8, 8),
        ("auto", None, 2),  # no GPU: one worker per CPU, as torchrun
        ("gpu", None, "no NVIDIA GPU"),
        ("0", None, "at least 1"),
        ("many", None, "auto, cpu or gpu"),
    ],
)
def test_nproc_per_node_accepts_torchrun_words(value, gpus, expected):
    from elasticd.cli import local_world_size
    from elasticd.errors import ConfigError

    if isinstance(expected, int):
        assert local_world_size(value, gpus, cpus=2) == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            local_world_size(value, gpus, cpus=2)


def test_pet_environment_variables_are_defaults_and_the_command_line_wins(monkeypatch):
    from elasticd.cli import build_parser

    monkeypatch.setenv("PET_NPROC_PER_NODE", "gpu")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    monkeypatch.setenv("PET_NO_PYTHON", "1")
    monkeypatch.setenv("PET_TERMINATION_GRACE", "1")  # not a torchrun option: ignored
    args = build_parser().parse_args(["run", "--", "x"])
    assert (args.nproc_per_node, args.max_restarts, args.no_python) == ("gpu", 4, True)
    assert args.termination_grace == 30.0
    args = build_parser().parse_args(["run", "--nproc-per-node", "2", "--max-restarts", "1", "x"])
    assert (args.nproc_per_node, args.max_restarts) == ("2", 1)


def test_module_form_and_nproc_auto_run_real_workers(tmp_path):
    (tmp_path / "show_args.py").write_text(SHOW_ARGS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    env["PET_NPROC_PER_NODE"] = "auto"
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--state-dir", str(tmp_path / "state")]
        + ["-m", "show_args", "one"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    cpus = len(os.sched_getaffinity(0))
    for rank in range(cpus):
        assert f"rank {rank} argv ['one']" in out, out
    assert f"rank {cpus} argv" not in out


SLEEPER = """
import os, time
open(os.path.join(os.environ["OUT"], f"started-{os.environ['RANK']}-{os.getpid()}"), "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_run_exits_128_plus_the_signal_and_leaves_no_worker(tmp_path, sig, code):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env.update(ELASTICD_ALLOW_ROOT="true", OUT=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticd", "run", "--nproc-per-node", "2"]
        + ["--termination-grace", "2", "--state-dir", str(tmp_path / "state"), "sleeper.py"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(started := list(tmp_path.glob("started-*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(sig)
        assert proc.wait(60) == code
        pids = [int(p.name.rsplit("-", 1)[1]) for p in started]
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("teed", "template", "expected"),
    [
        (False, None, "hello\n"),  # torchrun prints a worker's output bare
        (True, None, "[trainer1]:hello\n"),
        (True, "[${role_name}:${rank}/${local_rank}] ", "[trainer:5/1] hello\n"),
        (False, "[${rank}]:", "hello\n"),  # the template applies to teed lines only
    ],
)
def test_console_lines_look_as_torchrun_prints_them(capsys, teed, template, expected):
    from elasticd.console import ConsoleLine, write_line

    line = ConsoleLine("job", "trainer", 5, 1, "stderr", b"hello", teed)
    env = {} if template is None else {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": template}
    write_line(line, env)
    assert capsys.readouterr().err == expected


def test_teed_output_is_prefixed_on_the_console(tmp_path):
    done = run(tmp_path, SHOW_ARGS, "x")
    assert "\nrank 0 argv ['x']" in "\n" + done.stdout, done.stdout
    script = tmp_path / "script.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env.update(ELASTICD_ALLOW_ROOT="true", TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${rank}> ")
    done = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--nproc-per-node", "2", "--tee", "3"]
        + ["--state-dir", str(tmp_path / "state2"), str(script), "y"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "<0> rank 0 argv ['y']" in done.stdout and "<1> rank 1 argv ['y']" in done.stdout


READ_INPUT = """
import os
if os.environ["LOCAL_RANK"] == "0":
    print(f"rank 0 read {input()!r}")
"""


def test_workers_get_the_launchers_stdin_as_under_torchrun(tmp_path):
    """`echo hi | elasticd run ... python -c 'print(input())'` prints hi (torchrun's workers inherit
    its stdin; a served daemon's keep /dev/null)."""
    done = run(tmp_path, READ_INPUT, stdin="hi\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 read 'hi'" in done.stdout + done.stderr


def test_run_takes_the_job_flags_submit_takes(tmp_path):
    """`elasticd run` shares submit's job flags (--health-check, --startup-timeout, ...): a
    health check that fails ends the run as FAILED, naming the check."""
    flags = ("--startup-timeout", "60", "--prewarm", "json", "--health-check", "false")
    done = run(tmp_path, "print('hi')\n", flags=flags)
    assert done.returncode == 1, done.stderr
    assert "health_check: 'false' exited with code 1" in done.stderr
    assert "hi" not in done.stdout
