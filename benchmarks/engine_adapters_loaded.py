"""Decoding speed of the transformers engine against the number of adapters it has loaded.

An engine in online mode loads a version per candidate, and one serving many models of a base
loads an adapter per model. peft's ``set_adapter`` and ``disable_adapter`` walk every loaded
adapter of every LoRA layer; the engine called one of them before every forward, so every
decoded token paid for every version loaded. Since 2026-12-08 the engine's
:class:`~tracerl.backend.engines.adapter_switch.AdapterSwitch` calls peft only when a forward
needs another adapter, and a retired version is unloaded.

One engine (SmolLM2-135M-Instruct, in-process, greedy), with K = 1, 16, 64 adapters loaded (one
random LoRA on all projections, loaded K times under different names): a wave of
``--calls`` concurrent completions of ``--tokens`` tokens each, served by the base model and by
the newest adapter, first with the engine's switch, then with the peer, peft's setter before
every forward (the engine before the change; for base rows one walk where it had two). Reported
per K and model: completion tokens/s, and the ratio to K = 1 of the same switch (1.00: loaded
adapters cost nothing).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/engine_adapters_loaded.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.adapter_serving import random_lora
from tracerl.backend.engines.adapter_switch import AdapterSwitch
from tracerl.backend.engines.transformers_engine import TransformersEngine
from tracerl.backend.weights import resolve_base_model
from tracerl.core.config import EngineConfig, LoraConfig
from tracerl.core.engine import EngineSpec

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "1, 2, 3, 4, 5, 6,"  # greedy SmolLM2 keeps counting: every call runs to its max_tokens


class PeftEveryForward(AdapterSwitch):
    """The peer: peft's setters before every forward, as the engine did before the switch."""

    def select(self, model: Any, adapters: list[str | None]) -> dict[str, Any]:
        self.forget()
        return super().select(model, adapters)


async def wave(engine: TransformersEngine, model: str, args: argparse.Namespace) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0.0}
    t = time.perf_counter()
    answers = await asyncio.gather(*(engine.completions(dict(body)) for _ in range(args.calls)))
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return tokens / (time.perf_counter() - t)


async def main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = resolve_base_model("smollm2")
    engine = TransformersEngine(EngineSpec(path, path.name, EngineConfig(max_model_len=512),
                                           LoraConfig()))
    await engine.start()
    switches = {"switch": engine._switch, "peft-every-forward": PeftEveryForward()}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        adapter = random_lora(path, Path(tmp) / "lora", ALL_LINEAR, 8)
        loaded = 0
        try:
            for k in args.ks:
                while loaded < k:
                    await engine.load_adapter(f"v{loaded}", adapter)
                    loaded += 1
                for label, switch in switches.items():
                    engine._batcher_impl.access.adapters = switch
                    switch.forget()
                    for model in (engine.spec.served_name, f"v{loaded - 1}"):
                        await wave(engine, model, argparse.Namespace(calls=1, tokens=2))  # warm
                        row = {"adapters": k, "switch": label,
                               "model": "base" if model == engine.spec.served_name else "adapter",
                               "tok_s": await wave(engine, model, args)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            await engine.stop()
    report(rows)


def report(rows: list[dict[str, Any]]) -> None:
    first = {(r["switch"], r["model"]): r["tok_s"] for r in rows if r["adapters"] == rows[0][
        "adapters"]}
    print("\n| adapters loaded | model | switch tok/s | vs 1 loaded | peft every forward tok/s "
          "| vs 1 loaded | switch / peft |\n|---|---|---|---|---|---|---|")
    for k in sorted({r["adapters"] for r in rows}):
        for model in ("base", "adapter"):
            s, p = (next(r["tok_s"] for r in rows if r["adapters"] == k and r["model"] == model
                         and r["switch"] == label) for label in ("switch", "peft-every-forward"))
            print(f"| {k} | {model} | {s:.1f} | {s / first[('switch', model)]:.2f} | {p:.1f} | "
                  f"{p / first[('peft-every-forward', model)]:.2f} | {s / p:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
