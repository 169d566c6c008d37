"""The re-exec's hand-over manifest (elasticd.node.reexec): what crosses the exec reads back
the same, and a manifest of another format is refused, not guessed at."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elasticd.agent.handover import AgentHandover, CarriedFailure
from elasticd.agent.recovery import FirstProgress
from elasticd.models import RootCause
from elasticd.node.reexec import ENV_FD, Manifest, fence_at, take_manifest
from elasticd.rendezvous import RoundInfo
from elasticd.rendezvous.protocol import Seat
from elasticd.rendezvous.ranks import NodeSlot
from elasticd.supervise.adopt import HandedPipe, HandedWorker
from elasticd.supervise.sweep import start_time_of


def a_handover(seat: Seat | None = None, recovery: FirstProgress | None = None) -> AgentHandover:
    return AgentHandover(
        job_id="j1",
        spawn_seq=3,
        round=RoundInfo(
            round=4,
            group_rank=1,
            group_world_size=2,
            nodes=[NodeSlot(0, "default", 2), NodeSlot(1, "default", 2)],
            master_addr="10.0.0.1",
            master_port=29500,
            participants={"a": 0, "b": 1},
            seat=seat,
        ),
        restart_count=2,
        formed_at=1700000000.5,
        token_file="/var/lib/elasticd/tokens/j1.token",
        cgroup="/sys/fs/cgroup/elasticd.n/a3.abcd.j1",
        workers=[
            HandedWorker(0, 100, 7, 1.0, HandedPipe(20, 21, 0), HandedPipe(22, 23, 9), 24, 5.0)
        ],
        slots=[2, 3],
        recovery=recovery,
    )


def a_failure() -> CarriedFailure:
    """A failure of job j2 its agent had not recorded at the exec (its exit unsaid too)."""
    round_ = RoundInfo(
        round=2, group_rank=0, group_world_size=1, nodes=[NodeSlot(0, "default", 2)],
        master_addr="h", master_port=5, participants={"n": 0},
    )  # fmt: skip
    root = RootCause(message="worker exited with code 3", node="n", rank=1, exit_code=3, round=2)
    return CarriedFailure(round_, root, alone=True, job_tag="t", pid=42)


def test_the_manifest_reads_back_the_same() -> None:
    """Every field of a manifest, with a round that has a seat (large jobs) and one without,
    and a recovery still awaiting its first ping."""
    seat = Seat(4, 1, 2, "10.0.0.1", 29500, "default", 2, 2, 4, 2, 4, {"a": 0, "b": 1})
    manifest = Manifest(
        old_version="0.1.0",
        tcp_fd=5,
        unix_fd=6,
        lease=0xABC,
        renewed_at=12345.25,
        agents=[a_handover(), a_handover(seat, FirstProgress(4, 1700000001.25))],
        not_handed={"j2": "restarting"},
        failures={"j2": a_failure()},
        job_tokens={"j1": "digest"},
        unhanded=[(300, 11)],
        lighthouses={"tft": 43305},
    )
    back = Manifest.decode(manifest.encode())
    assert back == manifest
    assert back.adopted_pids() == {(100, 7)}
    assert back.fds == [5, 6, 20, 21, 22, 23, 24, 20, 21, 22, 23, 24]


def test_a_handover_without_a_recovery_reads_back_with_none() -> None:
    """A hand-over written without the recovery field (an older image) has none pending."""
    doc = a_handover(recovery=FirstProgress(4, 2.0)).to_json()
    del doc["recovery"]
    assert AgentHandover.from_json(doc).recovery is None


@pytest.mark.parametrize(
    ("renewed_at", "now", "fence"),
    [
        (100.0, 101.0, 103.0),  # a TTL from the last renewal that got through
        (100.0, 110.0, 103.0),  # already past: at once
        (None, 110.0, 113.0),  # an image that did not say renewed right before its exec
    ],
)
def test_handed_workers_are_fenced_when_the_lease_may_lapse(
    renewed_at: float | None, now: float, fence: float
) -> None:
    """The new image ends the handed workers, the store still away, once the node's lease
    (TTL 3 s here) may have lapsed: counted from the last renewal the old image got through."""
    assert fence_at(renewed_at, 3.0, now) == fence


def test_a_manifest_of_an_image_that_carried_no_failures_reads_back_with_none() -> None:
    """An older image's manifest has no ``failures``: none to record."""
    doc = json.loads(Manifest(old_version="0.0.9", failures={"j2": a_failure()}).encode())
    del doc["failures"]
    assert Manifest.decode(json.dumps(doc).encode()).failures == {}


def test_a_manifest_without_renewed_at_reads_back_with_none() -> None:
    """A manifest from an image that did not hand ``renewed_at`` over still reads."""
    doc = json.loads(Manifest(old_version="0.0.9", lease=7).encode())
    del doc["renewed_at"]
    assert Manifest.decode(json.dumps(doc).encode()).renewed_at is None


def test_a_manifest_of_another_format_is_refused() -> None:
    """A format this version does not know is an error (its jobs then resume as new attempts)."""
    with pytest.raises(ValueError, match="format"):
        Manifest.decode(json.dumps({"format": 99, "old_version": "9"}).encode())


def test_take_manifest_reads_the_memfd_once_and_clears_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The new image reads the manifest from the inherited descriptor; the variable is gone
    from the environment afterwards (nothing started later sees it); no variable: None."""
    fd = os.memfd_create("test-handover", 0)
    os.write(fd, Manifest(old_version="0.0.9", lease=7).encode())
    monkeypatch.setenv(ENV_FD, str(fd))
    manifest = take_manifest()
    assert manifest is not None
    assert (manifest.old_version, manifest.lease) == ("0.0.9", 7)
    assert ENV_FD not in os.environ
    assert take_manifest() is None


def test_take_manifest_names_the_children_the_old_image_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The new image reads its children (pid and start time) before it starts anything: all
    of them are the old image's."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fd = os.memfd_create("test-handover", 0)
        os.write(fd, Manifest(old_version="0.0.9").encode())
        monkeypatch.setenv(ENV_FD, str(fd))
        manifest = take_manifest()
        assert manifest is not None
        assert manifest.children[child.pid] == start_time_of(child.pid) is not None
    finally:
        child.kill()
        child.wait()
