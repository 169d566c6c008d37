"""The IO around a Slurm step's run: the shared token, and ``elasticd run --nnodes`` refused
outside a step."""

from __future__ import annotations

import hmac
import http.server
import json
import os
import stat
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator

import pytest

from elasticd import cli
from elasticd.errors import ConfigError
from elasticd.slurm import allocation
from elasticd.slurm import run as slurm_run


def test_tasks_racing_on_a_shared_home_all_get_one_token(tmp_path, monkeypatch):
    """Tasks that start at once on a shared home end with one 0600 token file, the same for
    all, and leave no temporary file behind."""
    monkeypatch.setattr(slurm_run, "DEFAULT_TOKEN", tmp_path / "home" / "slurm-token")
    paths, start = [], threading.Barrier(8)

    def task() -> None:
        start.wait()
        paths.append(slurm_run.shared_token(None))

    threads = [threading.Thread(target=task) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    target = tmp_path / "home" / "slurm-token"
    assert paths == [target] * 8
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert len(target.read_text().strip()) >= 32
    assert [p.name for p in target.parent.iterdir()] == ["slurm-token"]


def test_a_given_token_file_must_exist(tmp_path):
    """--token-file names a file the step's tasks share: a missing one is refused."""
    with pytest.raises(ConfigError, match="no such file"):
        slurm_run.shared_token(tmp_path / "absent")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nnodes", "2:3", "--", "true"], "runs inside a Slurm step"),
        (["run", "--store-url", "etcd://h:2379", "--", "true"], "go with --nnodes"),
    ],
)
def test_run_nnodes_is_refused_outside_a_slurm_step(argv, message, monkeypatch, capsys):
    """Outside ``srun`` (no SLURM_STEP_ID), --nnodes and its companions exit 2 saying why."""
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


# -- the step's token, and the store host's proof ------------------------------------


@pytest.mark.parametrize(
    ("secret", "step", "other"),
    [
        ("s3cret", "41.0", ("s3cret", "41.1")),  # the next step of the job
        ("s3cret", "41.0", ("s3cret", "410.")),  # the same characters, split elsewhere
        ("s3cret", "41.0", ("s3cres", "41.0")),  # another user's home
    ],
)
def test_a_step_token_is_the_secrets_hmac_for_that_step_only(secret, step, other):
    """HMAC-SHA256(secret, "elasticd-slurm-step:JOB.STEP"), hex; another step or secret
    gives another token, and the secret is not in it."""
    token = allocation.step_token(secret, step)
    expected = hmac.new(secret.encode(), f"elasticd-slurm-step:{step}".encode(), "sha256")
    assert token == expected.hexdigest()
    assert allocation.step_token(*other) != token and secret not in token


def test_the_plan_names_its_step():
    task = allocation.SlurmTask(job_id="41", step_id="3", nodes=("a", "b"), node_id=1)
    assert allocation.plan_allocation_run(task, "2").step == "41.3"


@pytest.mark.parametrize(
    ("proof_of", "holds"),
    [
        (lambda token, nonce: allocation.store_proof(token, nonce), True),
        (lambda token, nonce: allocation.store_proof(token, nonce + "x"), False),  # replayed
        (lambda token, nonce: allocation.store_proof(token + "x", nonce), False),  # other step
        (
            lambda token, nonce: hmac.new(token.encode(), nonce.encode(), "sha256").hexdigest(),
            False,
        ),
        (lambda token, nonce: token, False),  # the token itself is no proof
        (lambda token, nonce: None, False),
        (lambda token, nonce: 17, False),
        (lambda token, nonce: "é" * 64, False),
    ],
)
def test_only_the_steps_token_holder_proves_itself(proof_of, holds):
    """HMAC-SHA256(step token, "elasticd-slurm-proof:" + nonce) is the proof; a relay of
    another step's store host, a replay for another nonce or garbage is not."""
    token, nonce = allocation.step_token("s3cret", "41.0"), "n" * 32
    assert allocation.proof_holds(token, nonce, proof_of(token, nonce)) is holds


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Holds the store host's port first: 200 to everything; records each Authorization."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = b'{"status": "ok", "proof": "' + b"0" * 64 + b'"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def impostor() -> Iterator[int]:
    _Impostor.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.timeout(120)
def test_a_task_sends_no_token_to_a_store_host_that_cannot_prove_itself(impostor, tmp_path):
    """Another user's server holds the step's store port and answers 200 to everything:
    task 1's `elasticd run --nnodes` (a real process, its Slurm environment faked) sends it
    no token, starts no worker, and exits 2 saying the store host did not prove itself."""
    home = tmp_path / "home"
    home.mkdir()
    marker = tmp_path / "worker-ran"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ELASTICD_"))},
        "HOME": str(home),
        "SLURM_JOB_ID": "41",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost,localhost",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--nnodes",
            "2",
            "--port",
            str(impostor),
            "--",
            "touch",
            str(marker),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "did not prove it holds this step's token" in done.stderr
    assert "no token was sent" in done.stderr
    assert _Impostor.seen, "the task never asked the store host"
    assert all(auth is None for _, auth in _Impostor.seen), _Impostor.seen
    secret = (home / ".config" / "elasticd" / "slurm-token").read_text().strip()
    sent = " ".join(path for path, _ in _Impostor.seen)
    assert secret not in sent and allocation.step_token(secret, "41.0") not in sent
    assert not marker.exists()


class _Prover(_Impostor):
    """A store host holding :data:`_Prover.token`: answers the challenge with its proof."""

    token = ""

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        proof = allocation.store_proof(self.token, query["nonce"][0])
        body = json.dumps({"proof": proof}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.timeout(60)
async def test_a_store_host_that_proves_itself_passes_and_another_steps_does_not():
    """The check passes for the step's own store host; a task of another step (its token
    another) refuses that same host: a relayed challenge proves nothing."""
    _Prover.seen, _Prover.token = [], allocation.step_token("s3cret", "41.0")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Prover)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        await slurm_run.verify_store_host(url, _Prover.token, timeout=20)
        with pytest.raises(ConfigError, match="did not prove"):
            await slurm_run.verify_store_host(url, allocation.step_token("s3cret", "41.1"))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert [auth for _, auth in _Prover.seen] == [None, None]
