"""Bad input: schemathesis against the checked-in openapi.json on a live daemon, and a matrix
of hand-written bad requests. Every one gets a clear 4xx and the daemon keeps serving.

The fuzzed daemon runs jobs as nobody's business: as root it refuses root jobs (no
``allow_root``) and its workers' PATH names no folder, so no generated job runs anything.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from elasticd.rendezvous import state_key
from tests.hardening.support import Served, make_token_file, serve

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
from tests.hardening.schemathesis_bounds import bound_query  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 40
#: Answered without a token by design: liveness, the page (its API calls carry the token), and
#: a Slurm step's store host proving it holds the step's token (an HMAC of the caller's nonce;
#: 404 on any other daemon), asked before a task sends it anything (issue 38).
PUBLIC = {"/healthz", "/ui", "/slurm/proof"}
#: Operations not fuzzed: ``POST /reload`` re-executes the daemon (its answers are tested on
#: real daemons in tests/hardening/test_reexec.py, its authorization in tests/unit/test_identity.py).
NOT_FUZZED = {"/reload"}
#: Statuses routes answer but do not document, in code this suite does not own:
#: /store/watch's 410 (also for a negative `after`). Drop it once the route documents it.
KNOWN_UNDOCUMENTED = {
    ("/store/watch", 410, "Store history compacted"),
}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("fuzz")
    token_file, _ = make_token_file(root)
    daemon = serve(
        root,
        token_file=token_file,
        env={
            "ELASTICD_ALLOW_ROOT": "false",
            # Fuzzed jobs run as nobody (a root daemon refuses the admin's jobs without a user).
            **({"ELASTICD_RUN_AS": "nobody"} if os.geteuid() == 0 else {}),
            "PATH": "/nonexistent-elasticd-fuzz",
        },
    )
    try:
        asyncio.run(daemon.wait_ready())
        yield daemon
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0, daemon.output()[-3000:]
    # No request ever reached an unhandled exception in the app (uvicorn logs those).
    assert "Exception in ASGI application" not in daemon.output(), daemon.output()[-5000:]


def _bounded(case: Any) -> None:
    """Long-polls and streams answer within a fraction of a second."""
    query = case.query if isinstance(case.query, dict) else None
    bound_query(case.operation.path, query)


def _check(case: Any, response: Any, label: str) -> None:
    from schemathesis.checks import positive_data_acceptance
    from schemathesis.openapi.checks import UndefinedStatusCode

    # positive_data_acceptance is left out: JSON Schema cannot say everything the
    # validators check (standard base64, store-key characters, torchrun's redirects
    # syntax), so schema-valid input may still get a clear 422.
    try:
        case.validate_response(response, excluded_checks=[positive_data_acceptance])
    except BaseExceptionGroup as group:
        title = _title(response)
        rest = group.subgroup(
            lambda exc: (
                not isinstance(exc, BaseExceptionGroup)
                and not (
                    isinstance(exc, UndefinedStatusCode)
                    and any(
                        case.operation.path.startswith(prefix)
                        and response.status_code == status
                        and title == known_title
                        for prefix, status, known_title in KNOWN_UNDOCUMENTED
                    )
                )
            )
        )
        if rest is not None:
            raise rest from None


def _title(response: Any) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("title") if isinstance(body, dict) else None


def test_schemathesis_finds_no_500_no_schema_mismatch_and_no_way_past_the_token(
    live: Served,
) -> None:
    """Every operation of openapi.json, EXAMPLES generated requests each (valid and invalid):
    no 5xx, every response as documented, and the same request without the token is 401."""
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_path(ROOT / "openapi.json")
    auth = {"Authorization": f"Bearer {live.token}", "Accept": "application/json"}
    statuses: dict[int, int] = {}
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in NOT_FUZZED:
            continue

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        @given(case=operation.as_strategy())
        def fuzz(case: Any) -> None:
            label = case.operation.label
            _bounded(case)
            response = case.call(base_url=live.url, headers=auth, timeout=10)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (label, response.status_code, response.text)
            _check(case, response, label)
            if case.operation.path not in PUBLIC:
                anonymous = case.call(
                    base_url=live.url, headers={"Accept": "application/json"}, timeout=10
                )
                assert anonymous.status_code in (401, 413), (label, anonymous.status_code)
                if anonymous.status_code == 413:  # refused for its size before anything else
                    assert response.status_code == 413

        fuzz()
    assert time.monotonic() - started < 60
    assert sum(statuses.values()) > 100
    assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200


def test_schemathesis_stateful_sequences_get_documented_answers(live: Served) -> None:
    """schemathesis' own command, stateful phase: sequences of calls linked by the ids one
    answer gives the next (submit -> get -> cancel, grant -> keep-alive ...), every answer
    a documented status with a body of its documented schema."""
    started = time.monotonic()
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "schemathesis"),
            "run",
            str(ROOT / "openapi.json"),
            "--url",
            live.url,
            "-H",
            f"Authorization: Bearer {live.token}",
            "--phases",
            "stateful",
            "--checks",
            "response_schema_conformance,status_code_conformance",
            "--max-examples",
            "10",
            "--generation-deterministic",
            "--no-color",
            *(arg for path in sorted(NOT_FUZZED) for arg in ("--exclude-path", path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        # Long-polls bounded as in the test above (a 60 s wait would read-time out).
        env={
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.hardening.schemathesis_bounds",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert "Stateful" in done.stdout and "No issues found" in done.stdout, done.stdout[-3000:]
    assert time.monotonic() - started < 60


# -- the hand-written matrix -------------------------------------------------------------


def _client(live: Served) -> httpx.Client:
    return httpx.Client(base_url=live.url, headers=live.headers, timeout=10)


def _problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body: dict[str, Any] = r.json()
    assert body["status"] == status and body["detail"], body
    return body


GOOD = {"entrypoint": "/bin/true"}
HUGE = 10**40


@pytest.mark.parametrize(
    ("name", "request_", "status"),
    [
        ("not json", ("POST", "/jobs", {"content": b"{nope", "json_ct": True}), 422),
        ("form, not json", ("POST", "/jobs", {"content": b"entrypoint=x"}), 415),
        ("empty body", ("POST", "/jobs", {"content": b"", "json_ct": True}), 422),
        ("a list, not an object", ("POST", "/jobs", {"json": [GOOD]}), 422),
        ("wrong type", ("POST", "/jobs", {"json": {**GOOD, "nproc_per_node": "two"}}), 422),
        ("args not a list", ("POST", "/jobs", {"json": {**GOOD, "args": "a b"}}), 422),
        ("env values not strings", ("POST", "/jobs", {"json": {**GOOD, "env": {"A": 1}}}), 422),
        ("huge integer", ("POST", "/jobs", {"json": {**GOOD, "max_restarts": HUGE}}), 422),
        (
            "huge float",
            (
                "POST",
                "/jobs",
                {"content": b'{"entrypoint": "x", "join_timeout": 1e999}', "json_ct": True},
            ),
            422,
        ),
        (
            "NaN",
            (
                "POST",
                "/jobs",
                {"content": b'{"entrypoint": "x", "termination_grace": NaN}', "json_ct": True},
            ),
            422,
        ),
        ("negative grace", ("POST", "/jobs", {"json": {**GOOD, "termination_grace": -1}}), 422),
        ("zero join timeout", ("POST", "/jobs", {"json": {**GOOD, "join_timeout": 0}}), 422),
        ("negative wait", ("GET", "/jobs/x/events", {"params": {"wait": -1}}), 422),
        ("huge limit", ("GET", "/jobs", {"params": {"limit": HUGE}}), 422),
        ("negative offset", ("GET", "/jobs", {"params": {"offset": -1}}), 422),
        (
            "negative store watch timeout",
            ("GET", "/store/watch", {"params": {"key": "a", "timeout": -1}}),
            422,
        ),
        ("huge lease ttl", ("POST", "/store/leases", {"json": {"ttl": 1e300}}), 422),
        ("unknown job", ("GET", "/jobs/no-such-job", {}), 404),
        ("unknown job workers", ("GET", "/jobs/no-such-job/workers", {}), 404),
        ("unknown job goodput", ("GET", "/jobs/no-such-job/goodput", {}), 404),
        ("unknown job events", ("GET", "/jobs/no-such-job/events", {}), 404),
        ("unknown job logs", ("GET", "/jobs/no-such-job/logs", {}), 404),
        ("cancel unknown job", ("POST", "/jobs/no-such-job/cancel", {"json": {}}), 404),
        ("unknown lease", ("POST", "/store/leases/12345/keepalive", {"json": {}}), 404),
        ("unknown route", ("GET", "/nope", {}), 404),
        ("wrong method", ("DELETE", "/jobs", {}), 405),
        ("traversal in the job id", ("GET", "/jobs/..%2F..%2Fetc/logs", {}), 404),
        (
            "traversal in the stream",
            ("GET", "/jobs/x/logs", {"params": {"stream": "../../etc/passwd"}}),
            422,
        ),
        ("traversal in the rank", ("GET", "/jobs/x/logs", {"params": {"local_rank": "../0"}}), 422),
        (
            "traversal in the attempt",
            ("GET", "/jobs/x/logs", {"params": {"attempt": "../../1"}}),
            422,
        ),
        ("traversal in the node", ("GET", "/jobs/x/logs", {"params": {"node": "../../etc"}}), 422),
        ("store key with ..", ("GET", "/store/kv", {"params": {"key": "job/../node/x"}}), 422),
        (
            "store put with ..",
            ("PUT", "/store/kv", {"json": {"key": "../x", "value": "eA=="}}),
            422,
        ),
        (
            "store cas with ..",
            (
                "POST",
                "/store/cas",
                {"json": {"key": "a/../b", "value": "eA==", "expected_version": None}},
            ),
            422,
        ),
        ("store delete with ..", ("DELETE", "/store/kv", {"params": {"key": ".."}}), 422),
        ("store add with ..", ("POST", "/store/add", {"json": {"key": "x/..", "delta": 1}}), 422),
        (
            "store value not base64",
            ("PUT", "/store/kv", {"json": {"key": "k", "value": "not base64!"}}),
            422,
        ),
        ("store key with NUL", ("GET", "/store/kv", {"params": {"key": "a\x00b"}}), 422),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_daemon_keeps_serving(
    live: Served, name: str, request_: tuple[str, str, dict[str, Any]], status: int
) -> None:
    """Each bad request: the stated 4xx as problem+json with a detail; /healthz still answers."""
    method, path, kwargs = request_
    kwargs = dict(kwargs)
    headers = {"content-type": "application/json"} if kwargs.pop("json_ct", False) else {}
    with _client(live) as c:
        _problem(c.request(method, path, headers=headers, **kwargs), status)
        assert c.get("/healthz").status_code == 200


UNDECODABLE = b"\xff\xfe{"


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("post", "/jobs", UNDECODABLE, 400),
        ("post", "/jobs/no-such-job/cancel", UNDECODABLE, 400),
        ("post", "/store/add", UNDECODABLE, 400),
        ("post", "/store/batch", UNDECODABLE, 400),
        ("post", "/store/cas", UNDECODABLE, 400),
        ("post", "/store/leases", UNDECODABLE, 400),
        ("put", "/store/kv", b'{"key": "k", "value": "eA==", "lease": 987654}', 404),
        ("post", "/store/leases/987654/keepalive", b"{}", 404),
    ],
)
def test_what_the_routes_answer_is_in_openapi_json(
    live: Served, method: str, path: str, body: bytes, status: int
) -> None:
    """A body that is not UTF-8 JSON gets 400, an unknown lease 404: problems that the
    checked-in openapi.json documents for that operation (schemathesis found them missing)."""
    with _client(live) as c:
        answer = c.request(
            method.upper(), path, content=body, headers={"content-type": "application/json"}
        )
    _problem(answer, status)
    doc = json.loads((ROOT / "openapi.json").read_text())
    template = "/jobs/{job_id}/cancel" if path.startswith("/jobs/") else path
    template = "/store/leases/{lease}/keepalive" if "keepalive" in path else template
    documented = doc["paths"][template][method]["responses"]
    assert str(status) in documented
    assert "application/problem+json" in documented[str(status)]["content"]


def _job(c: httpx.Client, job_id: str, **fields: Any) -> httpx.Response:
    return c.post("/jobs", json={"id": job_id, "entrypoint": "/bin/true", **fields})


def _wait_terminal(c: httpx.Client, job_id: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = c.get(f"/jobs/{job_id}").json()
        if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return job
        assert time.monotonic() < deadline, job
        c.get(f"/jobs/{job_id}/events", params={"wait": 1, "after": 0})


def test_duplicate_ids_and_cancel_of_a_finished_job(live: Served) -> None:
    """Same id + same spec: 200 and the same job; different spec: 409; cancel after the end: 409."""
    with _client(live) as c:
        first = _job(c, "dup")
        assert first.status_code == 201
        again = _job(c, "dup")
        assert again.status_code == 200 and again.json()["id"] == "dup"
        assert "already" not in again.text
        body = _problem(_job(c, "dup", args=["other"]), 409)
        assert "different spec" in body["detail"]
        job = _wait_terminal(c, "dup")
        body = _problem(c.post("/jobs/dup/cancel", json={}), 409)
        assert f"already ended as {job['state']}" in body["detail"]


def test_a_cancel_racing_the_jobs_own_failure_is_200_or_409_never_500(live: Served) -> None:
    """A job of `live` ends a few ms after its submission, so a cancel sent 0-39 ms after it
    races that end (CI's stateful run found the 500): each answer is the cancel, or a 409
    that names the end the job kept."""
    answers = []
    with _client(live) as c:
        for i in range(40):  # the cancel sent 0 to 39 ms after the submission
            assert _job(c, f"race-{i}").status_code == 201
            time.sleep(i / 1000)
            answers.append(c.post(f"/jobs/race-{i}/cancel", json={}))
        for i, answer in enumerate(answers):
            assert answer.status_code in (200, 409), answer.text
            end = _wait_terminal(c, f"race-{i}")["state"]
            if answer.status_code == 200:
                assert end == "CANCELLED"
            else:
                assert f"already ended as {end}" in _problem(answer, 409)["detail"]


@pytest.fixture
def runs_jobs(tmp_path: Path) -> Iterator[Served]:
    """A daemon like `live` that does run jobs (as nobody): `live` fails every job at once,
    before its rendezvous, because it refuses root jobs."""
    if os.geteuid() != 0:
        pytest.skip("run_as needs root")
    token_file, _ = make_token_file(tmp_path)
    daemon = serve(
        tmp_path,
        "--run-as",
        "nobody",
        token_file=token_file,
        env={
            "ELASTICD_ALLOW_ROOT": "false",
            # Fuzzed jobs run as nobody (a root daemon refuses the admin's jobs without a user).
            **({"ELASTICD_RUN_AS": "nobody"} if os.geteuid() == 0 else {}),
            "PATH": "/nonexistent-elasticd-fuzz",
        },
    )
    try:
        asyncio.run(daemon.wait_ready())
        yield daemon
    finally:
        daemon.stop()
    assert "Exception in ASGI application" not in daemon.output(), daemon.output()[-5000:]


def test_a_rendezvous_document_that_is_not_json_fails_the_job_clearly(runs_jobs: Served) -> None:
    """Garbage written to the rendezvous document (through the store API) while the job waits for a
    second node: the job FAILS naming the malformed document; the daemon keeps serving."""
    key = state_key("garbled")
    with _client(runs_jobs) as c:
        # A second live node (a record bound to a lease, no daemon behind it), so that the
        # fleet scheduler places the two-node job and this node's agent joins and waits.
        lease = c.post("/store/leases", json={"ttl": 120}).json()["lease"]
        me = c.get("/nodes").json()[0]
        ghost = {**me, "name": "ghost", "url": "http://127.0.0.1:9"}
        value = base64.b64encode(json.dumps(ghost).encode()).decode()
        r = c.put("/store/kv", json={"key": "nodes/ghost", "value": value, "lease": lease})
        assert r.status_code == 200, r.text
        r = c.post(
            "/jobs",
            json={"id": "garbled", "entrypoint": "/bin/true", "min_nodes": 2, "join_timeout": 60},
        )
        assert r.status_code == 201
        deadline = time.monotonic() + 20
        while not c.get("/store/kv", params={"key": key}).json()["entry"]:
            assert time.monotonic() < deadline, "the job never joined its rendezvous"
            time.sleep(0.02)
        garbage = base64.b64encode(b"\x00{not json at all").decode()
        r = c.put("/store/kv", json={"key": key, "value": garbage})
        assert r.status_code == 200
        # ~30 s on main too: a node in an open round watches only the done key and reads
        # the document again at its next wake-up (rendezvous MAX_WATCH, 30 s).
        job = _wait_terminal(c, "garbled", timeout=90)
        assert job["state"] == "FAILED", job
        assert "malformed" in json.dumps(job), job
        assert c.get("/jobs/garbled/workers").status_code == 200
        # A garbled goodput record (anyone with the cluster token writes the store) is
        # left out of the job's figures, never an error.
        junk = base64.b64encode(b'{"node": "evil", "attempts": [{"round": -1}]}').decode()
        assert c.put("/store/kv", json={"key": "gp/garbled/evil", "value": junk}).status_code == 200
        assert c.get("/jobs/garbled/goodput").status_code == 200
        assert c.get("/jobs").status_code == 200
        assert c.get("/healthz").status_code == 200


def test_a_job_document_that_is_not_a_job_is_a_clear_409(live: Served) -> None:
    """Garbage written to job/<id> through the store: every route on that job answers 409
    naming the key to delete; listing skips it; the daemon keeps serving."""
    with _client(live) as c:
        garbage = base64.b64encode(b'{"id": "junk"}').decode()
        assert c.put("/store/kv", json={"key": "job/junk", "value": garbage}).status_code == 200
        for method, path in [
            ("GET", "/jobs/junk"),
            ("GET", "/jobs/junk/workers"),
            ("GET", "/jobs/junk/goodput"),
            ("GET", "/jobs/junk/events"),
            ("GET", "/jobs/junk/logs"),
            ("POST", "/jobs/junk/cancel"),
        ]:
            body = _problem(c.request(method, path, json={} if method == "POST" else None), 409)
            assert "'job/junk'" in body["detail"], body
        body = _problem(_job(c, "junk"), 409)
        assert "not a valid job" in body["detail"]
        assert "junk" not in [j["id"] for j in c.get("/jobs").json()["jobs"]]
        assert c.get("/healthz").status_code == 200
