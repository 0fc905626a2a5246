"""Shared fixtures. Heavy fixtures (models, engines, servers) are session-scoped."""

from __future__ import annotations

import os

os.environ.setdefault("TRACERL_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no internet here: no fetch retries

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str,
                timeout_s: float = 30.0, every_s: float = 0.01) -> None:
    """Poll ``condition`` (state another thread or process changes; a coroutine function is
    awaited) every ``every_s`` until it holds; fail after ``timeout_s`` naming ``what`` was
    awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(every_s)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tracerl.backend.weights import resolve_base_model

    return resolve_base_model("smollm2")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def make_random_lora(base_path: Path, out: Path, seed: int = 1, r: int = 8) -> Path:
    """A peft adapter with random B matrices, so that it visibly changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
        LoraConfig(r=r, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
async def tf_backend(tmp_path_factory):
    import tracerl

    backend = tracerl.LocalBackend(
        path=tmp_path_factory.mktemp("tf-backend"), engine="transformers"
    )
    model = tracerl.TrainableModel(
        name="gw", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)
    yield backend, model
    await backend.close()


@pytest.fixture(scope="session")
async def agent_model(tf_backend):
    """A second model on the session backend, served with a tool-calling chat template."""
    import tracerl

    backend, _ = tf_backend
    model = tracerl.TrainableModel(
        name="agent",
        project="tests",
        base_model="smollm2",
        config=tracerl.ModelConfig(
            engine=tracerl.EngineConfig(
                max_model_len=2048, chat_template="chatml-tools", tool_call_parser="hermes"
            )
        ),
    )
    await model.register(backend)
    return model


async def check_streamed_call_is_recorded(model, messages, max_tokens: int) -> None:
    """Stream a chat completion through the gateway and check its record matches the stream."""
    import tracerl

    with tracerl.rollout_scope() as ro:
        stream = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=max_tokens, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    (call,) = await model.fetch_calls(ro.rollout_id)
    assert call.streamed and call.completions[0].text == text
    assert len(call.completions[0].token_ids) == len(call.completions[0].logprobs) >= 1
    assert call.prompt_token_ids == call.response["prompt_token_ids"] and call.prompt_token_ids


def render_ids(tokenizer, messages, tools=None) -> list[int]:
    """A fresh chat-template tokenization of ``messages`` with the generation prompt: the tests'
    own oracle, written independently of tracerl.backend.chat_template on purpose."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="session")
def faults_server(tmp_path_factory):
    """One real ``tracerl serve`` process for the faults stage, with short head and body
    deadlines (2 s) so that slow-client tests finish quickly."""
    from tests.remote_server import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("faults"),
                        env={"TRACERL_HEAD_TIMEOUT_S": "2", "TRACERL_BODY_TIMEOUT_S": "2"}).start()
    yield srv
    srv.stop()
