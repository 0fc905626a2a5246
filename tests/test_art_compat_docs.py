"""ART 0.5's documentation pages as scripts (``tests/art_docs``: only ``import art`` changed to
``import tracerl as art``), each run once on the shared transformers-engine backend with
SmolLM2 and training at least one step; the tests check what each page promises."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

import tracerl
from tests.art_docs import (
    art_client,
    benchmarking,
    checkpoint_deletion,
    quick_start,
    ruler,
    sft,
)
from tests.test_art_compat import judge_for_art
from tracerl.core.trajectory import read_groups_jsonl

BASE_NAME = "SmolLM2-135M-Instruct"  # how the gateway names the base model it serves


@pytest.fixture(scope="session")
def backend(tf_backend):
    return tf_backend[0]


def train_lines(history):
    return [h for h in history if h["split"] == "train"]


# --- quick start ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def quick(backend):
    model, results = await quick_start.main(backend)
    return SimpleNamespace(model=model, results=results, history=await model.history(),
                           store=backend.store(model))


async def test_quick_start_trains_a_step_and_returns_arts_train_result(quick):
    (result,) = quick.results
    assert isinstance(result, tracerl.TrainResult) and result.step == 1
    assert result.metrics["trained_tokens"] > 0 and "loss" in result.metrics
    assert result.checkpoint_path == str(quick.store.checkpoint_dir(1))


async def test_quick_start_logs_the_step_once_through_model_log(quick):
    """The trainer's own line and the script's ``model.log(split="train")`` line; the groups
    the step saved are not written a second time by the log."""
    lines = train_lines(quick.history)
    assert [h["step"] for h in lines] == [1, 1]
    assert lines[1]["loss"] == quick.results[0].metrics["loss"]
    assert len(read_groups_jsonl(quick.store.trajectories_path("train", 1))) == 2


async def test_quick_start_trains_with_arts_default_loss(quick):
    """ART 0.5's LocalBackend default is CISPO with its clip range (epsilon 1, epsilon_high 4)."""
    result = quick.results[0]
    assert 0.0 <= result.metrics["clip_fraction"] <= 1.0
    config = tracerl.core.art_compat.train_config_from_art_kwargs({"learning_rate": 1e-4})
    assert (config.loss_fn, config.epsilon, config.epsilon_high) == ("cispo", 1.0, 4.0)


# --- the ART client page: _internal_config after construction, comparison models ------------


@pytest.fixture(scope="module")
async def client_page(backend):
    model, comparison, result = await art_client.main(backend, base_model_name=BASE_NAME)
    return SimpleNamespace(model=model, comparison=comparison, result=result,
                           comparison_history=await comparison.history(),
                           comparison_step=await comparison.get_step(),
                           comparison_groups=read_groups_jsonl(
                               backend.store(comparison).trajectories_path("val", 0)))


async def test_internal_config_set_after_construction_takes_effect(client_page):
    engine = client_page.model.config.engine
    assert (engine.max_model_len, engine.max_num_seqs) == (512, 4)


async def test_internal_config_set_after_register_is_refused(client_page):
    with pytest.raises(tracerl.ConfigError, match=r"before `await model\.register"):
        client_page.model._internal_config = tracerl.dev.InternalModelConfig()


async def test_a_comparison_model_keeps_its_own_endpoint_and_step_0(client_page):
    comparison = client_page.comparison
    assert comparison.inference_model_name == BASE_NAME
    assert client_page.comparison_step == 0


async def test_a_comparison_model_logs_its_trajectories_and_metrics(client_page):
    (line,) = client_page.comparison_history
    assert (line["split"], line["step"], line["num_trajectories"]) == ("val", 0, 2.0)
    assert [len(g) for g in client_page.comparison_groups] == [2]


async def test_the_client_page_trains_with_ppo(client_page):
    assert client_page.result.step == 1 and client_page.result.metrics["trained_tokens"] > 0


# --- RULER ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def ruler_page(backend):
    judge = judge_for_art()
    unreachable = {"api_base": "http://127.0.0.1:9/v1", "api_key": "k", "num_retries": 0}
    logger = logging.getLogger("tracerl.ruler.judge")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        model, judged, skipped = await ruler.main(
            backend, {"api_base": judge.url, "api_key": "k"}, unreachable)
    finally:
        logger.removeHandler(handler)
        judge.close()
    return SimpleNamespace(model=model, judged=judged, skipped=skipped,
                           warnings=[r.getMessage() for r in records],
                           history=await model.history())


async def test_ruler_scores_become_the_rewards_trained_on(ruler_page):
    groups, result = ruler_page.judged
    assert [t.reward for t in groups[0]] == [t.metrics["ruler_score"] for t in groups[0]]
    assert result.step == 1 and result.metrics["trained_tokens"] > 0


async def test_a_judge_failing_on_every_group_skips_the_step(ruler_page):
    groups, result = ruler_page.skipped
    assert groups == [] and result.step == 2
    assert result.metrics["skipped"] == 1.0 and result.metrics["num_groups"] == 0.0


async def test_the_judges_failure_is_shown(ruler_page):
    (warning,) = [w for w in ruler_page.warnings if "swallow_exceptions" in w]
    assert "group is dropped" in warning and "judge" in warning.lower()


# --- checkpoint deletion --------------------------------------------------------------------


@pytest.fixture(scope="module")
async def deletion(backend):
    model = await checkpoint_deletion.main(backend)
    return SimpleNamespace(model=model, steps=backend.store(model).checkpoint_steps(),
                           step=await model.get_step())


async def test_delete_checkpoints_keeps_the_newest_and_the_best_val_reward(deletion):
    assert (deletion.steps, deletion.step) == ([1, 3], 3)


# --- SFT ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def sft_page(backend, tmp_path_factory):
    model, after_sft, rl = await sft.main(backend, tmp_path_factory.mktemp("sft"))
    store = backend.store(model)
    return SimpleNamespace(model=model, after_sft=after_sft, rl=rl, step=await model.get_step(),
                           history=await model.history(), store=store)


async def test_sft_from_file_is_one_checkpoint_before_rl(sft_page):
    assert sft_page.after_sft == 1 and sft_page.rl.step == 2 and sft_page.step == 3
    assert sft_page.store.checkpoint_steps() == [1, 2, 3]


async def test_each_sft_call_has_its_own_history_line(sft_page):
    sft_lines = [h for h in train_lines(sft_page.history) if h.get("sft_batches")]
    assert [(h["step"], h["sft_batches"], h["num_trajectories"]) for h in sft_lines] == [
        (1, 2.0, 3.0), (3, 1.0, 3.0)]
    assert all(h["loss"] > 0 and h["trained_tokens"] > 0 for h in sft_lines)


async def test_sft_follows_the_learning_rate_schedule(sft_page):
    first = next(h for h in sft_page.history if h.get("sft_batches"))
    # 2 batches, warmup int(2 * 0.1) = 0: linear from the peak 1e-4 down to 0
    assert first["learning_rate"] == pytest.approx((1e-4 + 0.0) / 2)


async def test_sft_trajectories_are_saved_under_their_own_split(sft_page):
    (group,) = read_groups_jsonl(sft_page.store.trajectories_path("sft", 1))
    assert len(group) == 3
    assert not sft_page.store.trajectories_path("train", 1).exists()


# --- benchmarking ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def benchmark(backend, quick):
    return await benchmarking.main(backend, quick.model, BASE_NAME)


async def test_benchmarking_loads_each_models_val_trajectories(benchmark):
    per_model = {}
    for row in benchmark:
        if row["split"] == "val":
            per_model.setdefault(row["model"], []).append(row["step"])
    assert per_model == {"quick-start": [1] * 4, "benchmark-base": [0] * 4}


async def test_benchmark_rows_carry_reward_and_messages(benchmark):
    row = next(r for r in benchmark if r["split"] == "val")
    assert row["reward"] in (0.0, 1.0) and row["messages"][0]["role"] == "user"
    json.dumps(row)  # plain data, ready for a DataFrame


# --- LangGraph ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def langgraph_page(backend):
    pytest.importorskip("langgraph")
    from tests.art_docs import langgraph_agent

    model, groups, result = await langgraph_agent.main(backend)
    return SimpleNamespace(model=model, groups=groups, result=result)


async def test_langgraph_rollouts_are_recorded_call_by_call(langgraph_page):
    (group,) = langgraph_page.groups
    assert group.exceptions == [] and len(group) == 2
    assert all(t.llm_calls and t.messages()[-1]["role"] == "assistant" for t in group)


async def test_langgraph_page_trains_a_step_on_the_recorded_tokens(langgraph_page):
    result = langgraph_page.result
    assert result.step == 1 and result.metrics["trained_tokens"] > 0
    assert result.metrics["rendered_rows"] == 0


# --- ART's examples, shrunk -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["2048", "tic-tac-toe", "temporal-clue"])
async def game(request, backend):
    from tests.art_docs import games

    model, groups, result = await games.main(backend, request.param)
    return SimpleNamespace(name=request.param, groups=groups, result=result,
                           history=await model.history())


async def test_each_example_trains_a_step_on_its_multi_turn_rollouts(game):
    (group,) = game.groups
    assert len(group) == 2 and all(t.llm_calls for t in group)
    assert game.result.step == 1 and game.result.metrics["trained_tokens"] > 0


async def test_each_example_logs_its_metrics_at_the_trained_step(game):
    logged = train_lines(game.history)[-1]
    assert logged["step"] == 1 and logged["loss"] == game.result.metrics["loss"]


# --- deployment: the trained adapter served by a plain `vllm serve --lora-modules` ----------


@pytest.fixture(scope="module")
async def exported(quick, backend, tmp_path_factory):
    from tracerl.utils.deployment import export_lora

    return await export_lora(quick.model, backend, tmp_path_factory.mktemp("export") / "adapter")


async def test_export_writes_only_what_vllm_loads(exported):
    assert sorted(p.name for p in exported.adapter_dir.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert exported.name == "art-docs/quick-start@1"  # the gateway's name for that step
    args = exported.vllm_serve_args()
    assert args[args.index("--lora-modules") + 1] == f"{exported.name}={exported.adapter_dir}"


async def test_deploy_model_names_the_export_instead(exported):
    from tracerl.utils.deployment import deploy_model

    with pytest.raises(tracerl.ConfigError, match="export_lora"):
        await deploy_model()


@pytest.mark.vllm
async def test_vllm_serve_with_the_exported_adapter_answers_as_it(exported, tmp_path):
    import os
    import subprocess

    import httpx

    from tests.conftest import until
    from tests.remote_server import free_port
    from tracerl.backend.engines.vllm_engine import vllm_python

    if vllm_python() is None:
        pytest.skip("needs vLLM (TRACERL_VLLM_PYTHON)")
    port = free_port()
    # `vllm serve BASE ...` as the module the vLLM CPU venv runs (its `vllm` script needs
    # package metadata that venv lacks): `--model BASE ...`
    _, serve, base, *flags = exported.vllm_serve_args()
    assert serve == "serve"
    args = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", base,
            *flags, "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "256",
            "--dtype", "bfloat16"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    log = (tmp_path / "vllm.log").open("w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            async def lists_the_adapter() -> bool:
                assert process.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
                try:
                    models = (await client.get(f"{url}/models")).json()["data"]
                except httpx.TransportError:
                    return False
                return exported.name in [m["id"] for m in models]

            await until(lists_the_adapter, "vllm serve to list the exported adapter", 400, 1.0)
            answer = (await client.post(f"{url}/chat/completions", json={
                "model": exported.name, "max_tokens": 4,
                "messages": [{"role": "user", "content": "Say red."}]})).json()
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
    assert answer["model"] == exported.name and answer["choices"][0]["message"]["content"]
