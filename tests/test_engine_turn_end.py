"""Generation stops at the chat template's end of an assistant turn, whatever end token the
model's configs name: on a GPU machine whose transformers read SmolLM2's end token as
``<|endoftext|>``, every answer ran on past ``<|im_end|>`` ("69112<|im_end|>\\n"), and the task
scored the right product as a wrong answer."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from tracerl.backend.chat_template import apply_chat_template_override, turn_end_ids
from tracerl.backend.engines.transformers_engine import TransformersEngine
from tracerl.core.config import EngineConfig, LoraConfig
from tracerl.core.engine import EngineSpec


def test_the_turn_end_comes_from_the_template_not_the_eos_token(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token = "<|endoftext|>"
    assert turn_end_ids(tok) == {im_end}
    apply_chat_template_override(tok, "chatml-tools")
    assert turn_end_ids(tok) == {im_end}
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert turn_end_ids(tok) == set()  # no special token closes a turn here


async def test_the_engine_stops_at_im_end_when_the_configs_name_endoftext(smollm2_path, tmp_path):
    model = tmp_path / "smollm2-endoftext"
    model.mkdir()
    for f in smollm2_path.iterdir():
        if f.suffix == ".safetensors":
            (model / f.name).symlink_to(f)
        else:
            shutil.copy(f, model / f.name)
    for name, key, value in [("generation_config.json", "eos_token_id", 0),
                             ("tokenizer_config.json", "eos_token", "<|endoftext|>")]:
        config = json.loads((model / name).read_text())
        config[key] = value
        (model / name).write_text(json.dumps(config))
    engine = TransformersEngine(EngineSpec(model, model.name, EngineConfig(max_model_len=512),
                                           LoraConfig()))
    await engine.start()
    try:
        answer = await engine.chat({
            "model": model.name, "max_tokens": 48, "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    finally:
        await engine.stop()
    (choice,) = answer["choices"]
    assert "<|im_end|>" not in choice["message"]["content"]
    assert choice["finish_reason"] == "stop", choice
