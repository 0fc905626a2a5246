"""Exception types. Every error names the problem and, where it can, the fix."""

from __future__ import annotations


class TracerlError(Exception):
    """Base class of all tracerl errors."""


class InvalidTrajectoryError(TracerlError, ValueError):
    """A trajectory, group or message failed validation."""


class ConfigError(TracerlError, ValueError):
    """A configuration value is invalid."""


class NotRegisteredError(TracerlError, RuntimeError):
    """The model was used before ``await model.register(backend)``."""


class PluginError(TracerlError, RuntimeError):
    """A plugin could not be loaded or is incompatible with this tracerl."""


class RolloutTimeoutError(TracerlError, TimeoutError):
    """A rollout ran past its timeout."""


class TooManyExceptionsError(TracerlError, RuntimeError):
    """More rollouts failed than ``max_exceptions`` allows."""


class EngineError(TracerlError, RuntimeError):
    """The inference engine failed or is unavailable."""


class TrainingError(TracerlError, RuntimeError):
    """A training step could not run."""


class AuthenticationError(TracerlError, PermissionError):
    """A server refused the API key (or none was sent)."""


class BackendUnavailableError(TracerlError, ConnectionError):
    """A remote backend could not be reached, or kept failing, until the retry budget ran out."""


class RemoteError(TracerlError, RuntimeError):
    """A remote backend answered with an error that has no more specific type."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
