"""A trainer killed with SIGKILL leaves no inference server behind.

vLLM servers are started in their own session (so that stopping one stops its whole process
tree), which also means nothing kills them when the trainer dies: on a GPU an orphaned server
keeps holding most of the memory. The engine asks Linux to SIGTERM the server when its parent
dies. The stand-in server (``benchmarks/instant_vllm``, started by the real vLLM engine in place
of vLLM) makes this fast; the mechanism is the engine's, not the server's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults_support import alive

INSTANT_VLLM = Path(__file__).resolve().parents[1] / "benchmarks" / "instant_vllm"

TRAINER = """
import asyncio, sys
import tracerl

async def main():
    backend = tracerl.LocalBackend(path=sys.argv[1], engine="vllm")
    model = tracerl.TrainableModel(name="m", project="p", base_model=sys.argv[2])
    await model.register(backend)
    engine = next(iter(backend.gateway.models.values())).engine
    print(engine.process.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_server_dies_with_a_trainer_killed_by_sigkill(tmp_path, smollm2_path):
    env = {**os.environ, "TRACERL_VLLM_PYTHON": str(INSTANT_VLLM)}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path), str(smollm2_path)],
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = trainer.stdout.readline()  # the trainer prints once the server answers
        assert line.strip().isdigit(), f"the trainer did not start its server: {line!r}"
        server = int(line)
        assert alive(server)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive(server):
            assert time.monotonic() < deadline, f"server {server} outlived its killed trainer"
            time.sleep(0.1)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
