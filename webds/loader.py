"""WebLoader: a PyTorch ``DataLoader`` followed by chainable stages that run in the main process.

``WebLoader(dataset, batch_size=None, num_workers=4).unbatched().shuffle(1000).batched(64)``
mixes samples across workers and rebatches them; ``.with_epoch(n)`` fixes the number of batches
per epoch, ``.with_length(n)`` declares ``len()``.

With a balanced :class:`~webds.fluent.WebDataset` (an index and ``balance=``), ``len(loader)`` is
the exact number of batches this rank yields per epoch (also after ``.unbatched()...batched(n)``
in the main process), and ``state_dict()`` / ``load_state_dict()`` resume mid-epoch with exactly
the batches that were still to come.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from torch.utils.data import DataLoader

from .counting import source_counts
from .errors import LengthError
from .fluent import FluentMixin
from .pipeline import DataPipeline
from .stages.core import Length

__all__ = ["WebLoader"]


class WebLoader(DataPipeline, FluentMixin):
    """``DataLoader(*args, **kwargs)`` as the source of a pipeline.

    Each ``iter()`` hands the loader's epoch to its dataset (``dataset.set_epoch``) before the
    workers start, so shard and sample shuffles change every epoch even though non-persistent
    workers get a fresh copy of the dataset each time. ``set_epoch(e)`` chooses the epoch, as
    ``DistributedSampler.set_epoch`` does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(DataLoader(*args, **kwargs))
        dataset = self.loader.dataset
        if hasattr(dataset, "loader_hint"):
            # Lets a balanced dataset align its workers' shares to the loader's batches.
            dataset.loader_hint = (max(1, self.loader.num_workers), self.loader.batch_size)
        self.seed = getattr(dataset, "seed", None)

    @property
    def loader(self) -> DataLoader:
        """The underlying ``DataLoader``."""
        return self.pipeline[0]

    def _origin(self) -> Optional[Any]:
        return 0, _LoaderOrigin(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (persistent workers are restarted if
        they would otherwise run another one)."""
        if int(epoch) != self.epoch:
            self._restart_workers()
        super().set_epoch(epoch)

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Continue where :meth:`state_dict` was taken: the rest of that epoch's batches.

        Works across processes: build the same loader (same dataset, seed, index, world size,
        ``num_workers``, batch size), then load. Persistent workers are restarted.
        """
        super().load_state_dict(state, strict)
        self._restart_workers()

    def _restart_workers(self) -> None:
        # Persistent workers keep their own copy of the dataset, with its own epoch; they must
        # be started afresh to take a new epoch or resume position.
        it = getattr(self.loader, "_iterator", None)
        if it is not None:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self.loader._iterator = None

    def _resume_config(self) -> Dict[str, Any]:
        config = super()._resume_config()
        dataset = self.loader.dataset
        if hasattr(dataset, "_resume_config"):
            config["dataset"] = dataset._resume_config()
        config["num_workers"] = self.loader.num_workers
        config["batch_size"] = self.loader.batch_size
        return config

    def _one_pass(self, epoch: int, skip: int = 0) -> Any:
        dataset = self.loader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        plan = dataset.aligned_plan() if hasattr(dataset, "aligned_plan") else None
        if plan is not None:
            plan.warn_split(max(1, self.loader.num_workers))
        return super()._one_pass(epoch, skip)


class _LoaderOrigin:
    """The DataLoader as a counted source: one stream, made of its workers' streams in turn."""

    exact = False  # the datasets in the workers keep their own counts exact

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def _worker_counts(self) -> List[Length]:
        """What each worker yields this epoch (batches, when the DataLoader batches), with the
        samples inside them."""
        loader, dataset = self.loader, self.loader.dataset
        workers = max(1, loader.num_workers)
        if not hasattr(dataset, "stream_lengths"):
            raise LengthError(
                f"the length of this WebLoader is unknown: its dataset {type(dataset).__name__} "
                "does not say how many items each worker yields; use .with_epoch(n) or "
                ".with_length(n)"
            )
        counts = source_counts(dataset, workers)
        size = loader.batch_size
        if size is None:
            return counts
        if loader.drop_last:
            return [Length(c.items // size, Length(c.items // size * size)) for c in counts]
        return [Length(-(-c.items // size), c) for c in counts]

    def _worker_items(self) -> List[int]:
        return [c.items for c in self._worker_counts()]

    def stream_lengths(self, num_workers: Optional[int] = None) -> List[int]:
        return [n.items for n in self.stream_counts(num_workers)]

    def stream_counts(self, num_workers: Optional[int] = None) -> List[Length]:
        # The workers' streams arrive interleaved as one; what each batched, summed, is what
        # an unbatched() after the loader gets back.
        return [_total(self._worker_counts())]

    def stream_index(self) -> int:
        return 0

    def skip(self, n: int) -> bool:
        """Make the workers of the next epoch skip the first ``n`` items the loader yields.

        Returns False (the loader's output is then replayed and dropped) for datasets that
        can't skip.
        """
        dataset = self.loader.dataset
        if not isinstance(dataset, DataPipeline):
            return False
        workers = max(1, self.loader.num_workers)
        try:
            items = self._worker_items()
        except LengthError:
            items = [n] * workers  # unknown: assume no worker runs dry before item n
        shares, shift = _round_robin_share(items, n)
        size = self.loader.batch_size
        if size is not None:
            shares = [k * size for k in shares]
        dataset._skip = {"shares": shares, "shift": shift}
        return True


def _total(counts: List[Length]) -> Length:
    """The sum of several streams' counts, level by level while every stream knows the level."""
    inner = [c.inner for c in counts if c.inner is not None]
    below = _total(inner) if inner and len(inner) == len(counts) else None
    return Length(sum(c.items for c in counts), below)


def _round_robin_share(items: List[int], n: int) -> Tuple[List[int], int]:
    """How many of the first ``n`` loader items came from each worker, and whose turn is next.

    A DataLoader over an IterableDataset takes one item from each worker in turn, skipping
    workers that have run out; ``items`` is how many each yields.
    """
    workers = len(items)
    share = [0] * workers
    k = served = 0
    while served < n:
        for _ in range(workers):
            if share[k] < items[k]:
                break
            k = (k + 1) % workers
        else:
            break  # every worker ran out
        share[k] += 1
        served += 1
        k = (k + 1) % workers
    return share, k
