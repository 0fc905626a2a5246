"""ART's ``art.utils.deployment``, for a LoRA trained here: export a checkpoint for
``vllm serve --lora-modules`` (any vLLM server can then serve it beside its base model).

ART's cloud targets (Together, W&B inference) upload to a provider's account; tracerl has no
account to upload to, so ART's names import (``TogetherDeploymentConfig``,
``WandbDeploymentConfig``, ``DeploymentResult``) and :func:`deploy_model` fails when called,
naming the export and ``vllm serve`` instead of pretending to deploy.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from ..backend.engines.vllm_engine import _lora_rank_slot
from ..backend.local import LocalBackend
from ..backend.weights import resolve_base_model
from ..core.errors import ConfigError
from ..core.model_name import ModelName

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
    default_name = str(ModelName.of(f"{store.project}/{store.name}", step))
    return LoRAExport(name=name or default_name, adapter_dir=out, base_model=base, rank=rank)


Provider = Literal["together", "wandb"]


class DeploymentConfig(BaseModel):
    """ART's base of a provider's deployment settings."""


class TogetherDeploymentConfig(DeploymentConfig):
    """ART's Together settings (accepted so that ART code imports; :func:`deploy_model` fails)."""

    s3_bucket: str | None = None
    prefix: str | None = None
    wait_for_completion: bool = True


class WandbDeploymentConfig(DeploymentConfig):
    """ART's W&B inference settings (accepted so that ART code imports)."""


class DeploymentResult(BaseModel):
    """ART's answer of a deployment: the name to send as ``model``."""

    inference_model_name: str


async def deploy_model(*args: Any, **kwargs: Any) -> DeploymentResult:
    """ART's ``deploy_model`` uploads to a cloud provider's account; tracerl has none, so this
    fails with what to do instead: export the adapter, serve it with ``vllm serve``."""
    provider = kwargs.get("provider", args[3] if len(args) > 3 else None)
    target = f" to {provider}" if isinstance(provider, str) else ""
    raise ConfigError(
        f"tracerl does not deploy adapters{target}: export the checkpoint with "
        "`export = await tracerl.utils.deployment.export_lora(model, backend, out_dir)` and "
        "serve it with `vllm serve BASE_MODEL --enable-lora --lora-modules NAME=out_dir` "
        "(the whole command line: `export.vllm_serve_command()`)")


__all__ = ["DeploymentConfig", "DeploymentResult", "LoRAExport", "Provider",
           "TogetherDeploymentConfig", "WandbDeploymentConfig", "deploy_model", "export_lora"]
