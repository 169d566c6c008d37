"""elasticd: a per-node daemon that runs, watches and restarts distributed PyTorch jobs.

One daemon runs on every node. A job submitted to any daemon is rendezvoused
through a shared store, its workers are started with torchrun's environment
contract, watched without polling, and restarted as a group when a worker dies
or hangs. See DESIGN.md for the map.

The daemon process never imports torch; torch lives in the workers and in the
worker-side library (`elasticd.worker`).
"""

__version__ = "0.1.0"
