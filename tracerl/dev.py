"""ART's ``art.dev`` configuration dicts, for ported scripts: ``art.dev.InternalModelConfig(...)``
becomes ``tracerl.dev.InternalModelConfig(...)``. They are plain dicts, translated (and checked
key by key) by :mod:`tracerl.core.art_compat`; new code uses :class:`tracerl.ModelConfig`."""

from __future__ import annotations

from typing import Any, TypedDict


class InitArgs(TypedDict, total=False):
    max_seq_length: int
    gpu_memory_utilization: float
    dtype: str


class EngineArgs(TypedDict, total=False):
    """vLLM engine arguments: known ones map to EngineConfig, the rest become vLLM flags."""

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    dtype: str
    tool_call_parser: str
    enforce_eager: bool


class LoRAConfig(TypedDict, total=False):
    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]


class InternalModelConfig(TypedDict, total=False):
    init_args: InitArgs
    engine_args: EngineArgs
    lora_config: LoRAConfig
    peft_args: dict[str, Any]
    chat_template_path: str


class TrainConfig(TypedDict, total=False):
    """Per-step options of ``model.train(..., _config=...)``."""

    epsilon: float
    epsilon_high: float | None
    scale_rewards: bool
    kl_penalty_coef: float
    allow_training_without_logprobs: bool


class TrainSFTConfig(TypedDict, total=False):
    """ART's experimental options of ``model.train_sft(..., _config=...)``; tracerl takes none
    (a non-empty one is refused, naming its keys)."""


__all__ = ["EngineArgs", "InitArgs", "InternalModelConfig", "LoRAConfig", "TrainConfig",
           "TrainSFTConfig"]
