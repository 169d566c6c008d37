""":class:`elasticd.node.events.ParsedEvents`: a merged read parses each store entry once
per version (issue 40), forgets what the store no longer holds, and keeps a bounded number
of jobs."""

from __future__ import annotations

import pytest

from elasticd.eventkinds import EventKind
from elasticd.models import Event
from elasticd.node import events as events_module
from elasticd.node.events import ParsedEvents
from elasticd.store.base import Entry


def entry(key: str, version: int, message: str = "m") -> Entry:
    event = Event(
        seq=0, time=1.0, job_id="j", node="n", source="agent",
        kind=EventKind.WORKER_EXITED.value, message=message,
    )  # fmt: skip
    return Entry(key=key, value=event.model_dump_json().encode(), version=version, created=version)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys parsed, in order."""
    seen: list[str] = []
    real = events_module._parsed

    def counting(e: Entry) -> Event | None:
        seen.append(e.key)
        return real(e)

    monkeypatch.setattr(events_module, "_parsed", counting)
    return seen


def test_an_entry_is_parsed_once_per_version(parses: list[str]) -> None:
    cache = ParsedEvents()
    first = [entry("a", 1), entry("b", 2)]
    assert [e.message for _, e in cache.of("j", first)] == ["m", "m"]
    assert [e.message for _, e in cache.of("j", first)] == ["m", "m"]
    assert parses == ["a", "b"]
    # "b" rewritten (a new version): parsed again; "a" not.
    again = cache.of("j", [entry("a", 1), entry("b", 5, "new")])
    assert [e.message for _, e in again] == ["m", "new"]
    assert parses == ["a", "b", "b"]


def test_what_the_store_no_longer_holds_is_forgotten(parses: list[str]) -> None:
    cache = ParsedEvents()
    cache.of("j", [entry("a", 1), entry("b", 2)])
    assert [en.key for en, _ in cache.of("j", [entry("b", 2)])] == ["b"]
    cache.of("j", [entry("a", 1)])  # "a" came back: it was dropped, so parsed again
    assert parses == ["a", "b", "a"]


def test_a_malformed_entry_is_left_out_and_parsed_once(parses: list[str]) -> None:
    cache = ParsedEvents()
    bad = Entry(key="x", value=b"{not json", version=1, created=1)
    for _ in range(3):
        assert cache.of("j", [bad, entry("a", 1)])[0][0].key == "a"
    assert parses == ["x", "a"]


def test_only_the_jobs_read_last_are_kept(parses: list[str]) -> None:
    cache = ParsedEvents(jobs=2)
    for job in ("j1", "j2", "j1", "j3"):  # j2 is the oldest read when j3 comes
        cache.of(job, [entry(f"{job}/a", 1)])
    cache.of("j1", [entry("j1/a", 1)])
    cache.of("j2", [entry("j2/a", 1)])
    assert parses == ["j1/a", "j2/a", "j3/a", "j2/a"]
    cache.forget("j1")
    cache.of("j1", [entry("j1/a", 1)])
    assert parses[-1] == "j1/a"
