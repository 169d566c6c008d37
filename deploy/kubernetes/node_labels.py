#!/usr/bin/env python3
"""elasticd-node-labels: the node daemon's config file, with its Kubernetes node's labels.

The init container of the DaemonSet (daemonset.yaml) runs it before ``elasticd serve``:
it reads this pod's Node object from the API server (``GET /api/v1/nodes/NAME``, with
the pod's service-account token; rbac.yaml grants only that), keeps the labels whose
keys match ``--keys`` (fnmatch patterns, comma-separated) and writes ``--config-out``:
the text of ``--config-in`` with one ``labels = {...}`` line appended. The daemon then
starts with ``--config`` that file, so a job's ``elasticd submit --selector KEY=VALUE``
can ask for the node's GPU model or zone.

The downward API cannot do this: it gives a pod its node's name, not the node's labels.

Standard library only: it runs in the daemon's image before the daemon. It fails (exit 1,
no file written) when the node cannot be read or the result is not a config file the
daemon would read the labels from, so the pod never starts without them.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import ssl
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster_api() -> str:
    """The API server's URL as every pod's environment names it."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{port}"


def chosen(labels: dict[str, str], patterns: list[str]) -> dict[str, str]:
    """The labels whose keys match one of ``patterns``, sorted by key."""
    return {
        key: labels[key]
        for key in sorted(labels)
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)
    }


def with_labels(config_text: str, labels: dict[str, str]) -> str:
    """``config_text`` with a ``labels`` line appended; ValueError if the daemon would not
    read exactly these labels from it (the config sets ``labels`` itself, or ends in
    another table than ``[elasticd]``)."""
    # JSON strings are TOML basic strings (the same escapes); non-ASCII is kept as it is,
    # since TOML has no surrogate pairs for json's \uD83D\uDE00.
    pairs = ", ".join(
        f"{json.dumps(k, ensure_ascii=False)} = {json.dumps(v, ensure_ascii=False)}"
        for k, v in labels.items()
    )
    text = config_text.rstrip("\n") + "\n" if config_text.strip() else ""
    text += f"# Added by elasticd-node-labels: the node's labels.\nlabels = {{ {pairs} }}\n"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(
            f"the config with the labels is not TOML ({exc}): does it set labels?"
        ) from None
    section = data.get("elasticd", data)
    if section.get("labels") != labels:
        raise ValueError("the labels would not land in the daemon's settings")
    return text


def node_labels(api: str, node: str, token: str, ca_file: Path | None) -> dict[str, str]:
    """The labels of Node ``node``."""
    url = f"{api.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"}
    )
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=30, context=context) as answer:
        body = json.load(answer)
    labels = body.get("metadata", {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elasticd-node-labels", description=__doc__.split("\n")[0])
    p.add_argument(
        "--node", required=True, help="the node's name (the downward API's spec.nodeName)"
    )
    p.add_argument(
        "--keys", required=True, help="label keys to keep: fnmatch patterns, comma-separated"
    )
    p.add_argument(
        "--config-in", required=True, type=Path, help="the daemon's config (the ConfigMap's)"
    )
    p.add_argument(
        "--config-out", required=True, type=Path, help="where to write it with the labels"
    )
    p.add_argument("--api", default=None, help="the API server's URL (default: the in-cluster one)")
    p.add_argument("--token-file", type=Path, default=ACCOUNT / "token")
    p.add_argument("--ca-file", type=Path, default=ACCOUNT / "ca.crt")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    patterns = [k.strip() for k in args.keys.split(",") if k.strip()]
    try:
        token = args.token_file.read_text().strip()
        labels = node_labels(args.api or in_cluster_api(), args.node, token, args.ca_file)
        kept = chosen(labels, patterns)
        text = with_labels(args.config_in.read_text(), kept)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        print(f"elasticd-node-labels: node {args.node}: {exc}", file=sys.stderr)
        return 1
    args.config_out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.config_out.with_name(args.config_out.name + ".partial")
    partial.write_text(text)
    partial.replace(args.config_out)
    shown = ", ".join(f"{k}={v}" for k, v in kept.items()) or "none"
    print(f"elasticd-node-labels: node {args.node}: labels {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
