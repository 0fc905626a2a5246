"""ART's examples shrunk to SmolLM2 on CPU: 2048 (examples/2048), tic-tac-toe
(examples/tic_tac_toe) and temporal clue (examples/temporal_clue). The games are small
re-implementations; the ART side (multi-turn ``messages_and_choices``, ``@art.retry``,
metrics, ``gather_trajectory_groups``, ``backend.train``, ``model.log``) is as the examples
use it. Each game is cut to one or two turns with ``max_tokens`` 8, and the first attempt of a
group gets a small bonus so that a group of two never ties."""

import random
import re

import openai

import tracerl as art

MOVES = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


# --- 2048 -----------------------------------------------------------------------------------


def new_board(rng: random.Random) -> list[list[int]]:
    board = [[0] * 4 for _ in range(4)]
    for _ in range(2):
        r, c = rng.choice([(r, c) for r in range(4) for c in range(4) if not board[r][c]])
        board[r][c] = 2
    return board


def slide(row: list[int]) -> list[int]:
    cells = [v for v in row if v]
    merged: list[int] = []
    while cells:
        if len(cells) > 1 and cells[0] == cells[1]:
            merged.append(cells[0] * 2)
            cells = cells[2:]
        else:
            merged.append(cells.pop(0))
    return merged + [0] * (4 - len(merged))


def apply_move(board: list[list[int]], text: str) -> list[list[int]]:
    found = re.search(r"<move>\s*(left|right|up|down)\s*</move>", text) or re.search(
        r"\b(left|right|up|down)\b", text.lower())
    if not found:
        raise ValueError(f"no move in {text!r}")
    move = found.group(1)
    rows = [list(r) for r in board]
    if move in ("up", "down"):
        rows = [list(col) for col in zip(*rows, strict=True)]
    rows = [slide(r) if move in ("left", "up") else slide(r[::-1])[::-1] for r in rows]
    if move in ("up", "down"):
        rows = [list(col) for col in zip(*rows, strict=True)]
    return rows


@art.retry(exceptions=(openai.APIConnectionError,))
async def rollout_2048(model: art.Model, step: int, attempt: int) -> art.Trajectory:
    board = new_board(random.Random(step))
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": "You play 2048. Answer with "
                               "<move>left</move>, right, up or down."}],
        metadata={"step": step}, reward=0.0)
    for move_number in range(2):
        trajectory.messages_and_choices.append(
            {"role": "user", "content": "\n".join(" ".join(map(str, r)) for r in board)})
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=trajectory.messages(), max_tokens=8)
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        try:
            board = apply_move(board, choice.message.content or "")
        except ValueError:
            trajectory.reward = -1.0
            break
        trajectory.metrics["num_moves"] = move_number + 1
    trajectory.metrics["max_value"] = max(max(r) for r in board)
    trajectory.reward += 0.1 * (attempt == 0)
    return trajectory


# --- tic-tac-toe ----------------------------------------------------------------------------


async def rollout_tic_tac_toe(model: art.Model, step: int, attempt: int) -> art.Trajectory:
    board = [["_"] * 3 for _ in range(3)]
    board[1][1] = "O"  # the opponent opened in the centre
    trajectory = art.Trajectory(messages_and_choices=[
        {"role": "system", "content": "You are X in tic-tac-toe. Reply with a free cell as "
                                      "<move>A1</move> (rows A-C, columns 1-3)."},
        {"role": "user", "content": "\n".join(" ".join(r) for r in board)}], reward=0.0)
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=trajectory.messages(), max_tokens=8)
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    found = re.search(r"([ABC])\s*([123])", (choice.message.content or "").upper())
    valid = bool(found) and board["ABC".index(found.group(1))][int(found.group(2)) - 1] == "_"
    trajectory.metrics["invalid_move"] = float(not valid)
    trajectory.reward = (0.5 if valid else -1.0) + 0.1 * (attempt == 0)
    return trajectory


# --- temporal clue --------------------------------------------------------------------------

PUZZLE = ("Ann was in the library at 9, Bob in the garden at 9 and 10, Ann in the garden at 10. "
          "The vase in the garden broke at 9. Who broke it? Answer with one name.")


async def rollout_temporal_clue(model: art.Model, step: int, attempt: int) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": PUZZLE}]
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=messages, max_tokens=8)
    content = completion.choices[0].message.content or ""
    trajectory = art.Trajectory(messages_and_choices=[*messages, completion.choices[0]],
                                reward=float("bob" in content.lower()))
    trajectory.metrics["accuracy"] = trajectory.reward
    trajectory.reward += 0.1 * (attempt == 0)
    return trajectory


GAMES = {"2048": rollout_2048, "tic-tac-toe": rollout_tic_tac_toe,
         "temporal-clue": rollout_temporal_clue}


async def main(backend, game: str, base_model="smollm2"):
    rollout = GAMES[game]
    model = art.TrainableModel(name=game, project="art-examples", base_model=base_model)
    await model.register(backend)
    step = await model.get_step()
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, step, attempt) for attempt in range(2))
         for _ in range(1)),
        pbar_desc="gather", max_exceptions=1)
    result = await backend.train(model, groups, learning_rate=1e-5)
    await model.log(groups, metrics=result.metrics, step=result.step, split="train")
    return model, groups, result
