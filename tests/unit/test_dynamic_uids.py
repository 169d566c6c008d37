"""The pure allocation of per-job uids (``run_as = "dynamic"``) and its bookkeeping."""

from __future__ import annotations

import hashlib

import pytest

from elasticd.errors import ConfigError, WorkerSpawnError
from elasticd.security import JobUsers, dynamic_identity
from elasticd.supervise.uids import DynamicUids, UidRange, choose_uid, parse_uid_range

TEN = UidRange(100, 109)


def start_of(job_id: str, uids: UidRange) -> int:
    """Where ``choose_uid`` starts looking for ``job_id``: its hash in the range."""
    digest = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big")
    return uids.first + digest % len(uids)


@pytest.mark.parametrize(
    ("taken", "outside", "expected"),
    [
        # (offsets from the job's hash that are in use, uids outside the range, offset or None)
        ((), (), 0),  # nothing in use: the job's own place in the range
        ((0,), (), 1),  # its place taken: the next one
        ((0, 1), (), 2),  # and the next: the one after
        ((0, 1, 2, 4, 5, 6, 7, 8, 9), (), 3),  # all but one in use: that one
        (tuple(range(10)), (), None),  # every uid in use: none
        ((), (1, 99, 110, 65534), 0),  # uids outside the range change nothing
    ],
)
@pytest.mark.parametrize("job_id", ["a", "victim", "thief", "x" * 200])
def test_choose_uid_table(
    job_id: str, taken: tuple[int, ...], outside: tuple[int, ...], expected: int | None
) -> None:
    """The first free uid at or after the job's hash, wrapping round; None when all are taken."""
    start = start_of(job_id, TEN)

    def at(offset: int) -> int:
        return TEN.first + (start - TEN.first + offset) % len(TEN)

    in_use = {at(o) for o in taken} | set(outside)
    assert choose_uid(job_id, TEN, in_use) == (None if expected is None else at(expected))


def test_two_jobs_never_get_the_same_uid_and_a_job_keeps_its_own() -> None:
    """Claims are idempotent per job, distinct across jobs, and a release frees the uid."""
    pool = DynamicUids(UidRange(100, 101), scan=list, registered=lambda _: ())
    a = pool.claim("a")
    assert pool.claim("a") == a
    b = pool.claim("b")
    assert {a, b} == {100, 101}
    assert pool.claim("c") is None  # the range is full
    pool.release("a")
    assert pool.claim("c") == a


def test_a_uid_still_held_by_a_process_or_a_user_entry_is_not_given() -> None:
    """A leftover process of a released uid, or a passwd/group entry, keeps the uid out."""
    seen = [100, 0, 5000]  # the ids /proc shows: 100 is a leftover of an ended job
    pool = DynamicUids(UidRange(100, 102), scan=lambda: seen, registered=lambda _: {101})
    assert pool.claim("any") == 102
    assert pool.claim("other") is None
    seen.remove(100)  # the leftover died
    assert pool.claim("other") == 100


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("61184-65519", True),
        (" 1000 - 1000 ", True),
        ("0-100", False),  # root
        ("65000-65535", False),  # nobody, no uid
        ("200-100", False),
        ("100", False),
        ("100-2147483648", False),
        ("a-b", False),
    ],
)
def test_parse_uid_range(text: str, ok: bool) -> None:
    """A range is first-last, without root, nobody or the no-uid values."""
    if ok:
        parse_uid_range(text)
    else:
        with pytest.raises(ValueError, match=r"\S"):
            parse_uid_range(text)


def test_for_job_gives_a_job_that_names_no_user_its_own_uid() -> None:
    """for_job(None, job_id=...) is the job's dynamic identity; a named user is unaffected."""
    pool = DynamicUids(UidRange(100, 109), scan=list, registered=lambda _: ())
    nobody = dynamic_identity(7)  # stands for an allowed user here
    users = JobUsers(default=None, allowed={"u7": nobody}, daemon_uid=0, dynamic=pool)
    mine = users.for_job(None, job_id="j")
    assert mine is not None
    assert (mine.uid, mine.gid, mine.groups, mine.home) == (mine.uid, mine.uid, (), "/nonexistent")
    assert users.for_job(None, job_id="j") == mine
    assert users.for_job("u7", job_id="j") == nobody
    with pytest.raises(WorkerSpawnError, match="needs its id"):
        users.for_job(None)
    users.release("j")
    assert pool.held == {}


def test_run_as_dynamic_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_as = dynamic needs a root daemon; its range comes from dynamic_uids."""
    from elasticd.config import load_config
    from elasticd.security import resolve_job_users

    config = load_config({}, {"ELASTICD_RUN_AS": "dynamic", "ELASTICD_DYNAMIC_UIDS": "200-300"})
    users = resolve_job_users(config, euid=0)
    assert users.dynamic is not None
    assert users.dynamic.uids == UidRange(200, 300)
    assert [i.uid for i in users.identities] == [200]  # stands for every dynamic uid
    with pytest.raises(ConfigError, match="only a daemon running as root"):
        resolve_job_users(config, euid=1000)
