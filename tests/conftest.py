"""Shared fixtures. Heavy fixtures (models, engines, servers) are session-scoped."""

from __future__ import annotations

import os

os.environ.setdefault("TRACERL_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no internet here: no fetch retries

import asyncio
import inspect
import logging
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



def _vllm_available() -> bool:
    from tracerl.backend.engines.vllm_engine import VLLMEngine

    return VLLMEngine.available()


# the marks of a module of tests against real vLLM servers
VLLM_TESTS = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not _vllm_available(),
        reason="vLLM not installed; `make test` installs it and sets TRACERL_VLLM_PYTHON",
    ),
]

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


def lora_trainer(base_path: Path):
    """A one-process Trainer of ``base_path`` with a fresh r=4 LoRA whose B matrices are made
    non-zero (seed 0): the adapter changes the logits, and A gets gradients too."""
    import torch

    from tracerl.backend.training.trainer import Trainer
    from tracerl.core.config import LoraConfig

    torch.manual_seed(0)
    tr = Trainer(base_path, LoraConfig(r=4, alpha=8), device="cpu")
    with torch.no_grad():
        for name, p in tr.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return tr


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


class _Records(logging.Handler):
    """Log records of ``tracerl`` loggers, kept for assertions across a session fixture."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, logger: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.name.startswith(logger)]


async def _chat(model, messages, max_tokens: int, temperature: float = 1.0):
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=max_tokens,
        temperature=temperature)
    return response.choices[0]


@pytest.fixture(scope="session")
async def unhealthy_step(tf_backend, agent_model):
    """One training step of a model of its own with every step-health problem, each made for
    real: a group with equal rewards, an agent that rewrites history between calls, a call made
    outside any rollout, completions cut at max_tokens, trajectories without token records
    (re-rendered), and a group of calls another model served (agent_model: not trained on by
    this one). The watchdog's train threshold is 0, so the step's wait is
    reported. Returns (metrics, warnings logged, watchdog messages, model folder)."""
    import tracerl

    backend, _ = tf_backend
    model = tracerl.TrainableModel(  # its own model: the session's `gw` stays at step 0
        name="unhealthy", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)
    system = {"role": "system", "content": "Answer briefly."}

    async def equal_rewards(i: int) -> tracerl.Trajectory:
        messages = [system, {"role": "user", "content": f"Count to {i + 5}."}]
        return tracerl.Trajectory(messages_and_choices=[*messages, await _chat(model, messages, 4)],
                                  reward=0.5)

    async def rewrites_history(i: int) -> tracerl.Trajectory:
        first = [system, {"role": "user", "content": "Name a fruit."}]
        choice = await _chat(model, first, 4)
        edited = [{"role": "system", "content": "Answer in one word."}, first[1],
                  choice.message.model_dump(exclude_none=True),
                  {"role": "user", "content": "Another one."}]
        return tracerl.Trajectory(messages_and_choices=[*edited, await _chat(model, edited, 4)],
                                  reward=float(i))

    async def other_template(i: int) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": "Name a colour."}]
        choice = await _chat(agent_model, messages, 4)
        return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=float(i))

    def rendered(i: int) -> tracerl.Trajectory:  # made without the gateway: no token records
        return tracerl.Trajectory(messages_and_choices=[
            {"role": "user", "content": "Say yes."},
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                                                              "content": "yes" * (i + 1)}}],
            reward=float(i))

    await _chat(model, [{"role": "user", "content": "Unattributed hello."}], 2)
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(f(i) for i in range(2))
         for f in (equal_rewards, rewrites_history, other_template)], show_progress=False)
    groups.append(tracerl.TrajectoryGroup([rendered(0), rendered(1)]))
    handler = _Records()
    logging.getLogger("tracerl").addHandler(handler)
    saved = {k: os.environ.get(k) for k in ("TRACERL_WATCHDOG_TRAIN_S",
                                            "TRACERL_WATCHDOG_INTERVAL_S")}
    os.environ.update(TRACERL_WATCHDOG_TRAIN_S="0", TRACERL_WATCHDOG_INTERVAL_S="0.2")
    try:
        metrics = await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-5))
    finally:
        logging.getLogger("tracerl").removeHandler(handler)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return (metrics, handler.messages("tracerl.backend.training.health"),
            handler.messages("tracerl.watchdog"), backend.store(model).root)
