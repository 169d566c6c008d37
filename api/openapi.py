"""Print the OpenAPI document generated from the app (``make openapi`` writes openapi.json)."""

from __future__ import annotations

import json
import sys
from typing import Any

from api.app import create_app


def openapi_document() -> dict[str, Any]:
    return create_app(None).openapi()


def render() -> str:
    return json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
