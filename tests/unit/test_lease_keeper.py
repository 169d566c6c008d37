"""A re-executed image whose start is refused stops its lease keeper (issue 34)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from elasticd.config import load_config
from elasticd.errors import ConfigError
from elasticd.node.daemon import Daemon
from elasticd.node.execwindow import LeaseKeeper
from elasticd.testing import MemoryStore


class _Store(MemoryStore):
    renewals = 0

    async def keep_alive(self, lease: int) -> None:
        type(self).renewals += 1


async def test_a_refused_start_stops_the_keeper(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)  # foreign-writable: refuse_foreign_state refuses the start
    keeper = LeaseKeeper(_Store, lease=1, ttl=0.3)
    keeper.start()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    daemon = Daemon(
        load_config({"state_dir": str(state), "node_name": "n", "port": 0}, environ={}),
        store=MemoryStore(),
        serve_http=False,
        environ=environ,
        lease_keeper=keeper,
    )
    try:
        with pytest.raises(ConfigError, match="writable by its group or others"):
            await daemon.start()
        await asyncio.sleep(0.3)
        # Before the fix: the keeper (a non-daemon thread) renews on, forever, and the
        # process cannot exit: a node that looks alive with nobody supervising its workers.
        assert not keeper._thread.is_alive(), "the keeper outlived the refused start"
    finally:
        keeper.stop()


def test_the_keeper_never_keeps_the_process_alive() -> None:
    keeper = LeaseKeeper(_Store, lease=1, ttl=0.3)
    assert keeper._thread.daemon
    assert threading.current_thread() is threading.main_thread()


def test_the_preflight_refuses_what_the_start_refuses(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A pre-flight that passes where the new image's start is refused kills every job at
    the re-exec (the workers die with the image that exits)."""
    from elasticd.node.reexec import check_install

    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    token = tmp_path / "token"
    token.write_text("t" * 40)
    token.chmod(0o600)
    config = load_config(
        {"state_dir": str(state), "node_name": "n", "port": 0, "token_file": str(token)},
        environ={},
    )
    assert check_install(config) == 2
    assert "writable by its group or others" in capsys.readouterr().err
