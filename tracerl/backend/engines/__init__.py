"""engines: inference engines behind :class:`tracerl.core.engine.Engine`.

- ``vllm_engine.py``: a vLLM OpenAI server subprocess on loopback, LoRA hot-swap.
- ``url_engine.py``: an existing vLLM server reached by URL (not started by tracerl).
- ``replica_set.py``: several servers behind one engine: sticky / least-loaded routing,
  control plane fanned out, failed replicas retried around and restarted.
- ``json_codec.py``: decoding vLLM's replies (orjson when installed).
- ``transformers_engine.py``: in-process batched generation, the CPU fallback.
- ``tool_parsers.py``: hermes tool-call parsing for the transformers engine.
"""
