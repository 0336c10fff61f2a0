"""WebLoader: a PyTorch ``DataLoader`` followed by chainable stages that run in the main process.

``WebLoader(dataset, batch_size=None, num_workers=4).unbatched().shuffle(1000).batched(64)``
mixes samples across workers and rebatches them; ``.with_epoch(n)`` fixes the number of batches
per epoch, ``.with_length(n)`` declares ``len()``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from .fluent import FluentMixin
from .pipeline import DataPipeline

__all__ = ["WebLoader"]


class WebLoader(DataPipeline, FluentMixin):
    """``DataLoader(*args, **kwargs)`` as the source of a pipeline.

    Each ``iter()`` hands the loader's epoch to its dataset (``dataset.set_epoch``) before the
    workers start, so shard and sample shuffles change every epoch even though non-persistent
    workers get a fresh copy of the dataset each time.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(DataLoader(*args, **kwargs))

    @property
    def loader(self) -> DataLoader:
        """The underlying ``DataLoader``."""
        return self.pipeline[0]

    def _one_pass(self, epoch: int) -> Any:
        dataset = self.loader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        return super()._one_pass(epoch)
