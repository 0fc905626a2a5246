"""Training rows from token records: merging, mismatches, fallback rendering, advantages."""

import math

import tracerl
from tests.conftest import render_ids
from tracerl.backend.training.advantages import group_advantages
from tracerl.backend.training.rows import Row, RowStats, rows_from_calls, rows_from_messages
from tracerl.backend.training.trainer import micro_batches


def call(prompt, completion, t=0.0, temperature=1.0, logprobs=None, n=1):
    comps = [
        tracerl.CompletionRecord(
            index=i, token_ids=completion, logprobs=logprobs or [-0.5] * len(completion)
        )
        for i in range(n)
    ]
    return tracerl.LLMCall(id=f"c{t}", prompt_token_ids=prompt, completions=comps, created_at=t,
                           temperature=temperature)


def test_exact_prefix_continuations_merge_into_one_row():
    c1 = call([1, 2, 3], [4, 5], t=1, temperature=0.5)
    c2 = call([1, 2, 3, 4, 5, 9, 9], [6], t=2, logprobs=[-0.1])
    stats = RowStats()
    (row,) = rows_from_calls([c2, c1], stats)  # order by time, not by list position
    assert row.input_ids == [1, 2, 3, 4, 5, 9, 9, 6]
    assert row.loss_mask == [False, False, False, True, True, False, False, True]
    assert row.old_logprobs[3:5] == [-0.5, -0.5] and row.old_logprobs[7] == -0.1
    assert all(math.isnan(x) for x in row.old_logprobs[5:7])
    assert row.temperatures[:5] == [0.5] * 5 and row.temperatures[5:] == [1.0] * 3
    assert stats.merged_calls == 1 and stats.prefix_mismatches == 0


def test_recorded_ids_are_used_as_is_when_history_was_re_rendered_differently():
    """The second prompt re-renders the first answer with other tokens: two rows, no merge,
    and each row keeps exactly the ids the engine saw."""
    c1 = call([1, 2, 3], [4, 5], t=1)
    c2 = call([1, 2, 3, 40, 50, 9], [6, 7], t=2)
    stats = RowStats()
    rows = rows_from_calls([c1, c2], stats)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 40, 50, 9, 6, 7]]
    assert stats.prefix_mismatches == 1 and stats.merged_calls == 0


def test_n_samples_each_become_a_row_and_failed_calls_are_skipped():
    rows = rows_from_calls(
        [call([1], [2, 3], n=3), tracerl.LLMCall(id="e", prompt_token_ids=[1], error="boom")],
        RowStats(),
    )
    assert len(rows) == 3 and all(r.input_ids == [1, 2, 3] for r in rows)


def test_fallback_renders_messages_and_is_flagged(tokenizer):
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
    assert row.rendered
    completion = [i for i, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert tokenizer.decode(completion, skip_special_tokens=True) == "Hello there"
    assert completion[-1] == tokenizer.eos_token_id


def test_advantages_centre_scale_and_skip_zero_variance():
    a = group_advantages([1.0, 0.0, 1.0, 0.0], scale=True)
    assert not a.skipped and sum(a.advantages) == 0 and abs(a.advantages[0] - 1.0) < 1e-3
    assert group_advantages([1.0, 0.0], scale=False).advantages == [0.5, -0.5]
    assert group_advantages([0.3, 0.3, 0.3], scale=True).skipped


def test_micro_batches_respect_the_token_budget():
    rows = [
        Row(input_ids=[0] * n, loss_mask=[True] * n, old_logprobs=[0.0] * n, temperatures=[1.0] * n)
        for n in (10, 50, 20, 40, 30, 5)
    ]
    batches = micro_batches(rows, max_tokens=64)
    assert sorted(len(r) for b in batches for r in b) == [5, 10, 20, 30, 40, 50]
    for b in batches:
        assert len(b) == 1 or len(b) * max(len(r) for r in b) <= 64
