"""A training run in its own process, for crash/resume tests: `python train_script.py PATH MODE`.

MODE 'crash': train step 1, then hang inside step 2 (after its trajectories were saved) so the
test can kill -9 it. MODE 'resume': reopen, check the state, train the pending step."""

import asyncio
import json
import sys
import time

import tracerl


class HangInStepTwo:
    @tracerl.hookimpl
    def tracerl_before_train_step(self, model, step, groups, config):
        if step == 2:
            print("HANGING", flush=True)
            time.sleep(600)  # the injected fault: a step that stalls until the test kills it


async def rollout(model, i):
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=4,
        temperature=1.0)
    return tracerl.Trajectory(messages_and_choices=[r.choices[0]], reward=float(i % 2))


async def main(path, mode):
    backend = tracerl.LocalBackend(path=path, engine="transformers")
    model = tracerl.TrainableModel(name="crashy", project="tests", base_model="smollm2")
    await model.register(backend)
    config = tracerl.TrainConfig(learning_rate=1e-4)
    if mode == "crash":
        from tracerl.events.plugins import register

        register(HangInStepTwo(), name="hang")
        for _ in range(2):
            groups = await tracerl.gather_trajectory_groups(
                [tracerl.TrajectoryGroup(rollout(model, i) for i in range(4))], show_progress=False)
            await model.train(groups, config=config)
            print("STEP", await model.get_step(), flush=True)
    else:
        report = {"step_after_restart": await model.get_step()}
        pending = await backend.pending_groups(model)
        report["pending_trajectories"] = sum(len(g) for g in pending)
        report["pending_have_tokens"] = bool(pending) and all(
            t.llm_calls and t.llm_calls[0].prompt_token_ids for g in pending for t in g)
        await model.train(pending, config=config)
        report["step_after_training"] = await model.get_step()
        print("REPORT " + json.dumps(report), flush=True)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
