"""elasticd: a per-node daemon that runs, watches and restarts distributed PyTorch jobs.

One daemon runs on every node. A job submitted to any daemon is rendezvoused
through a shared store, its workers are started with torchrun's environment
contract, watched without polling, and restarted as a group when a worker dies
or hangs. See docs/design.md for the map.

The daemon process never imports torch; torch lives in the workers and in the
worker-side library (`elasticd.worker`).
"""

import sys
from typing import TYPE_CHECKING

# httpx imports its command-line tool (``httpx._main``) with itself, and with it rich,
# pygments and click where they are installed: about 4 MiB of every daemon's memory (issue
# 34's soak) for a program no elasticd process runs. Marked missing, httpx takes the
# fallback it has for an install without its CLI extra (its ``main`` then says so).
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

if TYPE_CHECKING:  # for type checkers; at run time these load lazily (below)
    from elasticd.launcher import LaunchError, launch

__version__ = "0.1.0"

__all__ = ["LaunchError", "__version__", "launch"]


def __getattr__(name: str) -> object:
    # Lazy: `import elasticd` (in every worker) must not import the daemon.
    if name in ("launch", "LaunchError"):
        from elasticd import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'elasticd' has no attribute {name!r}")
