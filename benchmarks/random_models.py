"""Random-initialised models of real shapes, for benchmarks: values do not change speed.

``random_model_dir("qwen2.5-0.5b", tokenizer_dir)`` saves a bf16 model with that architecture and
the given tokenizer to a temporary folder and returns it. ``vocab="tokenizer"`` sizes the
embedding to the tokenizer instead of the real model's vocabulary, so that every token a sampler
can draw decodes (needed for generation; training does not care).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import torch

SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True),
    # a small llama for CPU benchmarks that run many models (benchmarks/many_adapters.py)
    "tiny-llama": dict(arch="llama", hidden_size=256, intermediate_size=704,
                       num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=49152, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=False),
    "qwen2.5-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, tie_word_embeddings=False),
}


def random_model_dir(shape: str, tokenizer_from: Path,
                     vocab: Literal["model", "tokenizer"] = "model") -> Path:
    """Save a random-initialised bf16 model of ``shape`` with ``tokenizer_from``'s tokenizer."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    params = dict(SHAPES[shape])
    arch = params.pop("arch")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if vocab == "tokenizer":
        params["vocab_size"] = len(tokenizer)
    config_cls, model_cls = ((LlamaConfig, LlamaForCausalLM) if arch == "llama"
                             else (Qwen2Config, Qwen2ForCausalLM))
    config = config_cls(**params, max_position_embeddings=4096,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    out = Path(tempfile.mkdtemp(prefix=f"tracerl-{shape}-"))
    # initialised directly in bf16, on the GPU when there is one: a 7B shape in fp32 on CPU
    # takes minutes and 30 GB; values do not matter for speed or memory
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_cls._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tokenizer.save_pretrained(out)
    return out


def served_random_model(shape: str, tokenizer: str | None) -> str:
    """A random-initialised model of ``shape`` to serve: its vocabulary sized to ``tokenizer``
    (a folder; default: SmolLM2's, prepared from the package)."""
    from tracerl.backend.weights import resolve_base_model

    tokenizer_from = Path(tokenizer) if tokenizer else resolve_base_model("smollm2")
    return str(random_model_dir(shape, tokenizer_from, vocab="tokenizer"))
