"""elasticd under Slurm (issue 38).

Form 1, *inside an allocation with no daemon installed*, is torchrun's habit::

    srun --no-kill --ntasks-per-node=1 \\
        elasticd run --nnodes 2:3 --nproc-per-node 4 -- python train.py

Each task of the step runs an embedded daemon for the one job, as ``elasticd
run`` does on one node, and the tasks find each other from Slurm's
environment, with no endpoint to type (:mod:`elasticd.slurm.allocation`
decides everything from it, purely):

* the store is hosted by the daemon on the allocation's first node (task 0
  of the step), on a port derived from the job and step ids, or is the
  ``--store-url etcd://...`` given; the other daemons join it;
* task 0 submits the job (``min_nodes``/``max_nodes`` from ``--nnodes``)
  under an id made of Slurm's job and step ids, so every task waits on the
  same job; the fleet scheduler and the rendezvous place it, and nodes
  beyond ``MAX`` stand by as spares;
* a worker crash restarts the whole group (``--max-restarts``), the loss of
  a node other than the store host re-forms the job on the rest, down to
  ``MIN``;
* every task exits with the job's result; Slurm's SIGTERM (``scancel``, the
  time limit) stops the workers with the job's grace (``--termination-grace``,
  keep it under the cluster's ``KillWait``), exit 143.

The daemons of a step share one bearer token, the step's: an HMAC of a
secret (``--token-file`` when given, else a 0600 file in the user's home,
``~/.config/elasticd/slurm-token``, made by the first task that needs it; the
home folder is assumed shared across the allocation's nodes, as on most Slurm
clusters) for the job and step ids, so a leaked one is worth one step. The
store host's port can be predicted, so another user may hold it first: a
task sends the token only to a store host that has proven it holds the step's
token (its answer to the task's random nonce, ``GET /slurm/proof``), and
exits 2 saying so when none does.

:mod:`elasticd.slurm.run` is the IO around those decisions (addresses,
the token, the wait for the store, the end in order: the store host leaves
last).

Form 2, *elasticd's daemons on every node with Slurm as the allocator*:
``elasticd submit --slurm`` in a batch script restricts the job to the
allocation's nodes and records the Slurm job on it
(:func:`elasticd.slurm.allocation.submission_from_env`, pure); with
``--wait`` Slurm's SIGTERM cancels it within its grace, and ``elasticd slurm
epilog`` makes sure nothing of it is left on the node (:mod:`elasticd.slurm.node`);
``elasticd slurm prolog`` (:mod:`elasticd.slurm.hooks`) runs the node's health
checks before a job, a failure draining the node with the check's reason.
A quarantine drains the node in Slurm where ``slurm_drain = true``
(:mod:`elasticd.node.slurm_drain`, a daemon's own node).

Which side of the boundary:

* ``elasticd run`` in a step and ``elasticd submit --slurm`` run as the Slurm
  job's user, with that user's rights and no daemon secret: form 1's embedded
  daemons are that user's processes (their token is that user's file), and
  form 2 asks the node's daemon as any caller does;
* the prolog and the epilog run as root (slurmd runs them). They read
  Slurm's environment, set by slurmd, and ask the node's daemon over its
  socket as the node's admin; the prolog runs the operator's checks from the
  daemon's config, never anything of a job's;
* ``slurm_drain`` is the daemon's: it runs ``scontrol`` with an argument list,
  never a shell; the reason it writes is the health record's, which an admin
  or the policy wrote.
"""
