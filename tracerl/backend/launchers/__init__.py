"""launchers: where a distributed trainer's ranks (and, with Ray, the inference replicas) run;
plugins through the ``tracerl_launchers`` hook (contract: ``core/launcher.py``).

- ``local.py``: ``local``, the default: the ranks as torchrun subprocesses on this host.
- ``ray.py``: ``ray`` (optional extra): ranks and replicas as Ray actors in placement groups.
"""
