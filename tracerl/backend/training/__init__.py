"""training: one GRPO step on recorded tokens (and a supervised one on conversations).

In flow order:
- ``rows.py``: training rows from the gateway's token records (rendered only without them).
- ``advantages.py``: group-relative advantages.
- ``loss.py``: the clipped policy loss, token logprobs, KL (tested against TRL).
- ``health.py``: step health (skipped groups, prefix/template mismatches, engine KL, ...)
  and the warnings that name its cause and fix.
- ``trainer.py``: the policy (base + LoRA, peft or Unsloth), micro-batches, the optimizer.
- ``step.py``: the step top to bottom: save groups -> rows -> advantages -> loss ->
  optimizer step -> atomic checkpoint -> publish the adapter.
- ``sft.py``: supervised fine-tuning (ART's ``train_sft``): conversations, loss on the
  assistant tokens, in the same step frame.
"""
