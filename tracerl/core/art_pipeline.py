"""OpenPipe ART 0.5.23's pipeline settings (``art.PipelineRuntimeConfig``,
``art.PipelineAutotuneConfig``) and their translation onto tracerl's ``PipelineTrainer``.

The classes are ART's, field for field (same defaults and bounds), so ART code constructs them
unchanged. :func:`pipeline_options_from_art` maps what tracerl's pipeline has a knob for and
refuses, naming the field, what it has none for:

- ``min_batch_size`` -> ``groups_per_step`` (tracerl trains exactly that many groups a step);
  ``num_rollout_workers`` -> ``num_rollout_workers``.
- ``max_batch_size`` other than ``min_batch_size``: refused (no variable batch);
  ``queue_maxsize``: refused (what runs is bounded by ``max_steps_off_policy``, not a queue);
  ``score_reference_*``: refused (they scale ART's ``objective/score`` metric, not reported).
- ``PipelineAutotuneConfig(mode="off")`` (ART's default) changes nothing; ``"online"`` and
  ``"profile"`` are refused: tracerl has no autotuner (its ``staleness="admit"`` admission
  paces rollouts by the measured step time instead).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from .errors import ConfigError

_REFUSED_RUNTIME = {
    "queue_maxsize": "tracerl bounds the rollouts in flight by max_steps_off_policy (with "
                     "staleness='admit'), not by a queue size; leave it unset",
    "score_reference_groups_per_step": "it scales ART's objective/score metric, which tracerl's "
                                       "pipeline does not report; leave it unset",
    "score_reference_rollouts_per_group": "it scales ART's objective/score metric, which "
                                          "tracerl's pipeline does not report; leave it unset",
}


class PipelineRuntimeConfig(pydantic.BaseModel):
    """ART's runtime settings of its ``PipelineTrainer``: workers and batch bounds."""

    model_config = pydantic.ConfigDict(extra="forbid")

    num_rollout_workers: int = pydantic.Field(default=16, ge=1)
    min_batch_size: int = pydantic.Field(default=4, ge=1)
    max_batch_size: int | None = pydantic.Field(default=None, ge=1)
    queue_maxsize: int | None = pydantic.Field(default=None, ge=1)
    score_reference_groups_per_step: float | None = pydantic.Field(default=8.0, gt=0.0)
    score_reference_rollouts_per_group: float | None = pydantic.Field(default=None, gt=0.0)

    @pydantic.model_validator(mode="after")
    def validate_batch_bounds(self) -> PipelineRuntimeConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError("max_batch_size must be >= min_batch_size")
        return self


class PipelineAutotuneConfig(pydantic.BaseModel):
    """ART's pipeline autotuner settings. Only ``mode="off"`` (the default) ports."""

    mode: Literal["off", "online", "profile"] = "off"
    profile: str | None = None
    output_name: str = "latest"
    window_steps: int = pydantic.Field(default=4, ge=1)
    warmup_ignore_steps: int = pydantic.Field(default=3, ge=0)
    target_spill_probability: float = pydantic.Field(default=0.03, ge=0.0, le=1.0)
    worker_step: int = pydantic.Field(default=2, ge=1)
    worker_move_fraction: float = pydantic.Field(default=0.10, gt=0.0, le=1.0)
    worker_load_change_windows: int = pydantic.Field(default=2, ge=1)
    max_worker_move: int = pydantic.Field(default=16, ge=4)
    max_rollout_workers: int = pydantic.Field(default=1024, ge=1)
    initial_model_calls_per_inference_gpu: int = pydantic.Field(default=8, ge=1)
    initial_min_groups_per_packed_sequence: int = pydantic.Field(default=8, ge=1)
    initial_max_groups_per_packed_sequence: int = pydantic.Field(default=8, ge=1)
    packing_trials: int = pydantic.Field(default=48, ge=16)
    packing_reservoir_multiplier: int = pydantic.Field(default=2, ge=2)
    packing_reservoir_min_groups: int = pydantic.Field(default=32, ge=16)
    packing_history_steps: int = pydantic.Field(default=64, ge=1)
    packing_spill_prior_alpha: float = pydantic.Field(default=1.0, gt=0.0)
    packing_spill_prior_beta: float = pydantic.Field(default=8.0, gt=0.0)
    packing_spill_confidence: float = pydantic.Field(default=0.8, gt=0.0, lt=1.0)
    queue_running_reserve_fraction: float = pydantic.Field(default=0.75, ge=0.0, le=1.0)
    trainer_load_under_score: float = pydantic.Field(default=0.08, ge=0.0)
    trainer_load_severe_under_score: float = pydantic.Field(default=0.50, ge=0.0)
    trainer_load_over_score: float = pydantic.Field(default=0.04, ge=0.0)
    vllm_pressure_over_ratio: float = pydantic.Field(default=0.80, ge=0.0)
    vllm_pressure_under_ratio: float = pydantic.Field(default=0.50, ge=0.0)
    queue_put_severe_frac: float = pydantic.Field(default=1.0 / 3.0, ge=0.0, le=1.0)
    stale_high_frac: float = pydantic.Field(default=0.20, ge=0.0, le=1.0)
    stale_clear_frac: float = pydantic.Field(default=0.10, ge=0.0, le=1.0)
    unused_and_dummy_high_frac: float = pydantic.Field(default=0.25, ge=0.0, le=1.0)
    trainer_min_batch_lower_score: float = pydantic.Field(default=0.15, ge=0.0)
    trainer_min_batch_raise_score: float = pydantic.Field(default=0.10, ge=0.0)
    min_batch_collect_improvement_ratio: float = pydantic.Field(default=0.85, gt=0.0, le=1.0)
    min_batch_trial_windows: int = pydantic.Field(default=2, ge=1)
    recommendation_min_windows: int = pydantic.Field(default=5, ge=1)
    recommendation_consecutive_holds: int = pydantic.Field(default=2, ge=1)
    freshness_min_batch_floor_fraction: float = pydantic.Field(default=0.85, gt=0.0, le=1.0)
    target_group_change_windows: int = pydantic.Field(default=1, ge=1)
    target_group_increase_fraction: float = pydantic.Field(default=0.20, gt=0.0, le=1.0)
    target_group_max_increase: int = pydantic.Field(default=64, ge=1)
    target_group_min_relative_change: float = pydantic.Field(default=0.10, ge=0.0, le=1.0)
    target_group_immediate_decrease_fraction: float = pydantic.Field(default=0.25, ge=0.0,
                                                                     le=1.0)
    vllm_metric_interval_s: float = pydantic.Field(default=1.0, gt=0.0)
    vllm_metric_timeout_window_frac: float = pydantic.Field(default=0.35, ge=0.0, le=1.0)

    @pydantic.model_validator(mode="after")
    def validate_stale_hysteresis(self) -> PipelineAutotuneConfig:
        if self.stale_clear_frac > self.stale_high_frac:
            raise ValueError("stale_clear_frac must be <= stale_high_frac")
        if self.trainer_min_batch_raise_score > self.trainer_min_batch_lower_score:
            raise ValueError(
                "trainer_min_batch_raise_score must be <= trainer_min_batch_lower_score")
        return self


def _runtime_options(pipeline: PipelineRuntimeConfig) -> dict[str, int]:
    given = pipeline.model_fields_set
    for name, why in _REFUSED_RUNTIME.items():
        default = type(pipeline).model_fields[name].default
        if name in given and getattr(pipeline, name) not in (None, default):
            raise ConfigError(f"PipelineRuntimeConfig.{name}: tracerl has no equivalent; {why}")
    if pipeline.max_batch_size is not None and pipeline.max_batch_size != pipeline.min_batch_size:
        raise ConfigError(
            f"PipelineRuntimeConfig.max_batch_size: tracerl's pipeline trains exactly "
            f"min_batch_size ({pipeline.min_batch_size}) groups a step, not a variable batch "
            f"up to {pipeline.max_batch_size}; leave max_batch_size unset or equal to "
            "min_batch_size")
    options = {"groups_per_step": pipeline.min_batch_size}
    if "num_rollout_workers" in given:
        options["num_rollout_workers"] = pipeline.num_rollout_workers
    return options


def pipeline_options_from_art(pipeline: PipelineRuntimeConfig | None,
                              autotune: PipelineAutotuneConfig | None) -> dict[str, Any]:
    """``PipelineTrainer`` keywords (``groups_per_step``, ``num_rollout_workers``) from ART's
    ``pipeline=`` and ``autotune=``; a :class:`ConfigError` names a field tracerl cannot
    honour."""
    if pipeline is not None and not isinstance(pipeline, PipelineRuntimeConfig):
        raise ConfigError(f"pipeline must be a PipelineRuntimeConfig, got "
                          f"{type(pipeline).__name__}")
    if autotune is not None and not isinstance(autotune, PipelineAutotuneConfig):
        raise ConfigError(f"autotune must be a PipelineAutotuneConfig, got "
                          f"{type(autotune).__name__}")
    if autotune is not None and autotune.mode != "off":
        raise ConfigError(
            f"PipelineAutotuneConfig.mode: {autotune.mode!r} is not ported, tracerl has no "
            "pipeline autotuner; use mode='off' and set PipelineRuntimeConfig(min_batch_size=..., "
            "num_rollout_workers=...) (tracerl's staleness='admit' already paces rollouts by "
            "the measured step time)")
    return _runtime_options(pipeline) if pipeline is not None else {}


__all__ = ["PipelineAutotuneConfig", "PipelineRuntimeConfig", "pipeline_options_from_art"]
