"""``elasticd install-service``: the systemd unit, the service user, folders, config and token.

What a node needs to run ``elasticd serve`` under systemd, whatever way
elasticd was installed (a venv, pipx, a system package):

* the unit (package data ``elasticd/data/elasticd.service``) with its
  ``@ELASTICD@`` replaced by this ``elasticd``'s absolute path: systemd starts
  it with no venv on its ``PATH``;
* the user jobs run as by default (``run_as = "elasticd"``), a system user with
  no login and no home;
* the folders the unit names (state 0700, worker logs 0711, config), a minimal
  config file (the unit passes ``--config``) and the daemon's token, made as
  the daemon itself makes it at first start (``config.own_token``);
* the README where the unit's ``Documentation=`` points.

Decided purely, applied separately: :func:`desired` lists what should exist,
:func:`pending` keeps what does not yet (from an observed :class:`Found`), and
:func:`apply` does it. A second run finds everything in place and says so;
``--dry-run`` prints the plan and changes nothing. An existing config file or
token is never overwritten; a unit that differs is (it is ours). ``--root``
installs under another folder (a package build, a test): paths are joined
under it and the user is made with ``useradd --root``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from elasticd.config import own_token
from elasticd.errors import ConfigError

__all__ = [
    "Found",
    "Item",
    "apply",
    "desired",
    "elasticd_path",
    "exec_path_warnings",
    "install_service_command",
    "pending",
    "render_unit",
]

#: The placeholder for the ``elasticd`` executable in the shipped unit.
EXEC_PLACEHOLDER = "@ELASTICD@"
UNIT_NAME = "elasticd.service"
STATE_DIR = "/var/lib/elasticd"
LOG_DIR = "/var/log/elasticd"
CONFIG_DIR = "/etc/elasticd"
DOC_FILE = "/usr/share/doc/elasticd/README.md"

CONFIG_TEXT = """\
# /etc/elasticd/elasticd.toml, written by `elasticd install-service` (never overwritten).
# Every key has an ELASTICD_* environment equivalent and a flag (elasticd serve --help);
# the unit passes --state-dir, --log-dir and --unix-socket. All keys, explained:
# systemd/elasticd.toml.example in the source, or the README (/usr/share/doc/elasticd).
[elasticd]
host = "127.0.0.1"   # "0.0.0.0" for other nodes; every TCP caller needs a token
port = 7070
"""

Kind = Literal["dir", "file", "user", "token"]


@dataclass(frozen=True)
class Item:
    """One thing the service needs: a folder, a file with its content, the user, the token."""

    kind: Kind
    target: str  # a path under the root, or the user's name
    mode: int = 0
    content: str | None = None
    replace: bool = True  # a file that differs is rewritten (False: one that exists is kept)

    def describe(self) -> str:
        if self.kind == "user":
            return f"the system user {self.target!r} (jobs run as it)"
        if self.kind == "token":
            return f"the daemon's token {self.target} (0600)"
        return f"{self.kind} {self.target} ({self.mode:04o})"


@dataclass(frozen=True)
class Found:
    """What exists now, for the items of a plan: read by :func:`observe`."""

    users: frozenset[str]
    #: path -> (mode, content or None for a folder); absent paths are not in it.
    paths: dict[str, tuple[int, str | None]]


def render_unit(template: str, exec_path: str) -> str:
    """The unit with its ``ExecStart`` pointing at ``exec_path`` (pure).

    Only the ``ExecStart=`` line's placeholder is replaced: the header comment that
    explains the placeholder keeps naming it.
    """
    if not os.path.isabs(exec_path) or any(c.isspace() for c in exec_path):
        raise ConfigError(f"{exec_path!r}: ExecStart needs an absolute path without spaces")
    lines = template.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
    if len(starts) != 1 or EXEC_PLACEHOLDER not in lines[starts[0]]:
        raise ConfigError(f"the unit template has no ExecStart={EXEC_PLACEHOLDER} to replace")
    lines[starts[0]] = lines[starts[0]].replace(EXEC_PLACEHOLDER, exec_path)
    return "".join(lines)


#: Folders whose contents do not outlive a reboot or a cleaner (``systemd-tmpfiles``).
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def exec_path_warnings(
    exec_path: str, *, editable_source: str | None, homes: Iterable[str]
) -> list[str]:
    """What makes ``exec_path`` a fragile ``ExecStart`` (pure): an editable install (the
    service runs a source checkout's code), or a path under a scratch or home folder."""
    warnings = []
    if editable_source is not None:
        warnings.append(
            f"elasticd is an editable install of {editable_source}: the service runs that "
            "checkout's code, and breaks when it is moved, deleted or switched to another "
            "branch; install a release (pip install . into a venv of its own, or pipx) "
            "and give --exec its elasticd"
        )
    real = os.path.realpath(exec_path)
    for path in dict.fromkeys((exec_path, real)):
        folder = next((d for d in SCRATCH_DIRS if _under(path, d)), None)
        kind = "a scratch folder"
        if folder is None:
            folder = next((h for h in homes if _under(path, h)), None)
            kind = "a home folder"
        if folder is not None:
            warnings.append(
                f"ExecStart={exec_path} is under {kind} ({folder}): the service stops "
                "starting when it is cleaned, and the service user may not reach it; "
                "install elasticd in a system-wide place (e.g. a venv in /opt) and give "
                "--exec its elasticd"
            )
            break
    return warnings


def _under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/")
    return bool(folder) and (path == folder or path.startswith(folder + "/"))


def _editable_source() -> str | None:
    """The source folder this elasticd runs from when it is not installed (an editable
    install, PEP 660, or a checkout on ``PYTHONPATH``), else None."""
    package = Path(__file__).resolve().parent
    if {"site-packages", "dist-packages"} & set(package.parts):
        return None
    return str(package.parent)


def _homes() -> list[str]:
    """Home folders of root and of people (uid 1000 and up), as this node's passwd has them."""
    homes = {"/root", "/home"}
    for entry in pwd.getpwall():
        person = entry.pw_uid == 0 or entry.pw_uid >= 1000
        if person and entry.pw_dir not in ("", "/") and not entry.pw_dir.startswith("/nonex"):
            homes.add(entry.pw_dir)
    return sorted(homes)


def desired(*, root: Path, unit_dir: str, unit: str, readme: str | None, user: str) -> list[Item]:
    """Everything the service needs, in the order it is made (pure)."""

    def under(path: str) -> str:
        return str(root / path.lstrip("/"))

    items = [
        Item("user", user),
        Item("dir", under(unit_dir), 0o755),
        Item("file", under(f"{unit_dir}/{UNIT_NAME}"), 0o644, unit),
        Item("dir", under(CONFIG_DIR), 0o755),
        Item("file", under(f"{CONFIG_DIR}/elasticd.toml"), 0o644, CONFIG_TEXT, replace=False),
        Item("dir", under(STATE_DIR), 0o700),
        Item("token", under(f"{STATE_DIR}/token"), 0o600),
        Item("dir", under(LOG_DIR), 0o711),
    ]
    if readme is not None:
        items += [
            Item("dir", under(str(Path(DOC_FILE).parent)), 0o755),
            Item("file", under(DOC_FILE), 0o644, readme),
        ]
    return items


def pending(items: list[Item], found: Found) -> list[Item]:
    """The items that ``found`` lacks or has otherwise (pure)."""
    out = []
    for item in items:
        if item.kind == "user":
            if item.target not in found.users:
                out.append(item)
            continue
        current = found.paths.get(item.target)
        if current is None:
            out.append(item)
        elif item.kind in ("dir", "token"):
            if current[0] != item.mode:
                out.append(item)
        elif item.replace and current != (item.mode, item.content):
            out.append(item)
    return out


def _users(root: Path, user: str) -> frozenset[str]:
    if root == Path("/"):  # this system's: NSS (a directory service's users too)
        try:
            pwd.getpwnam(user)
        except KeyError:
            return frozenset()
        return frozenset({user})
    try:
        text = (root / "etc/passwd").read_text()
    except FileNotFoundError:
        return frozenset()
    return frozenset(line.split(":", 1)[0] for line in text.splitlines() if ":" in line)


def observe(items: list[Item], root: Path) -> Found:
    """Read what exists of ``items`` now."""
    paths: dict[str, tuple[int, str | None]] = {}
    users: frozenset[str] = frozenset()
    for item in items:
        if item.kind == "user":
            users |= _users(root, item.target)
            continue
        path = Path(item.target)
        try:
            mode = path.lstat().st_mode & 0o7777
        except FileNotFoundError:
            continue
        content = None
        if item.kind == "file":
            content = path.read_text(errors="replace")
        paths[item.target] = (mode, content)
    return Found(users=users, paths=paths)


def apply(item: Item, root: Path) -> None:
    """Make one pending item."""
    path = Path(item.target)
    if item.kind == "user":
        command = ["useradd", "--system", "--user-group", "--no-create-home"]
        command += ["--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin"]
        if root != Path("/"):
            command += ["--root", str(root)]
        done = subprocess.run([*command, item.target], capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(f"useradd {item.target} failed: {done.stderr.strip()}")
    elif item.kind == "dir":
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(item.mode)
    elif item.kind == "token":
        own_token(path.parent)  # the daemon's own rule: O_EXCL, 0600; an existing one is kept
        path.chmod(item.mode)
    else:
        assert item.content is not None
        partial = path.with_name(f".{path.name}.new")
        partial.write_text(item.content)
        partial.chmod(item.mode)
        partial.replace(path)  # atomic: a reader sees the old file or the new one


def elasticd_path(argv0: str | None = None) -> str:
    """The absolute path of the ``elasticd`` running now (its console script)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    candidates = [argv0] if Path(argv0).name == "elasticd" else []
    candidates += [str(Path(sys.executable).parent / "elasticd"), shutil.which("elasticd") or ""]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return os.path.abspath(candidate)
    raise ConfigError("cannot find the elasticd executable: give --exec /path/to/elasticd")


def _readme() -> str | None:
    """The README: the installed package's long description, else a source checkout's."""
    try:
        meta = importlib.metadata.metadata("elasticd")
        text = meta.get_payload() or meta.get("Description")  # type: ignore[attr-defined]
    except importlib.metadata.PackageNotFoundError:
        text = None
    if text:
        return str(text)
    source = Path(__file__).resolve().parents[1] / "README.md"
    return source.read_text() if source.is_file() else None


def install_service_command(args: argparse.Namespace) -> int:
    """``elasticd install-service``: print what changes (or would), apply it, exit 0."""
    root = Path(args.root).resolve()
    template = resources.files("elasticd").joinpath("data", UNIT_NAME).read_text()
    exec_path = args.exec_path or elasticd_path()
    unit = render_unit(template, exec_path)
    # The editable install is this elasticd's: it matters only when ExecStart runs this one.
    running = os.path.realpath(str(Path(sys.executable).parent / "elasticd"))
    editable = _editable_source() if os.path.realpath(exec_path) == running else None
    for warning in exec_path_warnings(exec_path, editable_source=editable, homes=_homes()):
        print(f"elasticd install-service: warning: {warning}", file=sys.stderr, flush=True)
    items = desired(root=root, unit_dir=args.unit_dir, unit=unit, readme=_readme(), user=args.user)
    todo = pending(items, observe(items, root))
    if not todo:
        print(f"elasticd install-service: nothing to change ({len(items)} items in place)")
        return 0
    if os.geteuid() != 0 and not args.dry_run:
        raise ConfigError("install-service needs root (or --dry-run to see the plan)")
    for item in todo:
        print(f"{'would make' if args.dry_run else 'making'}: {item.describe()}", flush=True)
        if not args.dry_run:
            apply(item, root)
    if not args.dry_run:
        print("done; then: systemctl daemon-reload && systemctl enable --now elasticd")
    return 0
