"""pytorch's own launcher test scripts, unchanged, under torchrun and under `elasticd run`.

The scripts are torch's `test/distributed/launcher/bin/` and
`test/distributed/elastic/multiprocessing/bin/` (see torch_bin/README.md); the arguments are
those torch's `test/distributed/launcher/test_run.py` (formerly `run_test.py`) passes, with 2
workers. Each test runs one command line under both launchers at once and compares the outcomes:
exit code, the files the workers write, the console lines, the environment they saw.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import time

import pytest

from tests.compat.launchers import (
    LAUNCHER_BIN,
    MP_BIN,
    NAMES,
    TORCH_BIN,
    Outcome,
    copy_script,
    run_both,
    started,
    workers_running,
)

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(120)]

README = TORCH_BIN / "README.md"
TEST_SCRIPT = str(LAUNCHER_BIN / "test_script.py")
TEST_SCRIPT_SH = str(LAUNCHER_BIN / "test_script.sh")
# Differ by design between any two runs: where the store listens, the run's id and log folder.
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"}


def same_exit(outcomes: dict[str, Outcome], code: int) -> None:
    for name, outcome in outcomes.items():
        assert outcome.returncode == code, f"{name}: {outcome.returncode}\n{outcome.text()}"


def env_by_rank(outcome: Outcome) -> dict[int, list[dict[str, str]]]:
    """test_script.py's ``NAME = value`` lines, one dict per attempt, by local rank."""
    seen: dict[int, list[dict[str, str]]] = {}
    for rank, lines in outcome.teed().items():
        for line in lines:
            if line == "Distributed env vars set by agent:":
                seen.setdefault(rank, []).append({})
            elif " = " in line and rank in seen:
                name, value = line.split(" = ", 1)
                seen[rank][-1][name] = value
    return seen


def test_test_script_sees_the_same_environment_and_every_rank_writes_its_file(tmp_path):
    """run_test.py's test_launch_standalone: each rank touches a file named by RANK; the worker
    contract (ranks, sizes, role, restart count, OMP_NUM_THREADS, the parent's variables) is the
    same under both launchers, and each gets an error file under attempt_0/<rank>."""
    args = ["--standalone", "--nproc-per-node=2", "--tee=3", TEST_SCRIPT, "--touch-file-dir={out}"]
    outcomes = run_both(tmp_path, args)
    same_exit(outcomes, 0)
    envs = {name: env_by_rank(o) for name, o in outcomes.items()}
    for name, outcome in outcomes.items():
        assert outcome.files == {"0", "1"}, name
        assert sorted(envs[name]) == [0, 1], outcome.text()
        for rank, (env,) in envs[name].items():
            assert env["MASTER_ADDR"] in {"localhost", "127.0.0.1"}  # torchrun: localhost
            assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
            assert env["MASTER_PORT"] == envs[name][0][0]["MASTER_PORT"]
    contract = {
        name: {r: {k: v for k, v in e[0].items() if k not in PER_RUN} for r, e in env.items()}
        for name, env in envs.items()
    }
    assert contract["elasticd"] == contract["torchrun"]
    assert contract["torchrun"][1]["WORLD_SIZE"] == "2"
    assert contract["torchrun"][1]["TEST_SENTINEL_PARENT"] == "FOOBAR"


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_failing_script_restarts_as_often_and_exits_1(tmp_path, max_restarts):
    """run_test.py's test_launch_elastic_worker_raise_exception (`--fail`), and with one restart:
    the same attempts (TORCHELASTIC_RESTART_COUNT 0..max), then exit code 1 under both."""
    args = ["--standalone", "--nproc-per-node=2", "--tee=3", f"--max-restarts={max_restarts}"]
    outcomes = run_both(tmp_path, [*args, TEST_SCRIPT, "--fail"])
    same_exit(outcomes, 1)
    expected = {str(n) for n in range(max_restarts + 1)}
    for name, outcome in outcomes.items():
        # A rank stopped because its peer failed may be gone before it printed every line.
        seen = [env for attempts in env_by_rank(outcome).values() for env in attempts]
        printed = [env for env in seen if "TORCHELASTIC_MAX_RESTARTS" in env]
        assert {env["TORCHELASTIC_RESTART_COUNT"] for env in printed} == expected, outcome.text()
        assert {env["TORCHELASTIC_MAX_RESTARTS"] for env in printed} == {str(max_restarts)}, name
        assert "RuntimeError: raising exception since --fail flag was set" in outcome.text()
        assert outcome.files == set()


def test_no_python_runs_the_bash_script(tmp_path):
    """run_test.py's test_launch_user_script_bash: `--no-python test_script.sh DIR`; the workers'
    output reaches stdout bare (no prefix without --tee)."""
    outcomes = run_both(
        tmp_path,
        ["--standalone", "--nproc-per-node=2", "--no-python"]
        + [
            TEST_SCRIPT_SH,
            "{out}",
        ],
    )
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert outcome.files == {"0", "1"}, name
        lines = sorted(outcome.stdout.replace(str(outcome.out), "OUT").splitlines())
        assert lines == ["creating OUT/0", "creating OUT/1"], (name, outcome.stdout)


def test_no_python_and_module_together_are_refused(tmp_path):
    """run_test.py: `--no-python` with `--module` is an error (torchrun raises ValueError)."""
    outcomes = run_both(tmp_path, ["--standalone", "--no-python", "--module", TEST_SCRIPT_SH, "x"])
    for name, outcome in outcomes.items():
        assert outcome.returncode != 0, name
        assert not outcome.files


def test_pet_variables_are_option_defaults(tmp_path):
    """run_test.py's test_launch_with_env_vars: PET_NPROC_PER_NODE, PET_NO_PYTHON and PET_MODULE
    set the options; the command line has only the script."""
    env = {"PET_NPROC_PER_NODE": "2", "PET_NO_PYTHON": "1", "PET_MODULE": "0"}
    outcomes = run_both(tmp_path, ["--standalone", TEST_SCRIPT_SH, "{out}"], env=env)
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert outcome.files == {"0", "1"}, name


@pytest.mark.parametrize("nproc", ["cpu", "auto"])
def test_nproc_per_node_words_start_as_many_workers(tmp_path, nproc):
    """run_test.py's test_nproc_launch_auto_configurations: with no GPU, `auto` (and `cpu`) start
    one worker per CPU under both launchers."""
    if nproc == "auto" and shutil.which("nvidia-smi"):
        pytest.skip("torch's CPU wheel sees no GPU where elasticd counts nvidia-smi's")
    outcomes = run_both(
        tmp_path,
        ["--standalone", f"--nproc-per-node={nproc}", "--no-python", TEST_SCRIPT_SH, "{out}"],
    )
    same_exit(outcomes, 0)
    assert outcomes["elasticd"].files == outcomes["torchrun"].files
    assert outcomes["torchrun"].files == {str(r) for r in range(os.cpu_count() or 1)}


def test_module_form(tmp_path):
    """`-m test_script` from the script's folder: `python -u -m` under both launchers."""
    copy_script(LAUNCHER_BIN / "test_script.py", tmp_path)
    outcomes = run_both(
        tmp_path,
        ["--standalone", "--nproc-per-node=2", "-m", "test_script", "--touch-file-dir={out}"],
        cwd=tmp_path,
    )
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert outcome.files == {"0", "1"}, (name, outcome.text())


def test_local_rank_macro_reaches_the_script(tmp_path):
    """test_script_local_rank.py checks `--local_rank=${local_rank}` against LOCAL_RANK and raises
    when they differ: both launchers substitute the macro."""
    script = str(LAUNCHER_BIN / "test_script_local_rank.py")
    outcomes = run_both(
        tmp_path, ["--standalone", "--nproc-per-node=2", script, "--local_rank=${local_rank}"]
    )
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert outcome.stdout.count("End execution") == 2, (name, outcome.text())


def test_is_torchelastic_launched(tmp_path):
    """run_test.py's test_is_torchelastic_launched: torch.distributed.is_torchelastic_launched()
    is True in a worker of either launcher."""
    script = str(LAUNCHER_BIN / "test_script_is_torchelastic_launched.py")
    outcomes = run_both(
        tmp_path, ["--standalone", "--nproc-per-node=1", script, "--out-file={out}/out"]
    )
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert (outcome.out / "out").read_text() == "True", name


@pytest.mark.parametrize("init_method", ["env://", "tcp://localhost:{port}"])
def test_init_method_gloo_all_reduce(tmp_path, init_method):
    """run_test.py's test_init_method_{env,tcp}_with_torchelastic: a gloo process group from
    `env://`, or from `tcp://` on the launcher's --master-port, all-reduces across 2 workers."""
    script = str(LAUNCHER_BIN / "test_script_init_method.py")
    args = ["--nproc-per-node=2", "--master-addr=localhost", "--master-port={port}"]
    outcomes = run_both(tmp_path, [*args, script, f"--init-method={init_method}"])
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert outcome.stdout.count("Done") == 2, (name, outcome.text())


def test_prefix_template_on_teed_lines(tmp_path):
    """test_run.py's test_capture_logs_using_default_logs_specs: `--redirects 3 --tee 3` with
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE prints `[rank<i>]: creating ...` on stdout."""
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}
    args = ["--standalone", "--nproc-per-node=2", "--redirects=3", "--tee=3", "--no-python"]
    outcomes = run_both(tmp_path, [*args, TEST_SCRIPT_SH, "{out}"], env=env)
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        for rank in (0, 1):
            assert f"[rank{rank}]: creating " in outcome.stdout, (name, outcome.text())


def test_echo_output_is_bare_on_stdout_and_stderr(tmp_path):
    """echo1.py prints one line to each stream: without --tee both launchers pass them on bare,
    stdout to stdout and stderr to stderr."""
    outcomes = run_both(
        tmp_path, ["--standalone", "--nproc-per-node=2", str(MP_BIN / "echo1.py"), "hello"]
    )
    same_exit(outcomes, 0)
    # elasticd passes each worker's output on line by line; torchrun's workers share its
    # stdout and stderr, so their lines may interleave mid-line (seen in CI): for torchrun
    # only the text is compared.
    assert sorted(outcomes["elasticd"].stdout.splitlines()) == [
        "hello stdout from 0",
        "hello stdout from 1",
    ]
    for rank in (0, 1):
        assert f"\nhello stderr from {rank}\n" in "\n" + outcomes["elasticd"].stderr
    for name, outcome in outcomes.items():
        for rank in (0, 1):
            assert f"hello stdout from {rank}" in outcome.stdout, name
            assert f"hello stderr from {rank}" in outcome.stderr, name
            assert f"hello stdout from {rank}" not in outcome.stderr, name


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("echo1.py", ["--exitcode=${local_rank}", "hello"], "exit 1 from 1"),
        # torchrun's workers share its stderr: their tracebacks may interleave mid-line
        ("echo2.py", ["--raises=True", "hello"], "raised from "),
        ("echo3.py", ["--segfault=True", "hello"], None),
    ],
    ids=["exit-code", "raises", "segfault"],
)
def test_a_failed_worker_fails_the_run_with_exit_code_1(tmp_path, script, args, message):
    """A worker that exits 1, raises, or dies of SIGSEGV: both launchers exit 1 (a worker
    failure, whatever the worker's own code or signal)."""
    outcomes = run_both(
        tmp_path, ["--standalone", "--nproc-per-node=2", str(MP_BIN / script), *args]
    )
    same_exit(outcomes, 1)
    if message:
        for name, outcome in outcomes.items():
            assert message in outcome.stderr, (name, outcome.text())


def test_a_failed_worker_stops_its_sleeping_peer(tmp_path):
    """echo4.py with `--exitcode=${local_rank}`: rank 1 exits 1 at once, rank 0 would sleep
    1000 s; both launchers stop rank 0 and exit 1 within seconds, leaving no worker."""
    script = copy_script(MP_BIN / "echo4.py", tmp_path)
    began = time.monotonic()
    outcomes = run_both(
        tmp_path,
        ["--standalone", "--nproc-per-node=2", str(script), "--exitcode=${local_rank}", "x"],
    )
    same_exit(outcomes, 1)
    assert time.monotonic() - began < 60
    assert workers_running(script) == []


def test_stopping_the_launcher_stops_every_worker(tmp_path):
    """zombie_test.py sleeps 600 s: SIGTERM to the launcher leaves no worker under either. The exit
    codes differ on purpose (README): torchrun 1, `elasticd run` 143 (128 + SIGTERM)."""
    script = copy_script(MP_BIN / "zombie_test.py", tmp_path)
    with started(tmp_path, ["--standalone", "--nproc-per-node=2", str(script)]) as procs:
        deadline = time.monotonic() + 60
        while len(workers_running(script)) < 2 * len(NAMES):
            assert time.monotonic() < deadline, workers_running(script)
            assert all(proc.poll() is None for proc, _ in procs.values())
            time.sleep(0.1)
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {name: proc.wait(60) for name, (proc, _) in procs.items()}
    assert codes == {"torchrun": 1, "elasticd": 143}
    deadline = time.monotonic() + 10
    while workers_running(script) and time.monotonic() < deadline:  # reaped by now: just in case
        time.sleep(0.1)
    assert workers_running(script) == []


def test_workers_read_the_launchers_stdin(tmp_path):
    """`echo hi | launcher --no-python cat`: the worker reads the launcher's stdin under both."""
    outcomes = run_both(
        tmp_path, ["--standalone", "--nproc-per-node=1", "--no-python", "cat"], stdin="hi\n"
    )
    same_exit(outcomes, 0)
    for name, outcome in outcomes.items():
        assert outcome.stdout == "hi\n", (name, outcome.text())


def test_vendored_scripts_are_unchanged():
    """Every script in torch_bin/ still has the SHA-256 its README records for pytorch's file."""
    rows = re.findall(
        r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", README.read_text(), re.MULTILINE
    )
    assert len(rows) == 10
    for name, digest in rows:
        assert hashlib.sha256((TORCH_BIN / name).read_bytes()).hexdigest() == digest, name
    assert os.access(TORCH_BIN / "launcher" / "test_script.sh", os.X_OK)
