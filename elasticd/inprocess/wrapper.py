"""``Wrapper`` and ``CallWrapper``: restart the training function in the same process.

Semantics follow NVIDIA's ``inprocess.Wrapper``; the coordination runs
through the cluster store (reached through the daemon) instead of a
``TCPStore`` hosted by a rank, so it survives the death of any rank.

One call of the wrapped function, on every rank::

    start barrier (all initial ranks) → world of iteration 0 pinned in the store
    loop:
        rank assignment (ShiftRanks: drop the terminated) → rank filter (spares)
        RANK / WORLD_SIZE set to the rank's place in the active world
        initialize(state) → health_check(state, None) → fn(...)        ← monitored
        fn returned: "done", then wait until every active rank is done
            → return fn's value (None on spares)
        fn raised, or the monitor interrupted it, or a fault arrived while waiting:
            record the interruption (the others' monitors wake and interrupt them)
            abort(state) → finalize(state, exc) → health_check(state, exc)
            wait last_call_wait (concurrent failures get recorded)
            restart barrier: every rank of the world arrived, or is terminated,
            or is declared missing at barrier_timeout
            the first rank through pins the next world (create-if-absent)
            iteration += 1

Ranks are named by their initial rank (``RANK`` at start). A rank that is
not in the pinned world raises :class:`RestartError`; a rank whose health
check fails records itself terminated and raises :class:`HealthCheckError`;
``KeyboardInterrupt``/``SystemExit`` in the function record the rank
terminated and propagate. Either way the others carry on without it.

Timeouts (seconds or ``timedelta``), with NVIDIA's meaning and ordering:
``soft_timeout`` < ``hard_timeout`` < ``barrier_timeout``;
``progress_watchdog_interval`` < ``soft_timeout``; ``last_call_wait`` <
``barrier_timeout``; ``completion_timeout`` and ``termination_grace_time``
positive. A violation is a ``ValueError`` naming the rule.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib
import inspect
import itertools
import logging
import math
import os
import threading
import time
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from elasticd.inprocess.abort import Abort, AbortTorchDistributed, tracker
from elasticd.inprocess.coordination import Coordinator
from elasticd.inprocess.errors import HealthCheckError, RankShouldRestart, RestartError
from elasticd.inprocess.keys import Layout
from elasticd.inprocess.monitor import IterationView, Monitor
from elasticd.inprocess.progress import (
    PendingCallProbe,
    Progress,
    async_raise,
    clear_async_exc,
)
from elasticd.inprocess.state import (
    RankAssignment,
    RankFilter,
    ShiftRanks,
    State,
    apply_filter,
)
from elasticd.tokens import TokenFileError, read_token_file
from elasticd.worker.store import ClusterStoreClient, StoreUnreachable

__all__ = ["CallWrapper", "Wrapper"]

log = logging.getLogger("elasticd.inprocess")

_P = ParamSpec("_P")
_R = TypeVar("_R")

Seconds = float | int | datetime.timedelta
Initialize = Callable[[State], State | None]
Finalize = Callable[[State, BaseException | None], None]
HealthCheck = Callable[[State, BaseException | None], None]
#: ``(timeout) -> client``: how the wrapper reaches the cluster store.
StoreFactory = Callable[[float], ClusterStoreClient]

#: Wrapped calls so far in this process: every rank makes the same calls in the same order.
_CALLS = itertools.count()
#: RANK and WORLD_SIZE as the process started (before any iteration rewrote them).
_INITIAL_ENV: dict[str, str] = {}


def _seconds(name: str, value: Seconds) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be seconds (a number) or a timedelta, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Timeouts:
    """The wrapper's timeouts in seconds, validated."""

    soft: float
    hard: float
    barrier: float
    completion: float
    last_call_wait: float
    termination_grace: float
    progress_interval: float | None

    def __post_init__(self) -> None:
        rules = [
            (self.soft > 0, "soft_timeout must be positive"),
            (self.soft < self.hard, "soft_timeout must be shorter than hard_timeout"),
            (self.hard < self.barrier, "hard_timeout must be shorter than barrier_timeout"),
            (self.completion > 0, "completion_timeout must be positive"),
            (self.last_call_wait >= 0, "last_call_wait must not be negative"),
            (
                self.last_call_wait < self.barrier,
                "last_call_wait must be shorter than barrier_timeout",
            ),
            (self.termination_grace >= 0, "termination_grace_time must not be negative"),
        ]
        if self.progress_interval is not None:
            rules += [
                (self.progress_interval > 0, "progress_watchdog_interval must be positive"),
                (
                    self.progress_interval < self.soft,
                    "progress_watchdog_interval must be shorter than soft_timeout",
                ),
            ]
        broken = [why for ok, why in rules if not ok]
        if broken:
            raise ValueError(
                f"invalid in-process restart timeouts ({self.describe()}): " + "; ".join(broken)
            )

    def describe(self) -> str:
        return (
            f"soft={self.soft:g}s hard={self.hard:g}s barrier={self.barrier:g}s "
            f"completion={self.completion:g}s last_call_wait={self.last_call_wait:g}s"
        )


class _Default:
    """The type of :data:`_DEFAULT`: "use the default hook" (None means "no hook")."""

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()


class Wrapper:
    """Decorate a training function so that a fault on any rank restarts it on all, in-process.

    Hooks: ``initialize(state) -> state``, ``abort(state)``, ``finalize(state,
    exc)``, ``health_check(state, exc)`` (raise to leave),
    ``rank_assignment(state, terminated) -> state`` (default :class:`ShiftRanks`),
    ``rank_filter(state) -> bool`` (active or spare). See the module doc for
    the timeouts. ``max_iterations`` bounds the iterations of one call (a
    deterministic bug would otherwise restart forever; default: no bound).
    ``store_factory(timeout)`` builds the store client (default:
    from ``ELASTICD_URL``/``ELASTICD_TOKEN_FILE``). ``enabled=False`` returns
    the function unchanged.
    """

    def __init__(
        self,
        *,
        initialize: Initialize | None = None,
        abort: Abort | None | _Default = _DEFAULT,
        finalize: Finalize | None = None,
        health_check: HealthCheck | None = None,
        rank_assignment: RankAssignment | None = None,
        rank_filter: RankFilter | None = None,
        soft_timeout: Seconds = 60.0,
        hard_timeout: Seconds = 90.0,
        barrier_timeout: Seconds = 120.0,
        completion_timeout: Seconds = 120.0,
        last_call_wait: Seconds = 1.0,
        termination_grace_time: Seconds = 5.0,
        progress_watchdog_interval: Seconds | None = 1.0,
        max_iterations: int | None = None,
        store_factory: StoreFactory | None = None,
        enabled: bool = True,
    ) -> None:
        self.timeouts = Timeouts(
            soft=_seconds("soft_timeout", soft_timeout),
            hard=_seconds("hard_timeout", hard_timeout),
            barrier=_seconds("barrier_timeout", barrier_timeout),
            completion=_seconds("completion_timeout", completion_timeout),
            last_call_wait=_seconds("last_call_wait", last_call_wait),
            termination_grace=_seconds("termination_grace_time", termination_grace_time),
            progress_interval=(
                None
                if progress_watchdog_interval is None
                else _seconds("progress_watchdog_interval", progress_watchdog_interval)
            ),
        )
        for name, hook in (
            ("initialize", initialize),
            ("abort", None if isinstance(abort, _Default) else abort),
            ("finalize", finalize),
            ("health_check", health_check),
            ("rank_assignment", rank_assignment),
            ("rank_filter", rank_filter),
            ("store_factory", store_factory),
        ):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable, not {hook!r}")
        self.initialize = initialize
        self.abort: Abort | None = AbortTorchDistributed() if isinstance(abort, _Default) else abort
        self.finalize = finalize
        self.health_check = health_check
        self.rank_assignment: RankAssignment = rank_assignment or ShiftRanks()
        self.rank_filter = rank_filter
        if max_iterations is not None and max_iterations < 1:
            raise ValueError(f"max_iterations must be at least 1, not {max_iterations}")
        self.max_iterations = max_iterations
        self.store_factory = store_factory
        self.enabled = enabled

    def __call__(self, fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
        if not self.enabled:
            return fn

        @functools.wraps(fn)
        def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
            with CallWrapper(self) as call:
                return call.run(fn, args, dict(kwargs))

        return wrapped


def _wants_call_wrapper(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s parameters annotated ``CallWrapper`` (or optional of it)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolved forward references: fall back to the raw text
        hints = {}
    names = []
    for name, param in params.items():
        hint = hints.get(name, param.annotation)
        if hint is CallWrapper or (
            CallWrapper in typing.get_args(hint)
            or (isinstance(hint, str) and "CallWrapper" in hint)
        ):
            names.append(name)
    return names


class CallWrapper:
    """The state of one call of a wrapped function; passed to parameters annotated with it.

    ``iteration``, ``state``, ``rank``/``world_size`` (in the process group),
    ``store`` (a ``torch.distributed.Store`` for this call, on the cluster
    store), ``init_process_group()``, ``ping()`` and ``atomic()``.
    """

    def __init__(self, wrapper: Wrapper, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        try:
            if environ is None:
                # The wrapper rewrites RANK/WORLD_SIZE for each iteration: a later call
                # of a wrapped function must still start from the process's own rank.
                for name in ("RANK", "WORLD_SIZE"):
                    _INITIAL_ENV.setdefault(name, env[name])
                env = {**env, **_INITIAL_ENV}
            rank = int(env["RANK"])
            world_size = int(env["WORLD_SIZE"])
        except (KeyError, ValueError) as exc:
            raise RestartError(
                "in-process restart needs RANK and WORLD_SIZE (run under elasticd or torchrun)"
            ) from exc
        self.wrapper = wrapper
        t = wrapper.timeouts
        self.call_index = next(_CALLS)
        self.layout = Layout.from_env(env)
        factory = wrapper.store_factory or _default_store_factory
        self._client = factory(t.barrier)
        self._monitor_client = factory(t.barrier)
        keepalive = max(t.soft / 2, 0.05)
        self.coordinator = Coordinator(
            self._client, self.layout, self.call_index, rank, keepalive=keepalive
        )
        self._state = State.initial(rank, world_size)
        self._lock = threading.RLock()
        self._running = False
        self._interrupted = False
        self._main_thread = threading.get_ident()
        in_main = threading.current_thread() is threading.main_thread()
        auto = t.progress_interval is not None and in_main and PendingCallProbe.available()
        self.progress = Progress(auto)
        self._probe = PendingCallProbe(self.progress, t.progress_interval or 1.0) if auto else None
        self._monitor = Monitor(
            Coordinator(
                self._monitor_client, self.layout, self.call_index, rank, keepalive=keepalive
            ),
            self.progress,
            self._view,
            self.interrupt,
            soft_timeout=t.soft,
            hard_timeout=t.hard,
            termination_grace_time=t.termination_grace,
        )
        self._torch_store: Any = None
        self._closed = False

    # -- context -------------------------------------------------------------------

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads and close the store clients."""
        if self._closed:
            return
        self._closed = True
        self._monitor.stop()
        if self._probe is not None:
            self._probe.stop()
        self._monitor_client.close()  # wakes the monitor out of its long-poll
        self._client.close()
        if self._torch_store is not None:
            self._torch_store.client.close()
        # The probe wakes at once (stop() posts its semaphore). The monitor is not
        # joined: a closed client does not interrupt a long-poll already sent, so
        # it ends at its next wake-up; it is a daemon thread and acts on nothing
        # once stopped.
        if self._probe is not None and self._probe.is_alive():
            self._probe.join(timeout=5.0)

    # -- what the training function sees ------------------------------------------------

    @property
    def iteration(self) -> int:
        """The restart iteration: 0 first, +1 after every in-process restart."""
        return self._state.iteration

    @property
    def state(self) -> State:
        return self._state

    @property
    def rank(self) -> int:
        """This rank in the process group of this iteration."""
        active = self._state.active_rank
        return active if active is not None else -1

    @property
    def world_size(self) -> int:
        """The size of the process group of this iteration."""
        return self._state.active_world_size

    @property
    def store(self) -> Any:
        """A ``torch.distributed.Store`` for this call (imports torch).

        Use ``PrefixStore(f"iteration_{call.iteration}", call.store)`` for a
        process group, or :meth:`init_process_group`.
        """
        if self._torch_store is None:
            from elasticd.worker.store import torch_store

            client = ClusterStoreClient(
                self._client.base_url,
                _token(),
                self.layout.torch_namespace(self.call_index),
                timeout=self.wrapper.timeouts.barrier,
            )
            self._torch_store = torch_store(client, timeout=self.wrapper.timeouts.barrier)
        return self._torch_store

    def init_process_group(self, backend: str = "gloo", **kwargs: Any) -> None:
        """``torch.distributed.init_process_group`` for this iteration's active world.

        Uses this call's store under a prefix per iteration, and remembers the
        group's sockets so that an abort can wake a blocked gloo collective.
        """
        dist: Any = importlib.import_module("torch.distributed")
        if not self._state.active:
            raise RestartError("a spare rank has no process group in this iteration")
        kwargs.setdefault("timeout", datetime.timedelta(seconds=self.wrapper.timeouts.barrier))
        store = dist.PrefixStore(f"iteration_{self.iteration}", self.store)
        before = tracker.snapshot()
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, **kwargs
        )
        tracker.record(before)

    def ping(self) -> None:
        """Report progress (also to the daemon); enables the manual progress timeout."""
        self.progress.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A section the monitor never interrupts (it waits for the section to end)."""
        with self._lock:
            yield

    # -- the monitor's side --------------------------------------------------------------

    def _view(self) -> IterationView:
        # No lock: the monitor must never wait on an atomic section just to look.
        state = self._state
        return IterationView(self._running, state.iteration, frozenset(state.active_world))

    def interrupt(self, reason: str, iteration: int | None = None, *, again: bool = False) -> None:
        """From the monitor thread: abort the group, unwind the function (RankShouldRestart).

        ``iteration`` is the one the monitor judged: nothing happens if that
        iteration is over or not running (a fault seen just before an
        iteration starts is caught by :meth:`_enter` itself). An iteration is
        interrupted once, unless ``again``: the soft timeout's escalation, when
        an earlier interruption did not unwind the function (its exception
        swallowed, or the rank still blocked after the abort): the abort runs
        again, on every socket the iteration opened, and so does the raise.
        """
        deadline = self.wrapper.timeouts.hard - self.wrapper.timeouts.soft
        if not self._lock.acquire(timeout=max(deadline, 0.1)):
            log.warning(
                "elasticd.inprocess: an atomic section delays the interruption (%s)", reason
            )
            return
        try:
            current = self._state.iteration
            if iteration is not None and iteration != current:
                return  # about an iteration that is over
            if not self._running or (self._interrupted and not again):
                return
            if self._interrupted:
                tracker.widen()  # the group's own sockets did not do it: every new one
            self._interrupted = True
            log.warning(
                "elasticd.inprocess: rank %d: interrupting iteration %d: %s",
                self._state.initial_rank,
                current,
                reason,
            )
            if self.wrapper.abort is not None:
                try:
                    self.wrapper.abort(self._state)
                except Exception:
                    log.exception("elasticd.inprocess: the abort hook failed")
            async_raise(self._main_thread, RankShouldRestart)
        finally:
            self._lock.release()

    def _enter(self) -> None:
        with self._lock:
            self._interrupted = False
            state = self._state
            view = IterationView(True, state.iteration, frozenset(state.active_world))
            reason = self._monitor.fault_in(view)
            if reason is not None:
                raise RankShouldRestart(reason)  # the fault came before the function started
            self._running = True

    def _leave(self) -> None:
        """End the monitored span; any interruption not yet raised is dropped.

        Idempotent: the handlers call it again in case the interruption was
        raised inside the first call.
        """
        with self._lock:
            self._running = False
            clear_async_exc(self._main_thread)
            self.progress.end()

    # -- the loop ---------------------------------------------------------------------

    def run(
        self, fn: Callable[..., _R], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _R | None:
        """Call ``fn`` until it completes on every active rank (see the module doc)."""
        for name in _wants_call_wrapper(fn):
            if kwargs.get(name) is None:
                kwargs[name] = self
        self._monitor.start()
        if self._probe is not None:
            self._probe.start()
        me = self._state.initial_rank
        try:
            world = self._pin_world(0, "start", self._state.world, next_iteration=0)
            iteration = 0
            while True:
                self._assign(world, iteration)
                finished, value, exc = self._iterate(fn, args, kwargs)
                if finished:
                    return value
                limit = self.wrapper.max_iterations
                if limit is not None and iteration + 1 >= limit:
                    raise RestartError(f"giving up after {limit} iteration(s)") from exc
                world = self._restart(iteration, exc)
                iteration += 1
        except (RestartError, HealthCheckError):
            raise
        except BaseException as exc:
            with contextlib.suppress(StoreUnreachable):
                self.coordinator.mark_terminated(me, f"left: {type(exc).__name__}: {exc}")
            raise
        finally:
            self.progress.end()

    def _pin_world(
        self, iteration: int, phase: str, world: tuple[int, ...], *, next_iteration: int
    ) -> list[int]:
        """Barrier over ``world``, then pin the world of ``next_iteration``.

        Raises RestartError when this rank is not in it.
        """
        t = self.wrapper.timeouts
        result = self.coordinator.barrier(iteration, phase, world, t.barrier)
        proposal = sorted(result.arrived - result.terminated)
        pinned, decider = self.coordinator.decide_world(next_iteration, proposal)
        if decider:
            for missing in sorted(result.missing):
                self.coordinator.mark_terminated(
                    missing, f"did not reach the {phase} barrier within {t.barrier:g} s"
                )
        me = self._state.initial_rank
        if me not in pinned:
            with contextlib.suppress(StoreUnreachable):
                self.coordinator.mark_terminated(me, "left out of the next world")
            raise RestartError(
                f"rank {me} is not part of the world of iteration {next_iteration}: {pinned}"
            )
        return pinned

    def _assign(self, world: list[int], iteration: int) -> None:
        state = self._state.replace(iteration=iteration)
        terminated = frozenset(state.world) - frozenset(world)
        if iteration == 0:
            terminated = frozenset(range(state.initial_world_size)) - frozenset(world)
        state = self.wrapper.rank_assignment(state, terminated)
        state = apply_filter(state, self.wrapper.rank_filter)
        if state.initial_rank not in state.world:
            raise RestartError(f"rank assignment left rank {state.initial_rank} out: {state}")
        with self._lock:
            self._state = state
        if state.active:
            os.environ["RANK"] = str(state.active_rank)
            os.environ["WORLD_SIZE"] = str(state.active_world_size)
        tracker.begin_iteration()

    def _iterate(
        self, fn: Callable[..., _R], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, _R | None, BaseException | None]:
        """One iteration: ``(True, value, None)`` when complete, else ``(False, None, cause)``."""
        t = self.wrapper.timeouts
        state = self._state
        self.progress.begin()
        value: _R | None = None
        try:
            self._enter()
            try:
                if self.wrapper.initialize is not None:
                    state = self.wrapper.initialize(state) or state
                    with self._lock:
                        self._state = state
                if self.wrapper.health_check is not None:
                    self.wrapper.health_check(state, None)
                if state.active:
                    value = fn(*args, **kwargs)
            finally:
                self._leave()
        except RankShouldRestart as exc:
            self._leave()
            return False, None, exc
        except Exception as exc:
            self._leave()
            log.warning(
                "elasticd.inprocess: rank %d raised in iteration %d: %s: %s",
                state.initial_rank,
                state.iteration,
                type(exc).__name__,
                exc,
            )
            self.coordinator.record_interrupted(
                state.iteration, "exception", f"{type(exc).__name__}: {exc}"
            )
            return False, None, exc
        if state.active:
            self.coordinator.arrive(state.iteration, "done")
        # A spare waits as long as the active ranks train; their completion
        # timeouts (and faults) end its wait.
        completion = self.coordinator.wait_completion(
            state.iteration, state.active_world, t.completion if state.active else math.inf
        )
        if completion.complete:
            return True, value, None
        if completion.timed_out:
            self.coordinator.record_interrupted(
                state.iteration, "completion_timeout", completion.reason
            )
        return False, None, RankShouldRestart(completion.reason)

    def _restart(self, iteration: int, exc: BaseException | None) -> list[int]:
        """Abort, finalize, check health, meet the others; the world of the next iteration."""
        t = self.wrapper.timeouts
        state = self._state
        me = state.initial_rank
        self.progress.end()
        if self.wrapper.abort is not None:
            try:
                state = self.wrapper.abort(state) or state
            except Exception:
                log.exception("elasticd.inprocess: the abort hook failed")
        if self.wrapper.finalize is not None:
            self.wrapper.finalize(state, exc)
        if self.wrapper.health_check is not None:
            try:
                self.wrapper.health_check(state, exc)
            except Exception as health:
                with contextlib.suppress(StoreUnreachable):
                    self.coordinator.mark_terminated(
                        me, f"health check failed: {type(health).__name__}: {health}"
                    )
                raise HealthCheckError(f"rank {me}: health check failed: {health}") from health
        gc.collect()  # drop the aborted group's objects (and their sockets) now
        if t.last_call_wait > 0:
            time.sleep(t.last_call_wait)
        return self._pin_world(iteration, "restart", state.world, next_iteration=iteration + 1)


def _token() -> str | None:
    path = os.environ.get("ELASTICD_TOKEN_FILE")
    if not path:
        return None
    try:
        return read_token_file(path, what="ELASTICD_TOKEN_FILE")
    except TokenFileError:
        return None


def _default_store_factory(timeout: float) -> ClusterStoreClient:
    return ClusterStoreClient.from_env(namespace="", timeout=timeout)
