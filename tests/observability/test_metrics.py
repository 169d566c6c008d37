"""/metrics: the Prometheus series, fed by events and job documents, behind the bearer token."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from elasticd.eventkinds import EventKind
from elasticd.models import Event, Job, JobSpec, incarnation_tag
from elasticd.node import metrics as m
from elasticd.node.metrics import Metrics, exit_reason, flakiness, recovery_phase, run_outcome
from elasticd.states import JobState
from tests.conftest import PY, make_daemon, script, wait_job
from tests.observability.support import CRASH_ONCE


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape[(name, tuple(sorted(labels.items())))]


def event(kind: str, job_id: str = "j", **fields) -> Event:
    base = {"seq": 1, "time": 100.0, "job_id": job_id, "node": "n1", "source": "agent"}
    return Event(**{**base, "kind": kind, **fields})


def job(job_id: str, state: JobState, restarts: int = 0, max_restarts: int = 3, **kw) -> Job:
    return Job(
        id=job_id,
        spec=JobSpec(entrypoint="x", max_restarts=max_restarts),
        state=state,
        restart_count=restarts,
        max_restarts=max_restarts,
        created_at=kw.pop("created_at", 1.0),
        **kw,
    )


def test_flakiness_is_the_seeds_formula_as_a_ratio():
    """torch's formula over 100: 1 when failed, else 1 - (remaining+1)/(max+1)."""
    assert flakiness(failed=True, restart_count=0, max_restarts=3) == 1.0
    assert flakiness(failed=False, restart_count=0, max_restarts=3) == 0.0
    assert flakiness(failed=False, restart_count=1, max_restarts=3) == 0.25
    assert flakiness(failed=False, restart_count=3, max_restarts=3) == 0.75
    assert flakiness(failed=False, restart_count=0, max_restarts=0) == 0.0


@pytest.mark.parametrize(
    ("failed", "restarts", "outcome"),
    [
        (False, 0, "success_no_retries"),
        (False, 2, "success_with_retries"),
        (True, 0, "failed_no_retries"),
        (True, 1, "failed_with_retries"),
    ],
)
def test_a_runs_outcome_label_is_torchs_counter_name(failed, restarts, outcome):
    """elasticd_run_total{outcome} takes the names of torch's four run_* counters."""
    assert run_outcome(failed=failed, restart_count=restarts) == outcome
    assert outcome in m.RUN_OUTCOMES


def test_exit_reasons_and_phases_come_from_the_tables():
    """worker.exited is classified by its fields; hang/health-check and recovery.* come by kind."""
    assert exit_reason(event("worker.exited", state="FAILED", exit_code=3)) == "exit_code"
    assert exit_reason(event("worker.exited", state="FAILED", signal=9)) == "signal"
    assert exit_reason(event("worker.exited", state="SUCCEEDED", exit_code=0)) == "success"
    assert exit_reason(event("worker.exited", state="STOPPED", signal=15)) == "stopped"
    assert exit_reason(event("worker.hang")) == "hang"
    assert exit_reason(event("worker.health_check_failed")) == "health_check"
    assert exit_reason(event("group.state")) is None
    assert recovery_phase("recovery.stop_workers") == "stop_workers"
    assert recovery_phase("workers.stopped") is None  # a cancel stops workers too: no recovery
    assert recovery_phase("recovery.first_progress") == "first_progress"
    assert recovery_phase("exit_barrier.done") is None


def test_sink_counts_a_restart_and_records_the_run_once():
    """A failure, a restart and a success become counters, a phase timeline and run metrics."""
    sink = Metrics()
    sink.on_jobs([job("j", JobState.RUNNING)])
    sink.on_event(event("group.state", state="HEALTHY"))
    sink.on_event(event("worker.exited", state="FAILED", exit_code=3, time=100.0))
    sink.on_event(event("recovery.detected", time=100.0))
    sink.on_event(event("workers.stopped", duration_s=0.5, time=100.5))
    sink.on_event(event("recovery.stop_workers", duration_s=0.5, time=100.5))
    sink.on_event(event("group.restarting", time=100.6))
    sink.on_event(event("rendezvous.complete", duration_s=0.25, time=101.0))
    sink.on_event(event("workers.started", time=101.5))
    sink.on_event(event("recovery.rendezvous", duration_s=0.25, time=101.5))
    sink.on_event(event("recovery.spawn", duration_s=0.75, time=101.5))
    sink.on_event(event("recovery.total", duration_s=1.5, time=101.5))
    sink.on_event(event("recovery.first_progress", duration_s=2.0, time=103.5))
    sink.on_event(event("group.state", state="SUCCEEDED"))
    done = job("j", JobState.SUCCEEDED, restarts=1, finished_at=104.0)
    sink.on_jobs([done])
    sink.on_jobs([done])  # a later snapshot does not count the run again
    scrape = samples(sink.render().decode())
    assert value(scrape, "elasticd_restarts_total") == 1
    assert value(scrape, "elasticd_worker_exits_total", reason="exit_code") == 1
    assert value(scrape, "elasticd_worker_exits_total", reason="hang") == 0
    assert value(scrape, "elasticd_rendezvous_rounds_total") == 1
    phase = "elasticd_recovery_phase_duration_seconds"
    assert value(scrape, f"{phase}_sum", phase="stop_workers") == 0.5
    assert value(scrape, f"{phase}_sum", phase="rendezvous") == 0.25
    assert value(scrape, f"{phase}_sum", phase="first_progress") == 2.0
    assert value(scrape, f"{phase}_sum", phase="total") == 1.5
    run = {"role": "default"}
    assert value(scrape, "elasticd_run_total", **run, outcome="success_with_retries") == 1
    assert value(scrape, "elasticd_run_total", **run, outcome="failed_no_retries") == 0
    assert value(scrape, "elasticd_flakiness_ratio", job_id="j", role="default") == 0.25
    assert value(scrape, "elasticd_jobs", state="SUCCEEDED") == 1
    assert value(scrape, "elasticd_job_remaining_restarts", job_id="j") == 2
    assert value(scrape, "elasticd_worker_group_state", job_id="j", node="n1", state="SUCCEEDED")
    assert not value(scrape, "elasticd_worker_group_state", job_id="j", node="n1", state="HEALTHY")


@pytest.mark.parametrize(
    ("before", "now", "expected"),
    [
        ({"j": 1.0}, {"j": 1.0}, []),  # the same job
        ({"j": 1.0}, {"j": 6.0}, ["j"]),  # taken again between two looks
        ({"j": 1.0}, {}, ["j"]),  # deleted
        ({}, {"j": 1.0}, []),  # not seen before: its events came first
    ],
)
def test_replaced_ids_are_those_gone_or_taken_again(before, now, expected):
    """Which ids this node ran no longer name the job it ran (pure)."""

    def docs(created: dict[str, float]) -> dict[str, Job]:
        return {i: job(i, JobState.RUNNING, created_at=at) for i, at in created.items()}

    assert m.replaced(docs(before), docs(now), ["j"]) == expected


def test_a_new_job_of_a_deleted_jobs_id_is_a_run_of_its_own():
    """The id of a job that ran here is deleted and taken again (seen between two looks):
    the new job's run is recorded too, and its group's state is its own. Before, what the
    node kept by id (the run recorded, the group state) was the old job's: the new job's
    failed run was never counted, its flakiness was the old job's."""
    sink = Metrics()
    old = job("j", JobState.RUNNING, created_at=1.0)
    sink.on_jobs([old])
    sink.on_event(event("group.state", state="HEALTHY", job_tag=incarnation_tag(old)))
    sink.on_event(event("group.state", state="SUCCEEDED", job_tag=incarnation_tag(old)))
    sink.on_jobs([job("j", JobState.SUCCEEDED, created_at=1.0, finished_at=5.0)])
    new = job("j", JobState.RUNNING, created_at=6.0)
    sink.on_jobs([new])
    sink.on_event(event("group.state", state="HEALTHY", job_tag=incarnation_tag(new)))
    sink.on_event(event("group.state", state="FAILED", job_tag=incarnation_tag(new)))
    sink.on_jobs([job("j", JobState.FAILED, created_at=6.0, finished_at=9.0)])
    scrape = samples(sink.render().decode())
    run = {"role": "default"}
    assert value(scrape, "elasticd_run_total", **run, outcome="success_no_retries") == 1
    assert value(scrape, "elasticd_run_total", **run, outcome="failed_no_retries") == 1
    assert value(scrape, "elasticd_flakiness_ratio", job_id="j", role="default") == 1.0


def test_a_new_job_of_a_deleted_jobs_id_that_never_ran_here_is_no_run_here():
    """The old job ran here, the new one of its id elsewhere: its end is no run of this node."""
    sink = Metrics()
    old = job("j", JobState.RUNNING, created_at=1.0)
    sink.on_jobs([old])
    sink.on_event(event("group.state", state="HEALTHY", job_tag=incarnation_tag(old)))
    sink.on_jobs([])  # deleted (it was cancelled: no run)
    sink.on_jobs([job("j", JobState.FAILED, created_at=6.0, finished_at=9.0)])
    scrape = samples(sink.render().decode())
    assert not any(name == "elasticd_run_total" for name, _ in scrape)
    group = "elasticd_worker_group_state"
    assert not [labels for name, labels in scrape if name == group and ("job_id", "j") in labels]


def test_first_rendezvous_is_not_a_recovery_and_cancel_is_not_a_run():
    """Only a rendezvous after a failure is a recovery phase; a cancelled job records no run."""
    sink = Metrics()
    sink.on_event(event("rendezvous.complete", duration_s=0.3))
    sink.on_event(event("group.state", state="HEALTHY"))
    sink.on_jobs([job("j", JobState.CANCELLED, finished_at=5.0)])
    scrape = samples(sink.render().decode())
    assert value(scrape, "elasticd_rendezvous_duration_seconds_count") == 1
    assert ("elasticd_recovery_phase_duration_seconds_count", (("phase", "rendezvous"),)) not in (
        scrape
    )
    assert not any(name == "elasticd_run_total" for name, _ in scrape)


def test_per_job_series_keep_only_recent_finished_jobs():
    """Active jobs and the newest finished ones have per-job series; older ones drop off."""
    sink = Metrics(keep_finished=2)
    finished = [job(f"f{i}", JobState.SUCCEEDED, finished_at=float(i)) for i in range(5)]
    sink.on_jobs([job("live", JobState.RUNNING), *finished])
    scrape = samples(sink.render().decode())
    shown = {dict(labels)["job_id"] for name, labels in scrape if name == "elasticd_job_restarts"}
    assert shown == {"live", "f3", "f4"}
    assert value(scrape, "elasticd_jobs", state="SUCCEEDED") == 5


def test_queue_and_placement_series_come_from_the_plan():
    from elasticd.sched.plan import FleetPlan, Placement, QueueEntry

    sink = Metrics()
    sink.on_jobs([job("a", JobState.RUNNING), job("b", JobState.PENDING)])
    entry = QueueEntry(job="b", position=1, priority=0, reason="capacity", message="m", since=0)
    sink.on_plan(
        FleetPlan(
            placements={"a": Placement(nodes=["n0", "n1"], spares=["n2"], placed_at=0)},
            queue=[entry],
        )
    )
    sink.on_event(event("job.preempted", "b"))
    scrape = samples(sink.render().decode())
    assert value(scrape, "elasticd_queued_jobs", reason="capacity") == 1
    assert value(scrape, "elasticd_queued_jobs", reason="unplaceable") == 0
    assert value(scrape, "elasticd_placed_slots", node="n2") == 1
    assert value(scrape, "elasticd_preemptions_total") == 1


def test_store_requests_are_observed():
    """observe_store_request feeds the latency histogram and the error counter."""
    m.observe_store_request("get_test", 0.002)
    m.observe_store_request("get_test", 0.5, error=True)
    scrape = samples(Metrics().render().decode())
    assert value(scrape, "elasticd_store_request_duration_seconds_count", op="get_test") == 2
    assert value(scrape, "elasticd_store_request_errors_total", op="get_test") == 1


async def test_scrape_after_a_crash_once_job(client, tmp_path):
    """A scrape after a job that crashed once parses and tells the story of that job."""
    path = script(tmp_path, "crash.py", CRASH_ONCE)
    r = await client.post("/jobs", json={"entrypoint": PY, "args": [path], "nproc_per_node": 2})
    job_id = r.json()["id"]
    assert (await wait_job(client, job_id))["state"] == "SUCCEEDED"
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    scrape = samples(r.text)
    assert value(scrape, "elasticd_jobs", state="SUCCEEDED") == 1
    assert value(scrape, "elasticd_jobs", state="RUNNING") == 0
    assert value(scrape, "elasticd_restarts_total") == 1
    assert value(scrape, "elasticd_job_restarts", job_id=job_id) == 1
    assert value(scrape, "elasticd_job_remaining_restarts", job_id=job_id) == 2
    assert value(scrape, "elasticd_worker_exits_total", reason="exit_code") == 1
    assert value(scrape, "elasticd_worker_exits_total", reason="success") == 3
    assert value(scrape, "elasticd_rendezvous_rounds_total") == 2
    assert value(scrape, "elasticd_rendezvous_duration_seconds_count") == 2
    phase = "elasticd_recovery_phase_duration_seconds_count"
    assert value(scrape, phase, phase="rendezvous") == 1
    assert value(scrape, phase, phase="stop_workers") >= 1
    assert value(scrape, phase, phase="total") == 1
    run = {"role": "default"}
    assert value(scrape, "elasticd_run_total", **run, outcome="success_with_retries") == 1
    assert value(scrape, "elasticd_run_total", **run, outcome="success_no_retries") == 0
    assert value(scrape, "elasticd_flakiness_ratio", job_id=job_id, role="default") == 0.25
    group = {"job_id": job_id, "node": "node-a"}
    assert value(scrape, "elasticd_worker_group_state", **group, state="SUCCEEDED") == 1
    assert value(scrape, "elasticd_worker_group_state", **group, state="HEALTHY") == 0


@pytest.mark.parametrize(
    ("public", "client_host", "expected"),
    [(False, "127.0.0.1", 401), (True, "127.0.0.1", 200), (True, "10.1.2.3", 401)],
)
async def test_metrics_need_the_token_unless_public_on_loopback(
    tmp_path, public, client_host, expected
):
    """/metrics is bearer-protected; metrics_public lets only loopback scrapers in without it."""
    d = make_daemon(tmp_path, token="s3cret", metrics_open_on_loopback=public)
    async with asyncio.timeout(30):
        await d.start()
        try:
            transport = httpx.ASGITransport(app=create_app(d), client=(client_host, 5555))
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                assert (await c.get("/metrics")).status_code == expected
                ok = await c.get("/metrics", headers={"Authorization": "Bearer s3cret"})
                assert ok.status_code == 200 and "elasticd_jobs" in ok.text
        finally:
            await d.shutdown()


def test_goodput_series_are_the_last_figures_of_jobs_run_here():
    """elasticd_job_goodput_ratio and elasticd_job_badput_seconds_total{kind} show the figures
    handed in; a scrape recomputes the jobs running here and, once, those that ended here."""
    from elasticd.goodput import BADPUT_KINDS, Goodput, GoodputSteps

    metrics = Metrics()
    metrics.on_jobs([job("a", JobState.SUCCEEDED, finished_at=5.0), job("b", JobState.RUNNING)])
    metrics.on_event(event("group.state", job_id="a", state="SUCCEEDED"))
    assert metrics.goodput_to_refresh(["b"]) == ["a", "b"]
    steps = GoodputSteps(max_step=None, checkpoint_step=None, lost_steps=None, failures=0)
    bad = dict.fromkeys(BADPUT_KINDS, 0.0) | {"startup": 1.0}
    figures = Goodput(
        job_id="a", as_of=5, finished=True, wall_s=4, productive_s=3, goodput=0.75,
        badput_s=bad, steps=steps, steps_reported=False, lost_work_known=False, attempts=1,
    )  # fmt: skip
    metrics.on_goodput([figures])
    assert metrics.goodput_to_refresh([]) == []  # its final figures are taken
    scrape = samples(metrics.render().decode())
    assert value(scrape, "elasticd_job_goodput_ratio", job_id="a") == 0.75
    labels = {"job_id": "a", "kind": "startup"}
    assert value(scrape, "elasticd_job_badput_seconds_total", **labels) == 1.0


def test_node_series_are_bounded_and_keep_quarantined_nodes_first():
    """Per node: quarantined 0/1 and the counted failures by kind; past the bound the
    quarantined nodes stay, then the live ones, and the rest are counted as left out;
    a key that names no node gets no series."""
    from elasticd.node.quarantine import HealthEntry, NodeHealth, Quarantine

    now = 1_700_000_000.0
    held = Quarantine(reason="bad DIMM", since=now - 5, by="admin")
    expired = Quarantine(reason="ttl", since=now - 60, by="policy", until=now - 1)
    entries = [
        HealthEntry(kind="hardware", at=now - 10, job="j", round=0),
        HealthEntry(kind="first_failure", at=now - 10, job="k", round=3),
        HealthEntry(kind="first_failure", at=now - 7200, job="k", round=1),  # out of the window
    ]
    records = {f"z{i:03}": NodeHealth(node=f"z{i:03}") for i in range(50)} | {
        "sick": NodeHealth(node="sick", quarantine=held, entries=entries),
        "over": NodeHealth(node="over", quarantine=expired),
        "<img src=x>": NodeHealth.model_construct(node="<img src=x>"),
    }
    rows, omitted = m.node_series(records, ["a", "b", "bad name"], 3600.0, now, limit=4)
    assert [r.node for r in rows] == ["a", "b", "over", "sick"]  # then by name
    assert omitted == 50
    sick = next(r for r in rows if r.node == "sick")
    assert sick.quarantined and sick.attributed == {
        "first_failure": 1,
        "hardware": 1,
        "health_check": 0,
    }
    sink = Metrics()
    sink.on_nodes(rows, omitted)
    scrape = samples(sink.render().decode())
    assert value(scrape, "elasticd_node_quarantined", node="sick") == 1
    assert value(scrape, "elasticd_node_quarantined", node="a") == 0
    assert value(scrape, "elasticd_node_attributed_failures", node="sick", kind="hardware") == 1
    assert value(scrape, "elasticd_node_attributed_failures", node="a", kind="hardware") == 0
    assert value(scrape, "elasticd_node_series_omitted") == 50
    assert not next(r for r in rows if r.node == "over").quarantined  # its TTL ran out
    rows, omitted = m.node_series(records, ["a"], 3600.0, now, limit=2)
    assert ([r.node for r in rows], omitted) == (["a", "sick"], 51)


async def test_a_drained_node_is_quarantined_in_the_metrics_until_undrained(client):
    """After an admin's drain /metrics shows the node quarantined (1), after the undrain 0."""

    async def quarantined() -> float:
        r = await client.get("/metrics")
        assert r.status_code == 200
        return value(samples(r.text), "elasticd_node_quarantined", node="node-a")

    assert await quarantined() == 0
    r = await client.post("/nodes/node-a/drain", json={"reason": "bad DIMM"})
    assert r.status_code == 200, r.text
    assert await quarantined() == 1
    r = await client.post("/nodes/node-a/undrain", json={"reason": "DIMM replaced"})
    assert r.status_code == 200, r.text
    assert await quarantined() == 0


async def test_a_page_answers_again_until_an_input_changes(daemon, client, monkeypatch):
    """Scrapes with no change between them get the page rendered for the first (issue 40:
    a scrape costs the loop milliseconds); an event, or a node record this daemon writes,
    makes the next scrape render anew, and it shows them."""
    renders: list[int] = []
    real = daemon._render_metrics

    async def counted() -> bytes:
        renders.append(1)
        return await real()

    monkeypatch.setattr(daemon, "_render_metrics", counted)
    first = await client.get("/metrics")
    assert (await client.get("/metrics")).text == first.text
    assert len(renders) == 1
    daemon.events.emit("some-job", "agent", EventKind.GROUP_RESTARTING, "restarting")
    scrape = samples((await client.get("/metrics")).text)
    assert len(renders) == 2
    assert value(scrape, "elasticd_restarts_total") == 1
    r = await client.post("/nodes/node-a/drain", json={"reason": "bad DIMM"})
    assert r.status_code == 200, r.text
    scrape = samples((await client.get("/metrics")).text)
    assert len(renders) == 3
    assert value(scrape, "elasticd_node_quarantined", node="node-a") == 1
