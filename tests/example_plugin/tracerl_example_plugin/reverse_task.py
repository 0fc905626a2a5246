"""A catalog task from outside tracerl: answer with the word you are given, reversed (no
library needed; the example's echo engine, which answers the last user message reversed,
solves every item)."""

import random
import string
from typing import Any

import tracerl
from tracerl.tasks import Item, Task
from tracerl.tasks.base import lora_config_for


def draw(seed: int, n: int) -> list[Item]:
    rng = random.Random(seed)
    words = ("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(n))
    return [Item(key=w, data={"word": w}) for w in words]


async def rollout(model: Any, item: Item, *, temperature: float = 1.0,
                  step: int | None = None) -> tracerl.Trajectory:
    messages = [{"role": "user", "content": item.data["word"]}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step), messages=messages, temperature=temperature,
        max_tokens=16)
    choice = completion.choices[0]
    success = float((choice.message.content or "").strip() == item.data["word"][::-1])
    return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=success,
                              metrics={"success": success}, metadata={"item": item.key})


TASK = Task(name="example-reverse", summary="answer with the given word reversed",
            source="tracerl-example-plugin", framework="OpenAI client", draw=draw,
            rollout=rollout, model_config=lora_config_for(256))
