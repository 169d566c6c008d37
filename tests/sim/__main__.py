"""``python -m tests.sim``: sweep seeds of the simulation, or replay one.

    python -m tests.sim --seed 1234            # replay one schedule, print its trace tail
    python -m tests.sim --seeds 100000 --from 0 --jobs 2
    python -m tests.sim --seeds 3000 --part agent

A failing seed prints the violation and a shortened trace; the same seed
replays the same schedule exactly (same draws, same calls, same order).
"""

from __future__ import annotations

import argparse
import sys

from tests.sim.sweep import PARTS, main

if __name__ == "__main__":
    sys.exit(main(argparse.ArgumentParser(prog="python -m tests.sim"), PARTS))
