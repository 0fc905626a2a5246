"""remote: the backend as a server (``tracerl serve``) and its torch-free client.

- ``wire.py``: the upload and progress format both sides share (NDJSON).
- ``client.py``: ``RemoteBackend``, the thin client (no torch, no web framework).
- ``server.py``: the control API (``/api/v1``) beside the gateway.
- ``jobs.py``: the training queue: one step at a time, idempotent by request id, resumable.
- ``serve.py``: ``tracerl serve``: a ``LocalBackend`` plus the control API until SIGTERM.
"""
