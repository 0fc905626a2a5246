"""ART's tic-tac-toe example (OpenPipe ART ``examples/tic_tac_toe``, Apache-2.0) through the ART
API as tracerl ports it (``import tracerl as art``): the example's game utilities and rollout,
with its system prompt, its ``<move>A1</move>`` XML moves, its random opponent and its reward
(win 1, draw 0.5, loss 0, an invalid move ``-1 + log(moves + 1) / log(100)``).

Changed from the example, for a 135M model on CPU and a catalog task: the item's seed decides
the agent's symbol and the opponent's moves (the example draws them from the global RNG);
``max_completion_tokens`` is 16 (the example's 128 serves models that reason first); one
example exchange (an empty board answered ``<move>B2</move>``) follows the system prompt; the
OpenPipe reporting is left out. Success is the example's own verdict, ``check_winner``: the
agent won.
"""

from __future__ import annotations

import math
import random
import xml.etree.ElementTree as ET
from typing import Any, Literal, TypedDict, cast

import openai

import tracerl as art

from .base import TASKS_EXTRA, Item, Task, lora_config_for

Symbol = Literal["x", "o"]


class TicTacToeGame(TypedDict):
    board: list[list[str]]
    agent_symbol: Symbol
    opponent_symbol: Symbol


# --- the example's game utilities (examples/tic_tac_toe/utils.py, game_utils.py) -------------


def generate_game(rng: random.Random, board_length: int = 3) -> TicTacToeGame:
    board = [["_" for _ in range(board_length)] for _ in range(board_length)]
    agent_symbol: Symbol = rng.choice(["x", "o"])
    opponent_symbol: Symbol = "x" if agent_symbol == "o" else "o"
    return {"board": board, "agent_symbol": agent_symbol, "opponent_symbol": opponent_symbol}


def render_board(game: TicTacToeGame) -> str:
    board = game["board"]
    board_length = len(board)
    board_str = "   " + "   ".join([str(i + 1) for i in range(board_length)]) + "\n"
    for i in range(board_length):
        board_str += f"{chr(65 + i)}  {board[i][0]} | {board[i][1]} | {board[i][2]}\n"
    return board_str


def get_opponent_move(game: TicTacToeGame, rng: random.Random) -> tuple[int, int]:
    empty_cells = [(i, j) for i in range(3) for j in range(3) if game["board"][i][j] == "_"]
    return rng.choice(empty_cells)


def unwrap_move(move: str) -> str:
    try:
        return ET.fromstring(move.strip()).text or ""
    except ET.ParseError:
        raise ValueError("Invalid xml") from None


def apply_agent_move(game: TicTacToeGame, move: str) -> None:
    square = unwrap_move(move).strip()
    board_length = len(game["board"])
    try:
        row_index = ord(square[0]) - 65
        col_index = int(square[1]) - 1
    except (IndexError, ValueError):
        raise ValueError("Unable to parse square") from None
    if not (0 <= row_index < board_length and 0 <= col_index < board_length):
        raise ValueError(f"Invalid move, row or column out of bounds: {row_index}, {col_index}")
    if game["board"][row_index][col_index] != "_":
        raise ValueError("Square already occupied")
    game["board"][row_index][col_index] = game["agent_symbol"]


def check_winner(board: list[list[str]]) -> Literal["x", "o", "draw", None]:
    n = len(board)
    lines = [*board, *([board[r][c] for r in range(n)] for c in range(n)),
             [board[i][n - i - 1] for i in range(n)], [board[i][i] for i in range(n)]]
    for line in lines:
        if line.count(line[0]) == n and line[0] != "_":
            return line[0]  # type: ignore[return-value]
    if all(cell != "_" for row in board for cell in row):
        return "draw"
    return None


# --- the example's rollout (examples/tic_tac_toe/rollout.py) ---------------------------------

# one example exchange after the system prompt (not in ART's example): without it the 135M
# model never writes the XML move, so every game scores -1 and a group has nothing to learn
EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "   1   2   3\nA  _ | _ | _\nB  _ | _ | _\nC  _ | _ | _\n"},
    {"role": "assistant", "content": "<move>B2</move>"}]



@art.retry(exceptions=(openai.LengthFinishReasonError,))
async def rollout_game(model: art.Model, seed: int, temperature: float = 1.0,
                       step: int | None = None) -> art.Trajectory:
    rng = random.Random(seed)
    game = generate_game(rng)
    trajectory = art.Trajectory(
        messages_and_choices=[{
            "role": "system",
            "content": "You are a tic-tac-toe player. You are playing against an opponent. "
                       "Always choose the move most likely to lead to an eventual win. Return "
                       "your move as an XML object with a single property 'move', like so: "
                       "<move>A1</move>. Optional moves are 'A1', 'B3', 'C2', etc. You are the "
                       f"{game['agent_symbol']} symbol."}],
        reward=0)
    trajectory.messages_and_choices += EXAMPLE
    move_number = 0
    invalid = 0.0
    if game["agent_symbol"] == "o":
        first = get_opponent_move(game, rng)
        game["board"][first[0]][first[1]] = game["opponent_symbol"]

    while check_winner(game["board"]) is None:
        trajectory.messages_and_choices.append({"role": "user", "content": render_board(game)})
        client = model.openai_client()
        chat_completion = await client.chat.completions.create(
            model=model.get_inference_name(step), messages=cast(Any, trajectory.messages()),
            max_completion_tokens=16, temperature=temperature)
        choice = chat_completion.choices[0]
        content = choice.message.content or ""
        trajectory.messages_and_choices.append(choice)
        try:
            apply_agent_move(game, content)
        except ValueError:
            trajectory.reward = -1 + (math.log(move_number + 1) / math.log(100))
            invalid = 1.0
            break
        move_number += 1
        if check_winner(game["board"]) is not None:
            break
        opponent_move = get_opponent_move(game, rng)
        game["board"][opponent_move[0]][opponent_move[1]] = game["opponent_symbol"]

    winner = check_winner(game["board"])
    if winner == game["agent_symbol"]:
        trajectory.reward = 1
        trajectory.metrics["win"] = 1
    elif winner == game["opponent_symbol"]:
        trajectory.reward = 0
        trajectory.metrics["win"] = 0
    elif winner == "draw":
        trajectory.reward = 0.5
        trajectory.metrics["win"] = 0.5
    trajectory.metrics["num_moves"] = move_number
    trajectory.metrics["invalid_move"] = invalid
    return trajectory


# --- the catalog task ------------------------------------------------------------------------


def draw(seed: int, n: int) -> list[Item]:
    rng = random.Random(seed)
    return [Item(key=f"seed-{s}", data={"seed": s}) for s in rng.sample(range(1_000_000), n)]


async def rollout(model: Any, item: Item, *, temperature: float = 1.0,
                  step: int | None = None) -> art.Trajectory:
    from ..rollout.gather import run_as_rollout

    async def play() -> art.Trajectory:
        trajectory = await rollout_game(model, item.data["seed"], temperature, step)
        turns = sum(1 for m in trajectory.messages_and_choices if not isinstance(m, dict))
        trajectory.metrics.update({"success": float(trajectory.metrics.get("win") == 1),
                                   "turns": float(turns)})
        trajectory.metadata["item"] = item.key
        return trajectory

    return await run_as_rollout(play)


TASK = Task(name="art-tic-tac-toe",
            summary="ART's tic-tac-toe example (XML moves vs a random opponent), ART API",
            source="OpenPipe ART examples/tic_tac_toe (Apache-2.0)",
            framework="ART API (import tracerl as art), OpenAI client",
            draw=draw, rollout=rollout, model_config=lora_config_for(1024),
            requires=("openai",), install=TASKS_EXTRA)
