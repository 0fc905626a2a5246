"""protocols: the APIs the gateway serves, each rendered on the engine's chat (or completions)
call.

Each protocol translates its request into the engine's request and the engine's answer (or its
stream of chunks) back, so every call is recorded as the same token-exact record and trains
unchanged; the record's metadata names the protocol (OpenAI's own shapes pass through).

- ``base.py``: ``Protocol`` (its routes, its engine call), ``Exchange`` (one translated
  request) and the chat stream reader they share.
- ``registry.py``: the protocols a gateway serves: tracerl's and ``tracerl_protocols`` plugins'.
- ``openai.py``: chat completions and completions, passed through, stripped for the caller.
- ``responses.py``: OpenAI Responses (``/v1/responses``), with stored responses per model.
- ``anthropic_messages.py``: Anthropic Messages (``/v1/messages``).
"""
