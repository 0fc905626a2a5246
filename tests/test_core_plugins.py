"""pluggy plugins: built-ins and a real third-party entry point, version checks, judges."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tracerl
from tracerl.core import plugins
from tracerl.core.lifecycle import score_group

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The example plugin, pip-installed (with its entry point) into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT / "tests" / "example_plugin"),
        ],
        check=True,
    )
    return target


def run_py(code, site, **env):
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}", **env},
        timeout=120,
    )


def test_builtins_are_listed_explicitly_and_loaded():
    names = {p.name: p for p in plugins.list_plugins()}
    for builtin in plugins.BUILTIN_PLUGINS:
        assert names[builtin].distribution == "tracerl"
    assert {"transformers", "vllm"} <= set(plugins.collect_classes("tracerl_engines"))
    assert {"local", "remote"} <= set(plugins.collect_classes("tracerl_backends"))


@pytest.mark.parametrize(("env", "loggers"), [
    ({"TRACERL_QUIET": "1"}, []),
    ({"TRACERL_QUIET": "0"}, ["console_logger"]),
    ({"TRACERL_QUIET": "1", "TRACERL_LOGGERS": "wandb"}, ["wandb_logger"]),
])
def test_loggers_are_registered_only_when_enabled(env, loggers):
    out = run_py(
        """
        from tracerl.core.plugins import get_plugin_manager
        names = get_plugin_manager().list_name_plugin()
        print(sorted(n for n, _ in names if n.endswith("_logger")))
    """,
        "",
        **{"TRACERL_LOGGERS": "", **env},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(loggers)


def test_an_unknown_logger_is_refused_by_name():
    out = run_py("""
        from tracerl.core.plugins import get_plugin_manager
        get_plugin_manager()
    """, "", TRACERL_LOGGERS="wandb,nosuchlogger")
    assert out.returncode != 0 and "nosuchlogger" in out.stderr


def test_third_party_entry_point_is_discovered_and_listed(plugin_site):
    out = subprocess.run(
        [sys.executable, "-m", "tracerl", "plugins", "-v"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": f"{plugin_site}:{ROOT}"},
    )
    assert out.returncode == 0, out.stderr
    assert "example_judge" in out.stdout and "tracerl-example-plugin 0.0.1" in out.stdout
    assert "tracerl_score_group" in out.stdout
    assert "engines: " in out.stdout and "transformers" in out.stdout


def test_hook_reference_lists_every_hookspec_and_its_implementers(plugin_site):
    from tracerl.core import hookspecs

    specs = [n for n, f in vars(hookspecs).items() if hasattr(f, "tracerl_spec")]
    reference = plugins.hook_reference()
    assert [h.name for h in reference] == specs and len(specs) >= 10
    by_name = {h.name: h for h in reference}
    assert (
        by_name["tracerl_score_group"].first_result
        and "ruler" in by_name["tracerl_score_group"].implemented_by
    )
    assert by_name["tracerl_on_llm_call"].signature == "tracerl_on_llm_call(call: LLMCall) -> None"

    out = subprocess.run([sys.executable, "-m", "tracerl", "hooks"], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": f"{plugin_site}:{ROOT}"})
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in specs)
    score_section = out.stdout.split("\ntracerl_score_group(", 1)[1]
    assert "[first result wins]" in score_section.splitlines()[0]
    assert "example_judge" in score_section.split("implemented by:", 1)[1].splitlines()[0]


def test_third_party_judge_and_logger_hooks_run(plugin_site):
    out = run_py("""
        import asyncio, tracerl
        from tracerl.core.lifecycle import score_group
        g = tracerl.TrajectoryGroup([
            tracerl.Trajectory(messages_and_choices=[{"role": "assistant", "content": "abc"}]),
            tracerl.Trajectory(messages_and_choices=[{"role": "assistant", "content": "a"}])])
        scored = asyncio.run(score_group(g, judge="length"))
        print([t.reward for t in scored])
    """, plugin_site)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3.0, 1.0]"


def test_blocked_plugins_are_not_loaded(plugin_site):
    out = run_py("""
        from tracerl.core.plugins import list_plugins
        print(sorted(p.name for p in list_plugins()))
    """, plugin_site, TRACERL_BLOCK_PLUGINS="example_judge")
    assert out.returncode == 0, out.stderr
    assert "example_judge" not in out.stdout and "local_backend" in out.stdout


def test_plugin_needing_a_newer_api_is_refused_by_name():
    class Future:
        TRACERL_PLUGIN_API = tracerl.HOOKSPEC_VERSION + 1

    wanted = tracerl.HOOKSPEC_VERSION + 1
    with pytest.raises(tracerl.PluginError, match=rf"'future' needs tracerl plugin API {wanted}"):
        plugins.register(Future(), name="future")


def test_runtime_registered_judge_scores_and_unknown_judge_fails_clearly():
    class Judge:
        @tracerl.hookimpl
        def tracerl_score_group(self, group, judge):
            if judge != "constant":
                return None

            async def score():
                for t in group.trajectories:
                    t.reward = 0.5
                return group

            return score()

    import asyncio

    name = plugins.register(Judge(), name="constant-judge")
    try:
        g = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[])])
        assert asyncio.run(score_group(g, judge="constant")).trajectories[0].reward == 0.5
        with pytest.raises(tracerl.PluginError, match="no judge plugin"):
            asyncio.run(score_group(g, judge="nobody"))
    finally:
        plugins.get_plugin_manager().unregister(name=name)


def test_hook_implementation_without_spec_is_rejected():
    class Typo:
        @tracerl.hookimpl
        def tracerl_on_llm_cal(self, call):  # misspelt hook name
            pass

    with pytest.raises(tracerl.PluginError, match="tracerl_on_llm_cal"):
        plugins.register(Typo(), name="typo")
    assert plugins.get_plugin_manager().get_plugin("typo") is None
