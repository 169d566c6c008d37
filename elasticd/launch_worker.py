"""The worker side of :func:`elasticd.launch`: ``python -m elasticd.launch_worker``.

Reads the call file named by ``$ELASTICD_LAUNCH_CALL`` (JSON: the function's
module and qualified name, the launcher's ``sys.path``, the arguments),
imports the function by name, calls it, and writes its return value as JSON
to ``<results>/rank_<RANK>.json`` (atomically: write, then rename). A raised
exception, or a return value that is not JSON, is written to
``$TORCHELASTIC_ERROR_FILE`` in torch's ``@record`` format and the worker
exits 1, so the daemon reports it as the root cause. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main() -> int:
    call_path = os.environ.get("ELASTICD_LAUNCH_CALL")
    if not call_path:
        print("elasticd.launch_worker: run by elasticd.launch only", file=sys.stderr)
        return 2
    call = json.loads(Path(call_path).read_text(encoding="utf-8"))
    # The launcher's import path first, as multiprocessing's spawn does.
    sys.path[:] = list(call["sys_path"]) + [p for p in sys.path if p not in call["sys_path"]]
    rank = int(os.environ["RANK"])
    try:
        from elasticd.launcher import resolve

        fn = resolve(call)
        value = fn(*call["call"]["args"], **call["call"]["kwargs"])
        try:
            text = json.dumps({"rank": rank, "value": value}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"the return value of {call['qualname']} on rank {rank} is not JSON ({exc}); "
                "elasticd.launch returns values as JSON, never pickled"
            ) from None
        results = Path(call["results"])
        tmp = results / f".rank_{rank}.json.{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(results / f"rank_{rank}.json")
    except Exception as exc:
        from elasticd.worker.errors import write_error_file

        write_error_file(exc)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
