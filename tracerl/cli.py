"""The ``tracerl`` command line. Each sub-command imports only what it needs."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from .core import settings
from .core.config import DistributedTrainerConfig
from .core.errors import ConfigError, TracerlError
from .core.net import is_loopback

if TYPE_CHECKING:
    from .core.engine import Engine
    from .core.launcher import Launcher


def _availability(classes: Mapping[str, type[Engine] | type[Launcher]]) -> str:
    """``name, name (unavailable)``: plugin classes and whether they can run here."""
    return ", ".join(f"{n}{'' if cls.available() else ' (unavailable)'}"
                     for n, cls in sorted(classes.items()))


def _cmd_plugins(args: argparse.Namespace) -> int:
    from .events.hookspecs import HOOKSPEC_VERSION
    from .events.plugins import collect_classes, list_plugins

    print(f"tracerl plugin API {HOOKSPEC_VERSION}")
    for p in list_plugins():
        origin = f"{p.distribution} {p.version}" if p.distribution else "registered at run time"
        print(f"{p.name:24} {p.module:45} {origin}")
        if args.verbose:
            for h in p.hooks:
                print(f"{'':26}{h}")
    engines = collect_classes("tracerl_engines")
    print("engines: " + _availability(engines))
    backends = collect_classes("tracerl_backends")
    print("backends: " + ", ".join(sorted(backends)))
    print("launchers: " + _availability(collect_classes("tracerl_launchers")))
    return 0


def _cmd_hooks(args: argparse.Namespace) -> int:
    import textwrap

    from .events.hookspecs import HOOKSPEC_VERSION
    from .events.plugins import hook_reference

    print(f"tracerl plugin API {HOOKSPEC_VERSION}: implement these in a module decorated with "
          "@tracerl.hookimpl (any subset of each hook's arguments)")
    for hook in hook_reference():
        print(f"\n{hook.signature}" + ("  [first result wins]" if hook.first_result else ""))
        print(textwrap.indent(hook.doc, "    "))
        print(f"    implemented by: {', '.join(hook.implemented_by) or 'no loaded plugin'}")
    return 0


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    from .backend.weights import resolve_base_model

    print(resolve_base_model(args.base_model))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.task == "agent":
        import asyncio

        from .agent_demo import agent_demo

        engine = "transformers" if args.engine == "auto" else args.engine
        asyncio.run(agent_demo(steps=args.steps or 10, engine=engine, base_path=args.base_path,
                               seed=args.seed, group_size=args.group_size,
                               items_per_step=args.groups))
        return 0
    from .demo import run_demo

    return run_demo(steps=args.steps, engine=args.engine, base_path=args.base_path,
                    group_size=args.group_size, groups_per_step=args.groups,
                    trainer=_trainer_config(args), seed=args.seed)


def _cmd_eval(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from .tasks.evaluation import eval_steps, table

    results = asyncio.run(eval_steps(
        Path(args.model_dir), args.task, args.steps, n=args.n, samples=args.samples,
        temperature=args.temperature, seed=args.seed, engine=args.engine, log=not args.no_log,
        allow_failures=args.allow_failures))
    print(f"{args.task}: held-out, {args.n} items x {args.samples} "
          f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}'})")
    print(table(results))
    return 0


def _add_trainer_args(p: argparse.ArgumentParser) -> None:
    """Options of the distributed trainer (``DistributedTrainerConfig``)."""
    p.add_argument("--launcher", default=None,
                   help="train on torch.distributed ranks started by this launcher: local "
                   "(torchrun on this host) or ray (Ray actors; pip install 'tracerl[ray]')")
    p.add_argument("--world-size", type=int, default=None, help="trainer ranks (default 2)")
    p.add_argument("--strategy", choices=["ddp", "fsdp2"], default=None,
                   help="ddp (default) or fsdp2 (the frozen base sharded too)")
    p.add_argument("--ray-address", default=None, help="the Ray cluster to join, e.g. auto")
    p.add_argument("--placement", default=None,
                   choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="Ray placement strategy of the ranks (SPREAD: one node each)")


def _trainer_config(args: argparse.Namespace) -> DistributedTrainerConfig | None:
    given = {"launcher": args.launcher, "world_size": args.world_size,
             "strategy": args.strategy, "ray_address": args.ray_address,
             "placement_strategy": args.placement}
    given = {k: v for k, v in given.items() if v is not None}
    return DistributedTrainerConfig(**given) if given else None


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_comparison, write_png, write_report

    if len(args.model_dir) > 1:
        if args.serve or args.png or args.step is not None:
            raise ConfigError("several model folders make one comparison report: --serve, "
                              "--png and --step take one folder")
        print(write_comparison(args.model_dir, out=args.out))
        return 0
    model_dir = args.model_dir[0]
    if args.serve:
        from .viewer import serve_report

        return serve_report(model_dir, host=args.host, port=args.port)
    print(write_report(model_dir, out=args.out, step=args.step))
    if args.png:
        print(write_png(model_dir))
    return 0


def _cmd_release(args: argparse.Namespace) -> int:
    """``tracerl promote MODEL N`` / ``tracerl rollback MODEL --to N``: through a running
    ``tracerl serve`` (effective for its next call), or in a model folder (``--path``: read
    when the server next starts)."""
    import json
    import urllib.error
    import urllib.request

    from .core import settings
    from .core.errors import ConfigError
    from .core.model_name import ModelName

    model = ModelName.parse(args.model)
    project, name = model.project, model.name
    if not project:
        raise ConfigError(f"MODEL must be PROJECT/NAME, not {args.model!r}")
    step = args.step if args.command == "promote" else args.to
    if args.path:
        from .core.release_log import ReleaseLog
        from .core.storage import ModelStore

        store = ModelStore(args.path, project, name)
        if not (store.root / "model.json").is_file():
            raise ConfigError(f"--path {args.path} holds no model {project}/{name} (no "
                              f"{store.root / 'model.json'}); nothing was written")
        if step > 0 and step not in store.checkpoint_steps():
            raise ConfigError(f"{args.model} has no checkpoint {step} "
                              f"(checkpoints: {store.checkpoint_steps()})")
        releases = ReleaseLog(store.root)
        releases.begin(args.command, step, releases.recover().incumbent, reason="by hand")
        releases.commit(args.command, step)
        print(f"{args.model}: incumbent {step} (served when the server next starts)")
        return 0
    key = settings.read_named(args.api_key_env) or "tracerl-local"
    body = {"step": step} if args.command == "promote" else {"to": step}
    request = urllib.request.Request(
        f"{args.server.rstrip('/')}/api/v1/models/{project}/{name}/release/{args.command}",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(f"tracerl: error: {e.code} {e.read().decode(errors='replace')}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError) as e:  # refused, unreachable, timed out
        reason = getattr(e, "reason", e)
        print(f"tracerl: error: could not reach tracerl serve at {args.server} ({reason}); is "
              "it running? (--server; --path changes a stopped server's folder)",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"tracerl: error: {args.server} answered something that is not JSON ({e})",
              file=sys.stderr)
        return 2
    print(f"{args.model}: incumbent {answer.get('incumbent')}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from .doctor import as_json, doctor, worst

    findings = doctor(run=args.run, live=args.live, env=not args.no_env,
                      base_model=args.base_model, engine=args.engine, path=args.path)
    if args.json:
        print(json.dumps(as_json(findings), indent=2))
    else:
        for f in findings:
            print(f.line())
        print(f"tracerl doctor: {worst(findings)}")
    return 1 if worst(findings) == "fail" else 0


def _cmd_proxy(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from .integrations.litellm_proxy import LiteLLMProxy

    proxy = LiteLLMProxy(upstream_base_url=args.backend_url, model_names=args.model,
                         upstream_api_key=args.api_key, host=args.host, port=args.port,
                         python=args.litellm_python, directory=Path(args.dir),
                         master_key=args.master_key or settings.LITELLM_MASTER_KEY.get())
    if not is_loopback(args.host):
        logging.getLogger(__name__).warning(
            "the proxy listens on %s; anyone who can reach it and holds the master key can use "
            "the model", args.host)
    with proxy:  # Ctrl-C and SIGTERM (a KeyboardInterrupt, see main) stop it on the way out
        print(f"LiteLLM proxy: {proxy.base_url}\nmaster key:    {proxy.master_key}\n"
              f"name the rollout with header x-rollout-id: <id>, or body metadata "
              f'{{"rollout_id": "<id>"}}; Ctrl-C stops', flush=True)
        while proxy.process is not None and proxy.process.poll() is None:
            time.sleep(1)
    return 1  # the proxy itself exited


def _cmd_serve(args: argparse.Namespace) -> int:
    from .remote.serve import parse_base_models, placement_options, serve

    api_key = settings.read_named(args.api_key_env) or None
    if args.api_key_file:
        try:
            api_key = open(args.api_key_file).read().strip() or None
        except OSError as e:
            raise ConfigError(f"--api-key-file: {e}") from None
    return serve(
        host=args.host,
        port=args.port,
        path=args.path,
        api_key=api_key,
        engine=args.engine,
        plugins=args.plugin,
        base_models=parse_base_models(args.base_model),
        max_upload_bytes=args.max_upload_mb * 1024 * 1024,
        max_queued=args.max_queued,
        allow_engine_args=args.allow_engine_args,
        online=args.online, online_config=args.online_config,
        placement=placement_options(
            replicas=args.replicas, replica_urls=args.replica_url,
            replicas_per_gpu=args.replicas_per_gpu, gpus_per_replica=args.gpus_per_replica,
            replica_failure=args.replica_failure, publish_dir=args.publish_dir,
            publish_mount=args.publish_mount),
    )


def _args_plugins(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="show each plugin's hooks")


def _args_none(p: argparse.ArgumentParser) -> None:
    """A sub-command without arguments."""


def _args_prepare_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("base_model", nargs="?", default="smollm2",
                   help="a model folder (with config.json) or smollm2, the embedded default")


def _args_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="+",
                   help="e.g. .tracerl/PROJECT/models/NAME; several (seeds of one setup): one "
                   "report of their train and held-out curves with the spread")
    p.add_argument("--out", default=None,
                   help="default: MODEL_DIR/report.html (several folders: ./runs.html)")
    p.add_argument("--step", type=int, default=None, help="training step to show (default: last)")
    p.add_argument(
        "--png", action="store_true", help="also write MODEL_DIR/report.png (matplotlib)"
    )
    p.add_argument("--serve", action="store_true",
                   help="serve a live trajectory viewer instead (updates while the run trains)")
    p.add_argument("--host", default="127.0.0.1", help="--serve: bind address (loopback)")
    p.add_argument("--port", type=int, default=8765, help="--serve: port (0 picks a free one)")


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad one exits 2 naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _temperature(text: str) -> float:
    """An argparse type: a sampling temperature in [0, 2] (what the gateway accepts)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 2.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in [0, 2], got {text}")
    return value


def _args_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="the model's folder, e.g. .tracerl/PROJECT/models/NAME")
    p.add_argument("--task", required=True, help="a task of the catalog (tracerl.tasks)")
    p.add_argument("--steps", default="base,latest",
                   help="comma-separated steps: numbers, 'base' and 'latest' (default: both)")
    p.add_argument("--n", type=_positive_int, default=24, help="held-out items (default 24)")
    p.add_argument("--samples", type=_positive_int, default=1,
                   help="rollouts per item (default 1)")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="in [0, 2]; 0 (default): greedy")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when rollouts failed (they count as rollout_errors); "
                   "by default the first failure is printed and the exit status is 1")
    p.add_argument("--seed", type=int, default=0, help="which held-out items are drawn")
    p.add_argument("--engine", default="transformers", help="transformers (default), vllm, auto")
    p.add_argument("--no-log", action="store_true",
                   help="do not append the results to the model's history as val")


def _args_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, metavar="MODEL_DIR",
                   help="check a run's folder (every step-health item over its history)")
    p.add_argument("--live", action="store_true",
                   help="serve the base model and check template, logprobs and adapter swap")
    p.add_argument("--no-env", action="store_true", help="skip the environment checks")
    p.add_argument("--base-model", default="smollm2", help="--live: the model to check")
    p.add_argument("--engine", default="transformers", help="--live: transformers or vllm")
    p.add_argument("--path", default=".tracerl", help="where runs live (for the disk check)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON (for CI)")


def _args_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="training steps (default 8)")
    p.add_argument("--engine", default="auto", help="auto, vllm or transformers")
    p.add_argument("--group-size", type=int, default=None,
                   help="rollouts per group, compared with each other (default 6)")
    p.add_argument("--groups", type=int, default=None, help="groups per step (default 4)")
    p.add_argument("--base-path", default=".tracerl",
                   help="where the run's model, trajectories and checkpoints are written")
    p.add_argument("--seed", type=int, default=0, help="sampling and training-number seed")
    p.add_argument("--task", default="numbers", choices=["numbers", "agent"],
                   help="numbers (default): repeat a number; agent: a LangGraph tool agent on "
                   "reasoning-gym multiplications (pip install 'tracerl[tasks]')")
    _add_trainer_args(p)


def _args_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address; anything but loopback needs an API key"
    )
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--path", default=".tracerl", help="where models, trajectories and checkpoints live"
    )
    p.add_argument("--engine", default=None, help="auto (default), vllm or transformers")
    p.add_argument("--api-key-env", default="TRACERL_API_KEY",
                   help="environment variable holding the API key (default TRACERL_API_KEY)")
    p.add_argument("--api-key-file", default=None, help="file holding the API key")
    p.add_argument(
        "--base-model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a model folder clients may train, by NAME (repeatable); smollm2 is built in",
    )
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE and register it as a plugin (repeatable)")
    p.add_argument("--max-upload-mb", type=int, default=256, help="largest train/log upload")
    p.add_argument("--max-queued", type=int, default=4, help="training requests allowed to wait")
    p.add_argument(
        "--allow-engine-args",
        action="store_true",
        help="let clients pass vLLM flags (EngineConfig.extra_args); they can name server paths",
    )
    _add_online_args(p)
    _add_replica_args(p)


def _add_online_args(p: argparse.ArgumentParser) -> None:
    """``tracerl serve``'s online-mode options."""
    o = p.add_argument_group("online mode (docs/online.md): learn from live traffic")
    o.add_argument("--online", action="append", default=[], metavar="PROJECT/NAME",
                   help="train this model on its live calls and their feedback, releasing each "
                        "version through canary and gates (repeatable; it starts once the "
                        "model is registered)")
    o.add_argument("--online-config", default=None, metavar="JSON",
                   help="OnlineConfig as a JSON object (group_size, groups_per_step, "
                        "canary_share, evaluate_every, train, gates, poll_s, reward_ttl_s, "
                        "max_pending, rollout_api)")


def _add_replica_args(p: argparse.ArgumentParser) -> None:
    """``tracerl serve``'s replica options."""
    g = p.add_argument_group("replicas (where inference runs, for every model; clients' "
                             "own replica settings are replaced by these)")
    g.add_argument("--replicas", type=int, default=None,
                   help="vLLM servers to start, spread over the GPUs (default 1)")
    g.add_argument("--replicas-per-gpu", type=int, default=1, help="servers sharing each GPU")
    g.add_argument("--gpus-per-replica", type=int, default=1,
                   help="GPUs per server (tensor parallel)")
    g.add_argument("--replica-url", action="append", default=[], metavar="URL",
                   help="route to an existing vLLM server instead (repeatable)")
    g.add_argument("--replica-failure", choices=["restart", "drop"], default="restart",
                   help="what happens to a replica that dies")
    g.add_argument("--publish-dir", default=None,
                   help="where adapters are published as policy@N (e.g. /dev/shm/tracerl)")
    g.add_argument("--publish-mount", default=None,
                   help="where the servers see an fsspec --publish-dir (s3://...) mounted")


def _args_promote(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="PROJECT/NAME")
    p.add_argument("step", type=int, metavar="N", help="the checkpoint step to serve")
    _add_release_args(p)


def _args_rollback(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="PROJECT/NAME")
    p.add_argument("--to", type=int, required=True, metavar="N",
                   help="the checkpoint step to serve (0: the base model)")
    _add_release_args(p)


def _add_release_args(p: argparse.ArgumentParser) -> None:
    """Where ``tracerl promote`` and ``tracerl rollback`` act: a server, or a folder."""
    p.add_argument("--server", default="http://127.0.0.1:8000",
                   help="the running `tracerl serve` (default http://127.0.0.1:8000)")
    p.add_argument("--api-key-env", default="TRACERL_API_KEY",
                   help="environment variable holding the server's API key")
    p.add_argument("--path", default=None,
                   help="no server: write the model folder's release log under this "
                        "base path instead (read when the server next starts)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the server (loading the version included)")


def _args_proxy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend-url", required=True, help="the gateway's OpenAI base URL (.../v1)")
    p.add_argument("--model", action="append", required=True, help="served model name (repeatable)")
    p.add_argument("--api-key", default="tracerl-local", help="the gateway's API key")
    p.add_argument("--host", default="127.0.0.1", help="the proxy's bind address")
    p.add_argument("--port", type=int, default=4000, help="the proxy's port")
    p.add_argument("--litellm-python", default=None, help="python of a venv with LiteLLM's proxy")
    p.add_argument("--dir", default=".tracerl/proxy",
                   help="run folder: config, log and the persisted master key")
    p.add_argument("--master-key", default=None,
                   help="proxy master key (default: $LITELLM_MASTER_KEY, else the one kept in "
                        "--dir/master_key, made on first start)")


class Command(NamedTuple):
    """One sub-command: its line in ``tracerl --help``, what adds its arguments, what runs it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# every sub-command, in the order ``tracerl --help`` lists them
COMMANDS: dict[str, Command] = {
    "plugins": Command("list loaded plugins, engines and backends", _args_plugins, _cmd_plugins),
    "hooks": Command("the plugin API: every hook, its arguments and who implements it",
                     _args_none, _cmd_hooks),
    "prepare-model": Command("resolve/convert a base model and print its folder",
                             _args_prepare_model, _cmd_prepare_model),
    "report": Command("write an HTML report (curves, best/worst trajectories)", _args_report,
                      _cmd_report),
    "eval": Command("evaluate a model's steps on a task's held-out split", _args_eval, _cmd_eval),
    "doctor": Command("check the environment, a live model and a run's folder", _args_doctor,
                      _cmd_doctor),
    "demo": Command("train SmolLM2-135M with GRPO on CPU on a verifiable task", _args_demo,
                    _cmd_demo),
    "serve": Command("serve the backend (gateway + trainer) for RemoteBackend clients",
                     _args_serve, _cmd_serve),
    "promote": Command("make version N the model's incumbent (release control)", _args_promote,
                       _cmd_release),
    "rollback": Command("serve an earlier version N again", _args_rollback, _cmd_release),
    "proxy": Command("run a LiteLLM proxy in front of a tracerl gateway", _args_proxy,
                     _cmd_proxy),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def configure_logging(command: str) -> None:
    """The CLI's log lines on stderr, as ``tracerl COMMAND: message`` (library code only logs)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"tracerl {command}: %(message)s"))
    root = logging.getLogger("tracerl")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def stop_on_sigterm() -> None:
    """SIGTERM (as ``timeout``, systemd or a container runtime stop a command) ends a command
    the way Ctrl-C does, so it stops its children on the way out (``tracerl serve`` sets its
    own handlers)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    configure_logging(args.command)
    stop_on_sigterm()
    try:
        return func(args)
    except TracerlError as e:
        print(f"tracerl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, once the command's children are stopped
        return 130


