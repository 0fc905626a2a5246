"""pluggy plugins: built-ins and a real third-party entry point, version checks, judges."""

import asyncio
import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tracerl
from tracerl.events import hookspecs, plugins
from tracerl.events.lifecycle import score_group
from tracerl.tasks import base as tasks_base

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The example plugin, pip-installed (with its entry point) into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "tests" / "example_plugin")],
        check=True,
    )
    return target


def run_py(code, site, **env):
    """Python code in a fresh interpreter (a fresh plugin manager) with ``site`` importable."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}", **env},
        timeout=120,
    )


def run_cli(*args, site):
    return subprocess.run([sys.executable, "-m", "tracerl", *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"},
                          timeout=120)


@pytest.mark.parametrize("builtin", list(plugins.BUILTIN_PLUGINS))
def test_each_builtin_plugin_is_loaded_as_part_of_tracerl(builtin):
    names = {p.name: p for p in plugins.list_plugins()}
    assert names[builtin].distribution == "tracerl"


@pytest.mark.parametrize(("hook", "provided"), [
    ("tracerl_engines", {"transformers", "vllm"}),
    ("tracerl_backends", {"local", "remote"}),
], ids=["engines", "backends"])
def test_builtin_plugins_provide_the_engines_and_backends(hook, provided):
    assert provided <= set(plugins.collect_classes(hook))


LOGGER_SETTINGS = {
    "quiet": ({"TRACERL_QUIET": "1"}, []),
    "console-by-default": ({"TRACERL_QUIET": "0"}, ["console_logger"]),
    "wandb-when-named": ({"TRACERL_QUIET": "1", "TRACERL_LOGGERS": "wandb"}, ["wandb_logger"]),
    "console-and-langfuse": ({"TRACERL_QUIET": "0", "TRACERL_LOGGERS": "console, langfuse"},
                             ["console_logger", "langfuse_logger"]),
    "weave-and-wandb": ({"TRACERL_QUIET": "1", "TRACERL_LOGGERS": "weave,wandb"},
                        ["wandb_logger", "weave_logger"]),
}


@pytest.mark.parametrize("case", LOGGER_SETTINGS, ids=list(LOGGER_SETTINGS))
def test_loggers_are_registered_only_when_enabled(case):
    env, loggers = LOGGER_SETTINGS[case]
    out = run_py(
        """
        from tracerl.events.plugins import get_plugin_manager
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
        from tracerl.events.plugins import get_plugin_manager
        get_plugin_manager()
    """, "", TRACERL_LOGGERS="wandb,nosuchlogger")
    assert out.returncode != 0
    assert "PluginError" in out.stderr and "nosuchlogger" in out.stderr


@pytest.fixture(scope="module")
def plugins_listing(plugin_site):
    out = run_cli("plugins", "-v", site=plugin_site)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_third_party_entry_point_is_listed_with_its_distribution(plugins_listing):
    assert "example_judge" in plugins_listing
    assert "tracerl-example-plugin 0.0.1" in plugins_listing


def test_the_plugin_listing_names_the_hooks_a_plugin_implements(plugins_listing):
    assert "tracerl_score_group" in plugins_listing


def test_the_plugin_listing_names_the_engines(plugins_listing):
    (engines,) = [ln for ln in plugins_listing.splitlines() if ln.startswith("engines: ")]
    assert "transformers" in engines


SPECS = [n for n, f in vars(hookspecs).items() if hasattr(f, "tracerl_spec")]


def test_hook_reference_lists_every_hookspec_in_source_order():
    assert len(SPECS) >= 10
    assert [h.name for h in plugins.hook_reference()] == SPECS


def test_hook_reference_says_the_first_judge_wins_and_who_implements_it():
    by_name = {h.name: h for h in plugins.hook_reference()}
    assert by_name["tracerl_score_group"].first_result
    assert "ruler" in by_name["tracerl_score_group"].implemented_by


def test_hook_reference_gives_each_hooks_signature():
    by_name = {h.name: h for h in plugins.hook_reference()}
    assert by_name["tracerl_on_llm_call"].signature == "tracerl_on_llm_call(call: LLMCall) -> None"


@pytest.fixture(scope="module")
def hooks_listing(plugin_site):
    out = run_cli("hooks", site=plugin_site)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("spec", SPECS)
def test_tracerl_hooks_lists_every_hook(hooks_listing, spec):
    assert f"\n{spec}(" in f"\n{hooks_listing}"


def test_tracerl_hooks_names_third_party_implementers(hooks_listing):
    score_section = hooks_listing.split("\ntracerl_score_group(", 1)[1]
    assert "[first result wins]" in score_section.splitlines()[0]
    assert "example_judge" in score_section.split("implemented by:", 1)[1].splitlines()[0]


def test_a_third_party_judge_scores_a_group(plugin_site):
    out = run_py("""
        import asyncio, tracerl
        from tracerl.events.lifecycle import score_group
        g = tracerl.TrajectoryGroup([
            tracerl.Trajectory(messages_and_choices=[{"role": "assistant", "content": "abc"}]),
            tracerl.Trajectory(messages_and_choices=[{"role": "assistant", "content": "a"}])])
        scored = asyncio.run(score_group(g, judge="length"))
        print([t.reward for t in scored])
    """, plugin_site)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3.0, 1.0]"


def test_a_third_party_logger_receives_logged_metrics(plugin_site):
    out = run_py("""
        import asyncio, tracerl, tracerl_example_plugin
        from tracerl.events.lifecycle import step_logged
        model = tracerl.ModelSpec(name="m", project="p", base_model="smollm2")
        asyncio.run(step_logged(model, 3, "val", {"reward": 0.25}, []))
        print(tracerl_example_plugin.LOGGED)
    """, plugin_site)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('m', 3, 'val', 0.25)]"


@pytest.mark.parametrize(("blocked", "loaded"), [("", True), ("example_judge", False)],
                         ids=["not-blocked", "blocked"])
def test_blocked_plugins_are_not_loaded(plugin_site, blocked, loaded):
    out = run_py("""
        from tracerl.events.plugins import list_plugins
        print("\\n".join(sorted(p.name for p in list_plugins())))
    """, plugin_site, TRACERL_BLOCK_PLUGINS=blocked)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    assert "local_backend" in names
    assert ("example_judge" in names) is loaded


def test_plugin_needing_a_newer_api_is_refused_by_name():
    class Future:
        TRACERL_PLUGIN_API = tracerl.HOOKSPEC_VERSION + 1

    wanted = tracerl.HOOKSPEC_VERSION + 1
    with pytest.raises(tracerl.PluginError, match=rf"'future' needs tracerl plugin API {wanted}"):
        plugins.register(Future(), name="future")
    assert plugins.get_plugin_manager().get_plugin("future") is None


@pytest.fixture
def constant_judge():
    """A judge registered at run time, answering only to judge="constant"."""
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

    name = plugins.register(Judge(), name="constant-judge")
    yield
    plugins.get_plugin_manager().unregister(name=name)


def one_trajectory_group():
    return tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[])])


def test_a_runtime_registered_judge_scores_groups(constant_judge):
    scored = asyncio.run(score_group(one_trajectory_group(), judge="constant"))
    assert [t.reward for t in scored.trajectories] == [0.5]


def test_a_judge_nobody_implements_fails_clearly(constant_judge):
    with pytest.raises(tracerl.PluginError, match="no judge plugin"):
        asyncio.run(score_group(one_trajectory_group(), judge="nobody"))


def test_hook_implementation_without_spec_is_rejected():
    class Typo:
        @tracerl.hookimpl
        def tracerl_on_llm_cal(self, call):  # misspelt hook name
            pass

    with pytest.raises(tracerl.PluginError, match="tracerl_on_llm_cal"):
        plugins.register(Typo(), name="typo")
    assert plugins.get_plugin_manager().get_plugin("typo") is None


def test_a_third_party_protocol_and_engine_are_served_and_recorded(plugin_site, tmp_path):
    """The example plugin's engine (``echo``) and protocol (``/v1/plain``) are served by a real
    gateway with no edit outside the plugin's own files; every call is recorded token-exactly,
    plain and streamed, and tracerl's own protocols run on the plugin's engine too."""
    out = run_py(f"""
        import asyncio, json, httpx, tracerl

        async def main():
            backend = tracerl.LocalBackend(path={str(tmp_path)!r}, engine="echo")
            model = tracerl.TrainableModel(name="m", project="p", base_model="smollm2")
            await model.register(backend)
            url = backend.base_url
            async with httpx.AsyncClient(timeout=30) as c:
                plain = await c.post(url + "/plain", json={{"model": "m", "input": "hello"}},
                                     headers={{"x-rollout-id": "r1"}})
                async with c.stream("POST", url + "/plain", headers={{"x-rollout-id": "r2"}},
                                    json={{"model": "m", "input": "abc", "stream": True}}) as s:
                    events = [line async for line in s.aiter_lines() if line]
                bad = await c.post(url + "/plain", json={{"model": "m", "input": 3}},
                                   headers={{"x-rollout-id": "r3"}})
                chat = await c.post(url + "/chat/completions", headers={{"x-rollout-id": "r4"}},
                                    json={{"model": "m", "messages": [
                                        {{"role": "user", "content": "xy"}}]}})
            calls = {{r: [c.model_dump(mode="json") for c in await backend.fetch_calls(model, r)]
                     for r in ("r1", "r2", "r3", "r4")}}
            await backend.close()
            print(json.dumps({{"plain": [plain.status_code, plain.json()], "events": events,
                              "bad": [bad.status_code, bad.json()],
                              "chat": chat.json()["choices"][0]["message"]["content"],
                              "calls": calls}}))

        asyncio.run(main())
    """, plugin_site)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    status, answer = got["plain"]
    assert status == 200 and answer["output"] == "olleh" and answer["id"].startswith("plain-")
    assert got["events"] == ['data: {"delta": "c"}', 'data: {"delta": "b"}',
                             'data: {"delta": "a"}', "data: end"]
    assert got["bad"][0] == 400 and got["bad"][1]["error"]["param"] == "input"
    assert got["chat"] == "yx"
    (plain_call,), (streamed_call,), no_calls, (chat_call,) = got["calls"].values()
    assert no_calls == []  # refused before the engine: nothing recorded
    # the gateway's turn verdict (``gateway/turns.py``) rides on every protocol's record
    assert plain_call["metadata"] == {"protocol": "plain", "id": answer["id"],
                                      "turn": {"verdict": "first"}}
    completion = plain_call["completions"][0]
    assert completion["token_ids"] == list(b"olleh") and completion["logprobs"] == [0.0] * 5
    assert plain_call["prompt_token_ids"] == list(b"user:hello\n")
    assert streamed_call["streamed"] and streamed_call["completions"][0]["token_ids"] == list(
        b"cba")
    assert chat_call["completions"][0]["text"] == "yx" and "protocol" not in chat_call["metadata"]


def test_a_third_party_task_joins_the_catalog_and_plays(plugin_site, tmp_path):
    """The example plugin's task (its ``tracerl_tasks``, an entry point loaded by pluggy) is in
    the catalog beside tracerl's own and is evaluated on the plugin's echo engine, which
    answers every item right."""
    out = run_py(f"""
        import asyncio, json, tracerl
        from tracerl.tasks import TASK_NAMES, evaluate, get_task, task_names

        async def main():
            task = get_task("example-reverse")
            backend = tracerl.LocalBackend(path={str(tmp_path)!r}, engine="echo")
            model = tracerl.TrainableModel(name="m", project="p", base_model="smollm2",
                                           config=task.model_config())
            await model.register(backend)
            summary = await evaluate(task, model, n=3, log_to_model=False)
            await backend.close()
            print(json.dumps({{"names": task_names(), "builtin": TASK_NAMES,
                              "success": summary["metrics/success"]}}))

        asyncio.run(main())
    """, plugin_site)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["names"] == sorted([*got["builtin"], "example-reverse"])
    assert "tool-products" in got["builtin"] and got["success"] == 1.0


def test_tracerl_eval_finds_a_third_party_task(plugin_site, tmp_path):
    """``tracerl eval --task`` takes the plugin's task (the command goes on to the model
    folder, which is not one) and lists it among the catalog for an unknown name."""
    found = run_cli("eval", str(tmp_path), "--task", "example-reverse", site=plugin_site)
    assert found.returncode == 2 and "is not a model folder" in found.stderr, found.stderr
    unknown = run_cli("eval", str(tmp_path), "--task", "nosuch", site=plugin_site)
    assert unknown.returncode == 2
    assert "unknown task 'nosuch'" in unknown.stderr and "example-reverse" in unknown.stderr


@pytest.fixture
def runtime_tasks():
    """Register a plugin giving ``tasks`` (a dict) at run time; unregistered afterwards."""
    names = []

    def register(tasks, name):
        class Tasks:
            @tracerl.hookimpl
            def tracerl_tasks(self):
                return tasks

        names.append(plugins.register(Tasks(), name=name))

    yield register
    for name in names:
        plugins.get_plugin_manager().unregister(name=name)


def test_a_task_name_two_plugins_give_is_refused_naming_both(runtime_tasks):
    from tracerl.tasks import get_task

    runtime_tasks({"tool-products": "my_tasks:TASK"}, "clashing-tasks")
    with pytest.raises(tracerl.PluginError, match=r"task 'tool-products': 'clashing-tasks' "
                       r"\(my_tasks:TASK\) and 'tasks' \(tracerl\.tasks\.tool_products:TASK\)"):
        get_task("game-guess-number")


def test_a_malformed_task_table_is_refused_naming_its_plugin(runtime_tasks):
    from tracerl.tasks import task_names

    runtime_tasks(["my-task"], "listed-tasks")
    with pytest.raises(tracerl.PluginError, match=r"'listed-tasks'.*not a dict"):
        task_names()


async def never_played(model, item, **options):
    raise AssertionError("get_task refuses the task before it is played")


NEEDY_TASK = tasks_base.Task(
    name="needy", summary="needs a library nobody has", source="tests", framework="none",
    draw=lambda seed, n: [], rollout=never_played, model_config=tasks_base.lora_config_for(256),
    requires=("json", "no_such_library_xyz"), install="pip install needy-extra")


def test_a_task_missing_a_library_says_what_to_install(runtime_tasks):
    from tracerl.core.errors import ConfigError
    from tracerl.tasks import get_task

    runtime_tasks({"needy": f"{__name__}:NEEDY_TASK", "not-a-task": f"{__name__}:SPECS"},
                  "needy-tasks")
    with pytest.raises(ConfigError, match=r"^task needy needs no_such_library_xyz: "
                       r"pip install needy-extra$"):
        get_task("needy")
    with pytest.raises(ConfigError, match=rf"{__name__}\.SPECS is not a tracerl\.tasks\.Task"):
        get_task("not-a-task")


CALL_PATH = """
    import asyncio, collections, json, sys, threading, httpx, tracerl

    DRIVERS = {"_handle", "_pump", "stream_answer"}  # the functions that drive one call
    entered, on = [], threading.Event()

    def profile(frame, event, arg):
        caller = frame.f_back
        if event != "call" or not on.is_set() or caller is None \\
                or caller.f_code.co_name not in DRIVERS:
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("tracerl.", "tracerl_example_plugin")) \\
                and (module, frame.f_code.co_qualname) not in entered:
            entered.append((module, frame.f_code.co_qualname))

    async def main():
        threading.setprofile(profile)  # the gateway's thread starts after this
        backend = tracerl.LocalBackend(path=sys.argv[1], engine="echo")
        model = tracerl.TrainableModel(name="m", project="p", base_model="smollm2")
        await model.register(backend)
        paths = {}
        async with httpx.AsyncClient(timeout=30) as c:
            for stream in (False, True):
                body = {"model": "m", "messages": [{"role": "user", "content": "abc"}],
                        "stream": stream}
                entered.clear()
                on.set()
                r = await c.post(backend.base_url + "/chat/completions", json=body)
                on.clear()
                assert r.status_code == 200, r.text
                paths["stream" if stream else "plain"] = list(entered)
        await backend.close()
        print(json.dumps(paths))

    asyncio.run(main())
"""


def test_one_call_enters_each_module_of_its_path_at_most_twice(plugin_site, tmp_path):
    """A call's path (gateway -> protocol -> served model -> engine -> recorder -> storage), as
    the functions its driving frames call: no module is entered more than twice. A stream adds
    one call per chunk to the protocol and the assembler (its loop) and their closing calls."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CALL_PATH), str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{plugin_site}:{ROOT}"})
    assert out.returncode == 0, out.stderr
    paths = json.loads(out.stdout.strip().splitlines()[-1])
    plain = collections.Counter(module for module, _ in paths["plain"])
    assert max(plain.values()) <= 2, paths["plain"]
    assert [f for _, f in paths["plain"]][-4:] == [
        "Admission.__exit__", "PassThrough.answer", "CallRecording.finish",
        "Exchange.recorded"]
    stream = collections.Counter(module for module, _ in paths["stream"])
    per_chunk = {"tracerl.backend.protocols.openai", "tracerl.backend.protocols.replies"}
    assert all(n <= 2 for m, n in stream.items() if m not in per_chunk), paths["stream"]
    assert all(stream[m] == 3 for m in per_chunk), paths["stream"]
