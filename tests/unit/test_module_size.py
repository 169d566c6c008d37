"""No module of the daemon or the API grows to 1,000 lines: a module that long does
several jobs, and is split by job (issue 24, item 4)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1000


def test_no_module_under_elasticd_or_api_reaches_a_thousand_lines() -> None:
    paths = sorted([*(ROOT / "elasticd").rglob("*.py"), *(ROOT / "api").rglob("*.py")])
    assert len(paths) > 50, "the rule would pass for nothing"
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in paths}
    too_long = {name: n for name, n in sizes.items() if n >= LIMIT}
    assert too_long == {}, f"split these modules by job: {too_long}"
