"""Event kinds are one enum (issue 13 point 3); the reference page follows it."""

from __future__ import annotations

import re
from pathlib import Path

from elasticd.eventkinds import MEANING, EventKind, known_kind, recovery_phase_kind, reference
from elasticd.models import Event
from elasticd.node.metrics import EXIT_REASON_BY_KIND, PHASE_BY_KIND, exit_reason, recovery_phase

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_is_subject_dot_what_and_documented() -> None:
    for kind in EventKind:
        assert re.fullmatch(r"[a-z_]+\.[a-z_]+", kind.value), kind
        assert MEANING[kind].strip(), kind


def test_the_reference_page_is_generated_from_the_enum() -> None:
    assert (ROOT / "docs" / "events.md").read_text() == reference()


def test_a_kind_read_back_that_this_version_lacks_is_kept_not_refused() -> None:
    assert known_kind("worker.exited") is EventKind.WORKER_EXITED
    assert known_kind("something.new") is None
    event = Event(seq=1, time=0.0, job_id="j", node="n", source="agent", kind="something.new")
    assert exit_reason(event) is None and recovery_phase(event.kind) is None


def test_every_recovery_phase_kind_feeds_a_metric() -> None:
    for phase in ("detected", "stop_workers", "rendezvous", "spawn", "total", "first_progress"):
        kind = recovery_phase_kind(phase)
        assert PHASE_BY_KIND[kind] == phase == recovery_phase(kind.value)
    assert set(EXIT_REASON_BY_KIND) == {EventKind.WORKER_HANG, EventKind.WORKER_HEALTH_CHECK_FAILED}


def test_no_module_emits_a_kind_as_a_bare_string() -> None:
    """emit()'s kind is an EventKind (mypy checks the type); no literal sneaks in."""
    literal = re.compile(r"""\.emit\(\s*[^,()]+,\s*"[a-z]+",\s*f?["']""")
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("elasticd", "api")
        for path in (ROOT / package).rglob("*.py")
        if literal.search(path.read_text())
    ]
    assert offenders == []
