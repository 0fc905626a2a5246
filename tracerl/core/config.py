"""Training, LoRA and engine configuration."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import ConfigError

# rewards of a group within this of each other count as equal (dynamic sampling, offline and
# online): float noise, or near-ties a std-scaled advantage would blow up
EQUAL_REWARDS_TOLERANCE = 1e-6


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainConfig(_Strict):
    """Hyper-parameters of one GRPO training step (ART-compatible names)."""

    learning_rate: float | Literal["auto"] = Field(
        "auto", description="AdamW's learning rate (in (0, 1]) for the LoRA weights, set at "
        "each step (so a schedule is a different value per step); with a schedule "
        "(lr_scheduler_type, warmup_steps) the peak rate. 'auto': the rate measured to train "
        "SmolLM2-135M's LoRA on every catalog task (1e-3 at LoRA alpha 16), scaled to the "
        "model's hidden size by Thinking Machines' fit of LoRA learning rates (Qwen: "
        "(576/hidden)^0.0775, others: ^0.781) and by 16/alpha; the step's metrics log the "
        "value. Lower it when rewards collapse or the KL jumps, raise it when nothing moves "
        "after several steps (ART's default is 5e-6)")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="how the learning rate moves over the adapter's steps (Hugging "
        "Face's and ART's trainer_args name): 'constant' (after any warmup), or from "
        "learning_rate after the warmup down to 0 at max_steps, in a straight line ('linear') "
        "or along a half cosine ('cosine'). The step is the adapter's count of GRPO updates "
        "(kept in its checkpoint, so a resumed run goes on where it was; a step with nothing "
        "to train, every group's rewards equal, does not count)")
    warmup_steps: int = Field(
        0, ge=0, description="GRPO steps whose learning rate ramps up linearly before the "
        "schedule (step i of them at (i+1)/(warmup_steps+1) of learning_rate): a few keep a "
        "fresh adapter's first updates small, for a high learning_rate")
    max_steps: int | None = Field(
        None, ge=1, description="the run's length in GRPO steps, where 'linear' and 'cosine' "
        "reach 0 (needed by them; later steps train at 0); unused by 'constant'")
    loss_fn: Literal["ppo", "cispo"] = Field(
        "ppo", description="'ppo': the clipped surrogate (GRPO); 'cispo': the clipped importance "
        "weight times the token logprob, the weight detached (ART 0.5's default, with "
        "epsilon=1, epsilon_high=4)")
    beta: float = Field(0.0, ge=0, validation_alias=AliasChoices("beta", "kl_penalty_coef"),
                        description="KL coefficient against the base model (0 = off); ART's "
                        "kl_penalty_coef is accepted as its name too")
    kl_penalty_source: Literal["current_learner"] = Field(
        "current_learner", description="ART's name for where the KL term's policy logprobs come "
        "from: the model being trained (TRL's way, the only one here)")
    kl_bias_correction: bool = Field(
        True, description="weight the KL term by the importance ratio (unbiased reverse KL, as TRL)"
    )
    epsilon: float = Field(0.2, gt=0, description="lower clip range of the importance ratio "
                           "(PPO's epsilon): how far below 1 a token's ratio may pull the update; "
                           "smaller is more conservative")
    epsilon_high: float | None = Field(
        None, gt=0, description="upper clip range (default: epsilon); a larger one (DAPO's "
        "clip-higher, e.g. 0.28) lets rare good tokens gain more and keeps entropy up; it acts "
        "only when the ratio moves: num_epochs > 1 or off-policy rollouts")
    scale_rewards: bool = Field(True, description="divide advantages by the group's reward std "
                                "(GRPO); off (Dr. GRPO) when groups with little spread in reward "
                                "should not weigh as much as the others")
    credit: Literal["rollout", "turn"] = Field(
        "rollout", description="'rollout': every trained token of a rollout gets its "
        "rollout's advantage in its group (GRPO); 'turn': each turn (answered call) gets that "
        "plus turn_weight times a step-level advantage, its discounted return against the "
        "returns of the group's turns in the same state (GiGPO, docs/training.md): for "
        "multi-turn agents whose rollouts revisit states, or that give per-turn rewards "
        "(metadata['turn_rewards'])")
    turn_weight: float = Field(
        1.0, ge=0, description="credit='turn': the step-level advantage's weight against the "
        "rollout's (GiGPO's w; 0 gives per-rollout credit back)")
    turn_discount: float = Field(
        0.95, ge=0, le=1, description="credit='turn': gamma of a turn's return, sum over later "
        "turns k of gamma^(k-t) times turn k's reward (GiGPO's 0.95); 1: later turns count fully")
    turn_state: Literal["prompt", "observation", "position"] = Field(
        "prompt", description="credit='turn': which turns share a state and are compared: "
        "'prompt': the same prompt tokens (the same history so far), 'observation': the same "
        "messages since the last assistant message (GiGPO's anchor state), 'position': the "
        "same turn number; metadata['turn_states'] (one string per turn) overrides it")
    loss_normalization: Literal["token", "sequence"] = Field(
        "token", description="'token': the loss is the mean over every trained token of the "
        "step (long answers weigh more, DAPO's choice); 'sequence': the mean over rows, each "
        "row's tokens averaged first (GRPO's paper)")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the gradient's global norm to this before each optimizer "
        "step (None: no clipping); lower it when grad_norm spikes")
    micro_batch_tokens: int = Field(
        4096, ge=16, description="tokens per packed micro-batch (rows longer are truncated to "
        "it); raise it for long trajectories, lower it when a step runs out of memory")
    num_epochs: int = Field(1, ge=1, description="optimizer steps over the step's data (one "
                            "per pass); more than 1 reuses the rollouts, off-policy after the "
                            "first")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute activations in the backward pass instead of keeping "
        "them: less memory, a slower step. 'auto': the fewest decoder layers that keep the "
        "step's largest micro-batch's estimated activations within activation_memory_mb "
        "(none when they fit: a step that fits runs as without checkpointing; the step's "
        "metrics say how many: checkpointed_layers); True: "
        "every layer; False: none")
    activation_memory_mb: float | None = Field(
        None, gt=0, description="the activation memory budget of gradient_checkpointing='auto', "
        "in MiB: the output head's buffers plus every decoder layer's kept activations of the "
        "step's largest micro-batch (estimated from the model's shape). None: 1,536 on CPU "
        "(a 4,096-token micro-batch of SmolLM2-135M within 2 GB), on CUDA half the memory the "
        "device has free as the step starts; raise it for speed when memory is plentiful, lower "
        "it when a step runs out of memory")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay on the "
                                "LoRA weights (0 = off, the usual choice for LoRA RL)")
    seed: int | None = Field(None, description="torch's seed, set before each step's update "
                             "(LoRA dropout and any other randomness of the update); None "
                             "leaves the random state as it is")

    @field_validator("learning_rate")
    @classmethod
    def _rate_in_range(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < float(value) <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1] or 'auto', not {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon * 0.1:
            raise ConfigError("epsilon_high is implausibly small compared with epsilon")
        if self.lr_scheduler_type != "constant" and self.max_steps is None:
            raise ConfigError(f"lr_scheduler_type={self.lr_scheduler_type!r} decays to 0 at "
                              "max_steps: set max_steps (the run's length in GRPO steps)")
        if self.max_steps is not None and self.warmup_steps >= self.max_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be fewer than "
                              f"max_steps ({self.max_steps})")
        return self

    def learning_rate_at(self, step: int, auto: float | None = None) -> float:
        """The learning rate of the adapter's GRPO update number ``step`` (0 for its first):
        the linear warmup, then ``lr_scheduler_type`` from the peak (``learning_rate``, or
        ``auto`` where it is ``"auto"``: the model's, which the trainer computes) down to 0 at
        ``max_steps``."""
        if self.learning_rate != "auto":
            peak = self.learning_rate
        elif auto is None:
            raise ConfigError("learning_rate='auto' depends on the model (its hidden size and "
                              "LoRA alpha): pass auto=, or read the step's learning_rate metric")
        else:
            peak = auto
        if step < self.warmup_steps:
            return peak * (step + 1) / (self.warmup_steps + 1)
        if self.lr_scheduler_type == "constant" or self.max_steps is None:
            return peak
        progress = min((step - self.warmup_steps) / (self.max_steps - self.warmup_steps), 1.0)
        if self.lr_scheduler_type == "linear":
            return peak * (1.0 - progress)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainSFTConfig(_Strict):
    """One supervised fine-tuning call (ART's ``TrainSFTConfig``): the trajectories are cut into
    batches of ``batch_size`` (``"auto"``: 2, ART's local default), one optimizer step each, at
    ``learning_rate`` (one value, or one per batch: a schedule)."""

    learning_rate: float | list[float] = Field(
        5e-5, description="AdamW's learning rate for every batch, or one per batch (a schedule, "
        "e.g. a warm-up then a decay); each in [0, 1]")
    batch_size: int | Literal["auto"] = Field(
        "auto", description="trajectories per optimizer step ('auto': 2, ART's local default); "
        "raise it for smoother updates when memory allows")

    @model_validator(mode="after")
    def _check(self) -> TrainSFTConfig:
        rates = self.learning_rate if isinstance(self.learning_rate, list) else [
            self.learning_rate]
        if not rates or any(not 0 <= lr <= 1.0 for lr in rates):
            raise ConfigError(f"learning_rate must be in [0, 1] (or a non-empty list of such), "
                              f"got {self.learning_rate!r}")
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 or 'auto', got {self.batch_size}")
        return self

    @property
    def resolved_batch_size(self) -> int:
        return 2 if self.batch_size == "auto" else self.batch_size


class LoraConfig(_Strict):
    """The LoRA adapter trained for the model."""

    r: int = Field(8, ge=1, le=1024, description="the adapter's rank: more capacity (and "
                   "memory) with a higher rank; vLLM serves ranks up to 512")
    alpha: int = Field(16, ge=1, description="LoRA's scale: the update is multiplied by "
                       "alpha / r, so change it with r to keep the same effective step")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while "
                           "training (0 = off, the usual choice for RL)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"],
        description="the base model's linear layers that get an adapter (every attention and "
        "MLP projection of Llama-style models); name others for other architectures")


class EngineConfig(_Strict):
    """How the backend serves the model."""

    engine: str = Field(
        "auto", description="'vllm', 'transformers', a plugin engine's name, or 'auto' (vLLM "
        "when available, else transformers; TRACERL_ENGINE overrides 'auto')")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the served weights' dtype ('auto': bfloat16 on vLLM and on CUDA, "
        "float32 for transformers on CPU); the trainer keeps its own")
    max_model_len: int = Field(
        2048, ge=64, description="the context length served, prompt plus answer; requests "
        "beyond it are refused at the gateway; raise it for long multi-turn rollouts")
    max_num_seqs: int = Field(
        32, ge=1, description="sequences an engine decodes at once (vLLM's --max-num-seqs, the "
        "transformers engine's batch); raise it for many concurrent rollouts")
    tool_call_parser: str | None = Field(
        None, description="vLLM's tool parser for the model's tool-call format, e.g. 'hermes'; "
        "needed for agents that call tools through vLLM")
    chat_template: str | None = Field(
        None, description="chat template replacing the model's own: a built-in name "
        "('chatml-tools': ChatML with hermes tool calls, for SmolLM2 and other ChatML models "
        "without tool support) or a path to a Jinja file; used for serving and training alike")
    request_timeout_s: float = Field(
        300.0, gt=0, description="seconds one call may take at the engine before the gateway "
        "answers with a timeout and restarts it; raise it for long generations")
    extra_args: list[str] = Field(
        default_factory=list, description="extra vLLM server flags, for options this config "
        "does not name (e.g. ['--enforce-eager'])")
    sleep_during_training: bool | None = Field(
        None, description="free vLLM's GPU memory while a training step runs (weights offloaded to "
        "CPU memory, KV cache dropped), so the trainer can use the same GPU; None: on when vLLM "
        "runs on CUDA, off on CPU (vLLM has no sleep mode there)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="the share of each GPU's memory vLLM may take (vLLM's "
        "default: 0.9); with replicas_per_gpu > 1, the servers on a GPU split it evenly")
    replicas: int | None = Field(
        None, ge=1, description="inference servers behind the gateway, spread over the visible "
        "GPUs; None: 1, or with replicas_per_gpu / gpus_per_replica set, as many as the GPUs "
        "allow")
    replicas_per_gpu: int = Field(1, ge=1, le=16, description="servers sharing each GPU (small "
                                  "models, where one vLLM API server is front-end bound)")
    gpus_per_replica: int = Field(1, ge=1, description="GPUs of each server (tensor parallel, "
                                  "for models that do not fit one GPU)")
    replica_urls: list[str] = Field(
        default_factory=list, description="existing vLLM servers to route to instead of "
        "starting any (http://host:port, each with runtime LoRA updating enabled)")
    replica_failure: Literal["restart", "drop"] = Field(
        "restart", description="what happens to a replica that dies: restarted (and re-loaded "
        "with the current adapters before it takes traffic again), or dropped from the set")
    resident_adapters: int = Field(
        1, ge=1, le=64, description="policy versions kept loaded (as name@step) so rollouts "
        "finish on the version they started with; max_steps_off_policy + 1 for async training")
    publish_dir: str | None = Field(
        None, description="where each step's adapter is published as policy@N before the "
        "servers load it: a directory every server can read (/dev/shm on one node, a shared "
        "filesystem across nodes) or an fsspec URL (s3://..., with publish_mount); None: "
        "servers load the checkpoint folder itself")
    publish_mount: str | None = Field(
        None, description="the path at which the servers see an fsspec publish_dir mounted")

    @model_validator(mode="after")
    def _check_replicas(self) -> EngineConfig:
        if self.replica_urls and self.replicas not in (None, len(self.replica_urls)):
            raise ConfigError("replicas and replica_urls disagree: give one of them")
        if self.replicas_per_gpu > 1 and self.gpus_per_replica > 1:
            raise ConfigError("replicas_per_gpu > 1 and gpus_per_replica > 1 exclude each other")
        url_publish = self.publish_dir is not None and "://" in self.publish_dir \
            and not self.publish_dir.startswith("file://")
        if url_publish and not self.publish_mount:
            raise ConfigError(f"publish_dir {self.publish_dir} is a URL: set publish_mount, the "
                              "path at which the inference servers see it mounted")
        for url in self.replica_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"replica_urls: {url!r} is not an http(s) URL")
        return self


class ModelConfig(_Strict):
    """Everything about a trainable model that is not its name."""

    lora: LoraConfig = Field(default_factory=LoraConfig,
                             description="the LoRA adapter trained (see LoraConfig)")
    engine: EngineConfig = Field(default_factory=EngineConfig,
                                 description="how the model is served (see EngineConfig)")


class DistributedTrainerConfig(_Strict):
    """Train on several processes (GPUs, nodes) with torch.distributed instead of one: peft LoRA
    under DDP or FSDP2, one rank per GPU (or CPU process), started by a launcher plugin.
    ``LocalBackend(trainer=DistributedTrainerConfig(world_size=2, strategy="fsdp2"))``."""

    world_size: int = Field(2, ge=1, le=4096, description="ranks (processes; one per GPU)")
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp", description="'ddp': every rank holds the whole model; 'fsdp2': fully_shard, the "
        "frozen base sharded across ranks too (for a base that does not fit one GPU)")
    launcher: str = Field("local", description="launcher plugin: 'local' (torchrun "
                          "subprocesses on this host) or 'ray' (the optional extra)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto': CUDA (NCCL) when available, else CPU (gloo)")
    ray_address: str | None = Field(
        None, description="the Ray cluster to join (ray.init(address=...)); None: 'auto' when "
        "RAY_ADDRESS is set, else a local cluster")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement group strategy of the trainer ranks")
    cpus_per_rank: float = Field(1.0, gt=0, description="Ray: CPUs reserved per rank/replica")
    replicas_on_launcher: bool = Field(
        True, description="Ray: serve each inference engine from a Ray actor (its own GPU on a "
        "GPU cluster) instead of this process")
    start_timeout_s: float = Field(600.0, gt=0, description="deadline for the ranks to start")
    step_timeout_s: float = Field(3600.0, gt=0,
                                  description="deadline for one command (update, save) of a step")


class OnlineConfig(_Strict):
    """How online mode (``tracerl serve --online``, :mod:`tracerl.backend.online`) forms batches
    of live calls and releases what it trains."""

    group_size: int = Field(4, ge=2, description="rewarded live calls of one task key per group")
    groups_per_step: int = Field(2, ge=1, description="groups per training step")
    canary_share: float = Field(0.5, gt=0, le=1, description="share of new calls the "
                                "candidate serves during its canary")
    evaluate_every: int = Field(4, ge=1, description="new canary rewards between two gate "
                                "evaluations")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(learning_rate=1e-4),
                               description="each online step's TrainConfig (learning rate ...)")
    gates: dict[str, float | list[float]] = Field(default_factory=dict, description="Gates fields "
                                  "(online/gates.py): min_samples, margin, z, ...")
    poll_s: float = Field(1.0, gt=0, description="seconds between two ticks")
    reward_ttl_s: float | None = Field(None, gt=0, description="seconds a live call "
                                       "may wait; default: TRACERL_ONLINE_REWARD_TTL_S")
    max_pending: int | None = Field(None, ge=1, description="live calls kept "
                                    "waiting; default: TRACERL_ONLINE_MAX_PENDING")
    equal_rewards_tolerance: float | None = Field(
        EQUAL_REWARDS_TOLERANCE, ge=0, description="a full group whose highest and lowest "
        "rewards differ by at most this carries no GRPO signal (DAPO's dynamic sampling): "
        "its calls expire ('no_signal') and it makes no step, so no candidate that learnt "
        "nothing takes up a canary; None: such groups are trained on")
    rollout_api: bool = Field(True, description="also train on finished rollout-API groups")
    batch_tries: int = Field(3, ge=1, description="tries of a batch whose training fails "
                             "before it is set aside (online/failed_batches.jsonl) and the loop "
                             "moves on to new groups")
    on_hold: Literal["reject", "wait"] = Field(
        "reject", description="a candidate the gates hold (latency, length, repeats, broken "
        "tool calls drifted): 'reject' it and train on, or 'wait' for tracerl promote/rollback")


class DynamicSampling(_Strict):
    """DAPO's dynamic sampling: a group whose rewards are all equal gives every rollout the same
    advantage (0), so it teaches GRPO nothing; such groups are set aside and more groups are
    drawn until the step has ``groups`` with a spread of rewards, within a bound of draws and
    time. Off unless given (``gather_trajectory_groups(..., dynamic_sampling=...)``,
    ``RolloutPipeline``, ``train_task``, ``gather_external_groups``)."""

    groups: int | None = Field(
        None, ge=1, description="groups with signal a step needs; None: the loop's own "
        "(train_task's items_per_step, the pipeline's groups_per_step, gather_external_groups' "
        "n_groups); gather_trajectory_groups needs it")
    tolerance: float = Field(
        EQUAL_REWARDS_TOLERANCE, ge=0, description="rewards of a group whose highest and "
        "lowest differ by at most this count as equal (float noise, or near-ties a std-scaled "
        "advantage would blow up)")
    max_draw_factor: float = Field(
        3.0, ge=1, description="a step draws at most this many times `groups` groups (so this "
        "many times its rollouts); when the bound is hit the step trains on the groups with "
        "signal it has (DAPO's verl recipe: max_num_gen_batches)")
    max_seconds: float | None = Field(
        None, gt=0, description="no replacement group is drawn for a step after this many "
        "seconds of drawing (None: only the draw bound); the pipeline stops setting groups aside "
        "once the trainer has waited this long for its batch; gather_external_groups waits this "
        "long for replacements (None: its timeout_s)")
