"""Online batches whose training failed: each failure recorded, and a batch that failed
``batch_tries`` times set aside, so that the loop moves on to new groups instead of retrying
one it cannot train (a reward that overflows, a row the model refuses) forever.

``{model folder}/online/failed_batches.jsonl``, append-only and fsynced
(:func:`~tracerl.core.storage.append_jsonl`), one record per line:

``failed``     ``batch``, ``try`` (1, 2, ...), ``error``, ``time``
``set_aside``  ``batch``, ``tries``, ``error`` (the last): the batch's groups stay taken, never
               trained; the next batch of the same step gets a new id (``online-0004-1``)

A restart reads the file back: the tries go on counting and a set-aside batch stays aside.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ...core.storage import ModelStore, append_jsonl, read_jsonl

log = logging.getLogger(__name__)

FAILED_BATCHES = "failed_batches.jsonl"


class FailedBatches:
    """One model's record of failed and set-aside online batches."""

    def __init__(self, store: ModelStore, model: str) -> None:
        self.path: Path = store.root / "online" / FAILED_BATCHES
        self.model = model

    def _records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def set_aside(self) -> list[str]:
        """The batches set aside, oldest first."""
        return [r["batch"] for r in self._records() if r.get("event") == "set_aside"]

    def next_id(self, step: int) -> str:
        """The id of the batch that trains ``step``: ``online-NNNN``, with ``-K`` after it once
        ``K`` batches for that step were set aside."""
        base = f"online-{step:04d}"
        aside = sum(b == base or b.startswith(base + "-") for b in self.set_aside())
        return f"{base}-{aside}" if aside else base

    def failed(self, batch: str, error: BaseException, tries: int) -> bool:
        """Record that ``batch`` failed with ``error``; after its ``tries``-th failure it is set
        aside (recorded, logged). Returns whether it was."""
        records = self._records()
        n = 1 + sum(r.get("event") == "failed" and r.get("batch") == batch for r in records)
        text = f"{type(error).__name__}: {error}"[:2000]
        append_jsonl(self.path, {"event": "failed", "batch": batch, "try": n, "error": text,
                                 "time": time.time()})
        if n < tries:
            return False
        append_jsonl(self.path, {"event": "set_aside", "batch": batch, "tries": n,
                                 "error": text, "time": time.time()})
        log.error("%s: online batch %s set aside after %d failed tries (never trained; the loop "
                  "moves on to new groups; %s): %s", self.model, batch, n, self.path, text)
        return True

    def status(self) -> dict[str, Any]:
        """For the online status: the batches set aside, and the tries of those failing now."""
        records = self._records()
        aside = {r["batch"] for r in records if r.get("event") == "set_aside"}
        failing: dict[str, int] = {}
        for r in records:
            if r.get("event") == "failed" and r["batch"] not in aside:
                failing[r["batch"]] = int(r["try"])
        last = next((r for r in reversed(records) if r.get("event") == "set_aside"), None)
        return {"set_aside_batches": sorted(aside), "failing_batches": failing,
                "last_set_aside_error": None if last is None else last["error"]}
