"""RULER: relative LLM judging of trajectory groups."""

from .judge import DEFAULT_RUBRIC, Ruler, RulerError, parse_scores, ruler_score_group, trajectory_id

__all__ = ["DEFAULT_RUBRIC", "Ruler", "RulerError", "parse_scores", "ruler_score_group", "trajectory_id"]
