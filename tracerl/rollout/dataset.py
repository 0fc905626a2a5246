"""Step-numbered batches of scenarios over epochs, resumable at any step (ART's
``iterate_dataset``).

Each epoch is a fresh deterministic shuffle of the whole dataset, so batch ``k`` is the same in
every run with the same seed: after a crash, ``iterate_dataset(..., initial_step=await
model.get_step())`` continues with exactly the batches that were not trained yet.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tqdm.auto import tqdm

from ..core.validated import check_int

T = TypeVar("T")


@dataclass(frozen=True)
class DatasetBatch(Generic[T]):
    """One training step's scenarios: ``step`` counts from 0 over all epochs."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int


def epoch_order(size: int, epoch: int, seed: int = 0) -> list[int]:
    """The dataset indices of ``epoch`` in the order they are served (same in every process).
    With ``seed=0`` it is ART's order (indices shuffled by a generator seeded with the epoch),
    so a run resumed from an ART-trained step replays the same items."""
    order = list(range(size))
    random.Random(epoch if seed == 0 else f"tracerl-dataset:{seed}:{epoch}").shuffle(order)
    return order


def iterate_dataset(dataset: Sequence[T] | Iterable[T], groups_per_step: int = 1,
                    num_epochs: int = 1, initial_step: int = 0, use_tqdm: bool = True, *,
                    seed: int = 0, shuffle: bool = True) -> Iterator[DatasetBatch[T]]:
    """Yield ``groups_per_step`` items per step, every item once per epoch (the last batch of an
    epoch may be smaller), starting at global step ``initial_step``."""
    groups_per_step = check_int("groups_per_step", groups_per_step, 1)
    num_epochs = check_int("num_epochs", num_epochs, 1)
    initial_step = check_int("initial_step", initial_step, 0)
    items: Sequence[T] = dataset if isinstance(dataset, Sequence) else list(dataset)
    if len(items) == 0:
        raise ValueError("iterate_dataset needs at least one item; the dataset is empty")
    return _batches(items, groups_per_step, math.ceil(len(items) / groups_per_step), num_epochs,
                    initial_step, use_tqdm, seed, shuffle)


def _batches(items: Sequence[T], groups_per_step: int, steps_per_epoch: int, num_epochs: int,
             initial_step: int, show_progress: bool, seed: int, shuffle: bool
             ) -> Iterator[DatasetBatch[T]]:
    total = steps_per_epoch * num_epochs
    bar = tqdm(total=total, initial=initial_step, desc="steps", file=sys.stderr,
               dynamic_ncols=True) if show_progress and initial_step < total else None
    try:
        for epoch in range(initial_step // steps_per_epoch, num_epochs):
            order = epoch_order(len(items), epoch, seed) if shuffle else range(len(items))
            first = max(0, initial_step - epoch * steps_per_epoch)
            for epoch_step in range(first, steps_per_epoch):
                chunk = order[epoch_step * groups_per_step:(epoch_step + 1) * groups_per_step]
                yield DatasetBatch(items=[items[i] for i in chunk],
                                   step=epoch * steps_per_epoch + epoch_step, epoch=epoch,
                                   epoch_step=epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
