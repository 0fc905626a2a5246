"""OpenPipe ART compatibility: ART code ports by changing ``import art`` to
``import tracerl as art``.

Every behaviour that exists only because ART has it, and where it lives:

Import paths (thin modules at the top of the package):
- ``tracerl.local`` (``LocalBackend``; ``tracerl.local.backend``), ``tracerl.utils``
  (``iterate_dataset``, ``limit_concurrency``, ``retry``; ``utils.sft``, ``utils.deployment``,
  ``utils.benchmarking``, ``utils.strip_logprobs``), ``tracerl.dev`` (ART's config dicts),
  ``tracerl.rewards`` (``ruler_score_group``, ``ruler``), ``tracerl.langgraph``
  (``init_chat_model``, ``wrap_rollout``); ``tracerl/__init__.py`` exports the ART aliases in
  their own block (``TrainResult``, ``TrainSFTConfig``, ``Messages``, ``LoRAConfig``, the
  capture scopes, ``retry``, ``trajectory_group_batches``).
- ART 0.5.23's: ``tracerl.tokenizer`` (``get_tokenizer``), ``tracerl.trajectories``
  (``tokenize``/``tensorize`` from the recorded ids), ``tracerl.metrics`` (``MetricDefinition``
  and the pipeline sets), ``tracerl.mcp`` (``art.mcp``), ``core/art_pipeline.py`` (the pipeline
  configs on ``PipelineTrainer``), ``core/art_unported.py`` (Megatron, serverless: refused
  naming the alternative); ``LocalServingUnavailableError`` is ``EngineUnavailableError``.

ART 0.5's API (beside ``model.train``):
- ``await backend.train(model, groups, **kwargs) -> TrainResult`` (``core/backend.py``), its
  keywords translated by :func:`train_config_from_art_kwargs`; the step itself is
  ``Backend.train_events``. ``TrainConfig(loss_fn="cispo")`` is ART's default loss.
- ``model.log(trajectories=None, split, *, metrics=, step=)``, ``model.train_sft``,
  ``model._internal_config = ...`` after construction (``rollout/model.py``); comparison models
  that register for logging only (``backend/local.py``).
- Capture scopes: ``with Trajectory():``, ``current_trajectory``, ``no_capture``
  (``core/trajectory.py``), ``trajectory``/``trajectory_group`` and the older names
  (``rollout/capture.py``), ``trajectory_group_batches`` (``rollout/gather.py``).
- ``iterate_dataset``'s default order is ART's (``rollout/dataset.py``).

Data model (``core/trajectory.py``):
- ``TrajectoryGroup(rollout_coroutines)`` returns an awaitable ``PendingTrajectoryGroup``
  (run by ``rollout/gather.py``); exceptions among a group's trajectories are its failed
  rollouts (``asyncio.gather(return_exceptions=True)`` results).
- ``Trajectory.additional_histories`` / ``History``: kept, trained rendered only when a rollout
  has no token records, shown to the RULER judge.

Configuration (translated here, key by key; unknown keys raise ``ConfigError`` naming them):
- ``TrainableModel(_internal_config=art.dev.InternalModelConfig(...))``:
  :func:`model_config_from_art`.
- ``model.train(groups, config, _config=art.dev.TrainConfig(...))``: :func:`train_options_from_art`.
- ``TrainConfig(kl_penalty_coef=...)`` (alias of ``beta``) and
  ``kl_penalty_source="current_learner"`` (``core/config.py``).

Model and backend (``rollout/model.py``, ``backend/local.py``):
- ``model.litellm_completion_params(step)``; ``model.delete_checkpoints()`` keeping the best
  ``"val/reward"`` (ART's default, and its ``"split/metric"`` form).
- ``LocalBackend(path=None, in_process=...)``: ``in_process`` is accepted and changes nothing.
- ``backend._experimental_push_to_s3`` / ``_experimental_pull_from_s3`` (ART's bucket layout
  and ``BACKUP_BUCKET``; ``backend/object_sync.py``, through fsspec/s3fs).
- ``art.utils.deployment``: ART's config classes import; ``deploy_model`` fails naming
  ``export_lora`` and ``vllm serve`` (``utils/deployment.py``).

Rollouts (``rollout/gather.py``, ``rollout/dataset.py``, ``rollout/concurrency.py``):
- ``gather_trajectory_groups(pbar_desc=, pbar_total_completion_tokens=, max_metrics=)``.
- ``iterate_dataset(dataset, groups_per_step, num_epochs, initial_step, use_tqdm)``;
  ``limit_concurrency(n, derive_key)``.

Integrations:
- ``ruler_score_group(group, judge_model="openai/o3", extra_litellm_params=, rubric=,
  swallow_exceptions=, debug=)`` (``ruler/judge.py``).
- ``init_chat_model()`` without a model inside ``wrap_rollout(model, fn)``
  (``integrations/langchain.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .config import EngineConfig, LoraConfig, ModelConfig, TrainConfig
from .errors import ConfigError

# ART key -> EngineConfig field
_ENGINE_FIELDS = {
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "dtype": "dtype",
    "tool_call_parser": "tool_call_parser",
}
_INIT_FIELDS = {
    "max_seq_length": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "dtype": "dtype",
}
# flags tracerl sets itself, or that only name the model (its base_model decides)
_ENGINE_MANAGED = {"model", "served_model_name", "enable_lora", "max_loras", "host", "port",
                   "enable_auto_tool_choice", "enable_sleep_mode", "logprobs_mode"}
_LORA_FIELDS = {
    "rank": "r",
    "r": "r",
    "alpha": "alpha",
    "lora_alpha": "alpha",
    "dropout": "dropout",
    "lora_dropout": "dropout",
    "target_modules": "target_modules",
}
# ART's per-step dev TrainConfig key -> tracerl TrainConfig field
_TRAIN_FIELDS = {
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "scale_rewards": "scale_rewards",
    "kl_penalty_coef": "beta",
}
# keys whose ART meaning tracerl always has (so they change nothing here)
_TRAIN_ALWAYS = {"allow_training_without_logprobs": True, "ppo": True}


def _dict(where: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a dict, got {type(value).__name__}")
    return value


def _refuse(where: str, keys: list[str], hint: str) -> None:
    if keys:
        raise ConfigError(
            f"{where}: tracerl has no equivalent for {', '.join(sorted(keys))}; {hint}"
        )


def _vllm_flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + flag[2:]]
    if isinstance(value, dict | list):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def model_config_from_art(internal: Mapping[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from ART's ``InternalModelConfig`` dict."""
    internal = _dict("_internal_config", internal)
    engine: dict[str, Any] = {}
    extra_args: list[str] = []
    init = _dict("_internal_config['init_args']", internal.get("init_args"))
    for key, value in init.items():
        if key in _INIT_FIELDS:
            engine[_INIT_FIELDS[key]] = value
    _refuse(
        "_internal_config['init_args']",
        [k for k in init if k not in _INIT_FIELDS],
        "remove them (Unsloth loading is tracerl's choice on GPUs; quantised loading is not "
        "supported)",
    )
    args = _dict("_internal_config['engine_args']", internal.get("engine_args"))
    for key, value in args.items():
        if key in _ENGINE_FIELDS:
            engine[_ENGINE_FIELDS[key]] = value
        elif key not in _ENGINE_MANAGED:
            extra_args += _vllm_flag(key, value)  # any other vLLM engine argument, as its flag
    engine["extra_args"] = extra_args
    if "chat_template_path" in internal:
        engine["chat_template"] = str(internal["chat_template_path"])
    lora: dict[str, Any] = {}
    if "peft_args" in internal and "lora_config" in internal:
        raise ConfigError("_internal_config has both peft_args and lora_config; keep one")
    lora_key = "lora_config" if "lora_config" in internal else "peft_args"
    lora_args = _dict(f"_internal_config[{lora_key!r}]", internal.get(lora_key))
    for key, value in lora_args.items():
        if key in _LORA_FIELDS:
            lora[_LORA_FIELDS[key]] = value
    _refuse(f"_internal_config[{lora_key!r}]", [k for k in lora_args if k not in _LORA_FIELDS],
            "tracerl trains a plain LoRA (rank, alpha, dropout, target_modules)")
    handled = {"init_args", "engine_args", "chat_template_path", "peft_args", "lora_config"}
    _refuse("_internal_config", [k for k in internal if k not in handled],
            "set the TrainConfig per step, and ModelConfig(engine=EngineConfig(...)) for serving")
    try:
        return ModelConfig(engine=EngineConfig(**engine), lora=LoraConfig(**lora))
    except ValueError as e:
        raise ConfigError(f"_internal_config: {e}") from None


# ART 0.5's ``backend.train`` keyword -> tracerl TrainConfig field (same meaning)
_TRAIN_KWARGS = {
    "learning_rate": "learning_rate",
    "loss_fn": "loss_fn",
    "kl_penalty_coef": "beta",
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "scale_rewards": "scale_rewards",
    "packed_sequence_length": "micro_batch_tokens",
}
# ART keywords tracerl accepts only at the value that means "off" (ART's defaults)
_TRAIN_KWARGS_OFF: dict[str, Any] = {
    "loss_fn_config": None, "adam_params": None, "kl_penalty_reference_step": None,
    "kl_ref_adapter_path": None, "advantage_balance": 0.0, "importance_sampling_level": "token",
    "max_negative_advantage_importance_sampling_weight": None, "mask_prob_ratio": False,
    "kimi_k2_tau": None, "precalculate_logprobs": False, "plot_tensors": False,
    "truncated_importance_sampling": None, "scale_learning_rate_by_reward_std_dev": False,
    "num_trajectories_learning_rate_multiplier_power": 0.0, "save_checkpoint": True,
}
# ART keywords whose every value is tracerl's behaviour already (or only a display/speed knob)
_TRAIN_KWARGS_IGNORED = {"allow_training_without_logprobs", "logprob_calculation_chunk_size",
                         "verbose"}
# ART's clip range per loss (LocalBackend's defaults when epsilon/epsilon_high are not given)
_LOSS_EPSILON = {"cispo": (1.0, 4.0), "ppo": (0.2, None)}


def train_config_from_art_kwargs(kwargs: Mapping[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` of ART 0.5's ``backend.train(model, groups, **kwargs)``.

    ART's keywords map to their tracerl field; tracerl's own TrainConfig fields are accepted
    too. Keywords tracerl has no equivalent for raise :class:`ConfigError` naming them (and, for
    those with an "off" value, accepting that value)."""
    fields: dict[str, Any] = {}
    unsupported = []
    for key, value in kwargs.items():
        if key in _TRAIN_KWARGS:
            fields[_TRAIN_KWARGS[key]] = value
        elif key in _TRAIN_KWARGS_OFF:
            if value != _TRAIN_KWARGS_OFF[key]:
                unsupported.append(f"{key}={value!r} (only {_TRAIN_KWARGS_OFF[key]!r})")
        elif key == "normalize_advantages":
            if not value:
                fields["scale_rewards"] = False
        elif key in TrainConfig.model_fields:
            fields[key] = value
        elif key not in _TRAIN_KWARGS_IGNORED:
            unsupported.append(key)
    if unsupported:
        raise ConfigError(
            f"backend.train: tracerl has no equivalent for {', '.join(unsupported)}; remove "
            "them (see tracerl.TrainConfig for what a step can set)")
    loss_fn = fields.setdefault("loss_fn", "cispo")  # ART 0.5's LocalBackend default
    if loss_fn not in _LOSS_EPSILON:
        raise ConfigError(f"backend.train: loss_fn={loss_fn!r}; tracerl trains 'cispo' (ART's "
                          "default) or 'ppo'")
    low, high = _LOSS_EPSILON[loss_fn]
    if fields.get("epsilon") is None:
        fields["epsilon"] = low
    if "epsilon_high" not in fields:
        fields["epsilon_high"] = high
    try:
        return TrainConfig(**fields)
    except ValueError as e:
        raise ConfigError(f"backend.train: {e}") from None


def train_options_from_art(options: Mapping[str, Any]) -> dict[str, Any]:
    """TrainConfig field updates from ART's per-step ``_config`` (``art.dev.TrainConfig``) dict."""
    options = _dict("_config", options)
    update = {_TRAIN_FIELDS[k]: v for k, v in options.items() if k in _TRAIN_FIELDS}
    unknown = [k for k, v in options.items()
               if k not in _TRAIN_FIELDS and not (k in _TRAIN_ALWAYS and v == _TRAIN_ALWAYS[k])]
    _refuse("_config", unknown, "see tracerl.TrainConfig for what a step can set")
    return update
