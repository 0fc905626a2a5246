"""A multi-turn game: textarena's ``GuessTheNumber-v0`` (textarena 0.7.4, MIT) played by an
OpenAI Agents SDK agent (``Agent`` + ``Runner``, served by :class:`TracerlModelProvider`).

The game draws a number from 1 to 20 (from the item's seed) and gives the player ten guesses,
answering "higher" or "lower"; a guess is a number in square brackets (textarena's
``ActionFormattingWrapper`` adds the brackets to a bare answer). A repeated or out-of-range
guess is an invalid move: the first is warned about, the second ends the game. The agent is
played the way textarena's own agents are (``action = agent(observation)``, the observation
being the whole game so far, from its default ``LLMObservationWrapper``): one ``Runner.run``
per turn, its input two example turns (the game's opening, answered ``[10]``, then ``[15]``
after "higher") and the observation. Success is the game's outcome (textarena's reward 1: the
number was found); the reward is textarena's own reward (1 on a win, else how close the last
guess came).

Items are game seeds (``seed-N``); the split is by the hash of that key. The seed decides the
number only (20 of them), so train and held-out games share numbers, but the agent never sees
the seed: what transfers is how it searches.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from ..core.trajectory import Trajectory
from .base import TASKS_EXTRA, Item, Task, lora_config_for

GAME = "GuessTheNumber-v0"
INSTRUCTIONS = ("You play a guessing game. Answer with one new guess in square brackets, "
                "like [7], and nothing else.")
GUESS = re.compile(r"\[(\d+)\]")
OPENING = ("[GAME] You are Player 0. You are playing Guess The Number.\nYou have to guess the "
           "number between 1 and 20 within 10 turns.\nAs you enter your guess, the game will "
           "provide you with hints such as 'higher' or 'lower'.\nYou may provide your response "
           "in any manner. Only the number that is wrapped in square brackets will be considered "
           "as your guess. For example, [5].\nAs you play, the history of your guesses will be "
           "appended below. Use the information to complete the game before you run out of "
           "guesses.\nEnter your guess.")
# two turns of an example game, before each observation: the 135M model otherwise continues
# the game's transcript ("[GAME] You are Player 0...") instead of guessing
EXAMPLES = [{"role": "user", "content": OPENING}, {"role": "assistant", "content": "[10]"},
            {"role": "user", "content": f"{OPENING}\n[Player] [10]\n[GAME] The target "
                                        "number is higher."},
            {"role": "assistant", "content": "[15]"}]


def draw(seed: int, n: int) -> list[Item]:
    rng = random.Random(seed)
    return [Item(key=f"seed-{s}", data={"seed": s}) for s in rng.sample(range(1_000_000), n)]


def new_game(seed: int) -> Any:
    """The textarena game of ``seed``, reset (the global RNG is left as it was: textarena's
    ``reset`` reseeds Python's ``random`` module)."""
    import textarena as ta

    env = ta.make(GAME)
    saved = random.getstate()
    try:
        env.reset(num_players=1, seed=seed)
    finally:
        random.setstate(saved)
    return env


def game_metrics(actions: list[str], game_info: dict[str, Any]) -> dict[str, float]:
    """Turns played, the share of moves the game took as valid guesses (a bracketed number in
    range, not guessed before), and whether the game ended on an invalid move."""
    seen: set[int] = set()
    valid = 0
    for action in actions:
        found = GUESS.search(action if "[" in action or "]" in action else f"[{action}]")
        if found and 1 <= int(found.group(1)) <= 20 and int(found.group(1)) not in seen:
            seen.add(int(found.group(1)))
            valid += 1
    return {"turns": float(len(actions)),
            "move_valid": valid / len(actions) if actions else 0.0,
            "invalid_end": float(bool(game_info.get("invalid_move")))}


async def rollout(model: Any, item: Item, *, temperature: float = 1.0,
                  step: int | None = None) -> Trajectory:
    from agents import Agent, ModelSettings, RunConfig, Runner

    from ..integrations.openai_agents import TracerlModelProvider
    from ..rollout.gather import run_as_rollout

    agent = Agent(name="player", instructions=INSTRUCTIONS,
                  model=model.get_inference_name(step),
                  model_settings=ModelSettings(temperature=temperature, max_tokens=8))
    run_config = RunConfig(model_provider=TracerlModelProvider(model),
                           workflow_name="guess-the-number")

    async def play() -> Trajectory:
        started = time.time()
        env = new_game(item.data["seed"])
        actions: list[str] = []
        done = False
        while not done:
            _, observation = env.get_observation()
            turn = [*EXAMPLES, {"role": "user", "content": observation.strip()}]
            result = await Runner.run(agent, turn, run_config=run_config,  # type: ignore[arg-type]
                                      max_turns=1)
            action = str(result.final_output or "").strip()
            actions.append(action)
            done, _ = env.step(action=action)
        rewards, game_info = env.close()
        reward = float(rewards[0])
        info = game_info.get(0, {})
        metrics = {"success": float(reward == 1.0), **game_metrics(actions, info)}
        return Trajectory(reward=reward, metrics=metrics, start_time=started,
                          metadata={"item": item.key, "reason": str(info.get("reason"))})

    return await run_as_rollout(play)


TASK = Task(name="game-guess-number",
            summary="textarena GuessTheNumber-v0 (1-20, ten guesses), OpenAI Agents SDK agent",
            source="textarena 0.7.4 `GuessTheNumber-v0` (MIT)",
            framework="OpenAI Agents SDK Agent + Runner",
            draw=draw, rollout=rollout, model_config=lora_config_for(1024),
            requires=("textarena", "agents"), install=TASKS_EXTRA)
