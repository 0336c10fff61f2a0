"""Shard descriptors to samples in one fast generator: :func:`tarfile_to_samples`.

It applies the WebDataset grouping rules of :mod:`webds.tar.grouping` (where ``url_opener``,
``tar_file_expander`` and ``group_by_keys``, the same steps one at a time, live; their names are
importable from here too) with the same error handling, reads planned sample ranges of indexed
shards (:mod:`webds.shards.plan`), and records each sample it reads in the pipeline's ledger
(:mod:`webds.base.ledger`), skipping those a resumed epoch already consumed.

Errors go through the stage's ``handler``. With the default (re-raise) the error surfaces after
every complete sample before it; with a skipping handler the rest of a broken shard is skipped,
the incomplete sample in flight is dropped, and reading goes on with the next shard.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ..base.handlers import ErrorPolicy, Handler, reraise_exception
from ..base.ledger import LEAF, StageLedger
from ..base.stage import stage
from ..errors import ArgumentError, ShardReadError
from ..io.readahead import DEFAULT_READAHEAD_SHARDS, check_readahead, fetch_ahead
from ..io.urls import url_scheme
from .grouping import (  # noqa: F401  (the one-step stages: importable from here too)
    META_PATTERN,
    _close_quietly,
    _duplicate,
    _kept_name,
    _member_key,
    _open_shard,
    _shard_opener,
    _shard_url,
    _warn_dotless,
    accepts_unterminated,
    base_plus_ext,
    group_by_keys,
    is_meta_name,
    open_shards,
    tar_file_expander,
    url_opener,
    warn_unterminated,
)
from .reader import EndWithoutMarker, read_members
from .windows import Window, stale_index, window, window_opener

__all__ = [
    "base_plus_ext",
    "url_opener",
    "tar_file_expander",
    "group_by_keys",
    "tarfile_to_samples",
    "tarfile_samples",
    "META_PATTERN",
]


@stage(expands=True)
def tarfile_to_samples(
    src: Iterable[Any],
    handler: Handler = reraise_exception,
    select_files: Optional[Callable[[str], bool]] = None,
    rename_files: Optional[Callable[[str], Optional[str]]] = None,
    lcase: bool = True,
    *,
    max_member_size: Optional[int] = None,
    readahead: Union[bool, int, None] = None,
    readahead_shards: int = DEFAULT_READAHEAD_SHARDS,
    sample_starts: Optional[List[int]] = None,
    accept_unterminated: Optional[bool] = None,
    ledger: Any = None,
    **storage_options: Any,
) -> Iterator[Dict[str, Any]]:
    """Shard descriptors to samples: ``url_opener``, ``tar_file_expander`` and
    ``group_by_keys`` in one fast generator, with the same rules and error handling::

        DataPipeline(SimpleShardList("data/shard-{000..009}.tar"), tarfile_to_samples())

    ``lcase=False`` keeps each extension's case (tools that copy shards use it).
    ``max_member_size`` bounds the members of compressed shards (see
    :func:`~webds.tar.reader.read_members`). A shard must end with its end-of-archive marker; one
    cut at a member boundary is an error (its sample in flight is never yielded) unless an index
    planned it and its sample count is complete, or ``accept_unterminated`` is true (default:
    the environment variable ``WDS_ACCEPT_UNTERMINATED``): the shard is then read as complete,
    its last sample included, as webdataset reads it, with a logged warning naming it (a writer
    killed between samples leaves such shards; a cut copy does too, and then samples are
    silently missing). While a shard is read, the next
    ``readahead_shards`` remote shards are fetched within a ``readahead`` budget of bytes
    (:mod:`webds.io.readahead`; True reads local shards ahead too, False turns it off).
    ``sample_starts``, a list, gets the header offset of each sample's first member (in the
    uncompressed stream) as the sample is made: the shard index records them. In a
    pipeline,
    sample ``j`` of the pipeline's source item ``k`` is recorded in its ledger as read (see
    :mod:`webds.base.ledger`); when resuming, the samples consumed before are skipped.
    """
    shared = ledger.ledger if isinstance(ledger, StageLedger) else ledger
    samples = _read_samples(
        src, handler, select_files, rename_files, lcase, max_member_size, readahead,
        readahead_shards, sample_starts, shared, storage_options,
        accepts_unterminated(accept_unterminated),
    )  # fmt: skip
    if shared is not None and shared.resuming:
        # The samples held at the checkpoint, read again first, in the order their stages
        # take them back (see webds.base.ledger.Slot.restore).
        return shared.restore_order(samples)
    return samples


def _read_samples(
    src: Iterable[Any],
    handler: Handler,
    select_files: Optional[Callable[[str], bool]],
    rename_files: Optional[Callable[[str], Optional[str]]],
    lcase: bool,
    max_member_size: Optional[int],
    readahead: Union[bool, int, None],
    readahead_shards: int,
    sample_starts: Optional[List[int]],
    ledger: Any,
    storage_options: Dict[str, Any],
    unterminated: bool = False,
) -> Iterator[Dict[str, Any]]:
    """The generator behind :func:`tarfile_to_samples` (``ledger``: the pipeline's;
    ``unterminated``: read shards without their end-of-archive marker as complete)."""
    policy = ErrorPolicy(handler, "tarfile_to_samples")
    filtering = select_files is not None or rename_files is not None
    base = -1  # the ledger id of this shard's sample 0, or -1 outside a pipeline
    resuming = ledger is not None and ledger.resuming
    # Not resuming, a sample read is recorded in the ledger's ``reading`` [shard, sample], two
    # stores, rather than through produce(): this runs once per sample.
    reading = ledger.reading if ledger is not None else None
    budget, depth, every_shard = check_readahead(readahead, readahead_shards)

    def numbered() -> Iterator[Tuple[Any, int, Optional[Window]]]:
        # Each shard with its ledger id, taken as it is pulled (shards read ahead are pulled
        # before the samples of the one being read are all yielded), and where to enter it.
        for shard in src:
            item = ledger.current if ledger is not None else None
            k = item & ~LEAF if isinstance(item, int) else -1
            first, last, _ = _sample_range(shard)
            if resuming and k >= 0:
                if ledger.skips_item(k >> 32):
                    continue  # all its samples were consumed before the resume: not opened
                first = ledger.first_unconsumed(k >> 32, first)
                if first >= last:
                    ledger.finish(k >> 32)  # consumed up to its last planned sample
                    continue
            yield shard, k, window(shard, first)

    def opener(entry: Tuple[Any, int, Optional[Window]]) -> Callable[[], Tuple[Any, ...]]:
        shard, _, win = entry
        if win is not None:
            return window_opener(shard, win, storage_options)
        return _shard_opener(shard, storage_options)

    probe = getattr(ledger, "probe", None)  # stats=True: reading is timed (stages.probe)
    shards = fetch_ahead(
        numbered(),
        name=lambda entry: _shard_name(entry[0]),
        opener=opener,
        ahead=lambda entry: _reads_ahead(entry[0], every_shard),
        shards=depth,
        budget=budget,
    )
    try:
        for (shard, base, win), opened in shards if probe is None else probe.reads(shards):
            if base >= 0:
                ledger.start_reading(base >> 32)
            try:
                url, stream, lpath = opened() if probe is None else probe.open(opened)
            except Exception as exn:
                if policy(exn):
                    continue
                break
            cur: Optional[Dict[str, Any]] = None
            cur_key: Optional[str] = None
            dotless, first_dotless = 0, None
            stop = False
            # A planned segment (see webds.shards.plan) reads samples [first, last) of the shard;
            # entered at a window, its stream starts with sample win.first.
            first, last, indexed = _sample_range(shard)
            n = 0 if win is None else win.first  # samples of this shard seen so far
            entry = 0 if win is None else win.offset
            # Entered by the index's offsets, every sample must start where the index says.
            bounds = shard["offsets"] if win is not None else None
            unmarked: Optional[EndWithoutMarker] = None
            # With an index, samples are numbered as the index counted them: before
            # select_files/rename_files, a sample whose members are all filtered out included.
            count_raw = filtering and last < _NO_RANGE
            fixed = 2 if lpath is None else 3  # __key__, __url__ and maybe __local_path__
            try:
                try:
                    for name, data, offset in read_members(stream, url, max_member_size, entry):
                        # This loop runs once per member: a plain "key.ext" name takes one
                        # partition; everything else (folders, metadata members, renaming, names
                        # without a dot) the general rules below.
                        key, dot, ext = name.partition(".")
                        sample_key = key  # what separates samples (before renaming, for an index)
                        if not dot or not key or filtering or key[:2] == "__" or "/" in name:
                            if count_raw:
                                sample_key = _member_key(name)
                            try:
                                name = _kept_name(name, select_files, rename_files)
                            except Exception as exn:
                                if policy(exn):
                                    continue
                                stop = True
                                break
                            if name is None:
                                if sample_key is None or sample_key == cur_key or not count_raw:
                                    continue
                                # Filtered out, but it starts a sample that the index counts.
                                key, ext = sample_key, None
                            else:
                                # base_plus_ext, inlined.
                                slash = name.rfind("/")
                                i = name.find(".", slash + 1)
                                if i > slash + 1:
                                    key = name[:i]
                                else:
                                    key = base_plus_ext(name)[0]
                                    if key is None:
                                        dotless += 1
                                        if first_dotless is None:
                                            first_dotless = name
                                        continue
                                ext = name[i + 1 :]
                            if not count_raw:
                                sample_key = key
                        if sample_key != cur_key:
                            if bounds is not None and (cur is not None or n == win.first):
                                _check_start(url, bounds, n + (cur is not None), offset)
                            if cur is not None and count_raw and len(cur) <= fixed:
                                cur = None  # every member filtered out: counted, not yielded
                                n += 1
                            if cur is not None:
                                if n >= first:
                                    if base < 0:
                                        yield cur
                                    elif not resuming:
                                        ledger.current = base | n
                                        reading[1] = n
                                        yield cur
                                    elif not ledger.consumed(base | n):
                                        ledger.produce(base | n)
                                        yield cur
                                n += 1
                            if n >= last:
                                cur = None
                                if last < indexed:
                                    break  # the rest of the shard belongs to another reader
                                raise _stale_index(url, indexed, more=True)
                            cur = {"__key__": key, "__url__": url}
                            if lpath is not None:
                                cur["__local_path__"] = lpath
                            cur_key = sample_key
                            if sample_starts is not None:
                                sample_starts.append(offset)
                        elif cur is None:
                            continue  # the rest of a sample dropped for a duplicate
                        if ext is None:
                            continue  # a member filtered out (count_raw)
                        if count_raw and len(cur) == fixed:
                            cur["__key__"] = key  # the key its first kept member has
                        if lcase:
                            ext = ext.lower()
                        if ext in cur:
                            cur = None
                            if policy(_duplicate(key, ext, url, name, offset)):
                                continue
                            stop = True
                            break
                        cur[ext] = data
                except EndWithoutMarker as exn:
                    # Cut at a member boundary, or written without the marker: only an index's
                    # sample count can vouch for the shard (checked below), or the caller's
                    # accept_unterminated. A window ends so.
                    if indexed >= 0:
                        unmarked = exn
                    elif unterminated:
                        warn_unterminated(exn)
                    else:
                        raise
                except ShardReadError as exn:
                    if bounds is not None and exn.offset in bounds:
                        # No member where the index says a sample starts.
                        where = f"byte {exn.offset}, where sample {bounds.index(exn.offset)}"
                        raise stale_index(url, f"no tar header at {where} starts") from exn
                    raise
                if cur is not None and count_raw and len(cur) <= fixed:
                    cur = None
                    n += 1
                if cur is not None:
                    n += 1
                if not stop and n < last < _NO_RANGE:
                    cur = None
                    raise unmarked or _stale_index(url, indexed, more=False, seen=n)
                s, stream = stream, None
                if stop or n >= last:
                    _close_quietly(s)
                else:
                    s.close()
            except Exception as exn:
                if stream is not None:
                    s, stream = stream, None
                    _close_quietly(s)
                _warn_dotless(url, dotless, first_dotless)
                if policy(exn):
                    continue
                break
            finally:
                if stream is not None:  # iteration stopped early
                    _close_quietly(stream)
            _warn_dotless(url, dotless, first_dotless)
            if stop:
                break
            if cur is not None and n > first:
                if base < 0:
                    yield cur
                elif not resuming:
                    ledger.current = base | (n - 1)
                    reading[1] = n - 1
                    yield cur
                elif not ledger.consumed(base | (n - 1)):
                    ledger.produce(base | (n - 1))
                    yield cur
            if base >= 0:
                ledger.finish(base >> 32)
    finally:
        shards.close()  # cancels the shards fetched ahead and not read
        policy.report()


_NO_RANGE = sys.maxsize


def _shard_name(shard: Any) -> str:
    url = shard.get("url") if isinstance(shard, dict) else shard
    return str(url)


def _reads_ahead(shard: Any, every_shard: bool) -> bool:
    """Whether ``shard`` is fetched ahead: remote shards (fsspec URLs, not yet in a local cache)
    by default, every shard with ``readahead=True``."""
    if every_shard:
        return True
    if isinstance(shard, dict) and shard.get("local_path") is not None:
        return False  # opened from a local copy (the shard cache)
    try:
        url = _shard_url(shard)
    except ArgumentError:
        return False  # opened in its turn, where a bad descriptor raises
    return url != "-" and url_scheme(url) not in (None, "file", "pipe")


def _sample_range(shard: Any) -> Tuple[int, int, int]:
    """(first, last, indexed count) of a planned segment descriptor; the whole shard otherwise."""
    if isinstance(shard, dict) and "stop" in shard:
        return int(shard.get("start", 0)), int(shard["stop"]), int(shard.get("samples", -1))
    return 0, _NO_RANGE, -1


def _check_start(url: str, bounds: Any, n: int, offset: int) -> None:
    """Raise the out-of-date index error if sample ``n`` does not start at ``bounds[n]``."""
    if n < len(bounds) and offset != bounds[n]:
        raise stale_index(
            url, f"sample {n} starts at byte {offset}, and the index says at byte {bounds[n]}"
        )


def _stale_index(url: str, indexed: int, more: bool, seen: int = 0) -> ShardReadError:
    found = f"more than {indexed}" if more else f"only {seen}"
    return stale_index(url, f"the shard has {found} samples but the index says {indexed}")


#: webdataset's name for the plain function behind :func:`tarfile_to_samples`.
tarfile_samples = tarfile_to_samples.fn
