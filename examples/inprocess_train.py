"""In-process restart with gloo: a training loop that survives a failing rank without new processes.

Run it under elasticd (the coordination store is the daemon's)::

    elasticd run --nproc-per-node 2 -- python examples/inprocess_train.py

Every step all-reduces ``rank + 1`` over the current process group and checks
the sum. Faults can be injected with environment variables, which the tests
and ``bench/bench_worker.py`` use:

* ``FAULT=raise|hang|exit`` — what rank ``FAULT_RANK`` (default 1) does at
  step ``FAULT_STEP`` (default 3) of iteration 0: raise an exception, block
  forever inside a C call (``time.sleep``), or exit the process abruptly;
* ``STEPS`` (default 6), ``STEP_SECONDS`` (default 0.05);
* ``SOFT_TIMEOUT`` / ``HARD_TIMEOUT`` / ``BARRIER_TIMEOUT`` (seconds).

Each rank prints ``enter iteration=I rank=R world=W pid=P t=<wall>`` when it
(re-)enters the function, once its new process group exists, and
``allreduce iteration=I step=S sum=X expected=Y`` per step.
"""

from __future__ import annotations

import os
import time
import warnings

from elasticd.inprocess import CallWrapper, Wrapper

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@Wrapper(
    soft_timeout=env_float("SOFT_TIMEOUT", 10),
    hard_timeout=env_float("HARD_TIMEOUT", 20),
    barrier_timeout=env_float("BARRIER_TIMEOUT", 60),
    completion_timeout=env_float("BARRIER_TIMEOUT", 60),
    last_call_wait=env_float("LAST_CALL_WAIT", 0.05),
    progress_watchdog_interval=env_float("PROGRESS_INTERVAL", 0.2),
    termination_grace_time=env_float("TERMINATION_GRACE", 1),
)
def train(call: CallWrapper | None = None) -> float:
    import torch
    import torch.distributed as dist

    assert call is not None
    call.init_process_group("gloo")
    me = call.state.initial_rank
    print(
        f"enter iteration={call.iteration} rank={call.rank} world={call.world_size} "
        f"initial_rank={me} pid={os.getpid()} t={time.time():.6f}",
        flush=True,
    )
    fault = os.environ.get("FAULT", "none")
    fault_rank = int(os.environ.get("FAULT_RANK", "1"))
    fault_step = int(os.environ.get("FAULT_STEP", "3"))
    steps = int(os.environ.get("STEPS", "6"))
    pause = env_float("STEP_SECONDS", 0.05)
    total = 0.0
    for step in range(steps):
        if call.iteration == 0 and me == fault_rank and step == fault_step:
            now = time.time()
            print(f"fault {fault} iteration={call.iteration} step={step} t={now:.6f}", flush=True)
            if fault == "raise":
                raise RuntimeError(f"rank {me} fails at step {step}")
            if fault == "hang":
                time.sleep(10_000)
            if fault == "exit":
                os._exit(3)
        t = torch.tensor([call.rank + 1.0])
        dist.all_reduce(t)
        expected = call.world_size * (call.world_size + 1) / 2
        print(
            f"allreduce iteration={call.iteration} step={step} sum={t.item():g} "
            f"expected={expected:g}",
            flush=True,
        )
        total += t.item()
        call.ping()
        time.sleep(pause)
    dist.destroy_process_group()
    return total


if __name__ == "__main__":
    result = train()
    print(f"done result={result:g} pid={os.getpid()}", flush=True)
