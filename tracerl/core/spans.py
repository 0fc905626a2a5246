"""Spans: the structure of a rollout as a framework saw it (nodes, agents, tools, LLM calls).

Adapters (LangChain/LangGraph, OpenAI Agents SDK, LiteLLM) record spans into the running
rollout; the gateway's token records stay the training data. :func:`link_spans_to_calls`
joins the two, so every recorded call knows which node, agent or tool loop produced it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator

from .validated import Validated, check_json

# the call tag naming the span that will be posted for a call after its answer (the LiteLLM
# proxy's callback sets it): finishing a rollout waits for such spans (``awaited_span_ids``)
POSTED_SPAN_TAG = "posted_span_id"

SpanKind = Literal[
    "rollout", "chain", "node", "agent", "llm", "tool", "handoff", "guardrail", "custom"
]


class Span(Validated):
    """One unit of work inside a rollout."""

    id: str
    parent_id: str | None = None
    kind: SpanKind
    name: str = ""
    framework: str = ""
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    # LLM spans: the provider's response id (joins the gateway record) and, once linked, the call
    response_id: str | None = None
    call_id: str | None = None

    @field_validator("attributes", mode="after")
    @classmethod
    def _json_attributes(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json("span attributes", value)


def span_path(span: Span, by_id: dict[str, Span]) -> list[str]:
    """Names from the outermost ancestor down to ``span`` (cycles and gaps tolerated)."""
    names: list[str] = []
    seen: set[str] = set()
    cur: Span | None = span
    while cur is not None and cur.id not in seen:
        seen.add(cur.id)
        names.append(cur.name or cur.kind)
        cur = by_id.get(cur.parent_id) if cur.parent_id else None
    return names[::-1]


class CallRecord(Protocol):
    """What pairing reads of a call's record: an LLMCall (:mod:`.trajectory`, which imports
    this module, so it cannot be named here)."""

    @property
    def id(self) -> str: ...
    @property
    def response(self) -> dict[str, Any] | None: ...
    @property
    def metadata(self) -> dict[str, Any]: ...


def link_spans_to_calls(spans: list[Span], calls: Sequence[CallRecord]) -> None:
    """Pair LLM spans with the token records they produced.

    A call is matched by the span id it was tagged with (``call_tags(span_id=...)``, else the
    ``posted_span_id`` tag of a span posted after the answer), or the first unpaired LLM span
    under its tagged ``parent_span_id``, else by the provider response id; LLM spans left
    without either are paired with the remaining calls in time order when the counts agree.
    Matched calls get ``metadata['span_id']`` and ``metadata['span_path']``; matched spans get
    ``call_id``.
    """
    by_id = {s.id: s for s in spans}
    llm_spans = [s for s in spans if s.kind == "llm"]
    by_response = {s.response_id: s for s in llm_spans if s.response_id}
    unmatched_calls: list[CallRecord] = []
    for call in calls:
        tags = call.metadata.get("tags") or {}
        response_id = (call.response or {}).get("id")
        span = next((by_id[tags[k]] for k in ("span_id", POSTED_SPAN_TAG)
                     if isinstance(tags.get(k), str) and tags[k] in by_id), None)
        if span is None and tags.get("parent_span_id"):  # the first free LLM span under it
            span = next((s for s in llm_spans if s.parent_id == tags["parent_span_id"]
                         and s.call_id is None), None)
        if span is None and response_id:
            span = by_response.get(response_id)
        if span is None:
            unmatched_calls.append(call)
            continue
        _pair(span, call, by_id)
    free = [s for s in llm_spans if s.call_id is None]
    if free and len(free) == len(unmatched_calls):
        for span, call in zip(
            sorted(free, key=lambda s: s.start_time), unmatched_calls, strict=True
        ):
            _pair(span, call, by_id)


def awaited_span_ids(spans: Sequence[Span], calls: Sequence[CallRecord]) -> set[str]:
    """Ids of spans that ``calls`` announced (their ``posted_span_id`` tag) and that are not
    among ``spans`` yet: a proxy posts a call's span after the call is answered."""
    have = {s.id for s in spans}
    announced = {(c.metadata.get("tags") or {}).get(POSTED_SPAN_TAG) for c in calls}
    return {i for i in announced if isinstance(i, str) and i not in have}


def _pair(span: Span, call: CallRecord, by_id: dict[str, Span]) -> None:
    span.call_id = call.id
    call.metadata["span_id"] = span.id
    call.metadata["span_path"] = span_path(span, by_id)
