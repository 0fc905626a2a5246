"""The ``ray`` launcher (optional extra ``tracerl[ray]``): trainer ranks and inference replicas
as Ray actors, each rank in a bundle of one placement group, on an existing cluster
(``ray.init(address=...)``) or a local one.

Each rank actor runs the same rank process code as under torchrun, with torchrun's environment
(``MASTER_ADDR`` is rank 0's node). A replica actor hosts a real engine (vLLM on its own ``mp``
executor, so vLLM never starts a Ray executor inside Ray; or the transformers engine) and the
gateway talks to it through :class:`RayReplicaEngine`. Adapters travel as file contents, so
nodes need no shared filesystem; the base model must be at the same path on every node
(``tracerl prepare-model`` there, as the examples do).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ...core import settings
from ...core.engine import Engine, EngineSpec, EngineUnavailableError
from ...core.launcher import Launcher
from ...events.hookspecs import hookimpl

log = logging.getLogger(__name__)


def _ray() -> Any:
    import ray

    return ray


class _RankActor:
    """One trainer rank inside a Ray worker process."""

    def node_ip(self) -> str:
        return _ray().util.get_node_ip_address()

    def free_port(self) -> int:
        from ...core.net import free_port

        return free_port("0.0.0.0")

    def run(self, module: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        importlib.import_module(module).main()


class _ReplicaActor:
    """An inference engine inside a Ray worker process (an async actor)."""

    def __init__(self, engine_class: type[Engine], spec: EngineSpec) -> None:
        self.engine = engine_class(spec)
        self.adapters = Path(tempfile.mkdtemp(prefix="tracerl-replica-"))

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.engine, method)(*args)

    async def chat_chunks(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        return [chunk async for chunk in self.engine.chat_stream(body)]

    async def load_adapter(self, lora_name: str, version: str, files: dict[str, bytes]) -> None:
        from ..training.rank import write_files

        folder = self.adapters / version
        folder.mkdir(parents=True, exist_ok=True)
        await self.engine.load_adapter(lora_name, write_files(files, folder))


class RayReplicaEngine(Engine):
    """The gateway's handle on an engine in a Ray actor: the same contract, over Ray calls.
    Streaming answers are produced whole by the replica, then yielded chunk by chunk."""

    name = "ray-replica"

    def __init__(self, engine_class: type[Engine], spec: EngineSpec, cpus: float,
                 gpus: float) -> None:
        super().__init__(spec)
        self.engine_class, self.cpus, self.gpus = engine_class, cpus, gpus
        self.actor: Any = None
        self._loaded = 0

    async def start(self) -> None:
        ray = _ray()
        actor_class = ray.remote(_ReplicaActor)
        self.actor = actor_class.options(num_cpus=self.cpus, num_gpus=self.gpus).remote(
            self.engine_class, self.spec)
        await self.actor.call.remote("start")

    async def stop(self) -> None:
        if self.actor is not None:
            try:
                await self.actor.call.remote("stop")
            finally:
                _ray().kill(self.actor)
                self.actor = None

    async def _actor(self, actor_method: str, *args: Any) -> Any:
        """``actor.actor_method(*args)``; the engine's own errors come back as they were raised
        there (an ``EngineRequestError`` keeps its status), a dead actor is 503."""
        if self.actor is None:
            raise EngineUnavailableError("the Ray replica is not started")
        try:
            return await getattr(self.actor, actor_method).remote(*args)
        except _ray().exceptions.RayActorError as e:
            raise EngineUnavailableError(f"the Ray replica died: {e}") from e
        except _ray().exceptions.RayTaskError as e:
            raise (getattr(e, "cause", None) or e) from None

    async def _call(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` in the actor."""
        return await self._actor("call", method, *args)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("chat", body)

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        for chunk in await self._actor("chat_chunks", body):
            yield chunk

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("completions", body)

    async def load_adapter(self, lora_name: str, path: Path) -> None:
        from ..training.distributed import checkpoint_files

        files = checkpoint_files(Path(path))
        self._loaded += 1
        await self._actor("load_adapter", lora_name, f"{self._loaded:06d}", files)

    async def healthy(self) -> bool:
        try:
            return bool(await self._call("healthy"))
        except Exception:
            return False

    async def sleep(self) -> None:
        await self._call("sleep")

    async def wake_up(self) -> None:
        await self._call("wake_up")


class RayLauncher(Launcher):
    """Trainer ranks in one placement group (``config.world_size`` bundles) and replicas as
    actors, on the Ray cluster at ``config.ray_address``."""

    name = "ray"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        ray = _ray()
        if not ray.is_initialized():
            address = config.ray_address or ("auto" if settings.RAY_ADDRESS.get() else None)
            ray.init(address=address, log_to_driver=False)
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self.group: Any = None

    @classmethod
    def available(cls) -> bool:
        return importlib.util.find_spec("ray") is not None

    def coordinator_host(self) -> str:
        return _ray().util.get_node_ip_address()

    def _gpus(self) -> float:
        if self.config.device == "cpu":
            return 0.0
        gpus = _ray().cluster_resources().get("GPU", 0)
        return 1.0 if gpus or self.config.device == "cuda" else 0.0

    def start_ranks(self, module: str, env: dict[str, str], log_path: Path) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world, gpus = self.config.world_size, self._gpus()
        bundle = {"CPU": self.config.cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([bundle] * world, strategy=self.config.placement_strategy)
        ray.get(self.group.ready(), timeout=self.config.start_timeout_s)
        actor_class = ray.remote(_RankActor)
        self.actors = [actor_class.options(
            num_cpus=self.config.cpus_per_rank, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=i)).remote()
            for i in range(world)]
        master = ray.get(self.actors[0].node_ip.remote())
        port = ray.get(self.actors[0].free_port.remote())
        torchrun = {"WORLD_SIZE": str(world), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                    "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",  # Ray sets CUDA_VISIBLE_DEVICES
                    "OMP_NUM_THREADS": str(max(1, int(self.config.cpus_per_rank)))}
        self.runs = [actor.run.remote(module, {**env, **torchrun, "RANK": str(i)})
                     for i, actor in enumerate(self.actors)]
        log.info("ray: %d trainer ranks placed (%s), rank 0 on %s", world, bundle, master)

    def failure(self) -> str | None:
        ray = _ray()
        if not self.runs:
            return None
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for rank, run in enumerate(self.runs):
            if run in done:
                try:
                    ray.get(run)
                except Exception as e:
                    return f"ray: the actor of rank {rank} failed: {type(e).__name__}: {e}"
                return f"ray: the actor of rank {rank} returned"
        return None

    def stop(self) -> None:
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.runs = [], []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None

    def engine(self, engine_class: type[Engine], spec: EngineSpec) -> Engine | None:
        if not self.config.replicas_on_launcher:
            return None
        return RayReplicaEngine(engine_class, spec, cpus=self.config.cpus_per_rank,
                                gpus=self._gpus())


@hookimpl
def tracerl_launchers() -> list[type]:
    return [RayLauncher]
