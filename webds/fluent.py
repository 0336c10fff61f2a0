"""The fluent face: ``WebDataset(url).shuffle(1000).decode("pil").to_tuple("jpg", "cls")``.

Every chainable method is derived from a stage factory defined once in :mod:`webds.stages.filters`,
:mod:`webds.stages.fields`, :mod:`webds.stages.batching`, :mod:`webds.stages.decode` or
:mod:`webds.stages.xdecode` (same name, signature and docstring) and returns a new pipeline with
that stage appended; the original is unchanged.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from .base.handlers import Handler, reraise_exception
from .base.redact import redact
from .base.workers import default_seed, worker_info
from .errors import ArgumentError, NoSamplesError
from .io.readahead import AUTO, DEFAULT_READAHEAD_SHARDS, LearnedDepth, check_readahead
from .io.urls import url_identity
from .keywords import legacy_keywords
from .pipeline import BATCH, SAME, Count, DataPipeline, Stage, StageFactory, stage
from .shards.datasets import ResampledShards, SimpleShardList
from .shards.index import ShardIndex, ShardInfo, is_index_url
from .shards.plan import PlannedShards, check_balance
from .shards.shardlists import URLs, expand_urls, split_by_node, split_by_worker
from .shards.specs import MultiShardSample, is_spec
from .stages import batching, fields, filters
from .stages.decode import decode as _decode_stage
from .stages.mix import RandomMix
from .stages.probe import PipelineStats, Probe, stats_of
from .stages.replay import Cached, LMDBCached
from .stages.xdecode import xdecode as _xdecode_stage
from .tar.cached import cache_settings, cached_shards
from .tar.samples import tarfile_to_samples

__all__ = ["FluentMixin", "FluidInterface", "FluidWrapper", "WebDataset"]

log = logging.getLogger("webds")


class LoaderShape(NamedTuple):
    """What a WebLoader tells the dataset it loads: how many workers run it, and the batch
    size (None: the loader does not batch)."""

    workers: int
    batch_size: Optional[int]


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
    map_dict = _chain(fields.map_dict)
    map_tuple = _chain(fields.map_tuple)
    select = _chain(filters.select)
    rename = _chain(fields.rename)
    rename_keys = _chain(fields.rename_keys)
    extract_keys = _chain(fields.extract_keys)
    to_tuple = _chain(fields.to_tuple)
    batched = _chain(batching.batched)
    unbatched = _chain(batching.unbatched)
    listed = _chain(batching.listed)
    unlisted = _chain(batching.unlisted)
    slice = _chain(filters.slice)
    rsample = _chain(filters.rsample)
    associate = _chain(fields.associate)
    info = _chain(filters.info)
    log_keys = _chain(filters.log_keys)
    xdecode = _chain(_xdecode_stage)

    def mix(
        self,
        *others: Iterable[Any],
        probs: Optional[Sequence[float]] = None,
        longest: bool = False,
        seed: Optional[int] = None,
    ) -> "FluidWrapper":
        """Mix this pipeline's items with ``others``' at random, with weights ``probs``.

        ``WebDataset(a, seed=0).mix(WebDataset(b, seed=0), probs=[3, 1])``; see
        :class:`~webds.stages.mix.RandomMix` (``seed`` defaults to this pipeline's).
        """
        if seed is None:
            seed = getattr(self, "seed", None)
        return FluidWrapper(RandomMix([self, *others], probs, longest=longest, seed=seed))

    def mcached(self) -> Any:
        """Record the samples of the first pass in memory and replay them afterwards."""
        return self.compose(Cached())

    def lmdb_cached(self, *args: Any, **kwargs: Any) -> Any:
        """Record the samples of the first pass in an LMDB file (see :class:`LMDBCached`)."""
        return self.compose(LMDBCached(*args, **kwargs))

    def stats(self) -> PipelineStats:
        """Where this pipeline's time went in this process (``WebDataset(..., stats=True)``):
        each stage's own seconds and share (reading shards, tar parsing, decoding, your maps,
        batching), samples/s and items/s. ``print(ds.stats())`` shows a table; a DataLoader's
        workers are measured by ``WebLoader(..., stats=True).stats()``."""
        probe = getattr(self, "probe", None)
        if probe is None:
            raise ArgumentError("stats() needs a pipeline made with WebDataset(..., stats=True)")
        return stats_of(probe)


#: webdataset's name for the mixin.
FluidInterface = FluentMixin


class FluidWrapper(DataPipeline, FluentMixin):
    """Any iterable (or callable returning one) followed by chainable stages."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)  # not through __init__, which would splice a list of samples


@stage(count=SAME, runs=True)
def _require_samples(src: Iterable[Any], urls: Any, *, ledger: Any = None) -> Iterator[Any]:
    """Raise if a single-process epoch yields nothing; in a worker, log why it may be empty.

    A resumed epoch may rightly have nothing left to read."""
    n = 0
    for sample in src:
        n += 1
        yield sample
    if n == 0 and not (ledger is not None and ledger.resuming):
        where = worker_info()
        why = (
            f"no samples found in {urls!r}: every shard was empty or skipped. Check the "
            "shards (and the handler's warnings), or pass empty_check=False"
        )
        if where.num_workers == 1 and where.world_size == 1:
            raise NoSamplesError(why)
        if ledger is not None:  # a WebLoader's main process raises if every worker found none
            ledger.ledger.no_samples = why
        log.warning(
            "webds: rank %d worker %d got no samples from %r; with fewer shards than "
            "ranks x workers some processes have nothing to read",
            where.rank,
            where.worker,
            redact(urls),
        )


def _shard_index(urls: Any, index: Any, storage_options: Optional[dict]) -> Optional[ShardIndex]:
    """The ShardIndex that ``WebDataset(urls, index=...)`` names, or None."""
    if isinstance(index, ShardIndex):
        return index
    if index is True:
        log.info(
            "webds: counting the samples of every shard of %r (write an index to skip this)",
            redact(urls),
        )
        return ShardIndex.build(urls, storage_options=storage_options)
    if isinstance(index, (str, os.PathLike)):
        return ShardIndex.load(os.fspath(index), storage_options=storage_options)
    if index not in (None, False):
        raise ArgumentError(f"index must be a path or URL, a ShardIndex or True, got {index!r}")
    if isinstance(urls, ShardIndex):
        return urls
    if isinstance(urls, (str, os.PathLike)) and is_index_url(os.fspath(urls)):
        return ShardIndex.load(os.fspath(urls), storage_options=storage_options)
    return None


def _indexed_shards(
    urls: Any, index: Any, shard_index: ShardIndex, storage_options: Optional[dict]
) -> Tuple[List[str], List[ShardInfo]]:
    """The shards to read, with their index entries: all of the index, or those ``urls``
    names."""
    if index in (None, False) or isinstance(urls, ShardIndex) or index is True:
        return shard_index.urls, list(shard_index.shards)
    infos = {url_identity(s.url): s for s in shard_index.shards}
    wanted = expand_urls(urls, storage_options=storage_options)
    missing = [u for u in wanted if url_identity(u) not in infos]
    if missing:
        raise ArgumentError(
            f"{len(missing)} shard(s) are not in the index {shard_index.location or ''}, e.g. "
            f"{missing[0]!r}; rebuild the index with `webds index`, or pass the index itself "
            "as the URL",
            url=missing[0],
        )
    return wanted, [infos[url_identity(u)] for u in wanted]


# Marks "the caller did not choose": node/worker splitting then depends on resampled=.
_AUTO: Any = "auto"


def _check_planning(
    shard_index: Optional[ShardIndex],
    balance: Optional[str],
    resampled: bool,
    nodesplitter: Any,
    workersplitter: Any,
) -> None:
    """Refuse what a plan can't honour: ``balance`` without an index, and an index with resampled
    shards or splitters of the caller's."""
    if balance is not None and shard_index is None:
        raise ArgumentError(
            f"balance={balance!r} needs the sample count of every shard: pass index= the "
            "index file (ShardWriter writes one; for existing shards run `webds index SHARDS "
            "-o index.json`), or index=True to count now by reading every shard"
        )
    # With an index the plan splits by rank and by worker, which is what the default
    # splitters do: 1.x code that passes them explicitly is accepted.
    if shard_index is not None and (
        resampled
        or nodesplitter not in (_AUTO, split_by_node)
        or workersplitter not in (_AUTO, split_by_worker)
    ):
        raise ArgumentError(
            "an index plans which samples each rank and worker reads; it can't be combined "
            "with resampled=True, or with a nodesplitter= or workersplitter= other than the "
            "default split_by_node and split_by_worker"
        )


def _shard_source(
    urls: URLs,
    index: Any,
    shard_index: Optional[ShardIndex],
    resampled: bool,
    shardshuffle: Union[bool, int, None],
    seed: Optional[int],
    balance: Optional[str],
    storage_options: Optional[dict],
) -> Tuple[Any, Tuple[Any, Any]]:
    """The pipeline's first stage (an epoch plan with an index, a shard spec's sampler, resampled
    shards, or the shard list) and the node and worker splitters it takes by default."""
    seed0 = 0 if seed is None else seed
    if shard_index is not None:
        plan_urls, infos = _indexed_shards(urls, index, shard_index, storage_options)
        plan = PlannedShards(
            plan_urls,
            [info.samples for info in infos],
            balance=balance or "pad",
            seed=seed0,
            shuffle=bool(shardshuffle),
            offsets=[info.offsets for info in infos],
        )
        return plan, (None, None)  # the plan splits by rank and worker itself
    if is_spec(urls):
        if resampled:
            raise ArgumentError(
                "a shard spec (a dict or .yaml file) selects its shards per epoch itself (its "
                "datasets' choose: and resample:); it can't be combined with resampled=True"
            )
        return MultiShardSample(urls, seed=seed0), (split_by_node, split_by_worker)
    if resampled:
        # Each node and worker draws its own sequence: no splitting unless asked for.
        shards = ResampledShards(
            urls, seed=seed0, deterministic=seed is not None, storage_options=storage_options
        )
        return shards, (None, None)
    shard_seed = seed0 if shardshuffle else None
    shards = SimpleShardList(urls, seed=shard_seed, storage_options=storage_options)
    return shards, (split_by_node, split_by_worker)


class WebDataset(DataPipeline, FluentMixin):
    """Samples from tar shards, as an ``IterableDataset`` with chainable stages.

    ``WebDataset("data/train-{000..099}.tar", shardshuffle=True, seed=0).shuffle(1000)
    .decode("pil").to_tuple("jpg", "cls").batched(64)``

    - ``urls``: shard URLs (braces, ``::``, prefixes, globs: :func:`expand_urls`, listed once,
      here), a shard index file, or a shard spec (:mod:`webds.shards.specs`).
    - ``shardshuffle``: shuffle the shards every epoch by (seed, epoch), alike on every node and
      worker (True, or an int as in webdataset); ``seed``: default ``WDS_SEED`` if set, else 0.
    - ``resampled``: draw shards with replacement, endlessly, each node and worker its own (use
      ``.with_epoch(n)``); ``repeat``: repeat the data forever.
    - ``nodesplitter`` / ``workersplitter``: split the shards by node / DataLoader worker (default
      :func:`split_by_node`, :func:`split_by_worker`; None: no split).
    - ``handler``: what to do when a shard cannot be opened or read; ``empty_check``: raise when a
      single-process epoch yields no sample.
    - ``select_files`` / ``rename_files``: functions on member names (rename runs first).
    - ``storage_options``: fsspec's, to open and list remote URLs.
    - ``index``: the shard index (a path or URL, a :class:`~webds.shards.index.ShardIndex`, or True:
      count now) gives every rank the same number of samples and batches, an exact ``len()`` and
      mid-epoch resume; ``balance`` (with an index): ``"pad"`` (the default) or ``"drop"``.
    - ``cache_dir`` / ``cache_size`` / ``cache_local``: keep remote shards (local ones too with
      ``cache_local``) in a directory; ``cache_size`` > 0 bounds it in bytes, 0 turns it off.
    - ``max_member_size``: the largest member read out of a compressed shard (default 1 GiB);
      ``max_sample_bytes``: the most bytes one sample's members may hold together (default
      512 MiB in a compressed shard; given, in plain shards too).
    - ``accept_unterminated``: read a shard without its end-of-archive marker as complete, with a
      warning (default: ``WDS_ACCEPT_UNTERMINATED``).
    - ``readahead`` / ``readahead_shards``: fetch the next remote shards while one is read (128 MiB;
      ``"auto"``: 8 shards, up to 32 while the reader waits on the link; False: off; True: local
      and ``pipe:`` too).
    - ``stats``: time each stage, for :meth:`stats` (about 0.1 us per item and stage).

    webdataset 1.x's ``mode``, ``detshuffle``, ``verbose``, ``url_to_name`` and the 0.1 keywords
    (``extensions=``, ...) still work (:func:`webds.keywords.legacy_keywords`). More: [distributed
    training](../distributed.md), [remote storage](../remote.md), [damaged data](../damaged.md),
    [handlers](errors.md#handlers), [stats](../starved.md), [migrating](../migrating.md).
    """

    def __init__(
        self,
        urls: URLs,
        # webdataset 1.x's parameters, in its positional order (mode, url_to_name, detshuffle
        # and verbose are its legacy keywords, see webds.keywords)...
        handler: Handler = reraise_exception,
        mode: Optional[str] = None,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: Union[bool, int, None] = None,
        cache_size: int = -1,
        cache_dir: Optional[str] = None,
        url_to_name: Any = None,
        detshuffle: Any = None,
        nodesplitter: Optional[Callable[..., Any]] = _AUTO,
        workersplitter: Optional[Callable[..., Any]] = _AUTO,
        select_files: Optional[Callable[[str], bool]] = None,
        rename_files: Optional[Callable[[str], str]] = None,
        empty_check: bool = True,
        verbose: Any = None,
        seed: Optional[int] = None,
        # ... then webds's own, by keyword.
        *,
        storage_options: Optional[dict] = None,
        cache_local: bool = False,
        index: Union[str, "os.PathLike[str]", ShardIndex, bool, None] = None,
        balance: Optional[str] = None,
        max_member_size: Optional[int] = None,
        max_sample_bytes: Optional[int] = None,
        accept_unterminated: Optional[bool] = None,
        readahead: Union[bool, int, None] = None,
        readahead_shards: Union[int, str] = DEFAULT_READAHEAD_SHARDS,
        stats: bool = False,
        **legacy: Any,
    ) -> None:
        super().__init__()
        self.probe = Probe() if stats else None
        # Set by a WebLoader over this dataset: its worker count and batch size.
        self.loader_shape: Optional[LoaderShape] = None
        extra_stages: list = []
        given = dict(mode=mode, url_to_name=url_to_name, detshuffle=detshuffle, verbose=verbose)
        legacy.update({k: v for k, v in given.items() if v is not None})
        if legacy:
            plan = legacy_keywords(legacy, resampled=resampled, shardshuffle=shardshuffle)
            resampled, shardshuffle, extra_stages = plan.resampled, plan.shardshuffle, plan.stages
        if seed is None:
            seed = default_seed()
        self.seed = seed
        check_balance(balance)
        check_readahead(readahead, readahead_shards)
        shard_index = _shard_index(urls, index, storage_options)
        _check_planning(shard_index, balance, resampled, nodesplitter, workersplitter)
        self.index = shard_index
        source, (default_node, default_worker) = _shard_source(
            urls, index, shard_index, resampled, shardshuffle, seed, balance, storage_options
        )
        self.plan: Optional[PlannedShards] = source if isinstance(source, PlannedShards) else None
        self.append(source)
        node = default_node if nodesplitter is _AUTO else nodesplitter
        worker = default_worker if workersplitter is _AUTO else workersplitter
        if node is not None:
            self.append(node)
        if worker is not None:
            self.append(worker)
        cache_dir, cache_size = cache_settings(cache_dir, cache_size)
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
                max_member_size=max_member_size,
                max_sample_bytes=max_sample_bytes,
                accept_unterminated=accept_unterminated,
                readahead=readahead,
                # "auto" learned once per dataset, not once per pass.
                readahead_shards=LearnedDepth() if readahead_shards == AUTO else readahead_shards,
                **(storage_options or {}),
            )
        )
        self._samples_at = len(self.pipeline) - 1
        if empty_check and self.plan is None:
            self.append(_require_samples(urls))
        for extra in extra_stages:
            self.append(extra)
        if repeat:
            self.repeat()

    # -- planned reading (with an index) ---------------------------------------------------------

    def _counted_source(self) -> Optional[Tuple[int, Any]]:
        if self.plan is None:
            return super()._counted_source()
        plan = self.aligned_plan()
        plan.set_epoch(self._position[0])  # the epoch in progress, or the next one
        return self._samples_at, plan

    def aligned_plan(self) -> Optional[PlannedShards]:
        """The epoch plan (None without an index), aligned to this pipeline's batch size.

        Composed copies of a dataset share one plan but may batch differently, so the
        alignment is set here, whenever the plan is about to be used.
        """
        if self.plan is not None:
            self.plan.granule = self._aligned_batch_size()
        return self.plan

    def _aligned_batch_size(self) -> int:
        """The batch size workers' shares are aligned to: the first batching after the samples,
        else the DataLoader's (``loader_shape``), else 1."""
        for s in self.pipeline[self._samples_at + 1 :]:
            if isinstance(s, Stage) and s.count is BATCH:
                return max(1, int(s.argument("batchsize")))
            if not isinstance(getattr(s, "count", None), Count):
                break
        if self.loader_shape is not None and self.loader_shape.batch_size:
            return int(self.loader_shape.batch_size)
        return 1

    def _workers_hint(self) -> Optional[int]:
        return self.loader_shape.workers if self.loader_shape is not None else None

    def _planned(self) -> Optional[Tuple[PlannedShards, int, int]]:
        return None if self.plan is None else (self.plan, self._aligned_batch_size(), 1)

    def _resume_config(self) -> Dict[str, Any]:
        config = super()._resume_config()
        if self.plan is not None:
            rank, world, _, _ = self.plan.where()
            config.update(
                index=self.index.digest() if self.index is not None else None,
                shards=len(self.plan.urls),
                balance=self.plan.balance,
                shardshuffle=self.plan.shuffle,
                world_size=world,
            )
        return config
