"""ART's ``art.utils`` helpers that training scripts use: ``from art.utils import
iterate_dataset`` becomes ``from tracerl.utils import iterate_dataset``."""

from .rollout.concurrency import limit_concurrency
from .rollout.dataset import DatasetBatch, iterate_dataset

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency"]
