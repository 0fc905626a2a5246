"""RULER as a ``tracerl_score_group`` plugin (judge name 'ruler').

Configured by environment: the judge model, and an OpenAI-compatible endpoint and its key (else
LiteLLM is used), each from a variable that :mod:`tracerl.core.settings` declares."""

from __future__ import annotations

from typing import Any

from ..core import settings
from ..events.hookspecs import hookimpl


@hookimpl
def tracerl_score_group(group: Any, judge: str | None) -> Any:
    model = settings.TRACERL_RULER_MODEL.get()
    if judge != "ruler" and not (judge is None and model):
        return None
    from .judge import RulerError, ruler_score_group

    if not model:
        raise RulerError("the 'ruler' judge needs TRACERL_RULER_MODEL (and TRACERL_RULER_BASE_URL "
                         "for an OpenAI-compatible endpoint)")
    client = None
    base_url = settings.TRACERL_RULER_BASE_URL.get()
    if base_url:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url,
                                    api_key=settings.TRACERL_RULER_API_KEY.get())
    return ruler_score_group(group, model, client=client)
