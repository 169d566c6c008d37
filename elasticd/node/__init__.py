"""The node daemon's services: what runs inside ``elasticd serve`` (as root) and nowhere else.

:mod:`~elasticd.node.daemon` is the composition root; :mod:`~elasticd.node.jobs`
the job service (what the API calls, one agent per job); :mod:`~elasticd.node.cluster`
this node's membership; :mod:`~elasticd.node.events` and :mod:`~elasticd.node.db`
the event log; :mod:`~elasticd.storage` local disk faults;
:mod:`~elasticd.node.health`, :mod:`~elasticd.node.metrics`,
:mod:`~elasticd.security`, :mod:`~elasticd.node.systemd`,
:mod:`~elasticd.node.logfollow`. Beside this package: :mod:`elasticd.agent`,
:mod:`elasticd.rendezvous`, :mod:`elasticd.supervise` (the daemon's other
parts), :mod:`elasticd.store` (shared with clients), the in-worker libraries
:mod:`elasticd.worker` and :mod:`elasticd.inprocess`, and the shared modules
at the top level (models, states, errors, config, keys, tokens, clock, storage,
security, ...)
with the client side (cli, client, console, launcher).
"""
