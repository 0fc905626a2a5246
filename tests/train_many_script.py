"""A two-model step in its own process, for the kill -9 test of ``backend.train_many``:
`python train_many_script.py PATH MODE`.

MODE 'crash': both models' groups are trained in one step; the process hangs once the first
model's checkpoint is written (before the second's), so the test can kill -9 it. MODE 'resume':
reopen, train what is pending (``backend.pending_groups``) with ``train_many``, report."""

import asyncio
import json
import sys
import time

from train_script import rollout  # a sibling: run as a script, tests/ is on the path

import tracerl


class HangAfterTheFirstCheckpoint:
    @tracerl.hookimpl
    def tracerl_after_train_step(self, model, step, metrics):
        print(f"DONE {model.key}", flush=True)
        print("HANGING", flush=True)
        time.sleep(600)  # the injected fault: stall until the test kills the process


async def main(path, mode):
    backend = tracerl.LocalBackend(path=path, engine="transformers")
    models = [tracerl.TrainableModel(name=n, project="tests", base_model="smollm2")
              for n in ("first", "second")]
    for m in models:
        await m.register(backend)
    config = tracerl.TrainConfig(learning_rate=1e-4)
    if mode == "crash":
        from tracerl.events.plugins import register

        register(HangAfterTheFirstCheckpoint(), name="hang")
        groups = {}
        for m in models:
            groups[m] = await tracerl.gather_trajectory_groups(
                [tracerl.TrajectoryGroup(rollout(m, i) for i in range(4))], show_progress=False)
        await backend.train_many(groups, config=config)
        print("NOT KILLED", flush=True)
    else:
        keys = [m.spec.key for m in models]
        named = list(zip(keys, models, strict=True))
        report = {"after_restart": {k: await m.get_step() for k, m in named}}
        pending = {m: await backend.pending_groups(m) for m in models}
        report["pending_trajectories"] = {
            m.spec.key: sum(len(g) for g in groups) for m, groups in pending.items()}
        results = await backend.train_many(pending, config=config)
        report["trained"] = [m.spec.key for m in results]
        report["after_resume"] = {k: await m.get_step() for k, m in named}
        report["train_history_steps"] = {
            k: [h["step"] for h in await m.history() if h["split"] == "train"]
            for k, m in named}
        report["saved_trajectory_files"] = {
            k: sorted(p.name for p in (backend.store(m).root / "trajectories" / "train")
                      .iterdir())
            for k, m in named}
        print("REPORT " + json.dumps(report), flush=True)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
