"""A normal user's clone of this checkout, set up as the README says: for tests that run as nobody.

A program a test runs as a normal user (``nobody``) needs a Python that user can run,
and the tests' own venv may not be one: CI's links into root's 0700 pyenv. The
``nobody_clone`` fixture, once a session, copies this checkout into a home of nobody's
(a 0755 folder under the temp folder: pytest's own is 0700) and runs there, as nobody
with a normal user's PATH, the set-up lines of the README's "Use it" recipe as written
(``python3 -m venv .venv && . .venv/bin/activate``, ``pip install -e .``). Its
``.venv/bin/python`` every user can run, with elasticd (the clone, editable) and its
runtime dependencies; the README's recipe test runs the rest of the recipe there.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.users import missing, need_root

#: The checkout under test.
ROOT = Path(__file__).resolve().parent.parent

#: A normal user's PATH: where their shell finds ``python3`` (not root's pyenv, not a venv).
USER_PATH = "/usr/local/bin:/usr/bin:/bin"

#: What a copy of the checkout leaves out: its venv, git, build and tool caches.
NOT_COPIED = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache"
)


def recipe(heading: str) -> str:
    """The first ``sh`` block of README.md after ``heading``."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, f"no sh block after {heading!r}"
    return match.group(1)


def use_it_recipe() -> tuple[str, str]:
    """The "Use it" recipe as its set-up (the venv, activated, and `pip install -e .`) and
    the rest, which runs in that venv."""
    setup, install, rest = recipe("## Use it").split("\n", 2)
    assert setup.startswith("python3 -m venv .venv && . .venv/bin/activate"), setup
    assert install.startswith("pip install -e ."), install
    return f"{setup}\n{install}\n", rest


def run_as_nobody(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``args`` run as nobody (its uid and group, no other group), its output captured."""
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(
        args,
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        **kwargs,
    )


@dataclass(frozen=True)
class NobodyClone:
    """A copy of this checkout in nobody's home, set up by the README's lines, as nobody."""

    home: Path
    clone: Path
    seconds: float  # what the set-up took

    @property
    def python(self) -> str:
        """The venv's python: nobody (and every user) can run it."""
        return str(self.clone / ".venv" / "bin" / "python")

    def env(self) -> dict[str, str]:
        """A normal user's environment: their HOME and PATH, and this machine's pip settings
        (its package mirror), nothing else of root's session."""
        pip = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
        return {
            **pip,
            "HOME": str(self.home),
            "USER": "nobody",
            "LOGNAME": "nobody",
            "PATH": USER_PATH,
            "LANG": "C.UTF-8",
        }


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    os.lchown(top, uid, gid)
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), uid, gid)


def make_nobody_clone(folder: Path) -> NobodyClone:
    """Copy the checkout to ``folder``/home/elasticd, nobody's, and run the README's set-up there."""
    nobody = pwd.getpwnam("nobody")
    home = folder / "home"
    clone = home / "elasticd"
    shutil.copytree(ROOT, clone, ignore=NOT_COPIED, symlinks=True)
    _chown_tree(home, nobody.pw_uid, nobody.pw_gid)
    home.chmod(0o755)
    made = NobodyClone(home, clone, 0.0)
    python = shutil.which("python3", path=USER_PATH)
    if python is None:
        missing(f"no python3 on a normal user's PATH ({USER_PATH})")
    probe = run_as_nobody([python, "-c", "import ensurepip, venv"], env=made.env(), timeout=60)
    if probe.returncode != 0:
        missing(f"nobody cannot make a venv with {python} (python3-venv): {probe.stderr.strip()}")
    setup, _rest = use_it_recipe()
    start = time.monotonic()
    done = run_as_nobody(
        ["bash", "-c", f"set -euo pipefail\n{setup}"], cwd=clone, env=made.env(), timeout=100
    )
    assert done.returncode == 0, f"the README's set-up, as nobody:\n{done.stdout}{done.stderr}"
    return NobodyClone(home, clone, time.monotonic() - start)


@pytest.fixture(scope="session")
def nobody_clone() -> Iterator[NobodyClone]:
    """nobody's clone, set up once a session in a folder every user can reach, removed after."""
    need_root()
    folder = Path(tempfile.mkdtemp(prefix="elasticd-nobody-"))
    try:
        folder.chmod(0o755)
        yield make_nobody_clone(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
