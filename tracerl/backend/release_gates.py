"""Old import path of :mod:`tracerl.backend.online.gates` (kept for users' code)."""

from .online.gates import ArmEvidence, Gates, Verdict, arm_evidence, judge

__all__ = ["ArmEvidence", "Gates", "Verdict", "arm_evidence", "judge"]
