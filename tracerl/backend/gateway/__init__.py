"""gateway: the OpenAI-compatible endpoint in front of the engines; every call recorded.

In flow order (one request to its answer):
- ``server_thread.py``: the app served by uvicorn on a loop of its own, in a daemon thread.
- ``app.py``: :class:`Gateway`, the app and the one call handler.
- ``http_answers.py``: OpenAI-shaped errors and the API-key check (gateway and control API).
- ``http_limits.py``: uvicorn's h11 protocol with deadlines on request heads and stalled writes.
- ``request_body.py``: request bodies read under size and time limits.
- ``request_validation.py``: each request field, the rollout id and call tags checked
  (OpenAI-style 400 naming the field) before use.
- ``served.py``: served models, the adapter version a requested name resolves to, and the
  release routing a model carries.
- ``releases.py``: the release steps a served model takes: put under release control, a
  candidate loaded, the incumbent moved (each in its release log before it routes).
- ``swap_lock.py``: a model's calls share it; its adapter swap waits for them, holds new ones;
  a call holds its share as one ``Admission``, released once.
- ``supervisor.py``: an engine call's failure as the caller's answer; dead engines restarted.
- ``hang_up.py``: a non-streamed call cancelled in the engine when its client hangs up.
- ``stream_pump.py``: a streamed call, forwarded chunk by chunk and recorded by its own task.
- ``recorder.py``: engine answers as token-exact ``LLMCall`` records, kept per rollout.
- ``rollout_api.py``: the rollout API (``/v1/rollouts``) for services outside the trainer's
  process: open, spans, reward, finish; the trainer takes finished groups once.
"""
