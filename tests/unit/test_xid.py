"""NVIDIA Xid errors read from the kernel log (elasticd.node.xid, issue 37)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from elasticd.node.xid import KERNEL_LOG, KernelLog, Xid, critical, parse_xids

KMSG = "3,1234,987654321,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"
DMESG = "[ 8123.456] NVRM: Xid (PCI:0000:86:00): 94, pid='<unknown>', Contained: CE User Channel\n"
APP = "4,55,1,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=9, Graphics Exception: ESR 0x404490\n"


@pytest.mark.parametrize(
    ("text", "found", "bad"),
    [
        (KMSG, [("0000:3b:00", 79)], [79]),
        (DMESG, [("0000:86:00", 94)], [94]),
        (APP, [("0000:3b:00", 13)], []),  # an application's fault: not the node's
        (
            KMSG + APP + DMESG,
            [("0000:3b:00", 79), ("0000:3b:00", 13), ("0000:86:00", 94)],
            [79, 94],
        ),
        ("6,1,2,-;usb 1-1: new high-speed USB device\n", [], []),
        # Written to /dev/kmsg by a process: filed under the user facility (8+), not the kernel's.
        ("11,7,8,-;NVRM: Xid (PCI:0000:3b:00): 79, forged\n", [], []),
        # A job's program segfaults in a file it named like an Xid: the kernel's record, but
        # the Xid is not at its start.
        (
            "6,9,9,-;python[77]: segfault at 0 ip 0 sp 0 error 4 in "
            "NVRM: Xid (PCI:0000:3b:00): 79, x[1000+1000]\n",
            [],
            [],
        ),
        (
            "Dec  2 06:00:00 h kernel: [ 12.5] NVRM: Xid (PCI:0000:3b:00): 48, DBE\n",
            [("0000:3b:00", 48)],
            [48],
        ),
        ("Dec  2 06:00:00 h root: NVRM: Xid (PCI:0000:3b:00): 79, logger\n", [], []),
        ("", [], []),
    ],
)
def test_xids_are_read_from_kmsg_records_and_dmesg_lines(
    text: str, found: list[tuple[str, int]], bad: list[int]
) -> None:
    xids = parse_xids(text)
    assert [(x.bus, x.code) for x in xids] == found
    assert [x.code for x in critical(xids)] == bad


def test_an_xid_is_described_with_its_meaning() -> None:
    (xid,) = parse_xids(KMSG)
    assert xid.describe().startswith("Xid 79 on PCI:0000:3b:00 (GPU has fallen off the bus)")
    assert Xid("0000:01:00", 999, "").describe().endswith("(see NVIDIA's Xid catalog)")


def test_only_records_written_after_the_open_count(tmp_path: Path) -> None:
    """An Xid from before the daemon started (handled since) does not take the node out
    again; each record is read once."""
    path = tmp_path / "kmsg"
    path.write_text(KMSG)
    reader = KernelLog(str(path))
    try:
        assert reader.readable and reader.new_xids() == []
        with path.open("a") as f:
            f.write(APP + DMESG)
        assert [x.code for x in reader.new_xids()] == [13, 94]
        assert reader.new_xids() == []
    finally:
        reader.close()


def test_a_log_that_cannot_be_opened_reads_nothing(tmp_path: Path) -> None:
    reader = KernelLog(str(tmp_path / "absent"))
    assert not reader.readable and reader.new_xids() == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(KERNEL_LOG), reason="root only")
def test_the_real_kernel_log_is_read_without_blocking() -> None:
    """At its end /dev/kmsg answers EAGAIN (non-blocking), never a wait."""
    reader = KernelLog()
    try:
        assert reader.readable
        started = time.monotonic()
        reader.new_xids()
        assert time.monotonic() - started < 2.0
    finally:
        reader.close()
