"""rollout: what runs in the user's process, beside the agent. Imports ``core`` only; needs
neither torch nor a web framework.

In flow order:
- ``model.py``: ``Model`` / ``TrainableModel``, the user's handle: register, clients, train, log.
- ``client.py``: OpenAI clients that attribute each request to the current rollout.
- ``aiohttp_transport.py``: openai's aiohttp transport with network errors reported truly.
- ``gather.py``: runs rollouts concurrently, each in its rollout context, under a timeout.
- ``sampling.py``: dynamic sampling (DAPO): groups with equal rewards set aside and more drawn,
  within a bound, with the step's counts.
- ``external.py``: ``gather_external_groups``, groups of rollouts that an outside service ran
  through the gateway's rollout API.
- ``pipeline.py``: ``PipelineTrainer`` / ``RolloutPipeline``, rollouts overlapped with training
  under a bound on how many policy versions a trained group may lag.
- ``capture.py``: ART's capture scopes: ``trajectory(coro)``, ``trajectory_group([...])`` and
  the older ``capture_auto_trajectory`` / ``capture_yielded_trajectory``.
- ``dataset.py``: ``iterate_dataset``, step-numbered batches resumable at any step.
- ``concurrency.py``: ``limit_concurrency``, a per-event-loop limit on an async function.
"""
