"""torch's side: its ``RendezvousHandler`` over the core; imports torch only when asked."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from elasticd.errors import RendezvousClosed, RendezvousError, RendezvousTimeout, StoreError
from elasticd.keys import torchrun_store_prefix
from elasticd.models import JobSpec
from elasticd.torchrun_backend.config import BACKEND, BackendConfig, backend_config
from elasticd.torchrun_backend.core import TorchrunRendezvous
from elasticd.torchrun_backend.edits import run_spec

log = logging.getLogger("elasticd.torchrun")


def _failure_reason(exc: BaseException) -> str:
    """One line on why torchrun ended with ``exc``."""
    first_failure = getattr(exc, "get_first_failure", None)  # torch's ChildFailedError
    if first_failure is not None:
        try:
            rank, failure = first_failure()
            return f"the workers failed: rank {rank} exited with code {failure.exitcode}"
        except Exception:  # torch's internals changed: fall back to the message
            pass
    lines = str(exc).strip().splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:500] if first else type(exc).__name__


_handler_cls: Any = None
_cls_lock = threading.Lock()


def _torch_handler_class() -> Any:
    """Build (once) the subclass of torch's ``RendezvousHandler``; imports torch."""
    global _handler_cls
    with _cls_lock:
        if _handler_cls is not None:
            return _handler_cls
        # Typed as Any whether torch's own annotations are installed or not.
        rapi: Any = importlib.import_module("torch.distributed.elastic.rendezvous.api")

        from elasticd.worker.store import ClusterStoreClient, torch_store

        def translate(exc: Exception) -> Any:
            """elasticd's rendezvous errors as torch's (the agent handles those)."""
            if isinstance(exc, RendezvousClosed):
                return rapi.RendezvousClosedError(str(exc))
            if isinstance(exc, RendezvousTimeout):
                return rapi.RendezvousTimeoutError(str(exc))
            if isinstance(exc, StoreError):
                return rapi.RendezvousConnectionError(str(exc))
            return rapi.RendezvousStateError(str(exc))

        base: Any = rapi.RendezvousHandler

        class ElasticdRendezvousHandler(base):  # type: ignore[misc]
            """torch's handler interface over :class:`TorchrunRendezvous`."""

            def __init__(self, core: TorchrunRendezvous) -> None:
                self._core = core
                self._client: ClusterStoreClient | None = None

            def get_backend(self) -> str:
                return BACKEND

            @property
            def use_agent_store(self) -> bool:
                return False

            def next_rendezvous(self) -> Any:
                try:
                    info = self._core.next_round()
                except (RendezvousError, StoreError) as exc:
                    raise translate(exc) from exc
                config = self._core.config
                if self._client is not None:
                    self._client.close()
                self._client = ClusterStoreClient(
                    config.url,
                    self._core.token,
                    torchrun_store_prefix(config.run_id, info.round),
                    timeout=config.store_timeout,
                )
                store = torch_store(self._client, timeout=config.store_timeout)
                bootstrap = rapi.RendezvousStoreInfo(info.master_addr, info.master_port)
                return rapi.RendezvousInfo(store, info.group_rank, info.group_world_size, bootstrap)

            def is_closed(self) -> bool:
                try:
                    return self._core.is_closed()
                except StoreError as exc:
                    raise translate(exc) from exc

            def set_closed(self) -> None:
                try:
                    self._core.set_closed()
                except (RendezvousError, StoreError) as exc:
                    raise translate(exc) from exc

            def num_nodes_waiting(self) -> int:
                return self._core.num_nodes_waiting()

            def get_run_id(self) -> str:
                return self._core.config.run_id

            def shutdown(self) -> bool:
                # torch's launcher calls this in a ``finally``: an exception on its way
                # out (ChildFailedError: the workers failed) means the run failed.
                exc = sys.exc_info()[1]
                failure = None if exc is None else _failure_reason(exc)
                try:
                    self._core.shutdown(failure=failure)
                except (RendezvousError, StoreError) as exc:
                    log.warning("closing the rendezvous of %s failed: %s", self.get_run_id(), exc)
                    return False
                finally:
                    if self._client is not None:
                        self._client.close()
                        self._client = None
                return True

        _handler_cls = ElasticdRendezvousHandler
        return _handler_cls


def _command_spec(config: BackendConfig) -> JobSpec:
    """What this torchrun runs, read from its command line by torch's own parser.

    Only when this process is torchrun (``torchrun`` or ``python -m
    torch.distributed.run``); a program that calls torch's launcher itself
    is shown by its own command line with the spec's defaults.
    """
    argv = list(sys.argv)
    name = os.path.basename(argv[0]) if argv else ""
    if name != "torchrun" and not (
        argv and argv[0].endswith(os.path.join("distributed", "run.py"))
    ):
        return run_spec(config, [name, *argv[1:]])
    try:
        run: Any = importlib.import_module("torch.distributed.run")
        args, _ = run.get_args_parser().parse_known_args(argv[1:])
        return run_spec(
            config,
            ["torchrun", *argv[1:]],
            nproc_per_node=int(run.determine_local_world_size(args.nproc_per_node)),
            max_restarts=int(args.max_restarts),
            role=str(args.role),
        )
    except (Exception, SystemExit):  # argparse exits on what it cannot parse
        return run_spec(config, ["torchrun", *argv[1:]])


def _create(params: Any) -> Any:
    """torch's handler creator: ``RendezvousParameters`` -> handler."""
    config = backend_config(
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        conf=params.config,
        environ=os.environ,
    )
    core = TorchrunRendezvous(config, spec=_command_spec(config))
    return _torch_handler_class()(core)


def create_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers the creator."""
    return _create
