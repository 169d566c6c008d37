"""Real Unix users for attack tests: made with ``useradd`` for one test, removed after it.

A test that plays a second local user (``alice`` reads ``bob``'s job output, ``mallory``
talks to the daemon's socket) needs users that exist in ``/etc/passwd``, with their
own uid, and sometimes a group they share. Names are random (``edt`` + 8 hex
characters), so parallel or repeated runs never collide, and every user and group
made here is deleted when the test ends. Needs root; a test that asks for a user
without it is skipped (CI runs as root and must not skip: see :func:`need_root`).
"""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NoReturn

import pytest


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str


def need_root() -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            raise AssertionError("this test plays other users and needs root (CI runs as root)")
        pytest.skip("needs root to make Unix users")


def missing(why: str) -> NoReturn:
    """A tool the tests need is missing: a skip here, a failure in CI (which installs it)."""
    if os.environ.get("CI"):
        raise AssertionError(f"{why} (.ci/run installs it)")
    pytest.skip(why)


@dataclass
class Users:
    """A factory of throwaway users and groups; :meth:`cleanup` deletes them."""

    made_users: list[str] = field(default_factory=list)
    made_groups: list[str] = field(default_factory=list)

    def group(self) -> str:
        name = "edtg" + secrets.token_hex(4)
        subprocess.run(["groupadd", name], check=True, capture_output=True)
        self.made_groups.append(name)
        return name

    def user(self, *, group: str | None = None, home: bool = False) -> User:
        """A new user; ``group``: its primary group (shared with others), else its own."""
        name = "edt" + secrets.token_hex(4)
        args = ["useradd", "--shell", "/bin/sh"]
        args += ["--create-home"] if home else ["--no-create-home", "--home-dir", "/nonexistent"]
        args += ["-g", group] if group else ["--user-group"]
        subprocess.run([*args, name], check=True, capture_output=True)
        self.made_users.append(name)
        entry = pwd.getpwnam(name)
        return User(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)

    def cleanup(self) -> None:
        for name in self.made_users:
            subprocess.run(["userdel", "--remove", name], capture_output=True)
        for name in self.made_groups:
            subprocess.run(["groupdel", name], capture_output=True)


@pytest.fixture
def users() -> Iterator[Users]:
    need_root()
    made = Users()
    try:
        yield made
    finally:
        made.cleanup()
