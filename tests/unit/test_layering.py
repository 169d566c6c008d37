"""Dependencies point one way (issue 13 point 7): a test reads every import and fails on one
that goes against the layering, so a shortcut cannot creep back in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    found = sorted((ROOT / package.replace(".", "/")).rglob("*.py"))
    assert found, f"no module in {package}: the rule would pass for nothing"
    return found


def offenders(package: str, forbidden: tuple[str, ...], allow: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in modules(package):
        name = str(path.relative_to(ROOT))
        if any(name == a or (a.endswith("/") and name.startswith(a)) for a in allow):
            continue
        for imported in imports_of(path):
            if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                out.append(f"{name} imports {imported}")
    return sorted(out)


@pytest.mark.parametrize(
    ("package", "forbidden", "allow"),
    [
        # The API is a thin layer over the daemon's services; only the composition root
        # (and the CLI that starts it) builds the app.
        ("elasticd", ("api",), ("elasticd/node/daemon.py", "elasticd/cli.py")),
        # The store knows nothing of jobs, agents or the API.
        (
            "elasticd.store",
            ("api", "elasticd.agent", "elasticd.node"),
            (),
        ),
        # Ranks and the protocol belong to the rendezvous; it never reaches up to the agent.
        ("elasticd.rendezvous", ("elasticd.agent", "elasticd.node.jobs", "elasticd.supervise"), ()),
        # The database stores rows; it does not know how workers are spawned.
        ("elasticd.node.db", ("elasticd.supervise", "elasticd.agent", "elasticd.node.jobs"), ()),
        # In-worker code runs in the training process: nothing of the daemon's side.
        (
            "elasticd.worker",
            ("api", "elasticd.agent", "elasticd.node", "elasticd.supervise"),
            (),
        ),
        (
            "elasticd.inprocess",
            ("api", "elasticd.agent", "elasticd.node", "elasticd.supervise"),
            (),
        ),
        # The client side (the CLI's client, the Python clients, the console) and the shared
        # modules know nothing of the node daemon's services.
        (
            "elasticd",
            ("elasticd.node",),
            (
                "elasticd/node/",
                "elasticd/agent/",
                "elasticd/supervise/",
                "elasticd/cli.py",
                "elasticd/launcher.py",
                "elasticd/__main__.py",
            ),
        ),
        # The daemon side never imports torch (code that runs in workers, or in torchrun's
        # process, may).
        (
            "elasticd",
            ("torch",),
            (
                "elasticd/launch_worker.py",
                "elasticd/worker/",
                "elasticd/inprocess/",
                "elasticd/torchrun_backend/",
            ),
        ),
        # The torchrun backend runs in torchrun's process (the job's side): the daemon and
        # the API never import it, so they cannot reach torch through it.
        ("elasticd", ("elasticd.torchrun_backend",), ("elasticd/torchrun_backend/",)),
        ("api", ("elasticd.torchrun_backend",), ()),
    ],
)
def test_no_import_goes_against_the_layering(
    package: str, forbidden: tuple[str, ...], allow: tuple[str, ...]
) -> None:
    if package == "elasticd.node.db":
        paths = [ROOT / "elasticd" / "node" / "db.py"]
        assert offenders_of(paths, forbidden) == []
        return
    assert offenders(package, forbidden, allow) == []


def offenders_of(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)} imports {i}"
        for p in paths
        for i in imports_of(p)
        if any(i == f or i.startswith(f + ".") for f in forbidden)
    ]


def test_the_torchrun_backend_reaches_nothing_of_the_daemon() -> None:
    """It runs in torchrun's process: the rendezvous and the store, never the daemon's services."""
    paths = sorted((ROOT / "elasticd" / "torchrun_backend").glob("*.py"))
    assert paths
    forbidden = ("api", "elasticd.node", "elasticd.agent", "elasticd.supervise")
    assert offenders_of(paths, forbidden) == []
