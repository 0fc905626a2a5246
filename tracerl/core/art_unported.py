"""OpenPipe ART 0.5.23's names for parts this backend does not have: Megatron training and W&B's
serverless backend. They import, so that ART code loads; using one raises a
:class:`~tracerl.core.errors.ConfigError` that names tracerl's alternative, as
``tracerl.utils.deployment.deploy_model`` does for ART's cloud deployment.

- ``MegatronRuntimeConfig``, ``MegatronTopologyConfig``, ``init_megatron_runtime_config``,
  ``get_megatron_runtime_config``: tracerl trains LoRA adapters with peft under DDP or FSDP2
  (``DistributedTrainerConfig``), not Megatron's tensor/pipeline/expert parallelism.
- ``ServerlessBackend``, ``ServerlessTrainResult``: training on W&B's hosted GPUs needs their
  account; tracerl trains on yours (``LocalBackend``) or on a ``tracerl serve`` you run
  (``RemoteBackend``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from .backend import TrainResult
from .errors import ConfigError

MEGATRON_ALTERNATIVE = (
    "tracerl trains LoRA adapters with peft under DDP or FSDP2, not Megatron: use "
    "`tracerl.LocalBackend(trainer=tracerl.DistributedTrainerConfig(world_size=N, "
    "strategy='fsdp2'))` (FSDP2 shards the frozen base across the ranks; see "
    "docs/scaling-out.md)")
SERVERLESS_ALTERNATIVE = (
    "tracerl has no serverless backend (ART's trains on W&B's hosted GPUs with a W&B account): "
    "train on your own GPUs with `tracerl.LocalBackend()`, or run `tracerl serve` on a GPU "
    "machine and use `tracerl.RemoteBackend(url)` from anywhere")


def _refuse(name: str, alternative: str) -> NoReturn:
    raise ConfigError(f"{name} is not ported to tracerl: {alternative}")


class MegatronTopologyConfig:
    """ART's Megatron parallel layout (tp, cp, ep, pp, ...): not ported; constructing one
    raises, naming ``DistributedTrainerConfig``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("MegatronTopologyConfig", MEGATRON_ALTERNATIVE)


class MegatronRuntimeConfig:
    """ART's Megatron runtime settings: not ported (see :class:`MegatronTopologyConfig`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("MegatronRuntimeConfig", MEGATRON_ALTERNATIVE)


def init_megatron_runtime_config(*args: Any, **kwargs: Any) -> NoReturn:
    """ART's set-up of its Megatron backend: not ported."""
    _refuse("init_megatron_runtime_config", MEGATRON_ALTERNATIVE)


def get_megatron_runtime_config() -> NoReturn:
    """ART's Megatron settings lookup: not ported."""
    _refuse("get_megatron_runtime_config", MEGATRON_ALTERNATIVE)


class ServerlessBackend:
    """ART's W&B serverless backend: not ported; constructing one raises, naming
    ``LocalBackend`` and ``RemoteBackend``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("ServerlessBackend", SERVERLESS_ALTERNATIVE)


class ServerlessTrainResult(TrainResult):
    """``ServerlessBackend.train``'s result in ART. ``isinstance`` checks work (nothing here is
    one); constructing one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("ServerlessTrainResult", SERVERLESS_ALTERNATIVE)


__all__ = ["MegatronRuntimeConfig", "MegatronTopologyConfig", "ServerlessBackend",
           "ServerlessTrainResult", "get_megatron_runtime_config", "init_megatron_runtime_config"]
