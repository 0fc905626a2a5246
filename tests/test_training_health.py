"""Step health: each problem made for real in one training step (conftest's ``unhealthy_step``)
is measured in the step's metrics and logged as a warning naming its cause and fix."""

import pytest

from tracerl.backend.training.health import step_warnings

# item: (metric check on the step, words its warning must contain)
PROBLEMS = {
    "equal-rewards": (lambda m: m["skipped_groups"] >= 1,
                      "groups had equal rewards (no learning signal): widen the reward"),
    "agent-rewrites-history": (lambda m: m["prefix_mismatch_fraction"] == 1.0,
                               "prompt did not continue the previous call's tokens in 100% of "
                               "turns (2 where the agent edited history, first at message 0): "
                               "the agent edits history between calls"),
    "call-outside-a-rollout": (lambda m: m["unattributed_calls"] >= 1,
                               "without a rollout id and were not trained on"),
    "completions-cut-at-max-tokens": (lambda m: m["length_clipped_fraction"] >= 0.3,
                                      "of completions were cut at max_tokens: raise max_tokens"),
    "trained-on-re-rendered-text": (lambda m: m["rendered_rows"] == 2,
                                    "of trained rows were re-rendered text, not engine tokens"),
}


@pytest.mark.parametrize("measured, warning", PROBLEMS.values(), ids=list(PROBLEMS))
def test_problem_is_measured_and_warned(unhealthy_step, measured, warning):
    metrics, warnings, _, _ = unhealthy_step
    assert measured(metrics), metrics
    assert any(warning in w for w in warnings), warnings


def test_step_health_is_in_the_history(unhealthy_step):
    _metrics, warnings, _, model_dir = unhealthy_step
    from tracerl.core.storage import read_jsonl

    last = [h for h in read_jsonl(model_dir / "history.jsonl") if h["split"] == "train"][-1]
    for key in ("skipped_groups", "groups", "unattributed_calls", "prefix_mismatch_fraction",
                "rendered_fraction", "template_mismatch_fraction", "engine_kl",
                "length_clipped_fraction", "health_warnings"):
        assert key in last, key
    assert last["health_warnings"] == len(warnings) >= 5


async def test_prompts_of_an_engine_with_another_chat_template_are_counted(agent_model, tokenizer):
    """Calls a chatml-tools engine served, re-rendered with SmolLM2's own template (a trainer
    with another template): every one is counted, and the step's warning names the cause. (In
    a step, calls served by another model are no longer trained on: sub-agents.)"""
    import tracerl
    from tests.conftest import _chat, render_ids
    from tracerl.backend.training import health

    async def call(i: int) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": f"Name colour {i}."}]
        return tracerl.Trajectory(messages_and_choices=[*messages,
                                                        await _chat(agent_model, messages, 4)])

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(call(i) for i in range(2))], show_progress=False)
    other = health.template_mismatches([group], lambda m, t: render_ids(tokenizer, m, t))
    assert other["template_checked"] == 2 and other["template_mismatches"] == 2, other
    warnings = [w.message for w in step_warnings({**other, "groups": 1})]
    assert any("the trainer's chat template renders" in w for w in warnings), warnings


def test_same_weights_give_no_engine_kl_warning(unhealthy_step):
    """The engine served the trainer's own weights: the KL estimate stays under its threshold."""
    metrics, warnings, _, _ = unhealthy_step
    assert 0 <= metrics["engine_kl"] < 0.05
    assert not any("logprobs of the sampled tokens disagree" in w for w in warnings)


@pytest.mark.parametrize("metrics, expected", [
    ({"groups": 8, "skipped_groups": 8}, "all 8 groups had equal rewards"),
    ({"groups": 8, "skipped_groups": 1}, None),
    ({"groups": 4, "skipped_groups": 4, "reward": 1.0, "reward_std": 0.0},
     "all 4 groups had the same reward 1, all of them (no learning signal): the task is solved"),
    ({"engine_kl": 0.2}, "disagree (KL 0.2 nats/token)"),
    ({"prefix_mismatch_fraction": 0.4}, "in 40% of turns: the agent edits history"),
    ({"prefix_mismatch_fraction": 0.5, "unspliced_turns": 3, "new_conversations": 1},
     "in 50% of turns (3 the gateway did not splice; 1 that started a conversation of their "
     "own (subagents)): see each call's metadata['turn']['why']"),
    ({"groups": 4, "skipped_groups": 3, "sampled_entropy": 0.01, "sampled_entropy_start": 0.6},
     "entropy collapse: the sampled tokens' entropy fell to 0.01 nats/token (from 0.6 at the "
     "adapter's first step) while 3 of 4 groups had equal rewards: the policy collapsed onto "
     "one answer: keep entropy up with a lower learning_rate"),

    ({"groups": 4, "skipped_groups": 0, "sampled_entropy": 0.01}, None),
    ({"groups": 4, "identical_groups": 2, "skipped_groups": 1, "sampled_entropy": 0.8},
     "entropy collapse: 2 of 4 groups sampled the same completion in every rollout"),
    ({"groups": 4, "identical_groups": 1, "sampled_entropy": 0.8, "entropy": 0.7}, None),
    ({"groups": 4, "learning_rate": 0.0, "loss": 0.1},
     "trained at learning rate 0: its adapter is past the schedule's max_steps"),
], ids=["all-groups-equal", "under-threshold", "task-solved", "engine-kl",
        "forty-percent-rewrites", "not-spliced-and-subagents", "low-entropy-flat-rewards",
        "low-entropy-rewards-spread", "half-the-groups-identical", "one-group-identical",
        "past-max-steps"])
def test_warning_thresholds(metrics, expected):
    found = [str(w) for w in step_warnings(metrics)]
    assert (expected is None and not found) or any(expected in w for w in found), found


def test_low_entropy_from_the_first_step_is_no_collapse():
    """A small model can sample with little entropy from its first step (SmolLM2-135M on a
    templated tool call: ~0.02 nats/token): a collapse is a fall from there, not a level."""
    flat = {"groups": 4, "skipped_groups": 3, "sampled_entropy": 0.02}
    assert not [w for w in step_warnings({**flat, "sampled_entropy_start": 0.022})
                if w.item == "collapse"]
    assert not [w for w in step_warnings(flat) if w.item == "collapse"]  # no baseline known
    assert [w.item for w in step_warnings({**flat, "sampled_entropy_start": 0.5})
            if w.item == "collapse"] == ["collapse"]


async def test_an_entropy_collapse_is_measured_and_warned_with_its_fixes(tf_backend):
    """Real recorded rollouts: a step whose groups each sampled one completion in every rollout
    (greedy, the same prompt) with flat rewards is an entropy collapse, and its warning names the
    fixes; a healthy step (sampled at temperature 1, rewards spread) is not."""
    import tracerl
    from tests.conftest import _chat

    backend, _ = tf_backend
    model = tracerl.TrainableModel(  # its own model: the session's `gw` stays at step 0
        name="collapse", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)

    async def rollout(prompt: str, temperature: float, reward: float) -> tracerl.Trajectory:
        messages = [{"role": "user", "content": prompt}]
        choice = await _chat(model, messages, 8, temperature=temperature)
        return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    collapsed = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(f"Name a colour ({item}).", 0.0, 1.0) for _ in range(3))
         for item in range(2)], show_progress=False)
    metrics = await model.train(collapsed, config=tracerl.TrainConfig(learning_rate=1e-5))
    assert metrics["identical_groups"] == 2 and metrics["skipped_groups"] == 2, metrics
    first_entropy = metrics["sampled_entropy"]  # the first step is its own baseline
    assert metrics["sampled_entropy_start"] == first_entropy, metrics
    warnings = [str(w) for w in step_warnings(metrics) if w.item == "collapse"]
    assert warnings == [
        "entropy collapse: all 2 groups sampled the same completion in every rollout: the "
        "policy collapsed onto one answer: keep entropy up with a lower learning_rate (or "
        "warmup_steps), larger groups (more rollouts per item) and dynamic sampling "
        "(gather_trajectory_groups(..., dynamic_sampling=tracerl.DynamicSampling())); "
        "clip-higher (TrainConfig(epsilon_high=0.28)) acts only when a batch is reused "
        "(num_epochs > 1) or trained off-policy; then restart from a checkpoint from before "
        "the collapse"]
    assert metrics["health_warnings"] >= 2  # and the equal rewards' own warning

    healthy = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(f"Say the number {i + 3} and a word.", 1.0, float(i))
                                 for i in range(3)) for _ in range(2)], show_progress=False)
    metrics = await model.train(healthy, config=tracerl.TrainConfig(learning_rate=1e-5))
    assert metrics["identical_groups"] == 0 and metrics["skipped_groups"] == 0, metrics
    assert metrics["sampled_entropy"] > 0.05 and metrics["entropy"] > 0.05, metrics
    assert metrics["sampled_entropy_start"] == first_entropy, metrics  # from the history
    assert not [w for w in step_warnings(metrics) if w.item == "collapse"]


def test_completions_past_the_turn_end_are_counted_and_warned(smollm2_path):
    """The GPU machine's engine stopped at ``<|endoftext|>`` instead of ``<|im_end|>``: its
    answers were "69112<|im_end|>\\n". Such completions are counted against the template's turn
    end; one that ends at the turn end is not."""
    from transformers import AutoTokenizer

    import tracerl
    from tracerl.backend.chat_template import turn_end_ids
    from tracerl.backend.training import health
    from tracerl.core.trajectory import CompletionRecord, LLMCall

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    answer = tok.encode("69112", add_special_tokens=False)
    past = [*answer, im_end, *tok.encode("\n", add_special_tokens=False), endoftext]

    def rollout(ids: list[int]) -> tracerl.Trajectory:
        call = LLMCall(id=f"c{len(ids)}", completions=[CompletionRecord(token_ids=ids)])
        return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}],
                                  llm_calls=[call])

    group = tracerl.TrajectoryGroup([rollout(past), rollout([*answer, im_end])])
    counted = health.past_turn_end([group], turn_end_ids(tok))
    assert counted == {"past_turn_end": 1.0}
    (warning,) = [w for w in step_warnings({**counted, "completions": 2.0})
                  if w.item == "past_turn_end"]
    assert "1 of 2 completions went on past the chat template's end" in str(warning)
    assert "eos_token_id" in warning.fix
