"""The README's 3-node recipe, run as written (as whoever runs the tests: root in CI).

The block is read from README.md, so the test fails when the text stops working:
three daemons started in one loop (any order), a gloo job on 2-3 of them that must
end SUCCEEDED. The text runs as written but for its ports and paths: 7070-7072 become
free ports and /tmp/... a folder of the test's (`localized`), so the test neither meets
nor disturbs a daemon of the user's on the README's ports; the shell runs under
`set -euo pipefail`, so a command of the recipe that fails fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.normal_user import NobodyClone, recipe, use_it_recipe
from tests.users import need_root

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def free_ports(count: int) -> list[int]:
    """Ports the kernel has just handed out and that are free again (held together: distinct)."""
    holders = [socket.socket() for _ in range(count)]
    try:
        for holder in holders:
            holder.bind(("127.0.0.1", 0))
        return [holder.getsockname()[1] for holder in holders]
    finally:
        for holder in holders:
            holder.close()


def localized(script: str, folder: Path, ports: list[int]) -> str:
    """The recipe with the test's ports and folder in place of 7070-7072 and /tmp, in strict mode.

    Only these literal spellings are rewritten; anything else of the README's that names a
    fixed port or /tmp path fails here, so the test cannot silently use the real ones.
    """
    script = script.replace("707$i", "${PORTS[$i]}")
    spelled = re.compile(rf"707([0-{len(ports) - 1}])")
    # Judged before the ports go in, and in one pass: a free port may itself contain
    # "707" (50707) or another spelling (17071).
    assert "707" not in spelled.sub("", script), script
    script = spelled.sub(lambda m: str(ports[int(m.group(1))]), script)
    script = script.replace("/tmp/", f"{folder}/")
    return f"set -euo pipefail\nPORTS=({' '.join(map(str, ports))})\n{script}"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("curl http://127.0.0.1:7071/nodes", "curl http://127.0.0.1:2001/nodes"),
        ("--port 707$i --state-dir /tmp/ed-n$i", "--port ${PORTS[$i]} --state-dir /F/ed-n$i"),
        ("cat /tmp/elasticd.token", "cat /F/elasticd.token"),
    ],
)
def test_localized_rewrites_only_the_ports_and_paths(script, expected):
    """The rewrite maps 707i to the i-th port and /tmp/ to the test's folder, under set -euo."""
    assert localized(script, Path("/F"), [2000, 2001, 2002]) == (
        f"set -euo pipefail\nPORTS=(2000 2001 2002)\n{expected}"
    )


def test_free_ports_that_contain_707_are_not_taken_for_readme_ports():
    """Ports like 50707 or 17071 (CI drew them) go in as they are, and only once."""
    script = "curl 127.0.0.1:7070/a 127.0.0.1:7071/b 127.0.0.1:7072/c"
    assert localized(script, Path("/F"), [50707, 17071, 7072]).endswith(
        "curl 127.0.0.1:50707/a 127.0.0.1:17071/b 127.0.0.1:7072/c"
    )


def test_localized_refuses_a_port_it_does_not_map():
    """A README port beyond the three it maps is an error, not a fixed port the test would bind."""
    with pytest.raises(AssertionError):
        localized("curl http://127.0.0.1:7075/", Path("/F"), [2000, 2001, 2002])


def get(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the recipe uses curl")
def test_the_three_node_recipe_runs_a_job_to_success(tmp_path):
    pytest.importorskip("torch")
    ports = free_ports(3)
    base = [f"http://127.0.0.1:{port}" for port in ports]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = tmp_path / "recipe.log"
    with log.open("wb") as out:  # the daemons keep it open: a file, not a pipe
        shell = subprocess.Popen(
            [
                "bash",
                "-c",
                localized(recipe("## A 3-node cluster on one machine"), tmp_path, ports),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        returncode = shell.wait(timeout=120)
        text = log.read_text(errors="replace")
        assert returncode == 0, text
        # The recipe's own folder (mktemp, under the test's folder in place of /tmp).
        (folder,) = tmp_path.glob("elasticd-demo.*")
        assert folder.stat().st_mode & 0o777 == 0o711
        token = (folder / "token").read_text().strip()
        deadline = time.monotonic() + 150
        while (job := get(f"{base[0]}/jobs/elastic-1", token))["state"] not in (
            "SUCCEEDED",
            "FAILED",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
        assert job["state"] == "SUCCEEDED", (job, text[-4000:])
        assert len(get(f"{base[1]}/nodes", token)) == 3
        # The next recipe, on the same cluster: priority, the queue, `elasticd queue`, --priority.
        fleet = subprocess.run(
            ["bash", "-c", localized(recipe("### Sharing the fleet"), tmp_path, ports)],
            cwd=ROOT,
            env={**env, "ED": str(folder)},  # "the cluster above": the same shell's $ED
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert fleet.returncode == 0, fleet.stdout + fleet.stderr
        assert '"queue":' in fleet.stdout and "submitted" in fleet.stdout, fleet.stdout
        submitted = re.search(r"job (\S+) submitted", fleet.stdout)
        assert submitted, fleet.stdout
        for job_id in ("urgent", submitted.group(1)):
            deadline = time.monotonic() + 60
            while (job := get(f"{base[0]}/jobs/{job_id}", token))["state"] not in (
                "SUCCEEDED",
                "FAILED",
            ):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            assert job["state"] == "SUCCEEDED", job
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while subprocess.run(["pgrep", "-g", str(shell.pid)], capture_output=True).returncode == 0:
            if time.monotonic() > deadline:
                os.killpg(shell.pid, signal.SIGKILL)
                break
            time.sleep(0.2)


#: The README's `crash.py` of its CLI sample: rank 1 fails with code 3 in the first attempt.
CRASH_PY = """
import os, sys
if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
"""


def cli_sample() -> tuple[list[str], list[str]]:
    """The README's `elasticd submit ... --wait` sample: its command and the lines it shows."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("  $ elasticd submit --id demo1") :]
    lines = block.split("\n")
    command = lines[0].removeprefix("  $ ").split("#")[0].split()
    shown = []
    for line in lines[1:]:
        if line.startswith("  $ "):
            break
        shown.append(line.removeprefix("  "))
    return command, shown


def shape(line: str) -> str:
    """A line with its numbers (pids, ports, times) made alike: what must match the real one."""
    return re.sub(r"\d+(\.\d+)?", "N", line)


async def test_the_cli_samples_submit_wait_lines_are_real_output(tmp_path):
    """Every line the README shows of `submit --wait` comes, in its order, from a real run;
    what it leaves out is marked '…', and the count it gives is the real one."""
    from tests.hardening.support import serve

    command, shown = cli_sample()
    assert command[:2] == ["elasticd", "submit"] and "--wait" in command, command
    (tmp_path / "crash.py").write_text(CRASH_PY)
    daemon = serve(tmp_path, node_name="smoke")
    try:
        await daemon.wait_ready()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        done = await asyncio.to_thread(
            subprocess.run,
            [
                *command[:2],
                "--url",
                daemon.url,
                "--token-file",
                str(tmp_path / f"auto-token-{daemon.port}"),
                *command[2:],
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        daemon.stop()
    real = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, real
    # "about 30": the count is the README's order of magnitude, not a promise to the line.
    said = re.search(r"# every event: about (\d+) lines", (ROOT / "README.md").read_text())
    assert said and 0.7 * int(said.group(1)) <= len(real) <= 1.3 * int(said.group(1)), real
    # The lines shown, with "…" for what is left out, are a subsequence of the real ones.
    left = iter(shape(line) for line in real)
    for line in shown:
        if line == "…":
            continue
        assert any(shape(line) == got for got in left), (line, real)
    assert shown[0] == real[0] and shown[-1] == real[-1], (shown, real)


#: The README's `train.py` of its "Use it" recipe: it only says it ran.
TRAIN_PY = "import os, sys\nprint('rank', os.environ['RANK'], 'epochs', sys.argv[2])\n"


def _reaches(user: str, path: str) -> bool:
    """Whether ``user`` can run ``path`` (its links followed), as a job of that user would."""
    probe = subprocess.run(
        ["/bin/sh", "-c", '[ -f "$1" ] && [ -x "$1" ]', "sh", path], user=user, timeout=30
    )
    return probe.returncode == 0


def _use_it_script(folder: Path, port: int, *, in_clone: bool) -> str:
    """The "Use it" block with the test's port and root's /var/lib/elasticd a folder of the
    test's, after its set-up: ``in_clone``, the one nobody's clone ran (the venv it made is
    activated again), else the tests' own venv (first on PATH, as activating it does)."""
    _setup, rest = use_it_recipe()
    script = f". .venv/bin/activate\n{rest}" if in_clone else rest
    return localized(script, folder, [port]).replace("/var/lib/elasticd", f"{folder}/state")


@pytest.mark.skipif(shutil.which("curl") is None, reason="the recipe uses curl")
@pytest.mark.parametrize("who", ["root", "root-with-elasticd-user", "user"])
def test_the_use_it_recipe_does_what_the_readme_says(who, request):
    """The README's first recipe, run as root with no `elasticd` user (the job is refused:
    403 naming --run-as and --allow-root and their config keys), as root once the `elasticd`
    user exists (the job runs as `elasticd`: it succeeds where `elasticd` can reach this
    venv's python, else fails naming the user and the folder it may not enter), and as a
    normal user, as written: nobody, in a clone in their home, with a normal user's PATH
    (the system python3), ran its set-up (`nobody_clone`) and runs the rest: the job runs
    as nobody and succeeds."""
    import httpx

    exists = subprocess.run(["id", "-u", "elasticd"], capture_output=True).returncode == 0
    python = str(Path(sys.executable).parent / "python")
    if os.geteuid() != 0:
        need_root()  # the recipe as root, and as nobody, whom only root can switch to
    if who == "root" and exists:
        pytest.skip("an elasticd user exists on this machine (it is not this test's to remove)")
    mine: NobodyClone | None = request.getfixturevalue("nobody_clone") if who == "user" else None
    folder = Path(tempfile.mkdtemp(prefix="elasticd-readme-"))
    folder.chmod(0o755)
    made_user = False
    shell = None
    try:
        if who == "root-with-elasticd-user" and not exists:
            subprocess.run(["useradd", "--system", "--no-create-home", "elasticd"], check=True)
            made_user = True
        port = free_ports(1)[0]
        if mine is None:
            work = folder / "work"
            work.mkdir()
            env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "PET_"))}
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
            state = folder / "state"
            env.update(ELASTICD_STATE_DIR=str(state), ELASTICD_LOG_DIR=str(folder / "logs"))
        else:  # in nobody's clone, where a user who cloned it types the recipe
            work = mine.clone
            env = mine.env()
            state = mine.home / ".local" / "state" / "elasticd"
        (work / "train.py").write_text(TRAIN_PY)
        (work / "train.py").chmod(0o644)
        # `elasticd jobs` would look at /run/elasticd first: this daemon's socket, named.
        env["ELASTICD_SOCKET"] = str(state / "run" / "elasticd.sock")
        log = folder / "recipe.log"
        nobody = pwd.getpwnam("nobody")
        with log.open("wb") as out:
            if mine is not None:
                os.chown(work / "train.py", nobody.pw_uid, nobody.pw_gid)
                os.chown(log, nobody.pw_uid, nobody.pw_gid)
            shell = subprocess.Popen(
                ["bash", "-c", _use_it_script(folder, port, in_clone=mine is not None)],
                cwd=work,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=None if mine is None else nobody.pw_uid,
                group=None if mine is None else nobody.pw_gid,
                extra_groups=None if mine is None else [],
            )
        assert shell.wait(timeout=150) == 0, log.read_text(errors="replace")
        text = log.read_text(errors="replace")
        # Over TCP with the daemon's token, as the recipe's last curl: a normal user's daemon
        # serves no other user on its socket, root included.
        token = (state / "token").read_text().strip()
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ) as http:
            if who == "root":
                assert '"status":403' in text.replace(" ", ""), text
                for fix in ("--run-as USER", 'run_as = \\"USER\\"', "--allow-root", "allow_root"):
                    assert fix in text, (fix, text)
                assert http.get("/jobs/resnet-1").status_code == 404
                return
            deadline = time.monotonic() + 60
            while True:
                answer = http.get("/jobs/resnet-1")
                assert answer.status_code == 200, (answer.text, text)
                if (job := answer.json())["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
        runs_as = "elasticd" if who != "user" else "nobody"
        assert job["spec"]["user"] in (runs_as, None), job
        if runs_as == "elasticd" and not _reaches("elasticd", python):
            assert job["state"] == "FAILED", job
            assert "as user elasticd" in job["reason"], job["reason"]
            assert "elasticd may not enter" in job["reason"], job["reason"]
        else:  # it ran; the recipe's cancel may have come before it ended
            assert job["state"] in ("SUCCEEDED", "CANCELLED"), job
            assert job["state"] == "CANCELLED" or job["restart_count"] == 0, job
    finally:
        if shell is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while (
                subprocess.run(["pgrep", "-g", str(shell.pid)], capture_output=True).returncode == 0
            ):
                if time.monotonic() > deadline:
                    os.killpg(shell.pid, signal.SIGKILL)
                    break
                time.sleep(0.2)
        if made_user:
            subprocess.run(["userdel", "elasticd"], check=False)
        shutil.rmtree(folder, ignore_errors=True)
