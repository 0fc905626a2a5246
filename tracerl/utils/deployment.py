"""ART's ``art.utils.deployment``, for a LoRA trained here: export a checkpoint for
``vllm serve --lora-modules`` (any vLLM server can then serve it beside its base model).

ART's cloud targets (Together, W&B inference) upload to a provider's account; tracerl has no
account to upload to, so :func:`deploy_model` names the export instead of pretending to deploy.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backend.engines.vllm_engine import _lora_rank_slot
from ..backend.local import LocalBackend
from ..backend.weights import resolve_base_model
from ..core.errors import ConfigError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class LoRAExport:
    """An exported adapter: its folder, the base model it applies to, and how to serve it."""

    name: str
    adapter_dir: Path
    base_model: Path
    rank: int

    @property
    def lora_module(self) -> str:
        """The ``--lora-modules`` value: ``name=path``."""
        return f"{self.name}={self.adapter_dir}"

    def vllm_serve_args(self) -> list[str]:
        """The ``vllm serve`` command line that serves the base model with this adapter
        (requests name the adapter as ``model=<name>``)."""
        return ["vllm", "serve", str(self.base_model), "--enable-lora",
                "--lora-modules", self.lora_module, "--max-lora-rank",
                str(_lora_rank_slot(self.rank))]

    def vllm_serve_command(self) -> str:
        return shlex.join(self.vllm_serve_args())


async def export_lora(model: Any, backend: LocalBackend, output_dir: str | Path, *,
                      step: int | None = None, name: str | None = None) -> LoRAExport:
    """Copy the adapter of ``model``'s checkpoint ``step`` (default: the newest) to
    ``output_dir`` (only what vLLM loads: its config and weights, no optimizer state). Its
    served ``name`` defaults to the gateway's for that step, ``project/name@step``
    (``model.get_inference_name(step)``): unique across projects, and the same in code."""
    store = backend.store(model)
    step = store.latest_step() if step is None else step
    source = store.checkpoint_dir(step)
    if step <= 0 or not source.is_dir():
        raise ConfigError(f"{store.name} has no checkpoint {step} to export "
                          f"(checkpoints: {store.checkpoint_steps()})")
    out = Path(output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    for file in ADAPTER_FILES:
        shutil.copy2(source / file, out / file)
    rank = int(json.loads((out / "adapter_config.json").read_text())["r"])
    base = resolve_base_model(model.base_model)
    return LoRAExport(name=name or f"{store.project}/{store.name}@{step}", adapter_dir=out,
                      base_model=base, rank=rank)


async def deploy_model(*args: Any, **kwargs: Any) -> None:
    """ART's ``deploy_model`` uploads to a cloud provider's account; tracerl has none."""
    raise ConfigError("tracerl does not upload adapters to a provider; export one with "
                      "`await tracerl.utils.deployment.export_lora(model, backend, out_dir)` "
                      "and serve it with its `vllm_serve_command()`")


__all__ = ["LoRAExport", "deploy_model", "export_lora"]
