"""The hang hook's read-back of a worker's stack dump: only what its stderr.log gained,
bounded, and never through something the worker planted in its folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from elasticd.agent.hooks import MAX_DUMP_BYTES, read_dump, read_flight
from elasticd.worker.flight import FILE as FLIGHT_FILE
from tests.supervise.support import worker_folder


def test_only_what_the_log_gained_is_read_and_bounded(tmp_path: Path) -> None:
    """The bytes past the size before the signal, at most MAX_DUMP_BYTES of their end."""
    folder = worker_folder(tmp_path)
    log = folder / "stderr.log"
    log.write_text("before\n")
    since = log.stat().st_size
    with log.open("a") as f:
        f.write("dump\n")
    assert read_dump(folder, since) == "dump\n"
    assert read_dump(folder, log.stat().st_size) == ""  # nothing new
    with log.open("a") as f:
        f.write("x" * (2 * MAX_DUMP_BYTES) + "end\n")
    text = read_dump(folder, since)
    assert len(text) == MAX_DUMP_BYTES and text.endswith("end\n")


def test_a_planted_link_or_fifo_is_not_read(tmp_path: Path) -> None:
    """A worker that swaps its log for a link to another file, or a FIFO, gets nothing read
    (and the read does not block)."""
    folder = worker_folder(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("root only\n" * 100)
    (folder / "stderr.log").symlink_to(secret)
    assert read_dump(folder, 0) == ""
    (folder / "stderr.log").unlink()
    os.mkfifo(folder / "stderr.log")
    assert read_dump(folder, -1) == ""
    (folder / "stderr.log").unlink()
    os.link(secret, folder / "stderr.log")  # a second name of someone else's file
    assert read_dump(folder, 0) == ""


def test_the_flight_recorder_summary_is_read_only_as_the_workers_own_file(tmp_path: Path) -> None:
    """The default group's count (else the highest); a link, a FIFO, junk, or a count that
    is not a number gives nothing (and the read does not block)."""
    folder = worker_folder(tmp_path)
    summary = folder / FLIGHT_FILE
    summary.write_text(json.dumps({"collectives": {"tp": 9, "default_pg": 3}}))
    assert read_flight(folder) == 3
    summary.write_text(json.dumps({"collectives": {"tp": 9, "dp": "many", "x": -1}}))
    assert read_flight(folder) == 9
    for junk in ("not json", "[]", '{"collectives": 5}'):
        summary.write_text(junk)
        assert read_flight(folder) is None
    summary.unlink()
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"collectives": {"default_pg": 1}}))
    summary.symlink_to(secret)
    assert read_flight(folder) is None
    summary.unlink()
    os.mkfifo(summary)
    assert read_flight(folder) is None
