"""online: learning from live traffic, safely (``tracerl serve --online``).

In flow order:
- ``live_calls.py``: live calls: a plain call is a rollout of its own, its feedback
  (``/v1/feedback/{response_id}``) comes later; expiry; groups by task key.
- ``loop.py``: :class:`OnlineLoop`: expire, judge the canary, train a batch of live calls from
  the incumbent and release it through canary and gates.
- ``batches.py``: batches whose training failed: recorded, set aside after ``batch_tries``.
- ``release.py``: release control: a trained version goes shadow -> canary (a sticky share of
  rollouts) -> promoted or rolled back, each stage in the model's release log.
- ``seam.py``: what online mode and release control ask of the backend (typed interfaces that
  ``LocalBackend`` satisfies): routes, live calls, rollouts, the call store, the trainer's step.
- ``gates.py``: the gates a candidate passes: reward vs the incumbent with a confidence bound,
  error rate, p95 latency, drift monitors (pure decision rules).
"""

from .loop import OnlineLoop

__all__ = ["OnlineLoop"]
