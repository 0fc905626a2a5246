"""ART's ``art.utils.sft``: supervised fine-tuning from a JSONL file of chat conversations.

Each line is ``{"messages": [...], "tools": [...]}`` (``tools`` optional). One
``train_sft_from_file`` call is one ``model.train_sft`` call: one new checkpoint, one optimizer
step per ``batch_size`` conversations, at a learning rate schedule over the whole run.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..core.config import TrainSFTConfig
from ..core.errors import InvalidTrajectoryError
from ..core.trajectory import Trajectory

if TYPE_CHECKING:
    from ..rollout.model import TrainableModel

Schedule = Literal["cosine", "linear", "constant"]


def create_lr_schedule(total_steps: int, peak_lr: float, method: Schedule = "linear",
                       warmup_steps: int = 0, min_lr: float = 0.0) -> list[float]:
    """One learning rate per step: a linear warmup over ``warmup_steps`` (ending at
    ``peak_lr``), then ``method`` from ``peak_lr`` down to ``min_lr`` at the last step."""
    if method not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown schedule {method!r}; use 'cosine', 'linear' or 'constant'")
    rates = []
    decay = total_steps - warmup_steps
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        progress = (step - warmup_steps) / (decay - 1) if decay > 1 else 0.0
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2)
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * progress)
        else:
            rates.append(peak_lr)
    return rates


class SFTChunk(NamedTuple):
    """Conversations for one ``model.train_sft`` call, with their slice of the schedule."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig
    step: int
    epoch: int
    epoch_step: int


def create_sft_dataset_iterator(
    trajectories: list[Trajectory], chunk_size: int = 10, epochs: int = 1, batch_size: int = 2,
    peak_lr: float = 2e-4, schedule_type: Schedule = "linear", warmup_ratio: float = 0.1,
    shuffle: bool = True, seed: int = 42, initial_step: int = 0, show_progress: bool = True,
) -> Iterator[SFTChunk]:
    """``trajectories`` in chunks of ``chunk_size`` batches, one ``model.train_sft`` call each
    (ART's): every epoch shuffled with ``seed + epoch``, the learning rate schedule computed
    over all batches and sliced per chunk; chunks before batch ``initial_step`` are skipped."""
    del show_progress
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not trajectories:
        return
    per_epoch = math.ceil(len(trajectories) / batch_size)
    schedule = create_lr_schedule(per_epoch * epochs, peak_lr, schedule_type,
                                  int(per_epoch * epochs * warmup_ratio))
    per_chunk = batch_size * chunk_size
    chunks_per_epoch = math.ceil(len(trajectories) / per_chunk)
    for epoch in range(epochs):
        order = list(trajectories)
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for chunk in range(chunks_per_epoch):
            if epoch * chunks_per_epoch + chunk < initial_step // chunk_size:
                continue
            items = order[chunk * per_chunk:(chunk + 1) * per_chunk]
            first_batch = epoch * per_epoch + chunk * chunk_size
            rates = schedule[first_batch:first_batch + math.ceil(len(items) / batch_size)]
            yield SFTChunk(items, TrainSFTConfig(learning_rate=rates, batch_size=batch_size),
                           step=first_batch, epoch=epoch, epoch_step=chunk * chunk_size)


def _jsonl(file_path: str | Path) -> Path:
    path = Path(file_path)
    if path.suffix != ".jsonl":
        raise ValueError(f"SFT data must be a .jsonl file, got {file_path}")
    return path


def _trajectory(line: str, where: str) -> Trajectory:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidTrajectoryError(f"{where}: not JSON: {e}") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not messages:
        raise InvalidTrajectoryError(f"{where}: needs a non-empty 'messages' list")
    try:
        return Trajectory(messages_and_choices=messages, tools=data.get("tools"))
    except InvalidTrajectoryError as e:
        raise InvalidTrajectoryError(f"{where}: {e}") from None


def get_file_row_count(file_path: str | Path) -> int:
    """Non-empty lines of a JSONL file."""
    with _jsonl(file_path).open() as f:
        return sum(1 for line in f if line.strip())


def iterate_file(file_path: str | Path, epochs: int = 1, shuffle_buffer_size: int = 10000,
                 seed: int = 42, initial_skip: int = 0) -> Iterator[Trajectory]:
    """The file's conversations, ``epochs`` times, streamed through a shuffle buffer of
    ``shuffle_buffer_size`` (epoch ``e`` shuffled with ``seed + e``, as ART), the first
    ``initial_skip`` left out (resuming)."""
    path = _jsonl(file_path)
    skipped = 0

    def emit(item: Trajectory) -> Iterator[Trajectory]:
        nonlocal skipped
        if skipped < initial_skip:
            skipped += 1
        else:
            yield item

    for epoch in range(epochs):
        rng = random.Random(seed + epoch)
        buffer: list[Trajectory] = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                buffer.append(_trajectory(line, f"{path}:{lineno}"))
                if len(buffer) >= shuffle_buffer_size:
                    yield from emit(buffer.pop(rng.randint(0, len(buffer) - 1)))
        rng.shuffle(buffer)
        for item in buffer:
            yield from emit(item)


async def train_sft_from_file(model: TrainableModel, file_path: str | Path, epochs: int = 1,
                              batch_size: int = 2, peak_lr: float = 2e-4,
                              schedule_type: Schedule = "linear", warmup_ratio: float = 0.1,
                              initial_step: int = 0, final_step: int | None = None,
                              _config: dict[str, Any] | None = None, verbose: bool = False,
                              shuffle_buffer_size: int = 10000) -> None:
    """Fine-tune ``model`` on a JSONL file (ART's ``train_sft_from_file``): batches
    ``initial_step`` to ``final_step`` of ``epochs`` passes, at a ``schedule_type`` learning
    rate peaking at ``peak_lr`` after ``warmup_ratio`` of the batches."""
    rows = get_file_row_count(file_path)
    total = rows * epochs
    skip = initial_step * batch_size
    if skip >= total:
        return
    batches = math.ceil(total / batch_size)
    schedule = create_lr_schedule(batches, peak_lr, schedule_type,
                                  int(batches * warmup_ratio))
    rates = schedule[initial_step:min(final_step, batches) if final_step is not None else None]
    trajectories = list(itertools.islice(
        iterate_file(file_path, epochs, shuffle_buffer_size, initial_skip=skip),
        len(rates) * batch_size))
    await model.train_sft(trajectories, TrainSFTConfig(learning_rate=rates, batch_size=batch_size),
                          _config=_config, verbose=verbose)
