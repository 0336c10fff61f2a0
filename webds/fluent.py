"""The fluent face: ``WebDataset(url).shuffle(1000).decode("pil").to_tuple("jpg", "cls")``.

Every chainable method is derived from a stage factory defined once in :mod:`webds.filters`,
:mod:`webds.batching` or :mod:`webds.decode` (same name, signature and docstring) and returns a
new pipeline with that stage appended; the original is unchanged.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from . import batching, filters
from .cache import cached_shards
from .decode import decode as _decode_stage
from .decode import xdecode as _xdecode_stage
from .errors import WebdsError
from .handlers import Handler, reraise_exception
from .pipeline import DataPipeline, StageFactory, stage
from .replay import Cached, LMDBCached
from .samples import tarfile_to_samples
from .shards import (
    ResampledShards,
    SimpleShardList,
    URLs,
    default_seed,
    split_by_node,
    split_by_worker,
    worker_info,
)

__all__ = ["FluentMixin", "FluidInterface", "FluidWrapper", "WebDataset"]

log = logging.getLogger("webds")


def _chain(factory: StageFactory) -> Callable[..., Any]:
    """Make the fluent method for a stage factory: ``self.compose(factory(*args, **kw))``."""

    def method(self: DataPipeline, *args: Any, **kwargs: Any) -> Any:
        return self.compose(factory(*args, **kwargs))

    method.__name__ = factory.__name__
    method.__qualname__ = f"FluentMixin.{factory.__name__}"
    method.__doc__ = factory.__doc__
    sig = factory.__signature__
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[self_param, *sig.parameters.values()]
    )
    return method


class FluentMixin:
    """Chainable stage methods, for any :class:`~webds.pipeline.DataPipeline` subclass."""

    compose: Callable[..., Any]

    shuffle = _chain(filters.shuffle)
    detshuffle = _chain(filters.detshuffle)
    decode = _chain(_decode_stage)
    map = _chain(filters.map)
    map_dict = _chain(filters.map_dict)
    map_tuple = _chain(filters.map_tuple)
    select = _chain(filters.select)
    rename = _chain(filters.rename)
    rename_keys = _chain(filters.rename_keys)
    extract_keys = _chain(filters.extract_keys)
    to_tuple = _chain(filters.to_tuple)
    batched = _chain(batching.batched)
    unbatched = _chain(batching.unbatched)
    listed = _chain(batching.listed)
    unlisted = _chain(batching.unlisted)
    slice = _chain(filters.slice)
    rsample = _chain(filters.rsample)
    associate = _chain(filters.associate)
    info = _chain(filters.info)
    log_keys = _chain(filters.log_keys)
    xdecode = _chain(_xdecode_stage)

    def mcached(self) -> Any:
        """Record the samples of the first pass in memory and replay them afterwards."""
        return self.compose(Cached())

    def lmdb_cached(self, *args: Any, **kwargs: Any) -> Any:
        """Record the samples of the first pass in an LMDB file (see :class:`LMDBCached`)."""
        return self.compose(LMDBCached(*args, **kwargs))


#: webdataset's name for the mixin.
FluidInterface = FluentMixin


class FluidWrapper(DataPipeline, FluentMixin):
    """Any iterable (or callable returning one) followed by chainable stages."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)  # not through __init__, which would splice a list of samples


@stage
def _require_samples(src: Iterable[Any], urls: Any) -> Iterator[Any]:
    """Raise if a single-process epoch yields nothing; in a worker, log why it may be empty."""
    n = 0
    for sample in src:
        n += 1
        yield sample
    if n == 0:
        where = worker_info()
        if where.num_workers == 1 and where.world_size == 1:
            raise WebdsError(
                f"no samples found in {urls!r}: every shard was empty or skipped. Check the "
                "shards (and the handler's warnings), or pass empty_check=False"
            )
        log.warning(
            "webds: rank %d worker %d got no samples from %r; with fewer shards than "
            "ranks x workers some processes have nothing to read",
            where.rank,
            where.worker,
            urls,
        )


# Marks "the caller did not choose": node/worker splitting then depends on resampled=.
_AUTO: Any = "auto"


class WebDataset(DataPipeline, FluentMixin):
    """Samples from tar shards, as an ``IterableDataset`` with chainable stages.

    ``WebDataset("data/train-{000..099}.tar", shardshuffle=True, seed=0).shuffle(1000)
    .decode("pil").to_tuple("jpg", "cls").batched(64)``

    - ``shardshuffle``: shuffle the shard list every epoch (True, or any positive int as in
      webdataset). The order depends only on (seed, epoch), so every node and worker agrees on it
      and splitting after the shuffle neither loses nor repeats shards. ``seed`` defaults to the
      environment variable ``WDS_SEED`` if set, else 0.
    - ``resampled``: draw shards at random with replacement, endlessly (use ``.with_epoch(n)``);
      each node and worker draws its own sequence, so no splitting is done unless asked for.
    - ``nodesplitter`` / ``workersplitter``: functions over the shard stream; by default shards are
      split by node (``split_by_node``) and by DataLoader worker (``split_by_worker``). ``None``
      turns a split off.
    - ``handler``: what to do when a shard cannot be opened or read (see :mod:`webds.handlers`).
    - ``select_files`` / ``rename_files``: functions on member names (rename runs first).
    - ``empty_check``: raise when a single-process epoch yields no sample at all.
    - ``storage_options``: passed to fsspec when opening remote URLs, and when listing a remote
      prefix (``"s3://bucket/train/"``) or glob (``"gs://b/train-*.tar"``), which happens once,
      here, so every worker and rank reads the same shard list (see :func:`expand_urls`).
    - ``cache_dir``: keep remote shards in this local directory after their first read (see
      :mod:`webds.cache`); ``cache_size`` > 0 bounds it in bytes, 0 turns caching off;
      ``cache_local=True`` caches local files too (shards on a slow network filesystem).

    Older keywords still work (see :func:`webds.compat.legacy_keywords`): webdataset 1.x's
    ``mode="resampled"``, ``detshuffle``, ``verbose`` and ``url_to_name``, and the 0.1 style
    ``extensions=``, ``decoder=``, ``transforms=``, ``shuffle=``, which warns with its modern
    spelling.
    """

    def __init__(
        self,
        urls: URLs,
        handler: Handler = reraise_exception,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: Union[bool, int, None] = None,
        nodesplitter: Optional[Callable[..., Any]] = _AUTO,
        workersplitter: Optional[Callable[..., Any]] = _AUTO,
        select_files: Optional[Callable[[str], bool]] = None,
        rename_files: Optional[Callable[[str], str]] = None,
        empty_check: bool = True,
        seed: Optional[int] = None,
        storage_options: Optional[dict] = None,
        cache_dir: Optional[str] = None,
        cache_size: int = -1,
        cache_local: bool = False,
        **legacy: Any,
    ) -> None:
        super().__init__()
        extra_stages: list = []
        if legacy:
            # Imported here because webds.compat also re-exports this class (as webdataset's
            # compat module did), so it imports this module.
            from .compat import legacy_keywords

            plan = legacy_keywords(legacy, resampled=resampled, shardshuffle=shardshuffle)
            resampled, shardshuffle, extra_stages = plan.resampled, plan.shardshuffle, plan.stages
        if seed is None:
            seed = default_seed()
        self.seed = seed
        if resampled:
            source: Any = ResampledShards(
                urls,
                seed=0 if seed is None else seed,
                deterministic=seed is not None,
                storage_options=storage_options,
            )
            default_node, default_worker = None, None
        else:
            shard_seed = (0 if seed is None else seed) if shardshuffle else None
            source = SimpleShardList(urls, seed=shard_seed, storage_options=storage_options)
            default_node, default_worker = split_by_node, split_by_worker
        self.append(source)
        node = default_node if nodesplitter is _AUTO else nodesplitter
        worker = default_worker if workersplitter is _AUTO else workersplitter
        if node is not None:
            self.append(node)
        if worker is not None:
            self.append(worker)
        if cache_dir is not None and cache_size != 0:
            self.append(
                cached_shards(
                    cache_dir,
                    cache_size,
                    handler=handler,
                    cache_local=cache_local,
                    **(storage_options or {}),
                )
            )
        self.append(
            tarfile_to_samples(
                handler=handler,
                select_files=select_files,
                rename_files=rename_files,
                **(storage_options or {}),
            )
        )
        if empty_check:
            self.append(_require_samples(urls))
        for extra in extra_stages:
            self.append(extra)
        if repeat:
            self.repeat()
