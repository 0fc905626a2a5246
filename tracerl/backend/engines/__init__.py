"""engines: inference engines behind :class:`tracerl.core.engine.Engine`.

- ``vllm_engine.py``: a vLLM OpenAI server subprocess on loopback, LoRA hot-swap.
- ``url_engine.py``: an existing vLLM server reached by URL (not started by tracerl).
- ``replica_set.py``: several servers behind one engine: sticky / least-loaded routing,
  control plane fanned out, failed replicas retried around and restarted.
- ``json_codec.py``: decoding vLLM's replies (orjson when installed).
- ``transformers_engine.py``: in-process generation, the CPU fallback.
- ``generation_job.py``: one request to its batcher, and what a batcher needs of the engine.
- ``continuous_batcher.py``: iteration-level batching: calls join and leave between steps.
- ``kv_slots.py``: the decoding rows' KV cache, one slot per row.
- ``static_batcher.py``: the former one-``generate``-per-batch batcher (a benchmark baseline).
- ``tool_parsers.py``: hermes tool-call parsing for the transformers engine.
"""
