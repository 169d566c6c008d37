"""The per-job agent: torch.distributed.elastic's agent state machine, async.

One agent runs per job on each node that takes part. Its life is::

    rendezvous → assign ranks → start workers → monitor
        → restart (a worker failed, budget left)
        → succeed (every worker exited 0) → exit barrier
        → fail (budget spent) | cancel

Every decision is :func:`elasticd.agent.machine.step`, a pure function of
the agent's state and an event (the table in ``docs/design.md``); the runner
:class:`elasticd.agent.agent.JobAgent` awaits the events and carries out the
effects, with the hooks of :mod:`elasticd.agent.hooks` for each attempt's
concerns. The job-document edits (``record_failure``, ``settle_failure``,
``charge_now``, ``merge_recovery``) are in :mod:`elasticd.agent.edits`; what
an attempt starts (ranks, env, log paths, the group view) is planned by
:func:`elasticd.agent.attempt.plan_attempt`. What the agent needs of the node
is handed in (:mod:`elasticd.agent.ports`): it imports nothing of
:mod:`elasticd.node`. Exits are awaited, never polled.
"""
