"""tracerl: train the LLM inside an existing agent with GRPO, token-exactly.

The package is built by stage, each importing only those below it: ``core`` (data model and
contracts), ``rollout`` (the user's process), ``backend`` (gateway, engines, training),
``remote`` (``tracerl serve`` and its client), then ``integrations`` and ``ruler``; the CLI
sits on top. Heavy parts (torch, vLLM, FastAPI) load only when a backend is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# --- the native API -------------------------------------------------------------------------
from .core.backend import Backend, InferenceEndpoint, TrainEvent
from .core.config import (
    DistributedTrainerConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
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
from .core.hookspecs import HOOKSPEC_VERSION, hookimpl
from .core.model_spec import ModelSpec
from .core.spans import Span
from .core.trajectory import (
    CompletionRecord,
    LLMCall,
    RolloutException,
    Trajectory,
    TrajectoryGroup,
)
from .rollout.client import rollout_headers
from .rollout.gather import gather_trajectories, gather_trajectory_groups
from .rollout.model import Model, TrainableModel

# isort: split
# --- OpenPipe ART's names and import paths (everything ART-only: tracerl.core.art_compat) ------
from . import dev, utils  # art.dev, art.utils (tracerl.local, .rewards, .langgraph load lazily)
from .core.trajectory import History

if TYPE_CHECKING:
    from .backend.local import LocalBackend
    from .remote.client import RemoteBackend

__version__ = "0.1.0"

__all__ = [
    "HOOKSPEC_VERSION",
    "AuthenticationError",
    "Backend",
    "BackendUnavailableError",
    "CompletionRecord",
    "ConfigError",
    "ContextThreadPoolExecutor",
    "DistributedTrainerConfig",
    "EngineConfig",
    "EngineError",
    "History",
    "InferenceEndpoint",
    "InvalidTrajectoryError",
    "LLMCall",
    "LocalBackend",
    "LoraConfig",
    "Model",
    "ModelConfig",
    "ModelSpec",
    "NotRegisteredError",
    "PluginError",
    "RemoteBackend",
    "RolloutException",
    "RolloutTimeoutError",
    "Span",
    "TooManyExceptionsError",
    "TracerlError",
    "TrainConfig",
    "TrainEvent",
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
    """The backends load on first use: they bring torch and FastAPI (local) or httpx (remote)."""
    if name == "LocalBackend":
        from .backend.local import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from .remote.client import RemoteBackend

        return RemoteBackend
    raise AttributeError(f"module 'tracerl' has no attribute {name!r}")
