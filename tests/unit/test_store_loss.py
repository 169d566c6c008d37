"""The fencing decision: only continuous store loss of ``fence_after`` seconds fences."""

from __future__ import annotations

import pytest

from elasticd.agent.watch import StoreLoss


@pytest.mark.parametrize(
    ("steps", "fences"),
    [
        # (time, "fail" | "ok") ... ; fences: the result of the last failure
        ([(0.0, "fail")], False),
        ([(0.0, "fail"), (2.9, "fail")], False),
        ([(0.0, "fail"), (3.0, "fail")], True),
        ([(0.0, "fail"), (1.0, "ok"), (3.5, "fail")], False),  # the hiccup bug: must not fence
        ([(0.0, "fail"), (1.0, "ok"), (3.5, "fail"), (6.4, "fail")], False),
        ([(0.0, "fail"), (1.0, "ok"), (3.5, "fail"), (6.5, "fail")], True),
    ],
)
def test_only_continuous_loss_fences(steps, fences):
    loss = StoreLoss(fence_after=3.0)
    result = None
    for now, what in steps:
        if what == "ok":
            loss.reached()
        else:
            result = loss.failed(now)
    assert result is fences


def test_backoff_grows_while_failing_and_resets_on_contact():
    loss = StoreLoss(fence_after=30.0)
    waits = []
    for t in range(6):
        loss.failed(float(t))
        waits.append(loss.backoff)
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    loss.reached()
    assert loss.backoff == 0.1 and loss.lost_for(100.0) == 0.0
