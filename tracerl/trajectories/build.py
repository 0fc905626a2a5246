"""A trajectory's tokenized histories, built as its training rows are
(:func:`tracerl.backend.training.rows.rows_from_calls`, the same function the trainer uses).

Recorded calls give the ids the engine saw and sampled, merged into one history where a call
continues an earlier one token for token; a trajectory without token records is rendered with
the tokenizer's chat template (its main history, then each ``additional_histories`` entry), as
the trainer's fallback does. A tokenizer is needed only for that fallback and for ``STOP``
flags (which ids end a generation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..backend.training.rows import Row, RowStats, rows_from_calls, rows_from_messages
from ..core.errors import InvalidTrajectoryError
from ..core.trajectory import Conversation, History, LLMCall, Trajectory
from .tokenized import TokenFlag, TokenizedHistory

SAMPLED = TokenFlag.EXACT | TokenFlag.SAMPLED | TokenFlag.ASSISTANT | TokenFlag.OUTPUT
RENDERED = TokenFlag.ASSISTANT | TokenFlag.OUTPUT
# special tokens that end an assistant turn in common chat templates, besides the eos token
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass
class Tokenizing:
    """What ``tokenize`` was asked: the model to select, and how to get a tokenizer (loaded only
    when needed, once)."""

    model: str | None
    load: Callable[[], Any] | None  # None: no tokenizer given nor base_model to load one
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, object] | None = None
    _tokenizer: Any = field(default=None, repr=False)

    def tokenizer(self, why: str) -> Any:
        if self._tokenizer is None:
            if self.load is None:
                raise InvalidTrajectoryError(f"{why}: pass tokenizer= or base_model=")
            self._tokenizer = self.load()
        return self._tokenizer

    def stop_ids(self) -> set[int]:
        if self.load is None and self._tokenizer is None:
            return set()  # as ART without a tokenizer: no STOP flags
        tok = self.tokenizer("STOP flags")
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        vocab = tok.get_vocab()
        return ids | {vocab[t] for t in TURN_ENDS if t in vocab}

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> list[int]:
        tok = self.tokenizer("this trajectory has no token records, so it is rendered")
        kwargs: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _flags(row: Row, sampled: TokenFlag, prompt: TokenFlag, stop_ids: set[int]) -> list[TokenFlag]:
    flags = [sampled if m else prompt for m in row.loss_mask]
    for i, trained in enumerate(row.loss_mask):  # the last token of each sampled run
        last = trained and (i + 1 == len(row.loss_mask) or not row.loss_mask[i + 1])
        if last and row.input_ids[i] in stop_ids:
            flags[i] |= TokenFlag.STOP
    return flags


def _call_history(call: LLMCall) -> History:
    """The conversation of a recorded call: its request's messages and the reply."""
    comp = call.completions[0]
    reply: dict[str, Any] = {"role": "assistant", "content": comp.text}
    if comp.tool_calls:
        reply["tool_calls"] = comp.tool_calls
    messages = call.request.get("messages")
    if not isinstance(messages, list):  # a completions call: its prompt as one user turn
        messages = [{"role": "user", "content": str(call.request.get("prompt", ""))}]
    return History(messages_and_choices=[*messages, reply], tools=call.request.get("tools"))


def _row_history(row: Row, calls: list[LLMCall], trajectory: Trajectory, only: bool) -> History:
    """The conversation a row holds: the trajectory's own when it is its only row and has one,
    else that of the longest call whose tokens begin the row."""
    if only and trajectory.messages_and_choices:
        return History(messages_and_choices=trajectory.messages_and_choices,
                       tools=trajectory.tools)
    best: LLMCall | None = None
    for call in calls:
        ids = list(call.prompt_token_ids) + list(call.completions[0].token_ids)
        if row.input_ids[:len(ids)] == ids and (best is None or len(ids) > len(
                best.prompt_token_ids) + len(best.completions[0].token_ids)):
            best = call
    return _call_history(best) if best is not None else History(
        messages_and_choices=trajectory.messages_and_choices, tools=trajectory.tools)


def _selected(trajectory: Trajectory, model: str | None) -> list[LLMCall]:
    calls = [c for c in trajectory.llm_calls
             if not c.error and c.completions and c.prompt_token_ids]
    if model is None:
        return calls
    mine = [c for c in calls if model in (c.model, c.model.partition("@")[0])]
    if calls and not mine:
        raise InvalidTrajectoryError(
            f"model={model!r}: none of the trajectory's calls named it (they named "
            f"{sorted({c.model for c in calls})})")
    return mine


def _recorded(trajectory: Trajectory, how: Tokenizing) -> list[TokenizedHistory]:
    calls = _selected(trajectory, how.model)
    rows = rows_from_calls(calls, RowStats())
    stop = how.stop_ids() if rows else set()
    return [TokenizedHistory(history=_row_history(row, calls, trajectory, len(rows) == 1),
                             model=how.model or calls[0].model, tokens=row.input_ids,
                             logprobs=row.old_logprobs,
                             flags=_flags(row, SAMPLED, TokenFlag.EXACT, stop))
            for row in rows]


def _rendered(trajectory: Trajectory, how: Tokenizing) -> list[TokenizedHistory]:
    tok = how.tokenizer("this trajectory has no token records, so it is rendered")
    stop = how.stop_ids()
    out = []
    conversations: list[Conversation] = [trajectory, *trajectory.additional_histories]
    for conversation in conversations:
        history = History(messages_and_choices=conversation.messages_and_choices,
                          tools=conversation.tools)
        for row in rows_from_messages(
                conversation, how.render,
                lambda text: tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id):
            out.append(TokenizedHistory(history=history, model=how.model or "",
                                        tokens=row.input_ids, logprobs=row.old_logprobs,
                                        flags=_flags(row, RENDERED, TokenFlag(0), stop)))
    return out


def trajectory_histories(trajectory: Trajectory, how: Tokenizing) -> list[TokenizedHistory]:
    """Every history of ``trajectory`` the trainer would train on, in order; raises naming the
    trajectory's problem when there is none."""
    if not isinstance(trajectory, Trajectory):
        raise InvalidTrajectoryError(
            f"tokenize takes Trajectory or TrajectoryGroup items, got {type(trajectory).__name__}")
    histories = _recorded(trajectory, how) if trajectory.llm_calls else []
    if not histories and not _selected(trajectory, None):
        histories = _rendered(trajectory, how)
    if not histories:
        raise InvalidTrajectoryError("Trajectory contains no trainable choices: no recorded "
                                     "call with tokens and no assistant Choice to render")
    return histories
