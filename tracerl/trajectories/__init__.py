"""ART 0.5.23's ``art.trajectories``: ``tokenize`` and ``tensorize`` of trajectories and groups,
and the tokenized and tensorized views they return (``import tracerl as art`` then
``await art.tokenize(groups)`` as in ART).

- ``views.py``: the shared base and ART's ``reward``/``metrics``/``metadata`` properties.
- ``tokenized.py``: ``TokenFlag`` and the tokenized views (ART's fields and properties).
- ``build.py``: a trajectory's histories, built as its training rows are (recorded ids first).
- ``tensors.py``: the tensorized views (loads torch; imported only when tensorizing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..core.errors import InvalidTrajectoryError
from ..core.trajectory import History, Trajectory, TrajectoryGroup, current_trajectory, no_capture
from ..rollout.capture import trajectory, trajectory_group
from .build import Tokenizing, trajectory_histories
from .tokenized import (
    TokenFlag,
    TokenizedHistory,
    TokenizedMultiHistoryTrajectory,
    TokenizedTrajectory,
    TokenizedTrajectoryGroup,
)

if TYPE_CHECKING:
    import torch

    from .tensors import (
        TensorizedHistory,
        TensorizedMultiHistoryTrajectory,
        TensorizedTrajectory,
        TensorizedTrajectoryGroup,
    )

_TENSOR_NAMES = {"TensorizedHistory", "TensorizedMultiHistoryTrajectory", "TensorizedTrajectory",
                 "TensorizedTrajectoryGroup"}


def _tokenize_one(item: Trajectory, how: Tokenizing,
                  multi_history: bool) -> TokenizedTrajectory | TokenizedMultiHistoryTrajectory:
    histories = trajectory_histories(item, how)
    if multi_history:
        return TokenizedMultiHistoryTrajectory(trajectory=item, histories=histories)
    if len(histories) != 1:
        raise InvalidTrajectoryError(
            f"Trajectory tokenization requires exactly one history; found {len(histories)} "
            "(its calls form several rows: pass multi_history=True)")
    (one,) = histories
    return TokenizedTrajectory(trajectory=item, **dict(one))


def _tokenize_all(items: list[Any], how: Tokenizing, multi_history: bool) -> list[Any]:
    if all(isinstance(i, TrajectoryGroup) for i in items):
        return [TokenizedTrajectoryGroup(
            trajectory_group=g, trajectories=[_tokenize_one(t, how, multi_history) for t in g])
            for g in items]
    if all(isinstance(i, Trajectory) for i in items):
        return [_tokenize_one(t, how, multi_history) for t in items]
    kinds = sorted({type(i).__name__ for i in items})
    raise InvalidTrajectoryError(f"items must be all Trajectory or all TrajectoryGroup, got "
                                 f"{', '.join(kinds)}")


async def tokenize(
    items: Iterable[Trajectory] | Iterable[TrajectoryGroup], *, multi_history: bool = False,
    reconcile_text_equivalent_tokenizations: bool = False, model: str | None = None,
    base_model: str | None = None, tokenizer: Any | None = None,
    chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None,
) -> list[Any]:
    """Tokenize trajectories (a list of ``TokenizedTrajectory``, or of
    ``TokenizedMultiHistoryTrajectory`` with ``multi_history=True``) or groups (a list of
    ``TokenizedTrajectoryGroup``), in input order, off the event loop.

    Recorded ids are used as recorded (``reconcile_text_equivalent_tokenizations`` has nothing
    to reconcile); ``tokenizer=`` or ``base_model=`` (loaded with ``get_tokenizer``) give
    ``STOP`` flags and render trajectories without token records (with ``chat_template`` and
    ``chat_template_kwargs``, when given); ``model=`` keeps only the calls to that model."""
    del reconcile_text_equivalent_tokenizations  # exact ids: nothing to reconcile
    if tokenizer is not None:
        load: Any = lambda: tokenizer  # noqa: E731
    elif base_model is not None:
        from ..tokenizer import get_tokenizer

        load = lambda: get_tokenizer(base_model)  # noqa: E731
    else:
        load = None
    how = Tokenizing(model=model, load=load, chat_template=chat_template,
                     chat_template_kwargs=chat_template_kwargs)
    return await asyncio.to_thread(_tokenize_all, list(items), how, multi_history)


async def tensorize(
    items: Iterable[Trajectory] | Iterable[TrajectoryGroup], *, multi_history: bool = False,
    reconcile_text_equivalent_tokenizations: bool = False, model: str | None = None,
    base_model: str | None = None, tokenizer: Any | None = None,
    chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None,
    device: torch.device | str | None = None,
) -> list[Any]:
    """:func:`tokenize`, then each result's ``tensorize(device=device)``: lists of
    ``TensorizedTrajectory`` / ``TensorizedMultiHistoryTrajectory`` /
    ``TensorizedTrajectoryGroup``."""
    tokenized = await tokenize(
        items, multi_history=multi_history,
        reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations,
        model=model, base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs)
    return await asyncio.to_thread(lambda: [t.tensorize(device=device) for t in tokenized])


def __getattr__(name: str) -> Any:
    if name in _TENSOR_NAMES:
        from . import tensors

        return getattr(tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["History", "TensorizedHistory", "TensorizedMultiHistoryTrajectory",
           "TensorizedTrajectory", "TensorizedTrajectoryGroup", "TokenFlag", "TokenizedHistory",
           "TokenizedMultiHistoryTrajectory", "TokenizedTrajectory", "TokenizedTrajectoryGroup",
           "Trajectory", "TrajectoryGroup", "current_trajectory", "no_capture", "tensorize",
           "tokenize", "trajectory", "trajectory_group"]
