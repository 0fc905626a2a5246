"""ART's ``art.utils.iterate_dataset`` module path (``from art.utils.iterate_dataset import
iterate_dataset``)."""

from ..rollout.dataset import DatasetBatch, iterate_dataset

__all__ = ["DatasetBatch", "iterate_dataset"]
