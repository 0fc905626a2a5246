"""The heap freeze: objects alive after start-up kept out of the cyclic garbage collector's
walks, which were most of the gateway's CPU."""

from __future__ import annotations

import gc
import logging

from ..core import settings

log = logging.getLogger(__name__)


def freeze_long_lived_objects() -> bool:
    """Move every object alive now (modules, the model, the engine's state) out of the cyclic
    garbage collector's sight (:func:`gc.freeze`), as vLLM's server does after start-up.

    Each gateway call decodes an engine reply of ~1,000 containers; the collections those
    allocations trigger walked the whole heap again and again, and were most of the gateway's CPU
    (``benchmarks/rollout_throughput.py`` over ``benchmarks/instant_vllm``: 2x calls per second
    once frozen). Each call first unfreezes and collects, so what an earlier freeze held and has
    since become garbage (a dropped engine, say) is reclaimed then. ``TRACERL_GC_FREEZE=0``
    leaves the collector as it is. Returns whether it froze (and so collected).
    """
    if not settings.TRACERL_GC_FREEZE.get():
        return False
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.debug("froze %d long-lived objects", gc.get_freeze_count())
    return True
