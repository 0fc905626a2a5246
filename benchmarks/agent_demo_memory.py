"""The agent demo's peak memory at a micro-batch size: `tracerl.agent_demo.agent_demo` in the
slow check's configuration (6 steps, 3 problems x 6 rollouts a step, 12 held-out problems) with
``TrainConfig(micro_batch_tokens=N)`` (the default's other memory settings unchanged); prints
the process's peak RSS, its seconds and the held-out table. Run two sizes at once to compare
them under the same load::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_demo_memory.py --micro-batch-tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import time
from typing import Any

from tracerl.core.config import TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-tokens", type=int,
                        default=TrainConfig().micro_batch_tokens)
    args = parser.parse_args()
    import tracerl.agent_demo as demo

    original = demo.TrainConfig

    def config(**kwargs: Any) -> TrainConfig:
        return original(**kwargs, micro_batch_tokens=args.micro_batch_tokens)

    demo.TrainConfig = config  # type: ignore[assignment,misc]
    started = time.time()
    result = asyncio.run(demo.agent_demo(steps=6, engine="transformers",
                                         base_path=tempfile.mkdtemp(), group_size=6,
                                         items_per_step=3, eval_n=12))
    keep = ("reward", "metrics/success", "metrics/tool_call_valid")
    print(json.dumps({
        "micro_batch_tokens": args.micro_batch_tokens,
        "seconds": round(time.time() - started),
        "maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "held_out": {step: {k: round(v, 2) for k, v in m.items() if k in keep}
                     for step, m in result["held_out"].items()}}))


if __name__ == "__main__":
    main()
