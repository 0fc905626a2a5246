"""Our GRPO loss and gradients equal TRL's GRPOTrainer._compute_loss on identical inputs."""

import math
from types import SimpleNamespace

import pytest
import torch

from tracerl import LoraConfig, TrainConfig
from tracerl.backend.training.advantages import group_advantages
from tracerl.backend.training.rows import Row
from tracerl.backend.training.trainer import Trainer

trl = pytest.importorskip("trl")


def fresh_trainer(smollm2_path):  # one per case: TRL adds a 'ref' adapter to the model it gets
    torch.manual_seed(0)
    tr = Trainer(smollm2_path, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # non-zero B so that the adapter matters for gradients of A
        for name, p in tr.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return tr


def trl_trainer(model, tokenizer, tmp_path, loss_type, beta, temperature, bias_correction):
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        temperature=temperature,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        use_bias_correction_kl=bias_correction,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_completion_length=8,
        logging_steps=1,
    )
    t = trl.GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4),
        processing_class=tokenizer,
    )
    t.current_gradient_accumulation_steps = 1
    return t


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


CASES = {
    # id: (TRL loss_type, our loss_normalization, beta, temperature, KL bias correction)
    "token-no-kl": ("bnpo", "token", 0.0, 1.0, True),
    "sequence-kl-cold": ("grpo", "sequence", 0.04, 0.7, True),
    "token-kl-hot-no-bias-correction": ("bnpo", "token", 0.1, 1.3, False),
}


@pytest.fixture(scope="module", params=CASES.values(), ids=list(CASES))
def compared(request, smollm2_path, tokenizer, tmp_path_factory):
    """TRL's loss and LoRA gradients, then ours, on the same off-policy batch of one group."""
    loss_type, ours, beta, temperature, bias_correction = request.param
    trainer = fresh_trainer(smollm2_path)
    g = torch.Generator().manual_seed(3)
    B, P, C = 4, 6, 5
    prompt = torch.randint(100, 5000, (1, P), generator=g).repeat(B, 1)  # one scenario, same length
    completion = torch.randint(100, 5000, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 3:] = 0  # a shorter completion
    completion_mask[3, 4:] = 0
    rewards = [1.0, 0.0, 0.5, 0.2]
    adv = torch.tensor(group_advantages(rewards, scale=True).advantages)

    model = trainer.model
    model.train()
    with torch.no_grad():
        ids = torch.cat([prompt, completion], 1)
        logits = model(input_ids=ids).logits[:, P - 1:-1].float() / temperature
        current = torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]
        with model.disable_adapter():
            ref_logits = model(input_ids=ids).logits[:, P - 1:-1].float() / temperature
        ref = torch.log_softmax(ref_logits, -1).gather(-1, completion[..., None])[..., 0]
    old = current + 0.3 * torch.randn(B, C, generator=g)  # off-policy: some ratios get clipped

    t = trl_trainer(model, tokenizer, tmp_path_factory.mktemp("trl"), loss_type, beta,
                    temperature, bias_correction)
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": completion_mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    model.zero_grad()
    trl_loss = t._compute_loss(model, inputs)  # TRL's own (private) loss: the reference
    trl_loss.backward()
    trl_loss = float(trl_loss.detach())
    trl_g = lora_grads(model)

    rows = []
    for b in range(B):
        n = int(completion_mask[b].sum())
        rows.append(Row(
            input_ids=prompt[b].tolist() + completion[b, :n].tolist(),
            loss_mask=[False] * P + [True] * n,
            old_logprobs=[math.nan] * P + old[b, :n].tolist(),
            temperatures=[temperature] * (P + n), advantage=float(adv[b])))
    config = TrainConfig(loss_normalization=ours, beta=beta, epsilon=0.2, epsilon_high=0.28,
                         kl_bias_correction=bias_correction)
    model.zero_grad()
    sums = trainer.backward([rows], config)
    assert sums["clip_fraction"] > 0, "the inputs must exercise the clipped branch"
    return SimpleNamespace(trl_loss=trl_loss, trl_grads=trl_g, loss=sums["loss"],
                           grads=lora_grads(model))


def test_our_grpo_loss_equals_trls(compared):
    assert compared.loss == pytest.approx(compared.trl_loss, rel=1e-4, abs=1e-6)


def test_our_lora_gradients_equal_trls(compared):
    trl_g, our_g = compared.trl_grads, compared.grads
    assert trl_g and trl_g.keys() == our_g.keys()
    for name in trl_g:
        scale = float(trl_g[name].abs().max())  # fp32 summation-order noise, relative to the tensor
        torch.testing.assert_close(our_g[name], trl_g[name], rtol=1e-3, atol=1e-3 * scale + 1e-9)
