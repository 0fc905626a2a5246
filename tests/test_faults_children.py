"""Children die with the command that started them: every process tracerl starts (the LiteLLM
proxy, vLLM servers, torchrun and its trainer ranks) is started by one helper,
:func:`tracerl.core.net.start_child`, which makes Linux SIGTERM it when its parent ends, even by
SIGKILL; long-running commands stop their children on SIGTERM and SIGINT. Real processes; the
parent is signalled alone (never its process group), and each child must be gone within a
deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import tracerl
from tests.faults_support import alive
from tests.remote_server import API_KEY, ROOT, free_port
from tracerl.core.net import stop_process_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")
LITELLM_PYTHON = os.environ.get("TRACERL_LITELLM_PYTHON")
INSTANT_VLLM = ROOT / "benchmarks" / "instant_vllm"
GONE_WITHIN_S = 60.0


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def wait_for(condition, what: str, timeout_s: float = GONE_WITHIN_S):
    """Poll ``condition`` every 0.1 s until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not (held := condition()):
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.1)
    return held


def assert_gone(pids: list[int], after: str) -> None:
    wait_for(lambda: not any(alive(p) for p in pids),
             f"processes {[p for p in pids if alive(p)]} to end after {after}")


def env_for_children(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("LITELLM_MASTER_KEY", None)
    return env


def kill_groups(pids: list[int]) -> None:
    """SIGKILL what a failed test left behind (each child leads a process group of its own)."""
    for pid in pids:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def as_a_terminal_starts_it() -> None:
    """In the child before exec: SIGINT at its default, as a shell's foreground job has it. A
    script's background job (``cmd &``, as a CI runner may start the tests) inherits SIGINT
    ignored, and Python keeps ignoring it: the command would rightly outlive a SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def end(parent: subprocess.Popen, sig: signal.Signals) -> None:
    """Send ``sig`` to ``parent`` alone and reap it."""
    parent.send_signal(sig)
    try:
        parent.wait(GONE_WITHIN_S)
    except subprocess.TimeoutExpired:
        parent.kill()
        parent.wait()
        raise AssertionError(f"the parent outlived {sig.name} by {GONE_WITHIN_S} s") from None


# --- the helper --------------------------------------------------------------------------------

ECHO = "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: print('TERM', flush=True))\n" \
       "for line in sys.stdin:\n    print(line.strip(), flush=True)\n"


def test_a_child_outlives_the_short_lived_thread_that_started_it():
    """Linux signals a child when the *thread* that forked it ends: a child started from a
    worker thread (``asyncio.to_thread``) must not be killed when that thread ends."""
    from tracerl.core.net import start_child

    started: list[subprocess.Popen] = []
    native: list[int] = []

    def worker() -> None:
        native.append(threading.get_native_id())
        started.append(start_child([sys.executable, "-c", ECHO], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    (child,) = started
    try:  # the thread is gone from the kernel (any death signal has been sent by then)
        wait_for(lambda: not Path(f"/proc/self/task/{native[0]}").exists(), "the thread to end")
        child.stdin.write(b"ping\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"ping\n"  # a TERM would have printed first
    finally:
        stop_process_group(child, 10)


# --- tracerl proxy: the LiteLLM proxy ----------------------------------------------------------

@pytest.mark.skipif(not LITELLM_PYTHON, reason="TRACERL_LITELLM_PYTHON (LiteLLM's proxy venv)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_the_litellm_proxy_ends_with_tracerl_proxy(tf_backend, tmp_path, sig):
    backend, model = tf_backend
    command = subprocess.Popen(
        [sys.executable, "-m", "tracerl", "proxy", "--backend-url", backend.base_url,
         "--model", model.get_inference_name(), "--port", str(free_port())],
        cwd=tmp_path, env=env_for_children(TRACERL_LITELLM_PYTHON=LITELLM_PYTHON or ""),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=as_a_terminal_starts_it)
    started: list[int] = []
    try:
        lines = []
        for line in command.stdout:  # "master key:" is printed once the proxy answers
            lines.append(line)
            if line.startswith("master key:"):
                break
        assert command.poll() is None, "".join(lines)[-3000:]
        started += children(command.pid)
        (litellm,) = started
        end(command, sig)
        assert_gone([litellm], f"{sig.name} of tracerl proxy")
    finally:
        command.kill()
        command.wait()
        kill_groups(started)
    if sig != signal.SIGKILL:  # stopped by the command itself, which then exits as Ctrl-C does
        assert command.returncode == 130


# --- tracerl serve: vLLM servers (the instant stand-in, started by the real vLLM engine) -------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
async def test_vllm_servers_end_with_tracerl_serve(tmp_path, sig):
    port = free_port()
    command = subprocess.Popen(
        [sys.executable, "-m", "tracerl", "serve", "--port", str(port), "--engine", "vllm"],
        cwd=tmp_path, env=env_for_children(TRACERL_API_KEY=API_KEY,
                                           TRACERL_VLLM_PYTHON=str(INSTANT_VLLM)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: list[int] = []
    try:
        lines = await asyncio.to_thread(_lines_until, command, "tracerl serve: ready")
        backend = tracerl.RemoteBackend(f"http://127.0.0.1:{port}", api_key=API_KEY)
        model = tracerl.TrainableModel(name="m", project="p", base_model="smollm2")
        await model.register(backend)
        await backend.close()
        started += children(command.pid)
        (server,) = started
        assert alive(server), lines
        end(command, sig)
        assert_gone([server], f"{sig.name} of tracerl serve")
    finally:
        command.kill()
        command.wait()
        kill_groups(started)
    assert (tmp_path / ".tracerl" / "p" / "models" / "m").is_dir()  # its default --path
    if sig == signal.SIGTERM:
        assert command.returncode == 0


def _lines_until(command: subprocess.Popen, mark: str) -> str:
    lines = []
    for line in command.stdout:
        lines.append(line)
        if mark in line:
            return "".join(lines)
    raise AssertionError(f"exited with {command.wait()} before {mark!r}:\n{''.join(lines)}")


# --- the local launcher: torchrun and its trainer ranks ------------------------------------------

LAUNCHER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tracerl.backend.launchers.local import LocalLauncher
    from tracerl.core.config import DistributedTrainerConfig

    launcher = LocalLauncher(DistributedTrainerConfig(launcher="local", world_size=2))
    launcher.start_ranks("tests.idle_rank", {}, Path(sys.argv[1]))
    print(launcher.process.pid, flush=True)
    sys.stdin.read()  # until the test ends it
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_torchrun_and_its_ranks_end_with_the_process_that_launched_them(tmp_path, sig):
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "ranks.log")],
                              cwd=ROOT, env=env_for_children(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    started: list[int] = []
    try:
        started.append(torchrun := int(parent.stdout.readline()))
        ranks = wait_for(lambda: len(found := children(torchrun)) == 2 and found,
                         "torchrun to start 2 ranks", 120)
        end(parent, sig)
        assert_gone([torchrun, *ranks], f"{sig.name} of the launching process")
    finally:
        parent.kill()
        parent.wait()
        kill_groups(started)
