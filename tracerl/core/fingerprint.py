"""Served-policy fingerprints: which weights answered a call, checked against the version it
claims.

An engine takes the digest of an adapter's weights (:func:`adapter_digest`, a SHA-256 over its
``*.safetensors`` files) once, when it loads it, and keeps it per loaded name only once the load
succeeded. For each call it serves it notes the digest of what actually served it on the call's
route (:func:`note_served`); the recorder writes it into the record (``LLMCall.adapter_digest``).
The base model's digest is :data:`BASE`; an engine that cannot tell leaves it ``None``.

The trainer compares each call's digest with the digest of the policy version the call claims
(``adapter_step``: checkpoint ``N`` of the model's folder, :func:`expected_digest`) and refuses
the calls that differ (:func:`check_calls`): a verl LoRA sync once served the initial policy for
two months, unseen, because nothing asked the engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .engine import current_route
from .trajectory import LLMCall

log = logging.getLogger(__name__)
BASE = "base"  # the digest of "no adapter": the base model served the call
PREFIX = "sha256:"
_CHUNK = 1 << 20
_cache: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def _weight_files(path: Path) -> list[Path]:
    """The adapter's weight files: its ``*.safetensors``, else (older peft) its ``*.bin``."""
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(p for p in Path(path).glob(pattern) if p.is_file())
        if files:
            return files
    return []


def adapter_digest(path: Path | str) -> str:
    """``sha256:<hex>`` of the adapter folder's weight files (``*.safetensors``, names and bytes
    in name order); cached per file list, sizes and modification times. ``FileNotFoundError``
    when the folder holds no weight file (an adapter that cannot be fingerprinted is not
    served)."""
    files = _weight_files(Path(path))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors (or *.bin) weights to "
                                "fingerprint")
    key_files = []
    for f in files:
        st = os.stat(f)
        key_files.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    key = (str(Path(path).resolve()), tuple(key_files))
    cached = _cache.get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    digest = PREFIX + h.hexdigest()
    _cache[key] = digest
    return digest


def digest_if_readable(path: Path | str) -> str | None:
    """:func:`adapter_digest`, or None when this process cannot read the adapter's weights
    (a server on another node loads it from its own mount): its calls are then unverified."""
    try:
        return adapter_digest(path)
    except OSError as e:
        log.info("no fingerprint for the adapter at %s: %s", path, e)
        return None


def note_served(digest: str | None) -> None:
    """Called by an engine while it serves a call: the digest of the weights that served it
    (``None``: unknown), written onto the call's route for the recorder."""
    route = current_route.get()
    if route is not None:
        route.adapter_digest = digest


def expected_digest(checkpoints_dir: Path, step: int) -> str | None:
    """The digest policy version ``step`` must have been served with: :data:`BASE` for step 0,
    else checkpoint ``step``'s adapter's; ``None`` when that checkpoint is gone."""
    if step == 0:
        return BASE
    try:
        return adapter_digest(Path(checkpoints_dir) / f"{step:04d}")
    except FileNotFoundError:
        return None


@dataclass
class FingerprintCheck:
    """Calls checked against the version they claim: ``refused`` ids served by other weights."""

    checked: int = 0
    unverified: int = 0  # no digest recorded, or the claimed checkpoint is gone
    refused: set[str] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)  # a few mismatches, described

    def as_metrics(self) -> dict[str, float]:
        return {"fingerprint_checked": float(self.checked),
                "fingerprint_unverified": float(self.unverified),
                "fingerprint_mismatches": float(len(self.refused))}


def check_calls(checkpoints_dir: Path, calls: Iterable[LLMCall]) -> FingerprintCheck:
    """Compare each call's recorded digest with its claimed version's (calls without a claimed
    version, e.g. a base-model name or an error, are skipped)."""
    out = FingerprintCheck()
    expected: dict[int, str | None] = {}
    for call in calls:
        if call.adapter_step is None or call.error:
            continue
        step = call.adapter_step
        if step not in expected:
            expected[step] = expected_digest(checkpoints_dir, step)
        want = expected[step]
        if call.adapter_digest is None or want is None:
            out.unverified += 1
            continue
        out.checked += 1
        if call.adapter_digest != want:
            out.refused.add(call.id)
            if len(out.examples) < 3:
                out.examples.append(f"call {call.id} claims policy@{step} ({want[:19]}) but was "
                                    f"served by {call.adapter_digest[:19]}")
    return out
