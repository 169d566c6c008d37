"""The per-job agent: torch.distributed.elastic's agent state machine, async.

One agent runs per job on each node that takes part. Its loop is::

    rendezvous → assign ranks → start workers → monitor
        → restart (a worker failed, budget left)
        → succeed (every worker exited 0) → exit barrier
        → fail (budget spent) | cancel

It decides in pure functions and applies the decisions in
:mod:`elasticd.agent.agent`: how an attempt ended (a result, a hang, a
rendezvous change, the exit barrier) maps to the next step in
:mod:`elasticd.agent.decide` (a table); the job-document edits
(``record_failure``, ``settle_failure``, ``charge_now``, ``merge_recovery``)
are in :mod:`elasticd.agent.edits`; what an attempt starts (ranks, env, log
paths, the group view) is planned by :func:`elasticd.agent.attempt.plan_attempt`.
Exits are awaited, never polled.
"""
