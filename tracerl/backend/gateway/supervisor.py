"""Engine supervision: a failed engine call becomes the caller's answer, and a dead engine is
restarted (once at a time, and only when it is really gone, not merely busy)."""

from __future__ import annotations

import asyncio

from ...core.engine import (
    Engine,
    EngineError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
)


class EngineSupervisor:
    """Restarts engines whose calls failed; one restart task per engine at a time."""

    def __init__(self, restart_grace_s: float = 30.0) -> None:
        self.restart_grace_s = restart_grace_s
        self._restarts: dict[int, asyncio.Task[None]] = {}

    def failure(self, e: BaseException, engine: Engine, timeout_s: float, *,
                starting_stream: bool = False, max_tokens: int | None = None) -> EngineError:
        """The error to answer for an engine call that raised ``e`` (an engine error or the
        call's deadline; ``starting_stream``: before a stream's first chunk; ``max_tokens``:
        the request's, if it set one): a refused request is the caller's (4xx, the engine is
        fine); anything else schedules a restart check (:meth:`schedule_restart`) and answers
        504 (deadline) or 503."""
        if isinstance(e, EngineRequestError):
            return e
        self.schedule_restart(engine)
        if isinstance(e, TimeoutError):  # the call's deadline, or EngineTimeoutError
            if starting_stream:
                return EngineTimeoutError(
                    f"the engine did not start the stream within {timeout_s} s")
            if max_tokens is not None:  # short answers, so the engine was busy with others
                return EngineTimeoutError(
                    f"the engine did not answer within {timeout_s} s though max_tokens was "
                    f"{max_tokens}: it was busy (requests queued ahead of this one, or, on the "
                    "transformers engine, a training step holding the model); raise "
                    "EngineConfig(request_timeout_s=...) or serve from an engine of its own "
                    "(vLLM)")
            return EngineTimeoutError(
                f"the engine did not answer within {timeout_s} s: set max_tokens (without it the "
                "engine may generate up to the context length) or raise "
                "EngineConfig(request_timeout_s=...)")
        return EngineUnavailableError(f"the inference engine is unavailable (a restart check "
                                      f"is scheduled): {e}")

    def schedule_restart(self, engine: Engine) -> None:
        task = self._restarts.get(id(engine))
        if task is not None and not task.done():
            return
        self._restarts[id(engine)] = asyncio.create_task(self._restart_if_dead(engine))

    async def _restart_if_dead(self, engine: Engine) -> None:
        # A busy or briefly stalled engine is not a dead one: restarting a working vLLM costs a
        # cold start (~100 s on a GPU) and fails every call in flight. Restart at once only if
        # its process is gone; otherwise only after restart_grace_s of failed checks.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.restart_grace_s
        while not await engine.healthy():
            if not engine.alive() or loop.time() >= deadline:
                await engine.restart()
                return
            await asyncio.sleep(1.0)
