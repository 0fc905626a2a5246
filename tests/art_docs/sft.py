"""ART's SFT page (docs: fundamentals/sft-training): ``train_sft_from_file`` warms a model up,
RL trains a step, then ``model.train_sft`` runs again between RL steps."""

import json

import tracerl as art
from tracerl.utils.sft import train_sft_from_file

ROWS = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant"},
                  {"role": "user", "content": "What is the capital of Tasmania?"},
                  {"role": "assistant", "content": "Hobart"}]},
    {"messages": [{"role": "user", "content": "What is the capital of Victoria?"},
                  {"role": "assistant", "content": "Melbourne"},
                  {"role": "user", "content": "And of Queensland?"},
                  {"role": "assistant", "content": "Brisbane"}]},
    {"messages": [{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris"}]},
]


async def main(backend, data_dir, base_model="smollm2"):
    path = data_dir / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    model = art.TrainableModel(name="sft", project="art-docs", base_model=base_model)
    await model.register(backend)
    await train_sft_from_file(model=model, file_path=str(path), epochs=1, batch_size=2,
                              peak_lr=1e-4, verbose=True)
    after_sft = await model.get_step()

    group = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "Capital of Spain?"},
                                             {"role": "assistant", "content": answer}],
                       reward=reward)
        for answer, reward in (("Madrid", 1.0), ("Rome", 0.0))])
    result = await backend.train(model, [group], learning_rate=1e-5)

    await model.train_sft(
        [art.Trajectory(messages_and_choices=row["messages"]) for row in ROWS],
        config=art.TrainSFTConfig(learning_rate=5e-5, batch_size=3))
    return model, after_sft, result
