"""Pure decisions of the agent: what to do after an attempt ends."""

from __future__ import annotations

from enum import Enum


class Outcome(Enum):
    """What the agent does once an attempt's result is known."""

    SUCCEEDED = "succeeded"
    RESTART = "restart"
    FAILED = "failed"


def after_attempt(*, succeeded: bool, restart_count: int, max_restarts: int) -> Outcome:
    """torchrun's rule: a failure restarts the whole group while restarts remain.

    ``restart_count`` is the job-wide number of restarts already spent.
    """
    if succeeded:
        return Outcome.SUCCEEDED
    if restart_count < max_restarts:
        return Outcome.RESTART
    return Outcome.FAILED
