"""A damaged `elasticd.sqlite3` is refused with one line and exit 2, or set aside on request
(issue 23, item 6). Before, each kind of damage was a raw `sqlite3.DatabaseError` traceback
and exit 1 (a crash loop under `Restart=on-failure`), sometimes after a `job.resumed` event.

Each test damages the database of a real daemon that was running a job when it was killed
(`kill -9`, so its restart would resume the job), in one of three ways: cut to half its
length, random bytes over its header, random bytes over the header of the events table's
page. The files are checkpointed first, so the damage is in what SQLite reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from elasticd.node.db import Database, damaged_message, set_aside_name
from tests.hardening.support import PY, SLEEPER, healthy_pids, script, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DB = "elasticd.sqlite3"


def _checkpoint(path: Path) -> None:
    """Fold the WAL into the main file, so the damage below is in what SQLite reads."""
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _truncated(good: bytes, path: Path) -> bytes:
    return good[: len(good) // 2]


def _header(good: bytes, path: Path) -> bytes:
    return random.Random(23).randbytes(64) + good[64:]


def _page(good: bytes, path: Path) -> bytes:
    """Random bytes over the b-tree header of the events table's root page."""
    db = sqlite3.connect(path)
    try:
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'events'").fetchone()
    finally:
        db.close()
    at = (root - 1) * page_size + (100 if root == 1 else 0)
    garbage = bytearray(random.Random(23).randbytes(32))
    garbage[0] = 0x01  # no valid page type: the damage is certain, not likely
    return good[:at] + bytes(garbage) + good[at + len(garbage) :]


DAMAGE = {"truncated": _truncated, "header": _header, "page": _page}


def _store_revision(state_dir: Path) -> int:
    db = sqlite3.connect(state_dir / "store.sqlite3")
    try:
        return int(db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
    finally:
        db.close()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state folder (checkpointed) left by a daemon killed while it ran job ``live``."""
    root = tmp_path_factory.mktemp("crashed")
    sleeper = script(root, "sleeper.py", SLEEPER)
    first = serve(root, node_name="dmg-node")
    try:
        import asyncio

        async def run() -> None:
            async with asyncio.timeout(60):
                await first.wait_ready()
                async with first.client() as c:
                    r = await c.post(
                        "/jobs",
                        json={"id": "live", "entrypoint": PY, "args": [sleeper]},
                    )
                    assert r.status_code == 201, r.text
                    await healthy_pids(c, "live", 1)

        asyncio.run(run())
    finally:
        first.kill9()
        _remove_subtree("dmg-node", first.state_dir)  # its copies run elsewhere
    _checkpoint(first.state_dir / DB)
    _checkpoint(first.state_dir / "store.sqlite3")
    (root / "token").write_text((root / f"auto-token-{first.port}").read_text())
    (root / "token").chmod(0o600)
    return root


def _remove_subtree(node: str, state_dir: Path) -> None:
    """Kill and remove the cgroup subtree a killed daemon left (nobody restarts it here)."""
    mount = own = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            mount = left.split()[4]
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            own = line[3:]
    if mount is None or own is None:
        return
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    base = Path(mount) / own.lstrip("/") / f"elasticd.{node}.{digest}"
    if not base.is_dir():
        return
    with contextlib.suppress(OSError):
        (base / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 10
    while "populated 1" in (base / "cgroup.events").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    for group in sorted((p for p in base.rglob("*") if p.is_dir()), reverse=True) + [base]:
        with contextlib.suppress(OSError):
            group.rmdir()


def _copy(crashed: Path, tmp_path: Path) -> Path:
    shutil.copytree(
        crashed / "state",
        tmp_path / "state",
        symlinks=True,
        ignore=shutil.ignore_patterns("*.sock"),
    )
    shutil.copy2(crashed / "token", tmp_path / "token")
    return tmp_path / "state"


@pytest.mark.parametrize("kind", sorted(DAMAGE))
async def test_a_damaged_database_is_refused_with_one_line_and_exit_2(
    crashed: Path, tmp_path: Path, kind: str
) -> None:
    """Exit 2, one line naming the file and the recovery, no traceback; the damaged file is
    left as it was and nothing reached the store (no job.resumed)."""
    state = _copy(crashed, tmp_path)
    path = state / DB
    damaged = DAMAGE[kind](path.read_bytes(), path)
    path.write_bytes(damaged)
    revision = _store_revision(state)
    daemon = serve(tmp_path, node_name="dmg-node", state_dir=state, token_file=tmp_path / "token")
    try:
        rc = daemon.proc.wait(60)
    finally:
        daemon.stop()
    said = daemon.output()
    assert rc == 2, said
    assert "Traceback" not in said, said
    lines = [ln for ln in said.splitlines() if "is damaged" in ln]
    assert len(lines) == 1, said
    assert str(path) in lines[0] and "restore it from a backup" in lines[0], said
    assert 'on_corrupt_database = "set_aside"' in lines[0]
    assert path.read_bytes() == damaged  # refused before anything wrote to it
    assert not list(state.glob(f"{DB}.corrupt-*"))
    assert _store_revision(state) == revision  # nothing emitted, nothing published


@pytest.mark.parametrize("kind", sorted(DAMAGE))
async def test_set_aside_keeps_the_damaged_file_and_starts_empty(
    crashed: Path, tmp_path: Path, kind: str
) -> None:
    """on_corrupt_database = set_aside: the daemon starts, the damaged file is kept beside the
    new one, byte for byte, with a log line naming both; the job (in the store) resumes."""
    state = _copy(crashed, tmp_path)
    path = state / DB
    damaged = DAMAGE[kind](path.read_bytes(), path)
    path.write_bytes(damaged)
    daemon = serve(
        tmp_path,
        node_name="dmg-node",
        state_dir=state,
        token_file=tmp_path / "token",
        env={"ELASTICD_ON_CORRUPT_DATABASE": "set_aside"},
    )
    try:
        await daemon.wait_ready(60)
        async with daemon.client() as c:
            await healthy_pids(c, "live", 1)
            job = (await c.get("/jobs/live")).json()
            events = (await c.get("/jobs/live/events", params={"after": 0})).json()
            await c.post("/jobs/live/cancel", json={})
    finally:
        daemon.stop()
    (kept,) = state.glob(f"{DB}.corrupt-*")
    assert kept.read_bytes() == damaged
    said = daemon.output()
    assert "Traceback" not in said, said
    assert any(str(kept) in ln and "damaged" in ln for ln in said.splitlines()), said
    assert job["restart_count"] == 0, job
    assert "job.resumed" in [e["kind"] for e in events]
    assert daemon.proc.returncode == 0
    db = sqlite3.connect(path)  # the new database is sound
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()


def test_set_aside_names_are_utc_stamped_and_never_reuse_one(tmp_path: Path) -> None:
    """The name carries the UTC time; a taken name gets .1, .2 (table)."""
    path = tmp_path / DB
    now = time.mktime((2024, 5, 6, 7, 8, 9, 0, 0, 0)) - time.timezone
    taken: set[str] = set()
    cases = [
        (set(), f"{DB}.corrupt-20240506T070809Z"),
        ({f"{DB}.corrupt-20240506T070809Z"}, f"{DB}.corrupt-20240506T070809Z.1"),
        (
            {f"{DB}.corrupt-20240506T070809Z", f"{DB}.corrupt-20240506T070809Z.1"},
            f"{DB}.corrupt-20240506T070809Z.2",
        ),
    ]
    for taken, expected in cases:
        assert set_aside_name(path, now, lambda p, t=taken: p.name in t).name == expected
    assert "\n" not in damaged_message(path, "x")


def test_a_row_whose_document_no_longer_parses_is_skipped(tmp_path: Path) -> None:
    """Bytes changed inside a record (no structural damage: quick_check passes) are skipped
    with a warning, not a crash of the reader; a non-UTF-8 row too."""
    db = Database(tmp_path / DB).open()
    try:
        db.conn.execute("INSERT INTO events (job_id, doc) VALUES ('j', '{not json')")
        db.conn.execute("INSERT INTO events (job_id, doc) VALUES ('j', CAST(x'ff00fe' AS TEXT))")
        assert db.list_events("j", 0, 10) == []
        assert db.unpublished_events() == []
    finally:
        db.close()


async def test_a_damaged_store_journal_is_refused_the_same_way(
    crashed: Path, tmp_path: Path
) -> None:
    """The embedded store's `store.sqlite3` with a garbage header: exit 2 and one line naming
    it and the recovery (was: a StoreUnavailable traceback, exit 1)."""
    state = _copy(crashed, tmp_path)
    path = state / "store.sqlite3"
    path.write_bytes(_header(path.read_bytes(), path))
    daemon = serve(tmp_path, node_name="dmg-node", state_dir=state, token_file=tmp_path / "token")
    try:
        rc = daemon.proc.wait(60)
    finally:
        daemon.stop()
    said = daemon.output()
    assert rc == 2, said
    assert "Traceback" not in said, said
    (line,) = [ln for ln in said.splitlines() if str(path) in ln]
    assert "restore it from a backup" in line, said
