"""elasticd is torchft's Lighthouse (issue 39): a quorum service that is no single point of failure.

torchft (pytorch's per-step fault tolerance) runs one ``Manager`` per replica group; every
step it asks a central **Lighthouse** for a quorum (a long poll) and heartbeats it. torchft's
own Lighthouse is one process with its state in memory: its loss stops every group, and a
restarted one hands out quorum ids from 1 again. Here every daemon serves torchft's
``LighthouseService`` to its own workers, and the state lives in the cluster store:

* :mod:`~elasticd.lighthouse.proto` — the protocol's messages in protobuf's wire format,
  written by hand and bounded (no protobuf package);
* :mod:`~elasticd.lighthouse.rules` — the quorum decision, pure: ``decide(state, now,
  settings)`` (torchft's rules, with min_replicas and the majority checked on every quorum);
* :mod:`~elasticd.lighthouse.state` — the store documents (each node's record of its
  Managers' requests and heartbeats, the quorum document) and the leader's view of them;
* :mod:`~elasticd.lighthouse.quorum` — one job's loops on one node: its record, the quorum
  watch that answers its long polls, the election (one leader per job, on its node's
  lease) and the leader's decide loop (compare-and-set on the quorum document);
* :mod:`~elasticd.lighthouse.peer` — the connecting socket's uid from the kernel's tables;
* :mod:`~elasticd.lighthouse.server` — ``grpc.aio`` servers, one per job, on loopback;
  :class:`~elasticd.lighthouse.server.Lighthouse` is what the daemon holds.

The quorum id is stored, so it never goes back across leaders or daemon restarts; every
quorum is written by compare-and-set on the document's version, so two daemons that both
believe they lead still issue one line of quorums. The loss of the leader's node costs the
other groups one lease TTL plus at most one heartbeat timeout.

Which side of the boundary: the daemon; nothing here imports torch. grpcio comes with the
extra ``elasticd[torchft]`` and is imported by :mod:`~elasticd.lighthouse.server` only.
"""
