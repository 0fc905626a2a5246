"""The update: one GRPO optimizer step of one policy, or of several adapters on one base, top
to bottom (CleanRL style), in the paper's terms.

    rows -> length-bucketed micro-batches -> old logprobs where the engine gave none
    -> per epoch: clipped policy loss per micro-batch (gradients accumulate)
       -> clip each adapter's gradient -> its optimizer step
    -> each policy's step metrics

:func:`update` is the one loop: a model's own step (``Policy.optimize``/``Policy.update``),
``backend.train_many`` (:func:`optimize` of several adapters on one shared base) and each
rank of the distributed trainer (its share of the micro-batches) all run it. Several policies
train in shared passes: the first one's forward runs every micro-batch, each row routed to the
adapter it trains (:attr:`Row.adapter`), and each adapter's loss is normalised by its own
rows, so each update is the one of training that policy alone.

What the loop asks of a policy is :class:`UpdatedPolicy`: ``policy.Policy`` implements it, the
distributed rank (``rank.py``) overrides the parts that talk across ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from ...core import settings
from ...core.config import TrainConfig
from .loss import grpo_per_token_loss, reduce_loss
from .rows import Row

# the sums a step's metrics are made of (per trained token, but the loss)
METRIC_SUMS = ("loss", "ratio", "clip_fraction", "kl", "entropy", "logprob_mismatch", "engine_kl")


class UpdatedPolicy(Protocol):
    """The seam between the update and a policy (``policy.Policy``; ``rank.RankTrainer``
    overrides the cross-rank parts). ``adapter_name`` keys the policy's rows, loss and metrics
    in a step of several policies; ``gradient_scale`` multiplies each rank's loss denominator
    (data parallel wrappers average gradients over ranks: 1 in one process)."""

    model: Any
    device: torch.device
    adapter_name: str
    optimizer: torch.optim.Optimizer
    steps_done: int
    gradient_scale: float

    def prepare(self, config: TrainConfig, largest: int = 0) -> dict[str, float]:
        """Seed, learning rate, training mode and checkpointed layers of a step whose largest
        micro-batch pads to ``largest`` tokens (on every rank); the decision's metrics."""
        ...

    def tensors(self, batch: list[Row]) -> dict[str, torch.Tensor]:
        """Padded tensors of a micro-batch (``policy.Policy.tensors`` lists them)."""
        ...

    def logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training forward: logits predicting ``t['targets']``, each row through the
        adapter it trains."""
        ...

    def logprobs(self, t: dict[str, torch.Tensor], entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The training forward's logprobs of ``t['targets']`` (and, with ``entropy``, each
        position's entropy), 0 off ``t['mask']``: what the loss and metrics read."""
        ...

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """Forwards inside run the base alone (the KL term's reference); each adapter stays
        as trainable as it was."""
        ...

    def fill_old_logprobs(self, batches: list[list[Row]]) -> None:
        """Rows without engine logprobs get the current policy's (an on-policy ratio of 1)."""

    def idle_pass(self, config: TrainConfig, backward: bool) -> None:
        """The passes of an empty micro-batch slot (a rank with fewer than the others)."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip this policy's gradient; its norm before clipping (over all ranks)."""
        ...

    def sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Metric sums of this process's micro-batches -> of the whole step."""
        ...

    def max_over_ranks(self, value: float) -> float:
        """The largest of every rank's ``value`` (one process: ``value``)."""
        ...

    def release_step_memory(self) -> None:
        """Between micro-batches: hand freed memory back."""


def optimize(policies: Sequence[UpdatedPolicy], rows: Sequence[list[Row]], config: TrainConfig,
             mixed: bool = False) -> list[dict[str, float]]:
    """One step of each of ``policies`` (one, or adapters on one base) on its ``rows``: the
    rows are labelled with their adapter, cut into length-bucketed micro-batches, and
    :func:`update` runs; what the step freed goes back to the OS (CPU) or to the accelerator.

    ``mixed``: micro-batches mix rows of different adapters (routed per row); else (the
    default, measured faster on CPU: ``benchmarks/many_adapters.py``) each micro-batch holds
    one adapter's rows. Returns each policy's step metrics."""
    with released_memory(policies[0].device), bounded_heap(policies[0].device):
        try:
            for policy, own in zip(policies, rows, strict=True):
                for row in own:
                    row.adapter = policy.adapter_name
            if mixed:
                batches = micro_batches([r for own in rows for r in own],
                                        config.micro_batch_tokens)
            else:
                batches = [b for own in rows for b in micro_batches(own,
                                                                    config.micro_batch_tokens)]
            totals = [step_totals([b for b in ([r for r in batch if r.adapter == p.adapter_name]
                                               for batch in batches) if b]) for p in policies]
            return update(policies, batches, totals, config)
        finally:
            for own in rows:
                for row in own:
                    row.adapter = ""


def update(policies: Sequence[UpdatedPolicy], batches: list[list[Row]],
           totals: Sequence[dict[str, float]], config: TrainConfig) -> list[dict[str, float]]:
    """One optimizer step of each of ``policies`` over ``batches`` (all of the step's
    micro-batches, or a rank's share: an empty one is an idle slot), each policy's loss
    normalised by its ``totals`` (:func:`step_totals` of its rows in the whole step). A row
    trains the adapter it names, or the first policy's. Returns each policy's metrics."""
    lead = policies[0]  # its forward runs every micro-batch, routing rows to their adapters
    if (len({p.adapter_name for p in policies}) < len(policies)
            or any(p.model is not lead.model for p in policies)):
        raise ValueError("one update trains distinct policies of one shared base")
    # seed, learning rate, training mode; the layers checkpointed (the step's largest
    # micro-batch within the activation budget: the same decision on every rank)
    largest = max((len(b) * max(len(r) for r in b) for b in batches if b), default=0)
    largest = int(lead.max_over_ranks(largest))
    checkpointed = [policy.prepare(config, largest) for policy in policies]
    # the ratio's denominator: rows sampled without logprobs get the current policy's
    lead.fill_old_logprobs(batches)
    normalizers = {p.adapter_name: loss_normalizer(t, config)
                   for p, t in zip(policies, totals, strict=True)}
    grad_norms = dict.fromkeys(normalizers, 0.0)
    sums: dict[str, dict[str, float]] = {}
    for epoch in range(config.num_epochs):  # metrics describe the first pass
        for policy in policies:
            policy.optimizer.zero_grad(set_to_none=True)
        # the clipped policy loss of every micro-batch; gradients accumulate
        epoch_sums = accumulate_gradients(lead, batches, config, normalizers,
                                          collect=epoch == 0)
        sums = sums or epoch_sums
        for policy in policies:  # each adapter: its gradient clipped, its optimizer step
            if config.max_grad_norm is not None:
                grad_norms[policy.adapter_name] = policy.clip_grad_norm(config.max_grad_norm)
            policy.optimizer.step()
    rates = [float(p.optimizer.param_groups[0]["lr"]) for p in policies]  # this step's
    for policy in policies:
        policy.steps_done += 1
    return [{**step_metrics(p.sum_over_ranks(sums[p.adapter_name]), t,
                            grad_norms[p.adapter_name], lr), **c}
            for p, t, lr, c in zip(policies, totals, rates, checkpointed, strict=True)]


def accumulate_gradients(lead: UpdatedPolicy, batches: list[list[Row]], config: TrainConfig,
                         normalizers: dict[str, float], collect: bool = True
                         ) -> dict[str, dict[str, float]]:
    """Forward and backward of every micro-batch through ``lead`` (no optimizer step): each
    adapter's loss is normalised by its own step's ``normalizers[adapter]``, so its gradient is
    the one of its rows alone. Returns each adapter's metric sums (``collect``: else zeros)."""
    sums = {name: dict.fromkeys(METRIC_SUMS, 0.0) for name in normalizers}
    for batch in batches:
        if batch:
            _micro_batch(lead, batch, config, normalizers, sums if collect else None)
        else:  # a rank's empty slot: as many passes as the other ranks
            lead.idle_pass(config, backward=True)
        # nothing of a micro-batch outlives it: what it freed goes back to the OS before the
        # next one (glibc keeps freed heap pages; a step's RSS grew micro-batch by
        # micro-batch without this, benchmarks/train_step_memory.py)
        lead.release_step_memory()
    return sums


def _micro_batch(lead: UpdatedPolicy, batch: list[Row], config: TrainConfig,
                 normalizers: dict[str, float], sums: dict[str, dict[str, float]] | None) -> None:
    """Forward, loss and backward of one micro-batch, each adapter's rows normalised by its
    own ``normalizers[adapter]``; adds each adapter's metrics to ``sums`` (None: no
    metrics). Its tensors (logprobs, the graph) die when it returns."""
    t = lead.tensors(batch)
    logp, entropy = lead.logprobs(t, entropy=sums is not None)
    ref = None
    if config.beta > 0:  # the reference policy: the base without the adapters
        with torch.no_grad(), lead.adapters_disabled():
            ref = lead.logprobs(t)[0]
    per_token, parts = grpo_per_token_loss(
        logp, t["old"], t["adv"], epsilon=config.epsilon, epsilon_high=config.epsilon_high,
        beta=config.beta, ref_logp=ref, kl_bias_correction=config.kl_bias_correction,
        loss_fn=config.loss_fn)
    loss: torch.Tensor | None = None
    for name, mask in adapter_masks(batch, t["mask"], lead.adapter_name):
        part = reduce_loss(per_token, mask, config.loss_normalization,
                           normalizers[name] / lead.gradient_scale)
        loss = part if loss is None else loss + part
        if sums is not None:
            assert entropy is not None
            _add_sums(sums[name], float(part.detach()) / lead.gradient_scale, entropy, logp,
                      parts, mask, t)
    assert loss is not None  # a micro-batch has rows
    loss.backward()
    if sums is not None:
        _keep_trainer_logprobs(batch, logp.detach(), int(t["input_ids"].shape[1]))


def _add_sums(sums: dict[str, float], loss: float, entropy: torch.Tensor,
              logp: torch.Tensor, parts: dict[str, torch.Tensor], m: torch.Tensor,
              t: dict[str, torch.Tensor]) -> None:
    """Add the metric sums of the tokens of mask ``m`` (one adapter's rows)."""
    sums["loss"] += loss
    sums["ratio"] += float(parts["ratio"][m].sum())
    sums["clip_fraction"] += float(parts["clipped"][m].float().sum())
    engine_diff = (logp.detach() - t["old"])[m]  # trainer - engine, per sampled token
    sums["logprob_mismatch"] += float(engine_diff.abs().sum())
    # KL(engine || trainer), k3 estimate over tokens the engine sampled (step health):
    # e^d - 1 - d >= 0 for every token; in float32, e^d - d - 1 of d near 0 cancelled
    # to slightly below 0 (a CI step with equal weights summed to -2e-9)
    d = engine_diff.double()
    sums["engine_kl"] += float((torch.expm1(d) - d).clamp_min(0).sum())
    if "kl" in parts:
        sums["kl"] += float(parts["kl"][m].sum())
    sums["entropy"] += float(entropy[m].sum())


# --- the pieces: micro-batches, totals, metrics, memory --------------------------------------

def micro_batches(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """Length-bucketed batches whose padded size (rows x longest) stays within ``max_tokens``."""
    batches: list[list[Row]] = []
    current: list[Row] = []
    for row in sorted(rows, key=len, reverse=True):
        longest = len(current[0]) if current else len(row)
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def step_totals(batches: list[list[Row]]) -> dict[str, float]:
    """What a step's loss is normalised by and its metrics count: trained tokens, rows, tokens
    and micro-batches."""
    rows = [r for b in batches for r in b]
    return {"trained_tokens": float(sum(r.trained_tokens for r in rows)),
            "rows": float(len(rows)), "tokens": float(sum(len(r) for r in rows)),
            "micro_batches": float(len(batches))}


def loss_normalizer(totals: dict[str, float], config: TrainConfig) -> float:
    """What the step's summed loss is divided by: its trained tokens, or its rows."""
    return totals["trained_tokens" if config.loss_normalization == "token" else "rows"]


def step_metrics(sums: dict[str, float], totals: dict[str, float], grad_norm: float,
                 learning_rate: float) -> dict[str, float]:
    """A step's metrics from its metric sums and totals (:func:`step_totals`), with the
    learning rate it trained at (the config's schedule at the policy's step)."""
    n = totals["trained_tokens"]
    metrics = dict(
        loss=sums["loss"],
        ratio=sums["ratio"] / n,
        clip_fraction=sums["clip_fraction"] / n,
        kl=sums["kl"] / n,
        entropy=sums["entropy"] / n,
        logprob_mismatch=sums["logprob_mismatch"] / n,
        engine_kl=sums["engine_kl"] / n,
        grad_norm=grad_norm,
        trained_tokens=n,
        tokens=totals["tokens"],
        micro_batches=totals["micro_batches"],
        learning_rate=learning_rate,
    )
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(f"non-finite loss {metrics['loss']} in a training step")
    return metrics


def adapter_masks(batch: list[Row], mask: torch.Tensor, default: str
                  ) -> list[tuple[str, torch.Tensor]]:
    """The trained-token mask of each adapter's rows in a micro-batch (:attr:`Row.adapter`;
    ``default`` for a row that names none): ``mask`` itself when one adapter has them all."""
    names = list(dict.fromkeys(r.adapter or default for r in batch))
    if len(names) == 1:
        return [(names[0], mask)]
    return [(name, mask & torch.tensor([(r.adapter or default) == name for r in batch],
                                       device=mask.device)[:, None]) for name in names]


def _keep_trainer_logprobs(batch: list[Row], logp: torch.Tensor, width: int) -> None:
    """Each row's trainer logprobs of its trained tokens (``logp`` covers the last columns)."""
    lp, start = logp.cpu(), width - logp.shape[1]
    for i, row in enumerate(batch):
        row.trainer_logprobs = [float(lp[i, j - start]) for j in range(start, len(row))
                                if row.loss_mask[j]]


@functools.cache
def glibc() -> Any | None:
    """The process's glibc (its allocator's ``malloc_trim`` and ``mallopt``), or None where
    the C library is another (musl...) or the platform not Linux: nothing to tune there."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def return_freed_memory() -> None:
    """Hand memory a step freed back to the OS. glibc keeps freed heap pages of the step's big
    temporaries (logits, activations): measured on CPU, the RSS of a process that trains grew by
    GBs per step (5.3 GiB after 2 demo steps, 14.5 GiB after 12) and stays ~1.6 GiB with this."""
    lib = glibc()
    if lib is not None:
        lib.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # where glibc's dynamic threshold stops rising (64-bit)


def set_mmap_threshold(size: int) -> bool:
    """glibc's mmap threshold (bytes; fixing it ends glibc's own adjustment); False where the
    C library is not glibc."""
    lib = glibc()
    return lib is not None and bool(lib.mallopt(M_MMAP_THRESHOLD, size))


@contextlib.contextmanager
def bounded_heap(device: torch.device) -> Iterator[None]:
    """During a CPU step, big allocations (activations, the head's chunks) get memory maps of
    their own that go back to the OS when freed, so the step's peak is what it holds at once,
    not that plus the heap its earlier temporaries left behind
    (``TRACERL_TRAIN_MMAP_THRESHOLD``)."""
    threshold = settings.TRACERL_TRAIN_MMAP_THRESHOLD.get()
    if device.type != "cpu" or threshold <= 0 or not set_mmap_threshold(threshold):
        yield
        return
    try:
        yield
    finally:
        set_mmap_threshold(GLIBC_MMAP_THRESHOLD_MAX)


@contextlib.contextmanager
def released_memory(device: torch.device) -> Iterator[None]:
    """After the block (a step), what it freed goes back: to the OS on CPU; on CUDA out of
    PyTorch's cache, which kept the step's freed activations and gradients and vLLM wakes up
    into that memory (H200: the trainer held 4.1 GiB after one step of a 135M model; for a 7B
    it would be tens of GiB and vLLM's wake-up would run out)."""
    try:
        yield
    finally:
        if device.type == "cpu":
            return_freed_memory()
        elif device.type == "cuda":
            torch.cuda.empty_cache()
