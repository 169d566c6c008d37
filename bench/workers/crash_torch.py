"""bench_restart's torch worker: the figures a real training restart pays for.

``crash_torch.py OUT CRASHES CRASH_AFTER``: its first statement is ``import torch``;
the time of the statement right after it goes to ``OUT/start-<pid>.json``
(``first_stmt``), with the time its gloo process group is initialised (``pg``,
``env://``: the launcher's MASTER_ADDR/PORT, RANK, WORLD_SIZE). While fewer than
CRASHES ``crash-<i>`` files exist, global rank 1 waits CRASH_AFTER seconds (long
enough for a standby to finish its own ``import torch``), writes the next one with
the time just before it exits 1; the others wait for SIGTERM. Then all exit 0.
Under elasticd with ``prewarm: ["torch"]`` the import is already done when the
worker takes over its standby.
"""

# ruff: noqa: I001, E402 - torch first, on purpose: the figure ends at the statement after it
import torch  # noqa: F401
import time

AFTER_IMPORT = time.time()

import json
import os
import signal
import sys

import torch.distributed as dist

out, crashes, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
seen = sum(1 for name in os.listdir(out) if name.startswith("crash-"))
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
dist.init_process_group("gloo")
PG = time.time()
with open(os.path.join(out, f".start-{os.getpid()}"), "w") as fh:
    json.dump({"first_stmt": AFTER_IMPORT, "pg": PG, "rank": dist.get_rank()}, fh)
os.rename(
    os.path.join(out, f".start-{os.getpid()}"), os.path.join(out, f"start-{os.getpid()}.json")
)
if seen >= crashes:
    dist.barrier()  # rank 0 holds the store: nobody leaves before all are past their init
    os._exit(0)
if os.environ.get("RANK") == "1":
    time.sleep(wait)
    fd = os.open(os.path.join(out, f"crash-{seen}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, repr(time.time()).encode())
    os._exit(1)
time.sleep(120)
os._exit(3)
