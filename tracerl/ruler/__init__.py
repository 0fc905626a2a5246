"""ruler: RULER, relative LLM judging of trajectory groups when there is no crisp reward.

- ``judge.py``: the judge: prompt, schema-constrained answer, validation, retries, chunking.
- ``plugin.py``: the judge as a ``tracerl_score_group`` plugin (judge name ``ruler``).
"""

from .judge import (
    DEFAULT_RUBRIC,
    Ruler,
    RulerError,
    TrajectoryScore,
    parse_judgement,
    parse_scores,
    ruler,
    ruler_score_group,
    trajectory_id,
)

__all__ = ["DEFAULT_RUBRIC", "Ruler", "RulerError", "TrajectoryScore", "parse_judgement",
           "parse_scores", "ruler", "ruler_score_group", "trajectory_id"]
