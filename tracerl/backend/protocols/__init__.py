"""protocols: the non-chat APIs the gateway serves, rendered on the chat path.

Each protocol translates its request into a chat completion request for the engine and the
engine's answer (or its stream of chunks) back, so every call is recorded as the same
token-exact chat record and trains unchanged; the record's metadata names the protocol.

- ``base.py``: ``Exchange`` (one translated request) and the chat stream reader they share.
- ``responses.py``: OpenAI Responses (``/v1/responses``), with stored responses per model.
- ``anthropic_messages.py``: Anthropic Messages (``/v1/messages``).
"""
