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


def test_only_exec_start_gets_the_path_and_the_header_keeps_the_placeholder():
    """The shipped unit: its header comment, which explains @ELASTICD@, keeps naming it; only
    ExecStart's placeholder becomes the path (a comment naming the path would be false)."""
    template = (ROOT / "elasticd" / "data" / "elasticd.service").read_text()
    unit = render_unit(template, "/opt/ed/bin/elasticd")
    changed = [
        (old, new)
        for old, new in zip(template.splitlines(), unit.splitlines(), strict=True)
        if old != new
    ]
    assert changed == [
        (line, line.replace("@ELASTICD@", "/opt/ed/bin/elasticd"))
        for line in template.splitlines()
        if line.startswith("ExecStart=")
    ]
    header = unit.split("[Unit]")[0]
    assert "@ELASTICD@" in header and "/opt/ed" not in header


def test_the_units_socket_folder_mode_is_the_one_the_daemon_makes():
    """RuntimeDirectoryMode and the comment above it say the mode bind_unix_socket gives a
    root daemon's socket folder (every local user served: 0755, the socket 0666)."""
    from elasticd.security import SOCKET_DIR_MODE_EVERYONE, SOCKET_MODE_EVERYONE

    unit = (ROOT / "elasticd" / "data" / "elasticd.service").read_text()
    mode = next(x for x in unit.splitlines() if x.startswith("RuntimeDirectoryMode="))
    assert int(mode.split("=")[1], 8) == SOCKET_DIR_MODE_EVERYONE
    comment = unit[unit.index("# Private folders") : unit.index("StateDirectory=")]
    assert (
        f"{SOCKET_DIR_MODE_EVERYONE:04o} with the\n# socket {SOCKET_MODE_EVERYONE:04o}" in comment
    )
    assert "socket, 0750" not in comment


@pytest.mark.parametrize(
    ("exec_path", "editable", "says"),
    [
        ("/opt/ed/bin/elasticd", None, []),
        ("/opt/ed/bin/elasticd", "/work/clone", ["editable install of /work/clone"]),
        ("/tmp/clone/.venv/bin/elasticd", None, ["under a scratch folder (/tmp)"]),
        ("/home/alice/ed/.venv/bin/elasticd", None, ["under a home folder (/home/alice)"]),
        ("/root/ed/bin/elasticd", None, ["under a home folder (/root)"]),
    ],
)
def test_a_fragile_exec_start_is_warned_about(exec_path, editable, says):
    """An editable install, or an elasticd under /tmp or a home folder, gets a warning naming
    it and the fix; a system-wide install gets none."""
    from elasticd.service import exec_path_warnings

    warnings = exec_path_warnings(
        exec_path, editable_source=editable, homes=["/home/alice", "/root"]
    )
    assert len(warnings) == len(says), warnings
    for warning, said in zip(warnings, says, strict=True):
        assert said in warning and "--exec" in warning, warning


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
    assert [x for x in text.splitlines() if "@ELASTICD@" in x and not x.startswith("#")] == []
    # This venv's elasticd is an editable install of the checkout: said, not refused.
    assert f"warning: elasticd is an editable install of {ROOT}" in first.stderr, first.stderr
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
