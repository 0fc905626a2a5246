"""tracerl: train the LLM inside an existing agent with GRPO, token-exactly.

The package is built by stage, each importing only those below it: ``core`` (data model and
contracts), ``events`` (plugin hooks and where they fire), ``rollout`` (the user's process),
``backend`` (gateway, engines, training), ``remote`` (``tracerl serve`` and its client), then
``integrations`` and ``ruler``; the CLI sits on top. Heavy parts (torch, vLLM, FastAPI) load
only when a backend is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# --- the native API -------------------------------------------------------------------------
from .core.backend import Backend, InferenceEndpoint, TrainEvent
from .core.config import (
    DistributedTrainerConfig,
    DynamicSampling,
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
from .core.model_spec import ModelSpec
from .core.spans import Span
from .core.trajectory import (
    CompletionRecord,
    LLMCall,
    RolloutException,
    Trajectory,
    TrajectoryGroup,
)
from .events.hookspecs import HOOKSPEC_VERSION, hookimpl
from .rollout.client import rollout_headers
from .rollout.external import gather_external_groups
from .rollout.gather import gather_trajectories, gather_trajectory_groups
from .rollout.model import Model, TrainableModel
from .rollout.pipeline import PipelineTrainer, RolloutPipeline, TrainedStep

# isort: split
# --- OpenPipe ART's names and import paths (everything ART-only: tracerl.core.art_compat) ------
from . import dev, utils  # art.dev, art.utils (tracerl.local, .rewards, .langgraph load lazily)
from .core.art_pipeline import PipelineAutotuneConfig, PipelineRuntimeConfig
from .core.art_unported import (  # ART 0.5.23's Megatron and serverless: raise when used
    MegatronRuntimeConfig,
    MegatronTopologyConfig,
    ServerlessBackend,
    ServerlessTrainResult,
    get_megatron_runtime_config,
    init_megatron_runtime_config,
)
from .core.backend import LocalTrainResult, TrainResult
from .core.config import TrainSFTConfig
from .core.errors import EngineUnavailableError as LocalServingUnavailableError
from .core.trajectory import (
    History,
    Messages,
    MessagesAndChoices,
    Tools,
    current_trajectory,
    no_capture,
)
from .dev import LoRAConfig
from .rollout.capture import (
    auto_trajectory,
    capture_auto_trajectory,
    capture_yielded_trajectory,
    trajectory,
    trajectory_group,
    yield_trajectory,
)
from .rollout.gather import trajectory_group_batches
from .utils.retry import retry

if TYPE_CHECKING:
    from .backend.local import LocalBackend
    from .metrics import (
        PIPELINE_RL_DASHBOARD_DEFAULT_METRICS,
        PIPELINE_RL_METRIC_DEFINITIONS,
        PIPELINE_RL_SCORE_METRICS,
        MetricDefinition,
    )
    from .remote.client import RemoteBackend
    from .tokenizer import get_tokenizer
    from .trajectories import tensorize, tokenize

# ART 0.5.23's names that load on first use (transformers, the training rows): name -> module
_LAZY = {"get_tokenizer": "tokenizer", "tokenize": "trajectories", "tensorize": "trajectories",
         "MetricDefinition": "metrics", "PIPELINE_RL_METRIC_DEFINITIONS": "metrics",
         "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS": "metrics", "PIPELINE_RL_SCORE_METRICS": "metrics"}

__version__ = "0.1.0"

__all__ = [
    "HOOKSPEC_VERSION",
    "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS",
    "PIPELINE_RL_METRIC_DEFINITIONS",
    "PIPELINE_RL_SCORE_METRICS",
    "AuthenticationError",
    "Backend",
    "BackendUnavailableError",
    "CompletionRecord",
    "ConfigError",
    "ContextThreadPoolExecutor",
    "DistributedTrainerConfig",
    "DynamicSampling",
    "EngineConfig",
    "EngineError",
    "History",
    "InferenceEndpoint",
    "InvalidTrajectoryError",
    "LLMCall",
    "LoRAConfig",
    "LocalBackend",
    "LocalServingUnavailableError",
    "LocalTrainResult",
    "LoraConfig",
    "MegatronRuntimeConfig",
    "MegatronTopologyConfig",
    "Messages",
    "MessagesAndChoices",
    "MetricDefinition",
    "Model",
    "ModelConfig",
    "ModelSpec",
    "NotRegisteredError",
    "PipelineAutotuneConfig",
    "PipelineRuntimeConfig",
    "PipelineTrainer",
    "PluginError",
    "RemoteBackend",
    "RolloutException",
    "RolloutPipeline",
    "RolloutTimeoutError",
    "ServerlessBackend",
    "ServerlessTrainResult",
    "Span",
    "TooManyExceptionsError",
    "Tools",
    "TracerlError",
    "TrainConfig",
    "TrainEvent",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "TrainedStep",
    "TrainingError",
    "Trajectory",
    "TrajectoryGroup",
    "auto_trajectory",
    "call_tags",
    "capture_auto_trajectory",
    "capture_yielded_trajectory",
    "current_rollout",
    "current_trajectory",
    "dev",
    "gather_external_groups",
    "gather_trajectories",
    "gather_trajectory_groups",
    "get_megatron_runtime_config",
    "get_tokenizer",
    "hookimpl",
    "init_megatron_runtime_config",
    "no_capture",
    "retry",
    "rollout_headers",
    "rollout_scope",
    "tensorize",
    "tokenize",
    "trajectory",
    "trajectory_group",
    "trajectory_group_batches",
    "utils",
    "yield_trajectory",
]


def __getattr__(name: str) -> Any:
    """The backends load on first use: they bring torch and FastAPI (local) or httpx (remote)."""
    if name == "LocalBackend":
        from .backend.local import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from .remote.client import RemoteBackend

        return RemoteBackend
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tracerl' has no attribute {name!r}")
