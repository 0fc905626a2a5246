"""RULER: relative LLM judging of trajectory groups."""

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
