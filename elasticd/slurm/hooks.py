"""``elasticd slurm prolog``: Slurm's node prolog, for ``slurm.conf`` (issue 38, form 2).

::

    # slurm.conf
    Prolog=/usr/local/sbin/elasticd-prolog     # exec elasticd slurm prolog
    PrologFlags=Alloc                          # on every node, when the job is allocated

slurmd runs it as root before a job's first step on the node. It runs the
node's own health checks, those its elasticd daemon runs before every start
(the config's ``health_check`` command within ``health_check_timeout``, and
the built-in GPU check, skipped where there is no ``nvidia-smi``), with the
configuration read as ``elasticd serve`` reads it (``--config``,
``ELASTICD_CONFIG``, ``ELASTICD_*``). A failing check exits 1: Slurm then
drains the node and requeues the job. Before that the prolog drains the node
itself with a reason naming the check (``elasticd prolog: node_health_check
failed: ...``), so ``scontrol show node`` says why, not only "Prolog error". (Not
``elasticd: ...``: that marks a quarantine's drain, which ``slurm_drain`` resumes.)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from elasticd.config import Config
from elasticd.node.health import HealthResult, checks_for_job, run_health_checks
from elasticd.supervise.env import operator_env

#: Slurm keeps a node's reason short on screen; the check's output is in the prolog's log.
MAX_REASON = 200


def drain_reason(results: Sequence[HealthResult]) -> str | None:
    """The node's drain reason for these results, or None when every check passed (pure)."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return None
    first = failed[0]
    message = " ".join(first.message.split()) or "no output"
    reason = f"elasticd prolog: {first.name} failed: {message}"
    if len(failed) > 1:
        reason += f" (and {len(failed) - 1} more)"
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."


async def prolog(config: Config, environ: Mapping[str, str]) -> int:
    """Run the node's checks; 0 if healthy, else drain the node (if Slurm names it) and 1."""
    job = environ.get("SLURM_JOB_ID", "")
    checks = checks_for_job(
        None,
        gpu=True,
        node_command=config.health_check,
        nvidia_smi=config.nvidia_smi,
        operator_timeout=config.health_check_timeout,
    )
    env = operator_env(environ, job_id=f"slurm-{job}" if job else "slurm-prolog")
    results = await run_health_checks(checks, env, config.health_check_timeout)
    reason = drain_reason(results)
    if reason is None:
        return 0
    print(f"elasticd slurm prolog: {reason}", file=sys.stderr, flush=True)
    node = environ.get("SLURMD_NODENAME")
    scontrol = shutil.which("scontrol", path=environ.get("PATH", os.defpath))
    if node and scontrol:
        process = await asyncio.create_subprocess_exec(
            scontrol, "update", f"nodename={node}", "state=drain", f"reason={reason}"
        )
        await process.wait()  # best effort: Slurm drains the node on the exit anyway
    return 1
