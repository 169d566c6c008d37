"""torch's flight recorder, written where the daemon reads it on a hang (issue 37).

With the flight recorder on (``TORCH_FR_BUFFER_SIZE`` or, for NCCL,
``TORCH_NCCL_TRACE_BUFFER_SIZE`` set in the job's ``env``), torch keeps a ring
of the last collectives each rank issued, with their sequence numbers. In a
collective hang the rank that stopped issued fewer than the others: it is
behind. A rank blocked in a collective cannot run Python on its main thread,
so a thread of this module reads the recorder (``_dump_fr_trace_json``, never
a pickle) every :data:`EVERY` seconds and writes what the daemon needs of it,
the highest collective sequence number of each process group and its last
collective (:func:`summary`), into the file the daemon named
(``ELASTICD_FLIGHT_RECORDER_FILE``, in the worker's own log folder), replaced
whole (a temporary file, then a rename). On a hang each node's daemon reads it
back (bounded, never following a link) with the stacks
(:mod:`elasticd.agent.hangs`).

Nothing happens unless the daemon named the file, the recorder is on and the
job initialised ``torch.distributed``; this module never imports torch itself
(it looks at ``sys.modules``). Which side of the boundary: the job's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading

__all__ = ["BUFFER_VARS", "EVERY", "FILE", "FILE_VAR", "start", "summary"]

#: The variable naming the file (set by the daemon for each worker).
FILE_VAR = "ELASTICD_FLIGHT_RECORDER_FILE"
#: The file's name in the worker's log folder.
FILE = "flight_recorder.json"
#: torch's variables that turn the recorder on (the entries it keeps).
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: Seconds between two writes.
EVERY = 2.0

_started = False


def start() -> bool:
    """Start the writer thread (idempotent); False when there is nothing to write."""
    global _started
    path = os.environ.get(FILE_VAR)
    if _started or not path or not any(_positive(os.environ.get(v)) for v in BUFFER_VARS):
        return _started
    _started = True
    threading.Thread(
        target=_run, args=(path,), name="elasticd-flight-recorder", daemon=True
    ).start()
    return True


def _positive(value: str | None) -> bool:
    return value is not None and value.strip().isdigit() and int(value) > 0


def _run(path: str) -> None:
    stop = threading.Event()
    while not stop.wait(EVERY):
        text = _dump()
        if text is None:
            continue
        # Read again at each write: a standby (prewarm) started with one attempt's path
        # is handed the next attempt's before its script runs.
        path = os.environ.get(FILE_VAR) or path
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return  # the folder is gone (the attempt ended): nothing more to write


def summary(dump: dict[str, object]) -> dict[str, object]:
    """What the daemon reads of a recorder's dump: per process group, the highest
    collective sequence number issued and that collective's name (p2p aside)."""
    seqs: dict[str, int] = {}
    names: dict[str, str] = {}
    entries = dump.get("entries")
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq, pg = e.get("collective_seq_id"), e.get("process_group")
        key = str(pg[1] if isinstance(pg, list) and len(pg) > 1 else e.get("pg_id"))
        if isinstance(seq, int) and seq > seqs.get(key, -1):
            seqs[key] = seq
            names[key] = str(e.get("profiling_name", ""))[:80]
    return {"version": 1, "collectives": seqs, "last": names}


def _dump() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.distributed.is_initialized():
            return None
        c10d = sys.modules.get("torch._C._distributed_c10d")
        dump_json = getattr(c10d, "_dump_fr_trace_json", None)
        if dump_json is None:
            return None
        return json.dumps(summary(json.loads(dump_json(True, False))))
    except Exception:  # an older torch, a torch without the recorder: nothing to say
        return None
