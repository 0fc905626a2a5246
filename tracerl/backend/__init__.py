"""backend: the GPU side, where calls are served, recorded and trained on. Imports ``core``
and ``events``.

In flow order (one request, then one training step):
- ``gateway.py``: the OpenAI-compatible endpoint; one call from its route to its answer.
- ``http_answers.py``: OpenAI-shaped errors and the API-key check (gateway and control API).
- ``http_limits.py``: uvicorn's h11 protocol with deadlines on request heads and stalled writes.
- ``request_body.py``: request bodies read under size and time limits (gateway and control API).
- ``protocols/``: every API served (chat, completions, Responses, Anthropic Messages, plugins'),
  each rendered on the engine's chat or completions call; ``registry.py`` finds them.
- ``request_validation.py``: each request field, the rollout id and call tags checked
  (OpenAI-style 400 naming the field) before use.
- ``served.py``: served models and the adapter version each requested name resolves to.
- ``swap_lock.py``: a model's calls share it; its adapter swap waits for them, holds new ones.
- ``supervisor.py``: an engine call's failure as the caller's answer; dead engines restarted.
- ``stream_pump.py``: a streamed call, forwarded chunk by chunk and recorded by its own task.
- ``external_rollouts.py``: the rollout API (``/v1/rollouts``) for services outside the
  trainer's process: open, spans, reward, finish; the trainer takes finished groups once.
- ``live_calls.py``: online mode's live calls: a plain call is a rollout of its own, its
  feedback (``/v1/feedback/{response_id}``) comes later; expiry; groups by task key.
- ``replies.py``: engine replies as records need them: streams assembled, entries reduced.
- ``recorder.py``: turns engine answers into token-exact ``LLMCall`` records, kept per rollout.
- ``engines/``: vLLM (a server subprocess) and transformers (in process) behind ``Engine``;
  a replica set routes over several servers.
- ``publishing.py``: each step's adapter written once as ``policy@N`` where all servers read it.
- ``chat_template.py``: chat templates, the same for serving and training.
- ``weights.py``: ``base_model`` to a local folder (the embedded SmolLM2 included).
- ``training/``: rows, advantages, loss, the policy, and the step itself (``step.py``).
- ``release.py``: release control: a trained version goes shadow -> canary (a sticky share
  of rollouts) -> promoted or rolled back, each stage in the model's release log.
- ``release_gates.py``: the gates a candidate passes: reward vs the incumbent with a
  confidence bound, error rate, p95 latency, drift monitors.
- ``online.py``: online mode's loop: expire, judge the canary, train a batch of live calls
  from the incumbent and release it through canary and gates.
- ``launchers/``: where distributed trainer ranks and replicas run (``local``, ``ray``).
- ``object_sync.py``: a model's folder pushed to and pulled from object storage (S3 via fsspec),
  to resume training on another machine (ART's ``_experimental_push_to_s3`` / ``_pull_from_s3``).
- ``local.py``: ``LocalBackend``, which holds the resources: gateway, engines, policies.
"""
