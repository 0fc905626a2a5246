"""What every framework adapter does with spans: open, close, fail, keyed by the framework's ids.

Spans go to the rollout that was current when they opened (so a span ending in another thread
or task still lands in the right trajectory), or to the recorder's own ``orphans`` list when
no rollout was running.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..core.context import RolloutContext, current_rollout
from ..core.spans import Span, SpanKind

MAX_TEXT = 2000


def short(value: Any, limit: int = MAX_TEXT) -> str:
    """A bounded string form of a tool input or output, for span attributes."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class SpanRecorder:
    def __init__(self, framework: str, rollout: RolloutContext | None = None) -> None:
        self.framework = framework
        self.rollout = rollout
        self.orphans: list[Span] = []
        self._open: dict[str, Span] = {}
        self._lock = threading.Lock()

    def start(self, span_id: str, kind: SpanKind, name: str, parent_id: str | None = None,
              **attributes: Any) -> Span:
        span = Span(id=span_id, parent_id=parent_id, kind=kind, name=name, framework=self.framework,
                    attributes={k: v for k, v in attributes.items() if v is not None})
        ctx = self.rollout or current_rollout()
        with self._lock:
            self._open[span_id] = span
            (ctx.spans if ctx is not None else self.orphans).append(span)
        return span

    def get(self, span_id: str) -> Span | None:
        return self._open.get(span_id)

    def end(
        self, span_id: str, error: BaseException | str | None = None, **attributes: Any
    ) -> Span | None:
        with self._lock:
            span = self._open.pop(span_id, None)
        if span is None:
            return None
        span.end_time = time.time()
        if attributes:
            span.attributes = {
                **span.attributes,
                **{k: v for k, v in attributes.items() if v is not None},
            }
        if error is not None:
            span.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return span
