"""Dependencies point one way (issue 13 point 7, issue 24 point 2): a test reads every import
and fails on one that goes against the layering, so a shortcut cannot creep back in.

There is no allow-list: every module has a place in :data:`LAYERS` (the longest prefix
that names it), and a module imports only from its own layer or from the ones below.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The daemon's layers, top first. A module belongs to the layer of the longest prefix
#: that names it; one that no prefix names (models, errors, config, the store, the
#: rendezvous, the process supervisor, the worker's side, ...) is in the bottom layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    # The entry points: the command line, ``elasticd.launch`` (the package's facade,
    # named ``elasticd.__init__`` here, and its worker side), and the composition root,
    # which builds the daemon's services and the API over them (the API depends on them).
    (
        "api",
        "elasticd.__init__",
        "elasticd.__main__",
        "elasticd.cli",
        "elasticd.launcher",
        "elasticd.launch_worker",
        "elasticd.node.daemon",
        "elasticd.slurm.hooks",
        "elasticd.slurm.run",  # the IO of `elasticd run` in a Slurm step (it writes the run token)
    ),
    # The node's services: jobs, the cluster, the scheduler's loop, events, health checks.
    ("elasticd.node",),
    # The per-job agent: what it needs of the node is handed in (protocols).
    ("elasticd.agent",),
)

#: Code that runs in the job's processes (workers, torchrun's): the only place for torch.
WORKER_SIDE = (
    "elasticd.launch_worker",
    "elasticd.worker",
    "elasticd.inprocess",
    "elasticd.torchrun_backend",
)


def module_name(path: Path) -> str:
    """The dotted name; the top package's own module is ``elasticd.__init__`` (its facade)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()
    return ".".join(parts)


def named_by(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int:
    """The index of ``name``'s layer in :data:`LAYERS`; ``len(LAYERS)``: the bottom one."""
    best, layer = -1, len(LAYERS)
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if named_by(name, prefix) and len(prefix) > best:
                best, layer = len(prefix), i
    return layer


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules(package: str) -> list[Path]:
    base = ROOT / package.replace(".", "/")
    found = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    assert found and found[0].exists(), f"no module in {package}: the rule would pass for nothing"
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {imported}"
        for path in modules(package)
        for imported in sorted(imports_of(path))
        if any(named_by(imported, f) for f in forbidden)
    ]


def test_every_import_points_down_the_layers() -> None:
    """A module imports nothing from a layer above its own (see :data:`LAYERS`)."""
    wrong = [
        f"{module_name(path)} (layer {layer_of(module_name(path))}) imports {imported} "
        f"(layer {layer_of(imported)})"
        for package in ("elasticd", "api")
        for path in modules(package)
        for imported in sorted(imports_of(path))
        if named_by(imported, "elasticd") or named_by(imported, "api")
        if layer_of(imported) < layer_of(module_name(path))
    ]
    assert wrong == []


def test_the_layers_name_real_modules() -> None:
    """A prefix that names nothing would make its rule pass for nothing."""
    for prefixes in LAYERS:
        for prefix in prefixes:
            assert modules(prefix)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        # The store knows nothing of jobs, agents or the API.
        ("elasticd.store", ("api", "elasticd.agent", "elasticd.node")),
        # Ranks and the protocol belong to the rendezvous; it never reaches up to the agent.
        ("elasticd.rendezvous", ("elasticd.agent", "elasticd.node", "elasticd.supervise")),
        # The process supervisor knows nothing of the node or the agent above it.
        ("elasticd.supervise", ("api", "elasticd.agent", "elasticd.node")),
        # The database stores rows; it does not know how workers are spawned.
        (
            "elasticd.node.db",
            ("elasticd.agent", "elasticd.node.jobs", "elasticd.supervise.spawn"),
        ),
        # In-worker code runs in the training process: nothing of the daemon's side.
        ("elasticd.worker", ("api", "elasticd.agent", "elasticd.node", "elasticd.supervise")),
        ("elasticd.inprocess", ("api", "elasticd.agent", "elasticd.node", "elasticd.supervise")),
        # The torchrun backend runs in torchrun's process (the job's side): the rendezvous
        # and the store, never the daemon's services.
        (
            "elasticd.torchrun_backend",
            ("api", "elasticd.node", "elasticd.agent", "elasticd.supervise"),
        ),
    ],
)
def test_no_import_goes_against_the_layering(package: str, forbidden: tuple[str, ...]) -> None:
    assert offenders(package, forbidden) == []


def test_only_the_worker_side_imports_torch() -> None:
    """The daemon never imports torch; the daemon and the API never import the torchrun
    backend, so they cannot reach torch through it."""
    wrong = []
    for package in ("elasticd", "api"):
        for path in modules(package):
            if any(named_by(module_name(path), w) for w in WORKER_SIDE):
                continue
            wrong += [
                f"{module_name(path)} imports {i}"
                for i in sorted(imports_of(path))
                if named_by(i, "torch") or named_by(i, "elasticd.torchrun_backend")
            ]
    assert wrong == []


def import_time_imports(path: Path, known: set[str]) -> set[str]:
    """The project's modules ``path`` imports when it is imported (not in functions, not
    under ``TYPE_CHECKING``): ``from a import b`` counts ``a.b`` when that is a module."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    return found & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_cycles_finds_a_cycle() -> None:
    """The check below can fail: a two-module loop is found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_at_import_time() -> None:
    """No two modules import each other when imported (a lazy import inside a function,
    like the composition root's of the API, is not one)."""
    paths = {module_name(p): p for package in ("elasticd", "api") for p in modules(package)}
    known = set(paths)
    graph = {name: import_time_imports(path, known) - {name} for name, path in paths.items()}
    assert cycles(graph) == []
