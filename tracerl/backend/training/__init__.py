"""training: one GRPO step on recorded tokens (and a supervised one on conversations).

In flow order:
- ``rows.py``: training rows from the gateway's token records (rendered only without them).
- ``advantages.py``: group-relative advantages.
- ``credit.py``: per-turn credit (GiGPO): each turn's advantage from the group's turns that
  share its state.
- ``loss.py``: the clipped policy loss, token logprobs, KL (tested against TRL).
- ``health.py``: step health (skipped groups, prefix/template mismatches, engine KL, ...)
  and the warnings that name its cause and fix.
- ``update.py``: the one update loop, top to bottom: micro-batches -> old logprobs -> loss
  and backward per micro-batch -> clip -> optimizer step, for one policy or several adapters
  on one base (a model's step, ``train_many`` and each distributed rank all run it).
- ``head.py``: the output head's logprobs and entropy in chunks (no ``[tokens, vocab]``
  logits); ``checkpointing.py``: the decoder layers a step recomputes, sized to a budget.
- ``policy.py``: one adapter's policy (its LoRA in a loaded peft model, optimizer, step
  count) and the update's public seam (tensors, logits, old logprobs, clipping, rank hooks).
- ``trainer.py``: the policy of a model on a base of its own (loaded: peft or Unsloth).
- ``adapters.py``: many models on one base: one copy of the base weights, a policy per
  model's adapter, rows routed to their adapter in shared passes.
- ``distributed.py``: the same policy on torch.distributed ranks (DDP or FSDP2), driven from
  here: micro-batches dealt to ranks, checkpoints from rank 0, a dead rank named.
- ``rank.py``: one rank's process (``python -m``, torchrun's environment).
- ``step.py``: the step top to bottom: save groups -> rows -> advantages -> loss ->
  optimizer step -> atomic checkpoint -> publish the adapter.
- ``many.py``: one step for several models (``backend.train_many``) in the same frame.
- ``sft.py``: supervised fine-tuning (ART's ``train_sft``): conversations, loss on the
  assistant tokens, in the same step frame.
"""
