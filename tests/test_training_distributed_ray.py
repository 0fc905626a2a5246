"""The ``ray`` launcher on a local Ray cluster: an inference replica and two trainer ranks as
Ray actors, one step end to end through the gateway (slow: Ray starts in ~15 s, three model
copies load)."""

from __future__ import annotations

import pytest

import tracerl
from tracerl.backend.launchers.ray import RayReplicaEngine
from tracerl.core.config import DistributedTrainerConfig, TrainConfig

from .test_training_step import _rollouts

ray = pytest.importorskip("ray")  # the optional extra: installed by the slow stage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def test_ray_places_a_replica_and_two_ranks_and_trains_a_step(ray_cluster, tmp_path):
    backend = tracerl.LocalBackend(path=tmp_path, engine="transformers", trainer=(
        DistributedTrainerConfig(world_size=2, strategy="fsdp2", launcher="ray", device="cpu",
                                 cpus_per_rank=0.5)))
    model = tracerl.TrainableModel(
        name="on-ray", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    try:
        await model.register(backend)
        engine = backend.gateway.models[model.spec.key].engine
        assert isinstance(engine, RayReplicaEngine)
        groups = await _rollouts(model, [0.0, 1.0, 2.0])
        assert all(t.llm_calls for g in groups for t in g.trajectories)  # recorded, token-exact
        metrics = await model.train(groups, config=TrainConfig(learning_rate=1e-3))
        assert await model.get_step() == 1 and metrics["trained_tokens"] > 0
        (policy,) = backend.policies.loaded.values()
        assert sorted(policy.ranks) == [0, 1]
        assert ray.get(policy.launcher.group.ready(), timeout=10) is not None
        # the replica serves the published adapter: the model's newest step answers
        after = await _rollouts(model, [0.0, 1.0])
        assert {c.adapter_step for g in after for t in g.trajectories for c in t.llm_calls} == {1}
    finally:
        await backend.close()
