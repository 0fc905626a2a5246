"""Training rows from token records: merging, mismatches, fallback rendering, advantages."""

import math

import pytest

import tracerl
from tests.conftest import render_ids
from tracerl.backend.training.advantages import group_advantages
from tracerl.backend.training.rows import Row, RowStats, rows_from_calls, rows_from_messages
from tracerl.backend.training.update import micro_batches


def call(prompt, completion, t=0.0, temperature=1.0, logprobs=None, n=1):
    comps = [
        tracerl.CompletionRecord(
            index=i, token_ids=completion, logprobs=logprobs or [-0.5] * len(completion)
        )
        for i in range(n)
    ]
    return tracerl.LLMCall(id=f"c{t}", prompt_token_ids=prompt, completions=comps, created_at=t,
                           temperature=temperature)


@pytest.fixture
def merged():
    """Two calls where the second prompt continues the first call's tokens exactly (plus a user
    turn 9, 9), listed out of time order."""
    c1 = call([1, 2, 3], [4, 5], t=1, temperature=0.5)
    c2 = call([1, 2, 3, 4, 5, 9, 9], [6], t=2, logprobs=[-0.1])
    stats = RowStats()
    rows = rows_from_calls([c2, c1], stats)  # ordered by time, not by list position
    return rows, stats


def test_an_exact_prefix_continuation_merges_into_one_row(merged):
    rows, stats = merged
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5, 9, 9, 6]]
    assert (stats.merged_calls, stats.prefix_mismatches) == (1, 0)


def test_a_merged_row_trains_only_the_sampled_tokens(merged):
    (row,), _ = merged
    assert row.loss_mask == [False, False, False, True, True, False, False, True]


def test_a_merged_row_keeps_engine_logprobs_and_nan_where_nothing_was_sampled(merged):
    (row,), _ = merged
    assert row.old_logprobs[3:5] == [-0.5, -0.5] and row.old_logprobs[7] == -0.1
    assert [i for i, x in enumerate(row.old_logprobs) if math.isnan(x)] == [0, 1, 2, 5, 6]


def test_a_merged_row_keeps_each_tokens_sampling_temperature(merged):
    (row,), _ = merged
    assert row.temperatures == [0.5] * 5 + [1.0] * 3


@pytest.mark.parametrize("temperature, trained_at", [(0.0, 1.0), (1.85e-301, 1.0),
                                                     (9.9e-6, 1.0), (1e-5, 1e-5), (0.7, 0.7)])
def test_a_greedy_call_is_scored_at_temperature_one(temperature, trained_at):
    """Below 1e-5 the engine sampled greedily; dividing logits by such a temperature overflows."""
    (row,) = rows_from_calls([call([1, 2], [3], temperature=temperature)], RowStats())
    assert row.temperatures == [trained_at] * 3


def test_recorded_ids_are_used_as_is_when_history_was_re_rendered_differently():
    """The second prompt re-renders the first answer with other tokens: two rows, no merge,
    and each row keeps exactly the ids the engine saw."""
    c1 = call([1, 2, 3], [4, 5], t=1)
    c2 = call([1, 2, 3, 40, 50, 9], [6, 7], t=2)
    stats = RowStats()
    rows = rows_from_calls([c1, c2], stats)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 40, 50, 9, 6, 7]]
    assert (stats.prefix_mismatches, stats.merged_calls) == (1, 0)


def test_each_of_n_samples_becomes_its_own_row():
    rows = rows_from_calls([call([1], [2, 3], n=3)], RowStats())
    assert [r.input_ids for r in rows] == [[1, 2, 3]] * 3
    assert all(r.loss_mask == [False, True, True] for r in rows)


UNUSABLE_CALLS = {
    "failed": tracerl.LLMCall(id="e", prompt_token_ids=[1], error="boom"),
    "no-completions": tracerl.LLMCall(id="e", prompt_token_ids=[1], completions=[]),
    "no-prompt-ids": tracerl.LLMCall(id="e", prompt_token_ids=[], completions=[
        tracerl.CompletionRecord(index=0, token_ids=[2], logprobs=[-0.5])]),
}


@pytest.mark.parametrize("bad", UNUSABLE_CALLS.values(), ids=list(UNUSABLE_CALLS))
def test_a_call_without_usable_tokens_is_skipped(bad):
    good = call([1], [2, 3], t=1)
    rows = rows_from_calls([bad, good], RowStats())
    assert [r.input_ids for r in rows] == [[1, 2, 3]]


@pytest.fixture
def rendered_row(tokenizer):
    """The fallback row of a trajectory without token records: user "hi", answer "Hello there"
    (finish_reason stop)."""
    from openai.types.chat.chat_completion import Choice

    choice = Choice.model_validate({"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "Hello there"}})
    traj = tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice])
    (row,) = rows_from_messages(
        traj,
        lambda msgs, tools: render_ids(tokenizer, msgs, tools),
        lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
        tokenizer.eos_token_id,
    )
    return row


def test_fallback_row_is_flagged_and_its_prompt_is_the_rendered_history(rendered_row, tokenizer):
    prompt = render_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert rendered_row.rendered
    assert rendered_row.input_ids[: len(prompt)] == prompt
    assert not any(rendered_row.loss_mask[: len(prompt)])


def test_fallback_completion_is_the_answer_text_ended_by_eos(rendered_row, tokenizer):
    completion = [i for i, m in zip(rendered_row.input_ids, rendered_row.loss_mask, strict=True)
                  if m]
    assert tokenizer.decode(completion, skip_special_tokens=True) == "Hello there"
    assert completion[-1] == tokenizer.eos_token_id


def test_scaled_advantages_are_centred_and_divided_by_the_group_std():
    a = group_advantages([1.0, 0.0, 1.0, 0.0], scale=True)  # mean 0.5, std 0.5
    assert not a.skipped
    assert a.advantages == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-3)


def test_unscaled_advantages_are_only_centred():
    assert group_advantages([1.0, 0.0], scale=False).advantages == [0.5, -0.5]


@pytest.mark.parametrize("rewards", [[0.3, 0.3, 0.3], [1.0]], ids=["equal-rewards", "single"])
def test_a_group_without_reward_variance_is_skipped_with_zero_advantages(rewards):
    a = group_advantages(rewards, scale=True)
    assert a.skipped and a.advantages == [0.0] * len(rewards)


def rows_of_lengths(*lengths: int) -> list[Row]:
    return [Row(input_ids=[n] * n, loss_mask=[True] * n, old_logprobs=[0.0] * n,
                temperatures=[1.0] * n) for n in lengths]


def test_micro_batches_pack_rows_longest_first_within_the_token_budget():
    batches = micro_batches(rows_of_lengths(10, 50, 20, 40, 30, 5), max_tokens=64)
    # padded size = rows x longest: 50 and 40 each fill a batch, 30+20 -> 60, 10+5 -> 20
    assert [[len(r) for r in b] for b in batches] == [[50], [40], [30, 20], [10, 5]]


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    batches = micro_batches(rows_of_lengths(100, 10, 5), max_tokens=64)
    assert [[len(r) for r in b] for b in batches] == [[100], [10, 5]]


def test_interleaved_conversations_each_continue_their_own_row():
    """Two subagents of one rollout take turns: each turn joins its own conversation's row."""
    a1, b1 = call([1, 2], [3], t=1), call([7, 8], [9], t=2)
    a2, b2 = call([1, 2, 3, 4], [5], t=3), call([7, 8, 9, 4], [6], t=4)
    stats = RowStats()
    rows = rows_from_calls([a1, b1, a2, b2], stats)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [7, 8, 9, 4, 6]]
    assert (stats.merged_calls, stats.prefix_mismatches) == (2, 1)


def test_a_mismatch_is_counted_by_the_reason_its_record_gives():
    calls = [call([1, 2], [3], t=0)]
    for t, turn in enumerate([{"verdict": "history_edited", "message": 4},
                              {"verdict": "history_edited", "message": 2},
                              {"verdict": "new_conversation", "message": 0},
                              {"verdict": "template", "message": 3}, None], start=1):
        c = call([50 + t], [3], t=t)
        if turn is not None:
            c.metadata["turn"] = turn
        calls.append(c)
    stats = RowStats()
    rows_from_calls(calls, stats)
    assert (stats.prefix_mismatches, stats.history_edits, stats.new_conversations,
            stats.unspliced_turns, stats.history_edit_message) == (5, 2, 1, 2, 2)
    assert RowStats().as_metrics().keys() == stats.as_metrics().keys() - {"history_edit_message"}
