"""tracerl: train the LLM inside an existing agent with GRPO, token-exactly.

The public API mirrors OpenPipe ART, so ``import art`` can become ``import tracerl as art``.
Heavy parts (torch, vLLM, FastAPI) load only when a backend is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import dev, utils
from .rollout.client import rollout_headers
from .core.config import EngineConfig, LoraConfig, ModelConfig, TrainConfig
from .core.context import ContextThreadPoolExecutor, call_tags, current_rollout, rollout_scope
from .core.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    EngineError,
    InvalidTrajectoryError,
    NotRegisteredError,
    PluginError,
    RolloutTimeoutError,
    TooManyExceptionsError,
    TracerlError,
    TrainingError,
)
from .rollout.gather import gather_trajectories, gather_trajectory_groups
from .core.hookspecs import HOOKSPEC_VERSION, hookimpl
from .rollout.model import Model, TrainableModel
from .core.spans import Span
from .core.trajectory import (
    CompletionRecord,
    History,
    LLMCall,
    RolloutException,
    Trajectory,
    TrajectoryGroup,
)

if TYPE_CHECKING:
    from .backend.local import LocalBackend
    from .remote.client import RemoteBackend

__version__ = "0.1.0"

__all__ = [
    "HOOKSPEC_VERSION",
    "AuthenticationError",
    "BackendUnavailableError",
    "CompletionRecord",
    "ConfigError",
    "ContextThreadPoolExecutor",
    "EngineConfig",
    "EngineError",
    "History",
    "InvalidTrajectoryError",
    "LLMCall",
    "LocalBackend",
    "LoraConfig",
    "Model",
    "ModelConfig",
    "NotRegisteredError",
    "PluginError",
    "RemoteBackend",
    "RolloutException",
    "RolloutTimeoutError",
    "Span",
    "TooManyExceptionsError",
    "TracerlError",
    "TrainConfig",
    "TrainableModel",
    "TrainingError",
    "Trajectory",
    "TrajectoryGroup",
    "call_tags",
    "current_rollout",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "hookimpl",
    "rollout_headers",
    "rollout_scope",
    "utils",
]


def __getattr__(name: str) -> Any:
    if name == "LocalBackend":
        from .backend.local import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from .remote.client import RemoteBackend

        return RemoteBackend
    raise AttributeError(f"module 'tracerl' has no attribute {name!r}")
