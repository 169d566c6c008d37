"""Issue 22 #15: a counter add past Python's 4,300-digit limit is a 422, not a 500 and a reset."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.hardening.support import serve

pytestmark = pytest.mark.timeout(60)


async def test_an_oversized_counter_add_is_refused_and_the_connection_lives_on(tmp_path: Path):
    """A 4,300-digit delta, and an add past 64 bits, answer 422; the same connection goes on."""
    daemon = serve(tmp_path)
    try:
        await daemon.wait_ready()
        async with daemon.client() as c:
            body = '{"key": "ctr", "delta": ' + "9" * 4300 + "}"
            r = await c.post(
                "/store/add", content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 422, r.text
            assert r.json()["errors"][0]["field"] == "delta"
            # A counter a store writer left at the top of the range: one more is refused.
            top = base64.b64encode(str(2**63 - 1).encode()).decode()
            assert (await c.put("/store/kv", json={"key": "top", "value": top})).status_code == 200
            r = await c.post("/store/add", json={"key": "top", "delta": 1})
            assert r.status_code == 422 and "64-bit range" in r.json()["detail"], r.text
            # A counter too long to be one at all (the 4,300 digits written by hand).
            huge = base64.b64encode(b"9" * 4300).decode()
            assert (
                await c.put("/store/kv", json={"key": "huge", "value": huge})
            ).status_code == 200
            r = await c.post("/store/add", json={"key": "huge", "delta": 1})
            assert r.status_code == 422, r.text
            # The same client (its kept-alive connection) and the daemon go on.
            r = await c.post("/store/add", json={"key": "ctr", "delta": 2})
            assert r.status_code == 200 and r.json() == {"value": 2}
            assert (await c.get("/healthz")).status_code == 200
        assert daemon.proc.poll() is None
        assert "Traceback" not in daemon.output()
    finally:
        daemon.stop()
