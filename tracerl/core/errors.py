"""Every exception tracerl raises, in one tree. Each names the problem and, where it can, the fix.

::

    TracerlError                          server_error           500
    ├── InvalidTrajectoryError (ValueError)   invalid_trajectory     400
    ├── ConfigError (ValueError)              invalid_config         400
    ├── RequestError (ValueError)             invalid_request        400
    │   ├── BadBodyEncodingError              bad_encoding           400
    │   ├── BodyTooLargeError                 body_too_large         413
    │   └── BodyTimeoutError                  body_timeout           408
    ├── AuthenticationError (PermissionError) invalid_api_key        401
    ├── NotRegisteredError (RuntimeError)     model_not_registered   404
    ├── PluginError (RuntimeError)            plugin_error           500
    ├── RolloutTimeoutError (TimeoutError)    rollout_timeout        504
    ├── RolloutNotFoundError (LookupError)    rollout_not_found      404
    ├── RolloutFinishedError (RuntimeError)   rollout_finished       409
    ├── ResponseNotFoundError (LookupError)   response_not_found     404
    ├── FeedbackClosedError (RuntimeError)    feedback_closed        409
    ├── ExternalAgentError (RuntimeError)     external_agent_failed  502
    ├── TooManyExceptionsError (RuntimeError) too_many_exceptions    500
    ├── EngineError (RuntimeError)            engine_error           503
    │   ├── EngineUnavailableError            engine_unavailable     503
    │   ├── EngineTimeoutError (TimeoutError) engine_timeout         504
    │   └── EngineRequestError                (per request: 400, 404, ...)
    ├── TrainingError (RuntimeError)          training_failed        500
    │   ├── TrainConflictError                training_conflict      409
    │   ├── StepsFailedError                  some_steps_failed      500
    │   ├── RankFailedError                   trainer_rank_failed    500
    │   └── QueueFullError                    queue_full             429
    ├── BackendUnavailableError (ConnectionError)  backend_unavailable  503
    ├── RemoteError (RuntimeError)            (the server's code and status)
    ├── BadAnswerError (RuntimeError)         bad_server_answer      502
    ├── StorageError (OSError)                storage_error          500
    │   └── DiskFullError                     disk_full              507
    └── RulerError (RuntimeError)             ruler_failed           502

The two columns are the error's ``code`` and HTTP ``status``: the one table that the gateway, the
``tracerl serve`` control API and the remote client share. A server answers
``{"error": {"message", "type", "code", "param"}}`` with ``status``; the client raises
:func:`exception_for` of it, the same class again.
"""

from __future__ import annotations

from typing import Any


class TracerlError(Exception):
    """Base class of all tracerl errors. ``code`` and ``status`` are given as class keywords:
    ``class QueueFullError(TrainingError, code="queue_full", status=429)``."""

    # class defaults; EngineRequestError and RemoteError set them per instance
    code: str = "server_error"
    status: int = 500

    def __init_subclass__(cls, code: str | None = None, status: int | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status


class InvalidTrajectoryError(TracerlError, ValueError, code="invalid_trajectory", status=400):
    """A trajectory, group or message failed validation."""


class ConfigError(TracerlError, ValueError, code="invalid_config", status=400):
    """A configuration value is invalid."""


class RequestError(TracerlError, ValueError, code="invalid_request", status=400):
    """An HTTP request is malformed (not JSON, not an object, a bad header...); ``param``
    names the body field at fault, when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadBodyEncodingError(RequestError, code="bad_encoding"):
    """The body's Content-Encoding is unknown or its data is corrupt."""


class BodyTooLargeError(RequestError, code="body_too_large", status=413):
    """The body is larger than the endpoint accepts."""


class BodyTimeoutError(RequestError, code="body_timeout", status=408):
    """The request body did not arrive within the server's deadline."""


class AuthenticationError(TracerlError, PermissionError, code="invalid_api_key", status=401):
    """A server refused the API key (or none was sent)."""


class NotRegisteredError(TracerlError, RuntimeError, code="model_not_registered", status=404):
    """The model was used before ``await model.register(backend)``."""


class PluginError(TracerlError, RuntimeError, code="plugin_error"):
    """A plugin could not be loaded or is incompatible with this tracerl."""


class RolloutTimeoutError(TracerlError, TimeoutError, code="rollout_timeout", status=504):
    """A rollout ran past its timeout."""


class RolloutNotFoundError(TracerlError, LookupError, code="rollout_not_found", status=404):
    """No rollout opened through the gateway's rollout API has this id."""


class RolloutFinishedError(TracerlError, RuntimeError, code="rollout_finished", status=409):
    """A rollout opened through the rollout API was already finished (its reward is final)."""


class ResponseNotFoundError(TracerlError, LookupError, code="response_not_found", status=404):
    """No live call of a model in online mode was answered with this response id."""


class FeedbackClosedError(TracerlError, RuntimeError, code="feedback_closed", status=409):
    """A live call's feedback can no longer be taken: it has its reward already, or expired."""


class ExternalAgentError(TracerlError, RuntimeError, code="external_agent_failed", status=502):
    """An agent run as a process of its own (a task's Node agent) failed or broke its protocol."""


class TooManyExceptionsError(TracerlError, RuntimeError, code="too_many_exceptions"):
    """More rollouts failed than ``max_exceptions`` allows."""


class EngineError(TracerlError, RuntimeError, code="engine_error", status=503):
    """The inference engine failed or is unavailable."""


class EngineUnavailableError(EngineError, code="engine_unavailable"):
    """The engine is down or restarting."""


class EngineTimeoutError(EngineError, TimeoutError, code="engine_timeout", status=504):
    """The engine did not answer within its deadline."""


class EngineRequestError(EngineError):
    """The request is invalid for the engine; ``status``, ``param`` and ``code`` are the
    OpenAI-style answer (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status  # per request, unlike the class default
        self.param = param
        self.code = code or "invalid_request"


class TrainingError(TracerlError, RuntimeError, code="training_failed"):
    """A training step could not run."""


class TrainConflictError(TrainingError, code="training_conflict", status=409):
    """Another training request of the same model is queued or running."""


class StepsFailedError(TrainingError, code="some_steps_failed"):
    """Some models of a multi-model step (``backend.train_many``) failed; the others
    finished. ``failed`` maps each failed model's key to its error: rows it cannot train on
    (refused before any model trained: nothing written), or its checkpoint or publish after
    the update (its groups are on disk for ``backend.pending_groups(model)``). ``results``
    holds the finished models' results, keyed as given to ``train_many``."""

    def __init__(self, failed: dict[str, BaseException] | str,
                 results: dict[Any, Any] | None = None) -> None:
        # a message alone: the error as a server answered it (exception_for)
        self.failed = {} if isinstance(failed, str) else failed
        self.results = dict(results or {})
        super().__init__(failed if isinstance(failed, str) else "the step of " + "; ".join(
            f"{key} failed: {type(e).__name__}: {e}" for key, e in failed.items()))


class RankFailedError(TrainingError, code="trainer_rank_failed"):
    """A rank of a distributed trainer died or failed during a step; ``rank`` names it. The
    step's groups are on disk: the next step reloads the newest checkpoint and
    ``backend.pending_groups(model)`` trains them again."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class QueueFullError(TrainingError, code="queue_full", status=429):
    """Too many training requests are waiting."""


class BackendUnavailableError(
    TracerlError, ConnectionError, code="backend_unavailable", status=503
):
    """A remote backend could not be reached, or kept failing, until the retry budget ran out."""


class RemoteError(TracerlError, RuntimeError):
    """A remote backend answered with an error that has no more specific type."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status or 500
        self.code = code or "server_error"


class BadAnswerError(TracerlError, RuntimeError, code="bad_server_answer", status=502):
    """A remote server answered with something that is not the API's answer (an HTML page, a
    redirect, empty or garbled JSON); the message names the server and what it sent."""


class StorageError(TracerlError, OSError, code="storage_error"):
    """A file of a model (call record, history, trajectories, checkpoint, marker) could not be
    written or read; nothing half-written is left where readers look."""


class DiskFullError(StorageError, code="disk_full", status=507):
    """A write failed for lack of space: the disk is full, a quota or the file size limit
    (``ulimit -f``) was reached. Free space and send the request again."""


class RulerError(TracerlError, RuntimeError, code="ruler_failed", status=502):
    """The RULER judge could not produce valid scores."""


def _subclasses(cls: type[TracerlError]) -> list[type[TracerlError]]:
    return [cls] + [s for sub in cls.__subclasses__() for s in _subclasses(sub)]


def error_classes() -> dict[str, type[TracerlError]]:
    """Error code -> exception class, for every class in the tree with a fixed code."""
    table: dict[str, type[TracerlError]] = {}
    for cls in _subclasses(TracerlError):
        if cls in (EngineRequestError, RemoteError):
            continue  # their code is the answer's, not the class's
        table.setdefault(cls.code, cls)
    return table


def code_of(exc: BaseException) -> str:
    """The wire code of an exception ('server_error' for anything not ours)."""
    return exc.code if isinstance(exc, TracerlError) else "server_error"


def error_type(status: int) -> str:
    """The OpenAI-style ``type`` of an error answer with ``status``."""
    return {401: "authentication_error", 503: "service_unavailable", 504: "timeout"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def exception_for(status: int, payload: Any) -> TracerlError:
    """The exception a client raises for an error answer: the class its code names."""
    err = payload.get("error") if isinstance(payload, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    message = message or f"HTTP {status}: {str(payload)[:500]}"
    cls = error_classes().get(code or "")
    if cls is not None and cls is not TracerlError:
        return cls(message)
    if status == 401:
        return AuthenticationError(message)
    return RemoteError(message, status=status, code=code)
