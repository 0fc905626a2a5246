"""backend: the GPU side, where calls are served, recorded and trained on. Imports ``core``
and ``events``.

Rooms, each a package but for a few shared files (lowest first; a room imports only rooms
below it, ``tests/test_layout.py`` checks):
- ``chat_template.py``: chat templates, the same for serving and training.
- ``weights.py``: ``base_model`` to a local folder (the embedded SmolLM2 included).
- ``publishing.py``: each step's adapter written once as ``policy@N`` where all servers read it.
- ``object_sync.py``: a model's folder pushed to and pulled from object storage (S3 via fsspec),
  to resume training on another machine (ART's ``_experimental_push_to_s3`` / ``_pull_from_s3``).
- ``rollout_log.py``: the per-model event logs the trainer takes groups from, and rollout files.
- ``heap.py``: objects alive after start-up frozen out of the garbage collector's walks.
- ``protocols/``: every API served (chat, completions, Responses, Anthropic Messages, plugins'),
  each rendered on the engine's chat or completions call; ``registry.py`` finds them.
- ``engines/``: vLLM (a server subprocess) and transformers (in process) behind ``Engine``;
  a replica set routes over several servers.
- ``training/``: rows, advantages, loss, the policy, and the step itself (``step.py``).
- ``launchers/``: where distributed trainer ranks and replicas run (``local``, ``ray``).
- ``gateway/``: the OpenAI-compatible endpoint: one call from its route to its answer, recorded
  token-exactly; the rollout API for outside services.
- ``online/``: online mode: live calls and their feedback, the online loop, release control and
  its gates; it reaches the gateway through a narrow seam.
- ``policies.py``, ``registration.py``, ``step_runner.py`` (above the rooms, below
  ``local.py``): the trained policies kept in memory; a model registered on the engine of
  its weights and a gateway route; training steps, one at a time, past the same guards.
- ``local.py``: ``LocalBackend``, the facade on top, which holds the resources: gateway,
  engines, policies.

Old import paths kept for users: ``release.py`` (:mod:`.online.release`) and
``release_gates.py`` (:mod:`.online.gates`).
"""
