"""The one store client's retry options (``store/http.py`` ``Retry``) and its blocking facade."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from elasticd.errors import StoreCompacted, StoreUnavailable
from elasticd.store.blocking import BlockingStore
from elasticd.store.http import FAIL_FAST, RIDE_OUT, Retry, next_pause
from elasticd.store.memory import MemoryStore
from tests.e2e.cluster import free_port
from tests.worker_lib.support import store_server

pytestmark = pytest.mark.timeout(60)

TOKEN = "retry-token"


@pytest.mark.parametrize(
    ("retry", "pause", "now", "deadline", "expected"),
    [
        (FAIL_FAST, 0.05, 0.0, 10.0, None),  # the daemon's: never again
        (RIDE_OUT, 0.05, 0.0, 10.0, 0.05),  # the workers': the backoff step
        (RIDE_OUT, 1.0, 9.5, 10.0, 0.5),  # never past the deadline
        (RIDE_OUT, 1.0, 10.0, 10.0, None),  # at the deadline: give up
        (RIDE_OUT, 1.0, 11.0, 10.0, None),
        (Retry(patience=1.0), 0.2, 0.3, 1.0, 0.2),  # any patience retries alike
    ],
)
def test_next_pause(
    retry: Retry, pause: float, now: float, deadline: float, expected: float | None
) -> None:
    """How long a client waits before sending again, or None to give up."""
    assert next_pause(retry, pause, now, deadline) == expected


@pytest.fixture
def compacted_url() -> Iterator[str]:
    """A real store server whose watch history keeps only the last change."""
    store = MemoryStore(history=1, history_keep=0, history_margin=0)
    with store_server(TOKEN, store) as url:
        yield url


def test_a_compacted_watch_raises_or_answers_empty_as_the_caller_chose(
    compacted_url: str,
) -> None:
    """410 from a real server: FAIL_FAST raises StoreCompacted, RIDE_OUT returns [] at once."""
    with (
        BlockingStore(compacted_url, TOKEN) as fast,
        BlockingStore(compacted_url, TOKEN, retry=RIDE_OUT) as patient,
    ):
        for i in range(5):
            fast.put(f"k/{i}", b"v")
        with pytest.raises(StoreCompacted):
            fast.watch("k/", 1, 5, prefix=True)
        started = time.monotonic()
        assert patient.watch("k/", 1, 5, prefix=True) == []
        assert time.monotonic() - started < 4  # not the watch's timeout: the 410's answer


def test_a_dead_store_fails_fast_or_is_retried_until_the_patience() -> None:
    """Nobody listening: FAIL_FAST raises at once; a patience of 0.5 s retries, then names it."""
    url = f"http://127.0.0.1:{free_port()}"
    with BlockingStore(url, timeout=2) as fast:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            fast.get("a")
        assert time.monotonic() - started < 2
    with BlockingStore(url, timeout=2, retry=Retry(patience=0.5)) as patient:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="could not be reached within 0.5s"):
            patient.get("a")
        assert 0.5 <= time.monotonic() - started < 3


def test_the_facade_is_shared_by_threads_and_closed_under_a_waiting_watch() -> None:
    """Threads share one facade; close() ends a watch blocked in another thread."""
    with store_server(TOKEN) as url:
        client = BlockingStore(url, TOKEN)
        results: list[object] = []

        def watch() -> None:
            try:
                results.append(client.watch("w", 0, 30))
            except StoreUnavailable as exc:
                results.append(exc)

        writers = [threading.Thread(target=client.put, args=(f"t/{i}", b"v")) for i in range(8)]
        for t in writers:
            t.start()
        for t in writers:
            t.join(10)
        assert len(client.list("t/").entries) == 8
        watcher = threading.Thread(target=watch)
        watcher.start()
        client.get("w")  # one more round trip: the watch is on the loop by now, or soon
        client.close()
        watcher.join(10)
        assert not watcher.is_alive()
        assert len(results) == 1
        assert isinstance(results[0], StoreUnavailable)
        with pytest.raises(StoreUnavailable, match="closed"):
            client.get("w")
