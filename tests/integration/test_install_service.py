"""`elasticd install-service`: the unit with this elasticd's path, the user, folders, token —
written into a folder standing for /, verified by systemd, and a second run changes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.service import Found, Item, pending, render_unit
from tests.users import need_root

ROOT = Path(__file__).resolve().parents[2]
ELASTICD = str(Path(sys.executable).parent / "elasticd")


def install(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "elasticd", "install-service", "--root", str(root), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under ``root``: (mode, mtime in ns, content) — what a second run must keep."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if path.is_file() else b""
        out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, data)
    return out


def new_root(tmp_path: Path) -> Path:
    """A folder with the account files useradd --root needs (only root's entries)."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group"):
        lines = Path(f"/etc/{name}").read_text().splitlines()
        (root / "etc" / name).write_text("".join(f"{x}\n" for x in lines if x.startswith("root:")))
    for name in ("shadow", "gshadow"):
        (root / "etc" / name).write_text("")
        (root / "etc" / name).chmod(0o600)
    return root


@pytest.mark.parametrize(
    ("item", "found", "is_pending"),
    [
        (Item("user", "elasticd"), Found(frozenset(), {}), True),
        (Item("user", "elasticd"), Found(frozenset({"elasticd"}), {}), False),
        (Item("dir", "/d", 0o700), Found(frozenset(), {"/d": (0o700, None)}), False),
        (Item("dir", "/d", 0o700), Found(frozenset(), {"/d": (0o755, None)}), True),
        (Item("file", "/u", 0o644, "new"), Found(frozenset(), {"/u": (0o644, "old")}), True),
        (Item("file", "/u", 0o644, "same"), Found(frozenset(), {"/u": (0o644, "same")}), False),
        # A config file the admin edited is kept.
        (
            Item("file", "/c", 0o644, "ours", replace=False),
            Found(frozenset(), {"/c": (0o600, "theirs")}),
            False,
        ),
        (Item("file", "/c", 0o644, "ours", replace=False), Found(frozenset(), {}), True),
        (Item("token", "/t", 0o600), Found(frozenset(), {"/t": (0o600, None)}), False),
    ],
)
def test_what_is_pending_is_what_differs(item, found, is_pending):
    """The plan keeps an item only when what exists lacks it or differs."""
    assert pending([item], found) == ([item] if is_pending else [])


def test_the_unit_gets_an_absolute_exec_path():
    """ExecStart takes the path given; a relative one or a template without it is refused."""
    assert "ExecStart=/opt/ed/bin/elasticd serve" in render_unit(
        "ExecStart=@ELASTICD@ serve", "/opt/ed/bin/elasticd"
    )
    with pytest.raises(ConfigError, match="absolute"):
        render_unit("ExecStart=@ELASTICD@ serve", "bin/elasticd")
    with pytest.raises(ConfigError, match="@ELASTICD@"):
        render_unit("ExecStart=/usr/local/bin/elasticd serve", "/opt/ed/bin/elasticd")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_install_service_writes_a_verified_unit_the_user_and_token_once(tmp_path):
    """A dry run changes nothing; the install writes the unit (ExecStart: the venv's elasticd),
    the user, folders and token; systemd-analyze verify is silent; a second run changes nothing."""
    need_root()
    root = new_root(tmp_path)
    before = snapshot(root)
    dry = install(root, "--exec", ELASTICD, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would make: the system user 'elasticd'" in dry.stdout
    assert snapshot(root) == before

    first = install(root, "--exec", ELASTICD)
    assert first.returncode == 0, first.stderr
    unit = root / "etc/systemd/system/elasticd.service"
    text = unit.read_text()
    assert f"ExecStart={ELASTICD} serve --config /etc/elasticd/elasticd.toml" in text
    assert "@ELASTICD@" not in text
    doc = next(line for line in text.splitlines() if line.startswith("Documentation="))
    assert (root / doc.removeprefix("Documentation=file:///")).read_text().startswith("# elasticd")
    user = next(x for x in (root / "etc/passwd").read_text().splitlines() if x.startswith("elast"))
    name, _, uid, _, _, home, shell = user.split(":")
    assert (name, home, shell) == ("elasticd", "/nonexistent", "/usr/sbin/nologin")
    assert int(uid) < 1000  # a system user
    modes = {p: (root / p).stat().st_mode & 0o777 for p in ("var/lib/elasticd", "var/log/elasticd")}
    assert modes == {"var/lib/elasticd": 0o700, "var/log/elasticd": 0o711}
    token = root / "var/lib/elasticd/token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32
    assert (root / "etc/elasticd/elasticd.toml").read_text().startswith("# /etc/elasticd")

    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr

    installed = snapshot(root)
    second = install(root, "--exec", ELASTICD)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("elasticd install-service: nothing to change")
    assert snapshot(root) == installed

    # An edited config survives; a unit pointing elsewhere is put right, and only it.
    (root / "etc/elasticd/elasticd.toml").write_text("[elasticd]\nport = 7171\n")
    unit.write_text(text.replace(ELASTICD, "/usr/local/bin/elasticd"))
    third = install(root, "--exec", ELASTICD)
    assert third.returncode == 0, third.stderr
    assert third.stdout.splitlines()[0] == f"making: file {unit} (0644)"
    assert unit.read_text() == text
    assert (root / "etc/elasticd/elasticd.toml").read_text() == "[elasticd]\nport = 7171\n"


def test_the_exec_path_is_the_running_elasticd(tmp_path):
    """The console script that runs is the path; under `python -m elasticd`, the venv's."""
    from elasticd.service import elasticd_path

    script = tmp_path / "bin" / "elasticd"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert elasticd_path(str(script)) == str(script)
    assert elasticd_path(str(ROOT / "elasticd" / "__main__.py")) == ELASTICD
