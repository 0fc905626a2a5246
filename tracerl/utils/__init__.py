"""ART's ``art.utils``: ``from art.utils import iterate_dataset`` becomes
``from tracerl.utils import iterate_dataset``.

- ``__init__.py``: ``iterate_dataset`` (ART's shuffle order), ``limit_concurrency``, ``retry``.
- ``iterate_dataset.py``, ``limit_concurrency.py``: ART's module paths of those two.
- ``retry.py``: ``@retry``, retries with exponential backoff (also ``tracerl.retry``).
- ``strip_logprobs.py``: ``strip_logprobs``, a copy of nested data without ``logprobs`` keys.
- ``sft.py``: ``train_sft_from_file``, ``create_lr_schedule``, ``iterate_file``.
- ``deployment.py``: export a trained adapter for ``vllm serve --lora-modules``.
- ``benchmarking.py``: load logged trajectories and metrics of models to compare them.
"""

from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .retry import retry

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
