"""OpenPipe ART 0.5.23's ``art.metrics`` names: :class:`MetricDefinition` and the pipeline-RL
metric sets (``PIPELINE_RL_METRIC_DEFINITIONS``, ``PIPELINE_RL_DASHBOARD_DEFAULT_METRICS``,
``PIPELINE_RL_SCORE_METRICS``), copied from ART (Apache-2.0) key for key, so that dashboards
and code built on them port.

They describe ART's PipelineTrainer metrics. tracerl's ``PipelineTrainer`` reports its own, under
the ``pipeline`` split (``kept_groups``, ``wait_s``, ``steps_off_policy_mean``, ...;
:mod:`tracerl.rollout.pipeline`), not these keys: a dashboard of ART's defaults shows no curve
for a tracerl run until it is pointed at those.
"""

from __future__ import annotations

from typing import Literal

import pydantic


class MetricDefinition(pydantic.BaseModel):
    """One metric a dashboard shows: its key, title, description and kind (ART's)."""

    key: str
    title: str
    description: str
    kind: Literal["counter", "duration", "gauge", "rate", "ratio", "score"]
    unit: str | None = None
    higher_is_better: bool | None = None
    dashboard_default: bool = False
    score_component: bool = False


PIPELINE_RL_METRIC_DEFINITIONS: tuple[MetricDefinition, ...] = (
    MetricDefinition(
        key="objective/score",
        title="Score",
        description=(
            "accepted trainable assistant tokens per second times freshness "
            "discount times critical-batch factor"
        ),
        kind="score",
        higher_is_better=True,
        dashboard_default=True,
        score_component=True,
    ),
    MetricDefinition(
        key="sample_efficiency/freshness_discount",
        title="Freshness discount",
        description=(
            "1 / token-weighted mean(exp(policy token age in train steps / 8))"
        ),
        kind="ratio",
        higher_is_better=True,
        score_component=True,
    ),
    MetricDefinition(
        key="sample_efficiency/batch_factor",
        title="Batch factor",
        description=(
            "critical-batch factor comparing accepted scenario groups and "
            "rollouts per group against configured references"
        ),
        kind="ratio",
        higher_is_better=True,
        score_component=True,
    ),
    MetricDefinition(
        key="offpolicy/token_weighted_policy_age_steps",
        title="Token-weighted policy age",
        description=(
            "completion-token-weighted mean train-step age of the policy that "
            "generated accepted data"
        ),
        kind="gauge",
        unit="steps",
        higher_is_better=False,
        score_component=True,
    ),
    MetricDefinition(
        key="throughput/accepted_train_tok_per_s",
        title="Accepted train tokens per second",
        description=(
            "accepted trainable assistant tokens divided by PipelineTrainer "
            "step wall time"
        ),
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
        dashboard_default=True,
        score_component=True,
    ),
    MetricDefinition(
        key="data/step_trainable_assistant_tokens",
        title="Accepted assistant tokens",
        description="trainable assistant tokens in accepted groups for this train step",
        kind="counter",
        unit="tokens",
        higher_is_better=None,
        score_component=True,
    ),
    MetricDefinition(
        key="data/step_nonpadding_logical_tokens",
        title="Non-padding logical train tokens",
        description="actual non-padding tokens in real training microbatches",
        kind="counter",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="data/step_loss_bearing_tokens",
        title="Loss-bearing train tokens",
        description="actual shifted token positions contributing to the loss",
        kind="counter",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="data/step_executed_token_equivalents",
        title="Executed token-equivalents",
        description=(
            "materialized per-rank token extents summed over DP and CP, including "
            "padding and dummy microbatches"
        ),
        kind="counter",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="data/step_nominal_schedule_capacity_tokens",
        title="Nominal schedule capacity",
        description="configured packed-row capacity before CP pruning",
        kind="counter",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="data/step_dummy_executed_token_equivalents",
        title="Executed dummy token-equivalents",
        description="runtime-plan token-equivalents executed by PP dummy microbatches",
        kind="counter",
        unit="tokens",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="data/step_dummy_schedule_capacity_tokens",
        title="Dummy schedule capacity",
        description="nominal packed-token capacity assigned to PP dummy microbatches",
        kind="counter",
        unit="tokens",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="data/step_unused_packed_capacity_tokens",
        title="Unused packed capacity",
        description="nominal real-microbatch capacity not occupied by logical tokens",
        kind="counter",
        unit="tokens",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="data/step_unused_and_dummy_ratio",
        title="Unused and dummy capacity ratio",
        description=(
            "unused real packed-token capacity plus PP dummy schedule capacity, "
            "divided by nominal schedule capacity"
        ),
        kind="ratio",
        higher_is_better=False,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="throughput/train_nonpadding_logical_tok_per_s",
        title="Logical train tokens per second",
        description="actual non-padding logical tokens divided by training time",
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="throughput/train_loss_bearing_tok_per_s",
        title="Loss-bearing train tokens per second",
        description="actual loss-bearing tokens divided by training time",
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
    ),
    MetricDefinition(
        key="throughput/train_executed_tok_equiv_per_s",
        title="Executed token-equivalents per second",
        description="executed materialized token-equivalents divided by training time",
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="throughput/train_nominal_capacity_tok_per_s",
        title="Nominal schedule capacity per second",
        description="configured packed-row capacity divided by training time",
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
    ),
    MetricDefinition(
        key="loss/importance_ratio_mean",
        title="Importance ratio mean",
        description="mean configured importance-sampling ratio on trainable tokens",
        kind="ratio",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="loss/importance_ratio_p95",
        title="Importance ratio p95",
        description="histogram-estimated p95 configured importance-sampling ratio",
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="loss/importance_ratio_p99",
        title="Importance ratio p99",
        description="histogram-estimated p99 configured importance-sampling ratio",
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="loss/clipped_token_fraction",
        title="Clipped token fraction",
        description=(
            "fraction of trainable tokens whose configured importance ratio is "
            "outside the active clipping interval"
        ),
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="vllm/prompt_tok_per_s",
        title="vLLM prompt tokens per second",
        description="vLLM prompt prefill throughput over time",
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="vllm/completion_tok_per_s",
        title="vLLM completion tokens per second",
        description="vLLM decode throughput over time",
        kind="rate",
        unit="tok/s",
        higher_is_better=True,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="vllm/num_requests_running",
        title="vLLM running requests",
        description="number of admitted requests currently running in vLLM",
        kind="gauge",
        unit="requests",
        higher_is_better=None,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="vllm/num_requests_waiting",
        title="vLLM waiting requests",
        description="number of queued requests waiting for vLLM admission",
        kind="gauge",
        unit="requests",
        higher_is_better=None,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="vllm/num_requests_waiting_capacity",
        title="vLLM capacity-waiting requests",
        description="number of queued requests waiting because vLLM capacity is exhausted",
        kind="gauge",
        unit="requests",
        higher_is_better=False,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="vllm/max_num_seqs",
        title="vLLM max running sequences",
        description="configured maximum number of sequences vLLM can schedule per iteration",
        kind="gauge",
        unit="requests",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="vllm/world_size",
        title="vLLM GPU world size",
        description="number of GPU ranks serving the model",
        kind="gauge",
        unit="ranks",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="vllm/max_num_batched_tokens",
        title="vLLM max batched tokens",
        description="configured token scheduling budget per vLLM iteration",
        kind="gauge",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="vllm/max_num_scheduled_tokens",
        title="vLLM max scheduled tokens",
        description="configured maximum scheduled tokens per vLLM iteration",
        kind="gauge",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="vllm/max_model_len",
        title="vLLM max model length",
        description="configured maximum sequence length served by vLLM",
        kind="gauge",
        unit="tokens",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="vllm/prefix_cache_hit_rate",
        title="vLLM prefix cache hit rate",
        description="delta prefix cache hits divided by delta prefix cache queries",
        kind="ratio",
        higher_is_better=True,
        dashboard_default=True,
    ),
    MetricDefinition(
        key="vllm/kv_cache_usage_perc",
        title="vLLM KV cache usage",
        description="fraction of vLLM KV cache blocks in use",
        kind="ratio",
        higher_is_better=None,
    ),
    MetricDefinition(
        key="vllm/num_preemptions_total",
        title="vLLM preemptions",
        description="cumulative vLLM request preemptions",
        kind="counter",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="queue/freshness_pressure",
        title="Queue freshness pressure",
        description="predicted queued policy age divided by the active off-policy limit",
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="queue/predicted_stale_fraction",
        title="Predicted stale queue fraction",
        description="fraction of queued groups predicted stale for the next train step",
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="queue/actual_stale_fraction",
        title="Actual stale dequeue fraction",
        description="stale groups divided by all groups dequeued for this train step",
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="queue/put_wait_frac",
        title="Completed queue wait fraction",
        description=(
            "worker queue-put wait divided by queue-put wait plus rollout time"
        ),
        kind="ratio",
        higher_is_better=False,
    ),
    MetricDefinition(
        key="queue/put_wait_s",
        title="Completed queue wait",
        description="worker-seconds spent waiting to enqueue completed rollout groups",
        kind="duration",
        unit="seconds",
        higher_is_better=False,
    ),
)

PIPELINE_RL_DASHBOARD_DEFAULT_METRICS = tuple(
    definition.key
    for definition in PIPELINE_RL_METRIC_DEFINITIONS
    if definition.dashboard_default
)
PIPELINE_RL_SCORE_METRICS = tuple(
    definition.key
    for definition in PIPELINE_RL_METRIC_DEFINITIONS
    if definition.score_component
)


__all__ = ["PIPELINE_RL_DASHBOARD_DEFAULT_METRICS", "PIPELINE_RL_METRIC_DEFINITIONS",
           "PIPELINE_RL_SCORE_METRICS", "MetricDefinition"]
