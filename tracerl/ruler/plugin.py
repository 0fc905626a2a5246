"""RULER as a ``tracerl_score_group`` plugin (judge name 'ruler').

Configured by environment: ``TRACERL_RULER_MODEL`` (required), ``TRACERL_RULER_BASE_URL`` and
``TRACERL_RULER_API_KEY`` for an OpenAI-compatible endpoint (else LiteLLM is used)."""

from __future__ import annotations

import os
from typing import Any

from ..events.hookspecs import hookimpl


@hookimpl
def tracerl_score_group(group: Any, judge: str | None) -> Any:
    model = os.environ.get("TRACERL_RULER_MODEL")
    if judge != "ruler" and not (judge is None and model):
        return None
    from .judge import RulerError, ruler_score_group

    if not model:
        raise RulerError("the 'ruler' judge needs TRACERL_RULER_MODEL (and TRACERL_RULER_BASE_URL "
                         "for an OpenAI-compatible endpoint)")
    client = None
    if os.environ.get("TRACERL_RULER_BASE_URL"):
        import openai

        client = openai.AsyncOpenAI(base_url=os.environ["TRACERL_RULER_BASE_URL"],
                                    api_key=os.environ.get("TRACERL_RULER_API_KEY", "none"))
    return ruler_score_group(group, model, client=client)
