"""A root daemon never uses state another user made: a state folder planted in a sticky
world-writable place, with a store holding a job of a third user, is refused at start
(issue 35, finding 4; docs/hardening.md, "Fair shares").

The attacker is a real Unix user (tests/users.py); the daemon is a real ``elasticd serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from elasticd.store.embedded import EmbeddedStore
from tests.hardening.support import serve
from tests.users import Users

pytestmark = pytest.mark.slow
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="plays other users: needs root")


async def _plant_store(path: Path, victim: str, marker: Path) -> None:
    """A store file whose one job runs as ``victim`` and leaves ``marker`` if it ever runs."""
    store = EmbeddedStore(path)
    try:
        owner = {"name": victim, "local": True, "unix_user": victim, "may_preempt": False}
        doc = {
            "id": "planted",
            "spec": {
                "entrypoint": "/bin/sh",
                "args": ["-c", f"id -u > {marker}"],
                "cwd": "/",
                "user": victim,
            },
            "owner": owner,
            "state": "PENDING",
            "max_restarts": 0,
            "created_at": time.time(),
        }
        await store.put("job/planted", json.dumps(doc).encode())
    finally:
        await store.close()


@AS_ROOT
async def test_a_state_folder_another_user_planted_is_refused(open_tmp: Path, users: Users) -> None:
    """mallory makes ``<sticky tmp>/ed-n0`` first, with a store.sqlite3 (and its -wal) whose
    job runs as bob; root's ``elasticd serve --state-dir`` there exits 2, naming the folder,
    its owner and the fix, and bob's job never runs. A folder root made itself in the same
    sticky place is used."""
    mallory, bob = users.user(), users.user()
    sticky = open_tmp / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    planted = sticky / "ed-n0"
    planted.mkdir(mode=0o700)
    marker = sticky / "ran"  # bob could write it here, had his job run
    async with asyncio.timeout(60):
        await _plant_store(planted / "store.sqlite3", bob.name, marker)
        for path in [planted, *planted.iterdir()]:
            os.chown(path, mallory.uid, mallory.gid)  # hers, as if she had made them
        daemon = serve(open_tmp, state_dir=planted, node_name="n0")
        try:
            deadline = time.monotonic() + 30
            while daemon.proc.poll() is None:
                assert time.monotonic() < deadline, (
                    f"the daemon serves from {mallory.name}'s folder:\n{daemon.output()[-2000:]}"
                )
                await asyncio.sleep(0.05)
        finally:
            daemon.stop()
        assert daemon.proc.returncode == 2, daemon.output()
        said = daemon.output()
        assert str(planted) in said and f"uid {mallory.uid} ({mallory.name})" in said, said
        assert "chown" in said, said
        assert not marker.exists()
        # The store file alone, planted in a folder of root's, is refused too.
        own = sticky / "ed-n1"
        own.mkdir(mode=0o700)
        await _plant_store(own / "store.sqlite3", bob.name, marker)
        for path in own.iterdir():
            os.chown(path, mallory.uid, mallory.gid)
        daemon = serve(open_tmp, state_dir=own, node_name="n1")
        try:
            assert await asyncio.to_thread(daemon.proc.wait, 30) == 2, daemon.output()
        finally:
            daemon.stop()
        assert f"{own / 'store.sqlite3'} belongs to uid {mallory.uid}" in daemon.output()
        assert not marker.exists()
        # Root's own folder in the same sticky place serves.
        fresh = sticky / "ed-n2"
        daemon = serve(open_tmp, state_dir=fresh, node_name="n2")
        try:
            await daemon.wait_ready()
        finally:
            daemon.stop()
