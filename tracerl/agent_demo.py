"""``tracerl demo --task agent``: an existing LangGraph tool agent (the catalog's
``tool-products``: reasoning-gym multiplications, a ``multiply`` tool) learning on CPU, with the
held-out table before and after."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from .core.config import TrainConfig
from .tasks.catalog import get_task
from .tasks.evaluation import table
from .tasks.runner import train_task

log = logging.getLogger(__name__)
TASK = "tool-products"


async def agent_demo(steps: int, engine: str, base_path: str, seed: int = 0,
                     group_size: int | None = None, items_per_step: int | None = None,
                     eval_n: int = 24, eval_every: int | None = None) -> dict[str, Any]:
    """Train the tool agent for ``steps`` steps; returns the held-out evaluations by step
    (before training, every ``eval_every`` steps (default: half the steps) and at the end)."""
    import tracerl

    from .demo import quiet_third_party, write_plots

    quiet_third_party()
    task = get_task(TASK)
    backend = tracerl.LocalBackend(path=base_path, engine=engine)
    model = tracerl.TrainableModel(name=f"agent-demo-{int(time.time())}", project="tracerl-demo",
                                   base_model="smollm2", config=task.model_config())
    print(f"tracerl demo --task agent: a LangGraph agent with a multiply tool on reasoning-gym's "
          f"products, SmolLM2-135M ({engine} engine)", file=sys.stderr)
    try:
        await model.register(backend)
        run = await train_task(task, model, steps=steps, seed=seed,
                               eval_every=eval_every or max(steps // 2, 1),
                               eval_n=eval_n, group_size=group_size,
                               items_per_step=items_per_step,
                               config=TrainConfig(learning_rate=task.learning_rate, seed=seed),
                               show_progress=True)
    finally:
        await backend.close()
    model_dir = backend.store(model).root
    plots = write_plots(model_dir)
    print(f"\nheld-out ({eval_n} unseen problems, greedy):\n{table(run.evals)}")
    print(f"\nheld-out success {run.success(0):.3f} -> {run.success(max(run.evals)):.3f} after "
          f"{steps} steps in {run.seconds:.0f} s\nmodel folder: {model_dir}\n"
          f"report:       {plots[0]}\n"
          f"next:         tracerl eval {model_dir} --task {TASK} --steps base,latest")
    return {"evals": {s: run.success(s) for s in run.evals}, "held_out": run.evals,
            "seconds": run.seconds, "model_dir": str(model_dir),
            "train_success": run.train_success}
