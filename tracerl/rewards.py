"""ART's ``art.rewards``: ``from art.rewards import ruler_score_group`` becomes
``from tracerl.rewards import ruler_score_group``, with the same arguments."""

from .ruler.judge import DEFAULT_RUBRIC, TrajectoryScore, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "TrajectoryScore", "ruler", "ruler_score_group"]
