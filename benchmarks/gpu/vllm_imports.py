"""Which third-party packages does a CUDA build of vLLM import on its serving path? Run here, on
a CPU box, to decide what the GPU kit must carry (vllm_deps.txt, downloaded by fetch_kit.sh)
without spending device time.

Imports the OpenAI server, engine core, GPU worker and model modules of an unpacked vLLM wheel
with its CUDA extensions replaced by empty modules and the platform pinned to an sm90 CUDA
platform, then prints the top-level packages that came from site-packages. Lazily imported
packages (inside functions) are not seen: vLLM's own log on the device names those (it is how
flashinfer's sampler import was found; the kit sets VLLM_USE_FLASHINFER_SAMPLER=0).

    .venv-vllm/bin/python benchmarks/gpu/vllm_imports.py UNPACKED_WHEEL_DIR
"""

from __future__ import annotations

import importlib
import sys
import types

ROOTS = ["vllm.entrypoints.openai.api_server", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
         "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama",
         "vllm.model_executor.models.qwen2", "vllm.v1.attention.backends.flash_attn",
         "vllm.v1.sample.sampler", "vllm.lora.worker_manager",
         "vllm.v1.executor.uniproc_executor", "vllm.entrypoints.openai.chat_completion.serving"]
EXTENSIONS = ["vllm._C_stable_libtorch", "vllm._C", "vllm._qutlass_C",
              "vllm._moe_C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C", "vllm._flashmla_C",
              "vllm._flashmla_extension_C"]
OP_NAMESPACES = {"_C", "_moe_C", "_qutlass_C", "_C_cache_ops", "_C_cuda_utils", "_C_custom_ar",
                 "_vllm_fa2_C", "_vllm_fa3_C", "_flashmla_C"}


def stub_cuda_extensions() -> None:
    """Empty modules for the .so files, and no-op ops/fake registrations in their namespaces."""
    import torch
    import torch._ops

    for name in EXTENSIONS:
        sys.modules[name] = types.ModuleType(name)
    getattr_ = torch._ops._OpNamespace.__getattr__

    def op(self, name):
        try:
            return getattr_(self, name)
        except AttributeError:
            if name.startswith("__") or getattr(self, "name", "") not in OP_NAMESPACES:
                raise
            return lambda *a, **k: True

    torch._ops._OpNamespace.__getattr__ = op
    register_fake = torch.library.register_fake

    def fake(qualname, *args, **kwargs):
        if qualname.split("::")[0] in OP_NAMESPACES:
            return args[0] if args else (lambda f: f)
        return register_fake(qualname, *args, **kwargs)

    torch.library.register_fake = fake


def pin_hopper_platform() -> None:
    import vllm.platforms
    import vllm.platforms.cuda as cuda

    cls = cuda.CudaPlatform
    cls.get_device_capability = classmethod(lambda c, device_id=0: cuda.DeviceCapability(9, 0))
    cls.has_device_capability = classmethod(
        lambda c, cap, device_id=0: 90 >= (cap if isinstance(cap, int) else cap[0] * 10 + cap[1]))
    cls.get_device_name = classmethod(lambda c, device_id=0: "NVIDIA H200")
    vllm.platforms._current_platform = cls()


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    site = [p for p in sys.path if "site-packages" in p]
    stub_cuda_extensions()
    pin_hopper_platform()
    for root in ROOTS:
        try:
            importlib.import_module(root)
        except Exception as e:  # report and go on: the others still show their imports
            print(f"could not import {root}: {type(e).__name__}: {e}", file=sys.stderr)
    packages = {name.split(".")[0] for name, module in list(sys.modules.items())
                if any((getattr(module, "__file__", None) or "").startswith(s) for s in site)}
    print(" ".join(sorted(packages)))


if __name__ == "__main__":
    main()
