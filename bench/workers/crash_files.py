"""bench_restart's worker: small, so that its first statement comes right after the interpreter's
start (a script is compiled whole before its first line runs; this one in well under 1 ms).

``crash_files.py OUT CRASHES``: records ``time.time()`` of its first statement in
``OUT/start-<pid>.json``. While fewer than CRASHES ``crash-<i>`` files exist in OUT,
global rank 1 waits 1 s, creates the next one holding the time just before it exits
1, and every other rank waits for SIGTERM; then every rank exits 0. Counting files
instead of reading ``TORCHELASTIC_RESTART_COUNT`` works the same under torchrun,
whose agents keep their own counts. No rank lives longer than 120 s.
"""

import time

FIRST = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

out, crashes = sys.argv[1], int(sys.argv[2])
seen = sum(1 for name in os.listdir(out) if name.startswith("crash-"))
with open(os.path.join(out, f".start-{os.getpid()}"), "w") as fh:
    json.dump({"first_stmt": FIRST, "rank": int(os.environ.get("RANK", "0"))}, fh)
os.rename(
    os.path.join(out, f".start-{os.getpid()}"), os.path.join(out, f"start-{os.getpid()}.json")
)
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
if seen >= crashes:
    os._exit(0)
if os.environ.get("RANK") == "1":
    time.sleep(1.0)
    fd = os.open(os.path.join(out, f"crash-{seen}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, repr(time.time()).encode())
    os._exit(1)
time.sleep(120)
os._exit(3)
