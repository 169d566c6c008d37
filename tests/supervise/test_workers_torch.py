"""The error file torch's own ``@record`` writes is read back (needs torch in the test env)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time

import pytest

from elasticd.supervise import read_error_file

from .support import Workers

pytestmark = [
    pytest.mark.torch,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]

FAILING_SCRIPT = """\
from torch.distributed.elastic.multiprocessing.errors import record


def load_batch():
    raise ValueError("rank 0 ran out of batches")


@record
def main():
    load_batch()


if __name__ == "__main__":
    main()
"""


async def test_a_torch_record_error_file_is_read_back(workers: Workers) -> None:
    """A worker whose @record entrypoint raises is reported with torch's message and traceback."""
    script = workers.root / "train.py"
    script.write_text(FAILING_SCRIPT)
    before = time.time()
    async with asyncio.timeout(90):  # importing torch takes seconds on a small machine
        group = await workers.start(
            workers.launch(0, "", argv=[sys.executable, str(script)], console_stdout=False)
        )
        async with group:
            result = await group.wait()
    cause = result.root_cause
    assert cause is not None
    assert cause.exit_code == 1
    assert cause.error is not None
    assert cause.error.message == "ValueError: rank 0 ran out of batches"
    assert cause.error.traceback is not None
    assert "Traceback (most recent call last)" in cause.error.traceback
    assert "load_batch" in cause.error.traceback
    assert int(before) <= cause.error.timestamp <= time.time()
    assert read_error_file(workers.log_dir(0) / "error.json") == cause.error
