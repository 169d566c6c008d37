"""Screenshots of the dashboard for the docs: ``docs/dashboard-desktop.png`` and ``-phone.png``.

Not a benchmark (``run_all`` runs ``bench_*.py`` only) and no test needs it:
it starts ``elasticd serve`` (bench/_common.py), runs a 4-worker job whose rank 2
is killed once (a restart on the timeline) and a short job that succeeds, then
photographs the page in Debian's headless Chromium at 1280 px and at 375 px
(a phone), with rank 0's log followed in the log viewer.

    python bench/dashboard_screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PYTHON, ROOT, ElasticdServer, poll_until  # noqa: E402

TRAIN = """
import os, time
rank = int(os.environ["RANK"])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
for step in range(1, 100000):
    if step <= 6 or step % 50 == 0:
        print(f"attempt {attempt} rank {rank} step {step} loss {2.5 / step:.4f}", flush=True)
    time.sleep(0.1)
"""
EVAL = "import os; print('eval rank', os.environ['RANK'], 'accuracy 0.913')"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]


class Server(ElasticdServer):
    """The bench daemon with 8 slots, whatever this machine's CPU count."""

    def command(self) -> list[str]:
        return [*super().command(), "--slots", "8"]


def healthy_workers(server: ElasticdServer, job_id: str, attempt: int) -> list[Any] | None:
    view = server.client.get(f"/jobs/{job_id}/workers").json()
    groups = [g for g in view["groups"] if g["attempt"] == attempt]
    workers = [w for g in groups for w in g["workers"] if w["state"] == "HEALTHY"]
    return workers if len(workers) == 4 else None


def stage(server: ElasticdServer, folder: Path) -> None:
    """A job that succeeded, and a running one that restarted once."""
    server.submit({"id": "eval-sweep", "entrypoint": PYTHON, "args": ["-c", EVAL]})
    server.wait_terminal("eval-sweep", 60)
    train = folder / "train.py"
    train.write_text(TRAIN)
    spec = {"entrypoint": PYTHON, "args": [str(train)], "nproc_per_node": 4}
    server.submit({"id": "resnet-demo", **spec, "termination_grace": 2})
    workers = poll_until(lambda: healthy_workers(server, "resnet-demo", 0), 60, "4 workers")
    os.kill(next(w["pid"] for w in workers if w["rank"] == 2), signal.SIGKILL)
    poll_until(lambda: healthy_workers(server, "resnet-demo", 1), 60, "the restarted workers")


def photograph(server: ElasticdServer, out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            for name, size in (("desktop", (1280, 1000)), ("phone", (375, 812))):
                page = browser.new_page(viewport={"width": size[0], "height": size[1]})
                page.goto(server.url + "/ui#resnet-demo")
                page.wait_for_selector("#token-dialog[open]")
                page.fill("#token-input", server.token)
                page.click("#token-form button[type=submit]")
                page.wait_for_selector('#timeline li[data-phase="workers spawned"]')
                page.locator('#workers .worker[data-state="HEALTHY"]').nth(3).wait_for()
                page.locator("#log-text").filter(has_text="attempt 1 rank 0 step 6").wait_for()
                page.screenshot(path=str(out / f"dashboard-{name}.png"), full_page=True)
                page.close()
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the PNGs")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("needs chromium (apt-get install chromium) and playwright", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="elasticd-shots-") as tmp,
        Server(Path(tmp), name="shots") as server,
    ):
        stage(server, Path(tmp))
        photograph(server, args.out, chromium)
    for name in ("desktop", "phone"):
        print(args.out / f"dashboard-{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
