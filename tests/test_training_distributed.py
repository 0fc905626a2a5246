"""The distributed trainer on real ranks (torchrun subprocesses, gloo on CPU): the same adapter
as the one-process trainer on the same rows, checkpoints and resume, a rank killed mid-step."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import tracerl
from tracerl.backend.training.distributed import start_distributed_policy
from tracerl.backend.training.rows import Row
from tracerl.backend.training.trainer import Trainer
from tracerl.core.config import DistributedTrainerConfig, LoraConfig, TrainConfig
from tracerl.core.errors import RankFailedError
from tracerl.core.storage import atomic_directory
from tracerl.core.trajectory import read_groups_jsonl

from .conftest import make_random_lora, until
from .test_training_step import _rollouts

LORA = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"])
# 4 micro-batches of 24 tokens: dealt 2 + 2 to two ranks; a warmup step (at half the rate)
# before the full rate: the ranks take each step's rate from the checkpoint's step count
CONFIG = TrainConfig(learning_rate=1e-3, micro_batch_tokens=24, warmup_steps=1)
NAN = float("nan")


def tiny_rows(seed: int) -> list[Row]:
    """Five rows of 10-16 tokens; odd ones carry engine logprobs, even ones none (filled
    on-policy); advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(5):
        n_prompt, n_completion = 6 + i, 4 + i % 3
        ids = torch.randint(10, 1000, (n_prompt + n_completion,), generator=g).tolist()
        sampled = ([-1.0 - 0.1 * j for j in range(n_completion)] if i % 2
                   else [NAN] * n_completion)
        rows.append(Row(ids, [False] * n_prompt + [True] * n_completion,
                        [NAN] * n_prompt + sampled, [1.0] * len(ids),
                        advantage=(-1) ** i * (0.5 + i / 10)))
    return rows


def distributed_step(strategy: str, adapter: Path, rows: list[Row], out: Path
                     ) -> dict[str, float]:
    """Two ranks load ``adapter``, train one step on ``rows`` and checkpoint into ``out``."""
    config = DistributedTrainerConfig(world_size=2, strategy=strategy, device="cpu")
    policy = start_distributed_policy(config, policy_model_path(), LORA, adapter, None,
                                      out.parent / f"{out.name}.log")
    try:
        metrics = policy.optimize(rows, CONFIG)
        with atomic_directory(out) as tmp:
            policy.save(tmp)
    finally:
        policy.close()
    return metrics


def policy_model_path() -> Path:
    from tracerl.backend.weights import resolve_base_model

    return resolve_base_model("smollm2")


@pytest.fixture(scope="module")
def one_process(smollm2_path, tmp_path_factory):
    """The reference: the one-process trainer, two steps from a random adapter."""
    root = tmp_path_factory.mktemp("distributed")
    init = make_random_lora(smollm2_path, root / "init")
    trainer = Trainer(smollm2_path, LORA, adapter_path=init, device="cpu")
    metrics = [trainer.optimize(tiny_rows(0), CONFIG)]
    trainer.save(root / "one-1")
    metrics.append(trainer.optimize(tiny_rows(1), CONFIG))
    trainer.save(root / "one-2")
    return SimpleNamespace(root=root, init=init, metrics=metrics)


def in_parameter_order(adapter: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Adapter tensors in the model's parameter order (the optimizer's): by layer number, then
    by name (q_proj before v_proj, A before B)."""
    def key(name: str) -> tuple[int, str]:
        layer = name.split(".layers.")[1].split(".")[0]
        return int(layer), name
    return [adapter[name] for name in sorted(adapter, key=key)]


def first_moments(checkpoint: Path) -> list[torch.Tensor]:
    state = torch.load(checkpoint / "optimizer.pt")["state"]
    return [entry["exp_avg"] for _, entry in sorted(state.items())]


def assert_same_checkpoint(ours: Path, reference: Path, *earlier: Path) -> None:
    """The same gradient (Adam's first moment is 0.1 x the clipped gradient), and the same
    adapter wherever the gradient is clearly non-zero: Adam's first step moves each weight by
    lr x sign(gradient), and a gradient at float-noise level may take either sign. The moments
    are the sharp check: they also show that Adam's state was resumed. ``earlier``: the
    reference's earlier checkpoints, whose unclear gradients are left out too."""
    moments = [first_moments(p) for p in (ours, reference)]
    scale = max(float(m.abs().max()) for m in moments[1])
    for got, want in zip(*moments, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=1e-3)
    adapters = [in_parameter_order(load_file(p / "adapter_model.safetensors"))
                for p in (ours, reference)]
    assert len(adapters[0]) == len(moments[1]) == 2 * 2 * 30  # q, v x A, B x 30 layers
    clear = total = 0
    steps = [moments[1], *(first_moments(p) for p in earlier)]
    # clear: 5x the largest difference measured (4e-5 of the step's largest moment)
    floors = [2e-4 * max(float(m.abs().max()) for m in step) for step in steps]
    for got, want, *gradients in zip(*adapters, *steps, strict=True):
        mask = torch.ones_like(got, dtype=torch.bool)
        for gradient, floor in zip(gradients, floors, strict=True):
            mask &= gradient.abs() > floor
        clear, total = clear + int(mask.sum()), total + mask.numel()
        # a tenth of one step's move (lr): float noise in a later Adam step stays below it
        torch.testing.assert_close(got[mask], want[mask], atol=0.1 * CONFIG.learning_rate,
                                   rtol=0)
    assert clear > 0.5 * total  # measured: 78% of the weights after one step


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_the_one_process_adapter_on_the_same_rows(one_process, strategy):
    out = one_process.root / f"{strategy}-1"
    metrics = distributed_step(strategy, one_process.init, tiny_rows(0), out)
    reference = one_process.metrics[0]
    for key in ("loss", "ratio", "clip_fraction", "entropy", "grad_norm"):
        assert metrics[key] == pytest.approx(reference[key], rel=1e-4), key
    for key in ("trained_tokens", "tokens", "micro_batches"):
        assert metrics[key] == reference[key], key
    assert metrics["learning_rate"] == reference["learning_rate"] == 5e-4  # the warmup step
    assert_same_checkpoint(out, one_process.root / "one-1")


def test_two_ranks_resume_from_their_checkpoint_like_one_process(one_process):
    """FSDP2 ranks (Adam state sharded) restart from the 2-rank DDP checkpoint: the second
    step matches the one-process second step, Adam moments included."""
    first = one_process.root / "ddp-1"
    if not first.exists():
        distributed_step("ddp", one_process.init, tiny_rows(0), first)
    second = one_process.root / "fsdp2-2"
    metrics = distributed_step("fsdp2", first, tiny_rows(1), second)
    assert metrics["learning_rate"] == one_process.metrics[1]["learning_rate"] == 1e-3
    assert json.loads((second / "trainer_state.json").read_text())["steps_done"] == 2
    assert_same_checkpoint(second, one_process.root / "one-2", one_process.root / "one-1")


async def test_a_rank_killed_mid_step_is_named_and_the_run_resumes(tmp_path):
    """SIGKILL to rank 1 during the update: RankFailedError naming rank 1, no checkpoint, the
    step's groups pending; the next step trains exactly them on fresh ranks."""
    backend = tracerl.LocalBackend(
        path=tmp_path, engine="transformers",
        trainer=DistributedTrainerConfig(world_size=2, strategy="ddp", device="cpu"))
    model = tracerl.TrainableModel(
        name="ranks", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    try:
        await model.register(backend)
        groups = await _rollouts(model, [0.0, 1.0, 2.0])
        step = asyncio.ensure_future(
            model.train(groups, config=TrainConfig(learning_rate=1e-3, num_epochs=3)))
        policies = backend.policies.loaded  # the policy the step started
        await until(lambda: any(p.phase == "update" for p in policies.values()) or step.done(),
                    "the ranks to start the update", timeout_s=300)
        (policy,) = policies.values()
        os.kill(policy.ranks[1]["pid"], signal.SIGKILL)
        with pytest.raises(RankFailedError, match=r"trainer rank 1 of 2 .* died") as failed:
            await step
        assert failed.value.rank == 1 and policy.launcher.process.poll() is not None
        store = backend.store(model)
        assert store.latest_step() == 0 and backend.policies.loaded == {}
        pending = await backend.pending_groups(model)
        ids = [t.rollout_id for g in groups for t in g.trajectories]
        assert [t.rollout_id for g in pending for t in g.trajectories] == ids

        metrics = await model.train(pending, config=TrainConfig(learning_rate=1e-3))
        assert await model.get_step() == 1 and metrics["trained_tokens"] > 0
        saved = read_groups_jsonl(store.trajectories_path("train", 1))
        assert [t.rollout_id for g in saved for t in g.trajectories] == ids
        assert [h["step"] for h in store.history() if h["split"] == "train"] == [1]
    finally:
        await backend.close()


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def tracerl_commands(value: object) -> list[str]:
    """Every ``tracerl ...`` command line in a parsed YAML document."""
    if isinstance(value, dict):
        return [c for v in value.values() for c in tracerl_commands(v)]
    if isinstance(value, list):
        return [c for v in value for c in tracerl_commands(v)]
    if isinstance(value, str):
        return [line.strip() for line in value.splitlines()
                if line.strip().startswith("tracerl ") and "prepare-model" not in line]
    return []


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*/two-node-ray.yaml")),
                         ids=lambda p: p.parent.name)
def test_the_two_node_examples_run_a_tracerl_command_with_the_ray_launcher(path):
    import shlex

    import yaml

    from tracerl.cli import build_parser

    commands = tracerl_commands(yaml.safe_load(path.read_text()))
    assert len(commands) == 1, commands
    args = build_parser().parse_args(shlex.split(commands[0])[1:])
    assert (args.command, args.launcher, args.world_size) == ("demo", "ray", 2)
    assert callable(args.func)
