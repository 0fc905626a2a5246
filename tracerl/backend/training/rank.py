"""One rank of the distributed trainer: ``python -m tracerl.backend.training.rank``, started by
a launcher with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).

The rank joins the process group (NCCL on GPUs, gloo on CPU), connects to the coordinator
(``distributed.DistributedPolicy``, in the backend process) and runs its commands: ``load``,
``update`` (its share of the step's micro-batches), ``save``, ``close``. Its policy is the
one-process :class:`Trainer` with the model wrapped by DDP or sharded by FSDP2's
``fully_shard``: it overrides the policy's cross-rank hooks (``policy.py``), and runs the
one-process update (``update.py``) on its share; the loss of each rank is normalised by the
whole step's token (or row) count, so the summed gradient is the one-process gradient.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import tempfile
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...core import settings
from ...core.config import LoraConfig, TrainConfig
from ...core.storage import OPTIMIZER_FILE
from .policy import STATE_FILE
from .rows import Row, has_unknown_logprobs
from .trainer import Trainer

log = logging.getLogger(__name__)
COORDINATOR_ENV = settings.TRACERL_COORDINATOR.name          # host:port of the coordinator
COORDINATOR_KEY_ENV = settings.TRACERL_COORDINATOR_KEY.name  # hex authkey of that connection


def _full(value: Any) -> Any:
    """A sharded tensor gathered whole (a collective: every rank calls it), on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def write_files(files: dict[str, bytes], folder: Path) -> Path:
    """Materialise a checkpoint's files (sent over the wire) in ``folder``."""
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


class RankTrainer(Trainer):
    """The policy on one rank: the one-process trainer with its cross-rank hooks for DDP or
    FSDP2 (the model distributed, the optimizer state sharded, metric sums and the gradient
    norm over all ranks, idle passes that keep every rank's collectives equal)."""

    def __init__(self, strategy: str, model_path: Path, lora: LoraConfig,
                 adapter_path: Path | None, device: str, chat_template: str | None) -> None:
        self.strategy = strategy
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.gradient_scale = float(self.world_size)
        # FSDP2 gathers the root's parameters (embeddings, norm, head) in the root module's
        # forward, which the chunked head's path (the decoder alone) would skip
        self.fused_head = strategy != "fsdp2"
        super().__init__(model_path, lora, adapter_path=adapter_path, device=device,
                         chat_template=chat_template)

    # --- the model across ranks ------------------------------------------------------------

    def distribute(self, model: Any) -> Any:
        # a fresh LoRA is initialised at random on each rank: rank 0's copy is everyone's
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers (rotary tables) are the same everywhere: no broadcast in every forward
            return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        layer_classes = set(getattr(model.get_base_model(), "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """The one-process format (whole tensors); FSDP2 keeps each rank's shard of them."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, entry in state["state"].items():
            p = params[int(index)]
            if isinstance(p, DTensor):
                for key, value in entry.items():
                    if key != "step" and isinstance(value, torch.Tensor):
                        entry[key] = distribute_tensor(value.to(self.device), p.device_mesh,
                                                       p.placements)
        self.optimizer.load_state_dict(state)

    def sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        names = sorted(values)
        t = torch.tensor([values[n] for n in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(names, t.tolist(), strict=True))

    def max_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], max_norm)
        return float(_full(norm))

    # --- equal collectives on every rank: idle passes where a rank has no micro-batch -------

    def idle_pass(self, config: TrainConfig, backward: bool) -> None:
        """The forward (and backward) of a slot without rows: FSDP2 gathers parameters in
        every forward and DDP reduces gradients in every backward, so each rank runs as many
        passes as the others; a zero loss adds nothing to any gradient."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        t = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "keep": torch.tensor(1)}
        with contextlib.nullcontext() if backward else torch.no_grad():
            logits = self.logits(t)
        if backward and config.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                self.logits(t)
        if backward:
            (logits.float().sum() * 0.0).backward()

    @torch.no_grad()
    def fill_old_logprobs(self, batches: list[list[Row]]) -> None:
        needed = torch.tensor([float(any(has_unknown_logprobs(r) for b in batches for r in b))],
                              device=self.device)
        dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        if not needed.item():
            return
        for batch in batches:  # one forward per slot on every rank
            if any(has_unknown_logprobs(r) for r in batch):
                super().fill_old_logprobs([batch])
            else:
                self.idle_pass(TrainConfig(), backward=False)

    # --- checkpoints: gathered on every rank, written by rank 0 -----------------------------

    def checkpoint_files(self) -> dict[str, bytes] | None:
        """The checkpoint in the one-process format (adapter, whole optimizer state, step
        count): every rank gathers, rank 0 returns the files, the others None."""
        adapter = {k: _full(v) for k, v in self.model.state_dict().items() if "lora_" in k}
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {i: {k: _full(v) for k, v in s.items()}
                              for i, s in optimizer["state"].items()}
        if self.rank != 0:
            return None
        with tempfile.TemporaryDirectory(prefix="tracerl-rank0-") as tmp:
            self.model.save_pretrained(tmp, state_dict=adapter)
            buffer = io.BytesIO()
            torch.save(optimizer, buffer)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
        files[OPTIMIZER_FILE] = buffer.getvalue()
        files[STATE_FILE] = json.dumps({"steps_done": self.steps_done, "backend": "peft",
                                        "strategy": self.strategy,
                                        "world_size": self.world_size}).encode()
        return files


# --- the process ----------------------------------------------------------------------------

def _device() -> str:
    wanted = settings.TRACERL_RANK_DEVICE.get()
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        local_rank = settings.LOCAL_RANK.get()
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def _connect() -> Connection:
    host, _, port = settings.TRACERL_COORDINATOR.require().rpartition(":")
    return Client((host, int(port)),
                  authkey=bytes.fromhex(settings.TRACERL_COORDINATOR_KEY.require()))


def _load(payload: dict[str, Any], device: str, scratch: Path) -> RankTrainer:
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=timedelta(seconds=payload["timeout_s"]))
    adapter = None
    if payload["adapter_files"]:
        adapter = write_files(payload["adapter_files"], Path(tempfile.mkdtemp(dir=scratch)))
    return RankTrainer(payload["strategy"], Path(payload["model_path"]),
                       LoraConfig(**payload["lora"]), adapter, device, payload["chat_template"])


def serve(conn: Connection) -> None:
    """Run the coordinator's commands until ``close`` (or until it hangs up)."""
    device = _device()
    trainer: RankTrainer | None = None
    with tempfile.TemporaryDirectory(prefix="tracerl-rank-") as scratch:
        while True:
            try:
                command, payload = conn.recv()
            except EOFError:
                return
            try:
                if command == "load":
                    trainer = _load(payload, device, Path(scratch))
                    result: Any = {"device": device}
                elif command == "update" and trainer is not None:
                    result = trainer.update(payload["batches"], payload["totals"],
                                            TrainConfig(**payload["config"]))
                elif command == "save" and trainer is not None:
                    result = trainer.checkpoint_files()
                elif command == "close":
                    conn.send(("ok", None))
                    return
                else:
                    raise RuntimeError(f"command {command!r} before 'load'")
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", result))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    conn = _connect()
    conn.send(("hello", {"rank": settings.RANK.require(), "pid": os.getpid(),
                         "host": socket.gethostname()}))

    def on_term(signum: int, frame: Any) -> None:  # stopped by the launcher: say so, then go
        with contextlib.suppress(OSError):
            conn.send(("terminated", f"stopped by its launcher (signal {signum})"))
        os._exit(128 + signum)

    with contextlib.suppress(ValueError):  # not the main thread (a Ray actor): no handler
        signal.signal(signal.SIGTERM, on_term)
    try:
        serve(conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


if __name__ == "__main__":
    main()
