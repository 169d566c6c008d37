"""NVIDIA Xid errors from the kernel log: the GPU check's second witness (issue 37).

The driver reports a GPU's hardware faults as ``NVRM: Xid (PCI:<bus>): <code>, ...``
lines in the kernel log, often before ``nvidia-smi`` shows anything (an Xid 79, "fallen
off the bus", may leave nvidia-smi hanging, and an Xid 94/95 ECC error needs a reset
though the ECC counters look clean). The daemon reads the log's new records at each GPU
check (:class:`KernelLog`); a critical Xid among them (:data:`CRITICAL_XIDS`: a fault
of the board, its memory, NVLink or its firmware; never the ones an application causes,
such as 13 or 31) fails the check, and so quarantines the node (``node/quarantine``).

Only records written after the daemon opened the log count (it starts at the log's end):
an Xid from before, already handled (a GPU reset, a drained node put back), does not take
the node out again. ``/dev/kmsg`` is readable by root only; a daemon that cannot open it
says so once and checks with ``nvidia-smi`` alone.

Which side of the boundary: the daemon (the kernel log is the kernel's; no job writes it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from dataclasses import dataclass

__all__ = ["CRITICAL_XIDS", "KERNEL_LOG", "KernelLog", "Xid", "critical", "parse_xids"]

log = logging.getLogger("elasticd.node.xid")

#: The kernel's log, one record a read.
KERNEL_LOG = "/dev/kmsg"

#: Xids that say the GPU or its links failed, not the program on it (NVIDIA's Xid catalog).
CRITICAL_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (the GPU needs a reset)",
    95: "uncontained ECC error (the GPU needs a reset)",
    119: "GSP firmware timeout",
    120: "GSP firmware error",
    140: "unrecovered ECC error",
}

#: Bytes read from the log per check at most (a storm of records is cut, not followed).
MAX_READ = 1 << 20

#: An Xid message: at the start of a record's message, never inside one (a segfault record
#: ends with the name of the file the program ran in, which the job chooses).
_XID = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f:.]+)\): (?P<code>\d+)(?P<rest>.*)")
#: A ``/dev/kmsg`` record: ``<facility*8+level>,<seq>,<usec>,<flags>;<message>``.
_KMSG = re.compile(r"(?P<prio>\d+),\d+,\d+,[^;]*;(?P<message>.*)")
#: A ``dmesg`` line (``[ seconds] message``), or a ``kern.log`` one (``... kernel: [ seconds]
#: message``): a file the operator names; messages of the kernel's own only.
_LOGGED = re.compile(r"(?:.*\bkernel: )?\[\s*\d+\.\d+\]\s?(?P<message>.*)")


@dataclass(frozen=True)
class Xid:
    """One Xid record: its GPU's PCI bus id, its code, and the rest of the line."""

    bus: str
    code: int
    text: str

    def describe(self) -> str:
        meaning = CRITICAL_XIDS.get(self.code, "see NVIDIA's Xid catalog")
        return f"Xid {self.code} on PCI:{self.bus} ({meaning}){self.text[:200]}"


def parse_xids(text: str) -> list[Xid]:
    """The Xid records in kernel log ``text`` (``/dev/kmsg`` records, ``dmesg`` or
    ``kern.log`` lines). Only the kernel's own count: a ``/dev/kmsg`` record of facility 0
    (the kernel files what a process writes there under another, ``user``) whose message
    starts with the driver's ``NVRM: Xid``."""
    xids = []
    for line in text.splitlines():
        if (record := _KMSG.fullmatch(line)) is not None:
            if int(record["prio"]) >> 3 != 0:
                continue  # not the kernel's: a process wrote it
            message = record["message"]
        elif (logged := _LOGGED.fullmatch(line)) is not None:
            message = logged["message"]
        else:
            continue
        if (m := _XID.match(message)) is not None:
            xids.append(Xid(m["bus"], int(m["code"]), m["rest"].rstrip()))
    return xids


def critical(xids: list[Xid]) -> list[Xid]:
    """The ones that fail the check (pure)."""
    return [x for x in xids if x.code in CRITICAL_XIDS]


class KernelLog:
    """The kernel log, read from where it stood when opened: new records only, never
    blocking (``O_NONBLOCK``: a read at its end is ``EAGAIN``), bounded per read."""

    def __init__(self, path: str = KERNEL_LOG) -> None:
        self.path = path
        self._fd: int | None = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as exc:
            log.info(
                "the GPU check reads no Xid errors: %s cannot be opened (%s); it relies on "
                "nvidia-smi alone",
                path,
                exc.strerror or exc,
            )
            return
        with contextlib.suppress(OSError):
            os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd

    @property
    def readable(self) -> bool:
        return self._fd is not None

    def new_xids(self) -> list[Xid]:
        """The Xid records written since the last call (or the open)."""
        if self._fd is None:
            return []
        chunks: list[bytes] = []
        size = 0
        while size < MAX_READ:
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break  # at the end
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                log.warning("reading %s failed: %s", self.path, exc)
                break
            if not chunk:
                break  # a regular file's end
            chunks.append(chunk)
            size += len(chunk)
        return parse_xids(b"".join(chunks).decode(errors="replace"))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
