"""``tracerl eval``: a trained model's steps (and the base) on a task's held-out split, side
by side, each logged as ``val`` at its step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, TooManyExceptionsError
from ..core.model_spec import ModelSpec
from ..core.trajectory import RolloutException
from .catalog import get_task
from .runner import evaluate

COLUMNS = ("metrics/success", "reward", "metrics/tool_call_valid", "metrics/turns",
           "metrics/completion_tokens", "metrics/seconds")


def parse_steps(text: str, latest: int) -> list[int]:
    """``base,4,latest`` -> ``[0, 4, latest]`` (``base`` is 0; order kept, repeats dropped)."""
    steps: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "base":
            value = 0
        elif part == "latest":
            value = latest
        elif part.isdigit():
            value = int(part)
        else:
            raise ConfigError(f"--steps: {part!r} is not a step number, 'base' or 'latest'")
        if value not in steps:
            steps.append(value)
    if not steps:
        raise ConfigError("--steps names no step")
    return steps


def read_spec(model_dir: Path) -> tuple[Path, ModelSpec]:
    """The backend path and the model's definition of ``BASE/PROJECT/models/NAME``."""
    definition = model_dir / "model.json"
    if not definition.is_file():
        raise ConfigError(f"{model_dir} is not a model folder (no model.json)")
    return model_dir.parent.parent.parent, ModelSpec.read(definition)


def table(results: dict[int, dict[str, float]]) -> str:
    """The evaluations as a text table: one row per metric, one column per step."""
    steps = sorted(results)
    head = f"{'':28}" + "".join(f"{'base' if s == 0 else f'step {s}':>12}" for s in steps)
    rows = [head]
    for col in COLUMNS:
        if any(col in results[s] for s in steps):
            rows.append(f"{col.removeprefix('metrics/'):28}" + "".join(
                f"{results[s][col]:12.3f}" if col in results[s] else f"{'-':>12}"
                for s in steps))
    return "\n".join(rows)


async def eval_steps(model_dir: Path, task_name: str, steps: str, *, n: int, samples: int,
                     temperature: float, seed: int, engine: str, log: bool,
                     allow_failures: bool = False) -> dict[int, dict[str, float]]:
    """Evaluate each of ``steps`` of the model in ``model_dir`` on ``task_name``; raises
    :class:`TooManyExceptionsError` naming the first failed rollout unless ``allow_failures``
    (then failures only count, as ``rollout_errors``)."""
    from ..backend.local import LocalBackend
    from ..rollout.model import TrainableModel

    task = get_task(task_name)
    base_path, spec = read_spec(model_dir)
    if not spec.base_model:
        raise ConfigError(f"{model_dir}: the model has no base_model to serve")
    backend = LocalBackend(path=base_path, engine=None if engine == "auto" else engine)
    model: Any = TrainableModel(name=spec.name, project=spec.project,
                                        base_model=spec.base_model, config=spec.config)
    results: dict[int, dict[str, float]] = {}
    try:
        await model.register(backend)
        latest = await model.get_step()
        for step in parse_steps(steps, latest):
            if step > latest:
                raise ConfigError(f"--steps: step {step} is beyond the model's newest ({latest})")
            if step != 0:
                await backend.serve_step(model, step)
            failures: list[RolloutException] = []
            results[step] = await evaluate(
                task, model, n=n, samples=samples, temperature=temperature, seed=seed,
                step=step, log_to_model=log, failures=failures, desc=f"{task.name} held-out, "
                + ("base" if step == 0 else f"step {step}"))
            if failures and not allow_failures:
                first = failures[0]
                raise TooManyExceptionsError(
                    f"{len(failures)} of {n * samples} rollouts of "
                    f"{'the base' if step == 0 else f'step {step}'} failed; the first: "
                    f"{first.type}: {first.message[:500]} (--allow-failures: report them as "
                    "rollout_errors and exit 0)")
    finally:
        await backend.close()
    return results
