"""core: the data model and the contracts every stage builds on. It imports nothing else of
tracerl, so any stage may import it (``tests/test_layout.py`` checks).

Data model:
- ``errors.py``: the one exception tree, with each error's code and HTTP status.
- ``validated.py``: the pydantic base whose errors name the field.
- ``strict_json.py``: JSON from outside, refused (naming the field) where a record could not
  hold a value: NaN, Infinity, overflowed floats, lone surrogates, integers past 64 bits.
- ``settings.py``: every environment variable tracerl reads (name, type, default, doc), and
  the only module that reads them.
- ``config.py``: ``TrainConfig``, ``LoraConfig``, ``EngineConfig``, ``ModelConfig``,
  ``DistributedTrainerConfig``.
- ``model_spec.py``: ``ModelSpec``, what a backend knows of a model.
- ``model_name.py``: ``ModelName``, a name as callers send it (``[project/]name[@step]``),
  parsed and written in one place.
- ``context.py``: the current rollout (a ``ContextVar``), its observers, and call tags.
- ``spans.py``: framework structure of a rollout, linked to its LLM calls.
- ``trajectory.py``: token-exact call records, trajectories, groups, their JSONL form.
- ``metrics.py``: aggregate metrics of groups.
- ``storage.py``: a model's folder, atomic writes, append-only JSONL.
- ``fingerprint.py``: served-policy fingerprints: an adapter's digest, the one that served a
  call, checked against the version the call claims.
- ``release_log.py``: a model's release log (append-only, crash-consistent): its incumbent.
- ``net.py``: loopback addresses, free ports, child process groups.
- ``loops.py``: values kept per event loop (HTTP clients cannot outlive their loop).
- ``watchdog.py``: a wait longer than its threshold logs what it is waiting on.

Contracts:
- ``pluggable.py``: what engines and launchers, selected by name among plugins', share.
- ``backend.py``: the ``Backend`` contract and its ``TrainEvent`` stream.
- ``engine.py``: the ``Engine`` contract (and its errors).
- ``launcher.py``: the ``Launcher`` contract: where distributed trainer ranks and replicas run.
- ``hookspecs.py``, ``plugins.py``, ``lifecycle.py``: the old import paths of
  :mod:`tracerl.events`' modules (plugin hooks, the plugin manager, where hooks fire), kept for
  code written before; core itself fires no hook.
- ``art_compat.py``: OpenPipe ART compatibility: every ART-only behaviour, listed.
- ``art_pipeline.py``: ART 0.5.23's ``PipelineRuntimeConfig`` / ``PipelineAutotuneConfig``,
  mapped onto ``PipelineTrainer``'s knobs (refusing, by field, what has none).
- ``art_unported.py``: ART's Megatron and serverless names: they import, and raise naming the
  alternative when used.
"""
