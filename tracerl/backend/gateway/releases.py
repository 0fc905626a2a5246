"""The release steps a served model takes, on the gateway's loop: put under release control
(:func:`attach`), a candidate loaded beside the incumbent (:func:`load_candidate`), the
incumbent moved (:func:`move_incumbent`). Each writes the model's release log
(:mod:`tracerl.core.release_log`) before it routes (:class:`.served.ReleaseRouting`), so a
restart (even after kill -9) serves the last committed incumbent; what to release and when is
release control's (:mod:`tracerl.backend.online.release`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from ...core.errors import ConfigError
from ...core.release_log import ReleaseLog, ReleaseState
from .served import ReleaseRouting, ServedModel

log = logging.getLogger(__name__)


def checkpoint(route: ServedModel, step: int) -> Path:
    """The folder of ``route``'s checkpoint ``step`` (0: the base model); a ConfigError naming
    the checkpoints there are when it has none of that step."""
    path = route.store.checkpoint_dir(step)
    if step > 0 and not path.is_dir():
        raise ConfigError(f"{route.key} has no checkpoint {step} to serve "
                          f"(checkpoints: {route.store.checkpoint_steps()})")
    return path


async def attach(route: ServedModel, *, missing_ok: bool = False) -> ReleaseState:
    """Put ``route`` under release control: recover its release log (a ``begin`` without
    ``commit`` is aborted), adopt the version it serves when the log is new, load the incumbent
    (and a canary's candidate) and route to them. A candidate whose checkpoint is gone is
    rejected (recorded). An incumbent whose checkpoint is gone leaves ``route`` unavailable
    (:attr:`.served.ServedModel.unavailable`: its calls are 503s saying why, until a promote
    or rollback names a checkpoint that exists): a ConfigError saying so, unless
    ``missing_ok``."""
    releases = ReleaseLog(route.store.root)
    state = await asyncio.to_thread(releases.recover)
    if state.incumbent is None:
        step = route.step
        await asyncio.to_thread(releases.begin, "adopt", step, None)
        await asyncio.to_thread(releases.commit, "adopt", step)
        state = await asyncio.to_thread(releases.state)
    incumbent = state.incumbent
    assert incumbent is not None
    try:
        path = checkpoint(route, incumbent)
    except ConfigError as e:
        route.unavailable = (f"{e}: the checkpoint of its release incumbent is gone; "
                             f"`tracerl promote {route.key} N` serves checkpoint N")
        log.error("%s is not served: %s", route.key, route.unavailable)
        if missing_ok:
            return state
        raise ConfigError(route.unavailable) from None
    if state.candidate is not None and not route.store.checkpoint_dir(state.candidate).is_dir():
        await asyncio.to_thread(releases.append, "rejected", step=state.candidate,
                                reason="its checkpoint is gone")
        log.warning("%s: candidate %d rejected: its checkpoint is gone", route.key,
                    state.candidate)
        state = await asyncio.to_thread(releases.state)
    steps = {incumbent, *([state.candidate] if state.candidate is not None else [])}
    # loaded first, routed after: a call routed to NAME@N finds N loaded
    await route.load_version(incumbent, path, keep=steps)
    if state.candidate is not None:
        await route.load_version(state.candidate, checkpoint(route, state.candidate), keep=steps)
    route.release = ReleaseRouting(incumbent, state.candidate,
                                   state.share if state.stage == "canary" else 0.0)
    route.unavailable = None
    return state


async def load_candidate(route: ServedModel, step: int) -> int:
    """Load checkpoint ``step`` beside ``route``'s incumbent as ``NAME@step`` (attached first
    if it is not under release control yet); no plain-name call goes to it yet. Returns the
    incumbent."""
    if route.release is None:
        await attach(route)
    assert route.release is not None
    incumbent = route.release.incumbent
    await route.load_version(step, checkpoint(route, step))
    return incumbent


async def move_incumbent(route: ServedModel, action: str, step: int,
                         **evidence: Any) -> ReleaseState:
    """Promote or roll back ``route`` to ``step``: ``begin`` record, the version loaded,
    ``commit`` record, routed; the old incumbent is unloaded once its calls in flight have
    finished."""
    path = checkpoint(route, step)
    if route.release is None:  # (an incumbent whose checkpoint is gone: this move replaces it)
        await attach(route, missing_ok=True)
    releases = ReleaseLog(route.store.root)
    incumbent = (await asyncio.to_thread(releases.state)).incumbent
    await asyncio.to_thread(releases.begin, action, step, incumbent, **evidence)
    await route.load_version(step, path)
    await asyncio.to_thread(releases.commit, action, step)
    route.release = ReleaseRouting(step)  # new calls: the new incumbent
    route.unavailable = None
    await route.load_version(step, path)  # retires the old one (after its calls in flight)
    log.info("%s: %s to version %d", route.key, action, step)
    return await asyncio.to_thread(releases.state)
