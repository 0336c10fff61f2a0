"""Shard descriptors to samples in one fast generator: :func:`tarfile_to_samples`.

It groups members by the rules of :mod:`webds.tar.grouper`, as the one-step stages of
:mod:`webds.tar.grouping` do (``url_opener``, ``tar_file_expander``, ``group_by_keys``: their
names are importable from here too), with the same error handling, reads planned sample ranges
of indexed shards (:mod:`webds.shards.plan`), and records each sample it reads in the pipeline's
ledger (:mod:`webds.base.ledger`), skipping those a resumed epoch already consumed.

The layers, each a generator: :func:`_read_samples`, the shard loop, where every sample leaves
the stage; :func:`_shard_samples`, one shard's samples, numbered and checked against its index;
:func:`~webds.tar.grouper.group_members`, the grouping; :func:`~webds.tar.reader.read_members`.

Errors go through the stage's ``handler``. With the default (re-raise) the error surfaces after
every complete sample before it; with a skipping handler the rest of a broken shard is skipped,
the incomplete sample in flight is dropped, and reading goes on with the next shard.
"""

from __future__ import annotations

import sys
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Tuple,
    Union,
)

from ..base.handlers import ErrorPolicy, Handler, reraise_exception
from ..base.ledger import StageLedger, item_id, shard_of
from ..base.runs import Run
from ..base.stage import stage
from ..errors import ArgumentError, ShardReadError
from ..io.readahead import (
    AUTO,
    DEFAULT_READAHEAD_SHARDS,
    Depth,
    LearnedDepth,
    check_readahead,
    fetch_ahead,
)
from ..io.urls import url_scheme
from .bulk import bulk_groups, takes_rules
from .grouper import ALL_FILTERED, END, Grouping, ShardNotes, group_members
from .grouping import (  # noqa: F401  (the one-step stages: importable from here too)
    META_PATTERN,
    _close_quietly,
    _shard_opener,
    _shard_url,
    accepts_unterminated,
    base_plus_ext,
    group_by_keys,
    is_meta_name,
    open_shards,
    tar_file_expander,
    url_opener,
    warn_unterminated,
)
from .reader import read_members
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
    max_sample_bytes: Optional[int] = None,
    readahead: Union[bool, int, None] = None,
    readahead_shards: Union[int, str] = DEFAULT_READAHEAD_SHARDS,
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
    :func:`~webds.tar.reader.read_members`), and ``max_sample_bytes`` the members of one sample
    together (default 512 MiB in a compressed shard, none in a plain one; past it a
    :class:`~webds.errors.SampleTooLargeError`, before the member is read). A shard must end
    with its end-of-archive marker; one cut at a member boundary is an error (its sample in
    flight is never yielded) unless an index planned it and its sample count is complete, or
    ``accept_unterminated`` is true (default:
    the environment variable ``WDS_ACCEPT_UNTERMINATED``): the shard is then read as complete,
    its last sample included, as webdataset reads it, with a logged warning naming it. While a
    shard is read, the next ``readahead_shards`` remote shards are fetched within a
    ``readahead`` budget of bytes (:mod:`webds.io.readahead`; True reads local shards ahead
    too, False turns it off; ``"auto"``, the default: 8, more while the reader waits on the
    link).
    ``sample_starts``, a list, gets the header offset of each sample's first member (in the
    uncompressed stream) as the sample is made: the shard index records them. In a pipeline,
    sample ``j`` of the pipeline's source item ``k`` is recorded in its ledger as read (see
    :mod:`webds.base.ledger`); when resuming, the samples consumed before are skipped.
    """
    shared = ledger.ledger if isinstance(ledger, StageLedger) else ledger
    if max_sample_bytes is not None and (
        isinstance(max_sample_bytes, bool)
        or not isinstance(max_sample_bytes, int)
        or max_sample_bytes < 1
    ):
        raise ArgumentError(f"max_sample_bytes must be a positive number, got {max_sample_bytes!r}")
    how = _Reading(
        isinstance(ledger, StageLedger) and ledger.runs,
        Grouping(select_files, rename_files, lcase, unmarked_end=True),
        max_member_size,
        max_sample_bytes,
        sample_starts,
        accepts_unterminated(accept_unterminated),
        readahead,
        readahead_shards,
        storage_options,
    )
    samples = _read_samples(src, handler, how, shared)
    if shared is not None and shared.resuming:
        # The samples held at the checkpoint, read again first, in the order their stages
        # take them back (see webds.base.slots.Slot.restore).
        return shared.restore_order(samples)
    return samples


class _Reading(NamedTuple):
    """How :func:`tarfile_to_samples` reads (its arguments, less the handler and the ledger)."""

    runs: bool  # runs of samples may be yielded (webds.base.runs): the next stages take them
    rules: Grouping
    max_member_size: Optional[int]
    max_sample_bytes: Optional[int]  # given: plain shards too, read member by member
    sample_starts: Optional[List[int]]
    unterminated: bool  # shards without their end-of-archive marker are read as complete
    readahead: Union[bool, int, None]
    readahead_shards: Union[int, str]
    storage_options: Dict[str, Any]


def _read_samples(
    src: Iterable[Any], handler: Handler, how: _Reading, ledger: Any
) -> Iterator[Dict[str, Any]]:
    """The generator behind :func:`tarfile_to_samples`, the shard loop (``ledger``: the
    pipeline's, or None). Each sample leaves the stage at one place, recorded in the ledger."""
    policy = ErrorPolicy(handler, "tarfile_to_samples")
    resuming = ledger is not None and ledger.resuming
    # Not resuming, a sample read is recorded in the ledger's ``reading`` [shard, sample], two
    # stores, rather than through produce(): this runs once per sample.
    reading = ledger.reading if ledger is not None else None
    probe = getattr(ledger, "probe", None)  # stats=True: reading is timed (stages.probe)
    starts = how.sample_starts
    # Runs of samples (webds.base.runs) where each sample needs nothing but its ledger record,
    # which the run makes as it is taken apart: not while resuming, nor recording starts; and
    # (in the shard loop) a whole shard, numbered, without an index's bounds to check.
    may_run = how.runs and not resuming and starts is None
    # With an index, samples are numbered as the index counted them: before select_files and
    # rename_files, a sample whose members are all filtered out included.
    filtering = how.rules.select_files is not None or how.rules.rename_files is not None
    counted = how.rules._replace(count_raw=filtering)
    shards = _fetch_shards(src, how, ledger, probe)
    try:
        for (shard, base, win), opened in shards if probe is None else probe.reads(shards):
            if base >= 0:
                ledger.start_reading(shard_of(base))
            # A planned segment (see webds.shards.plan) reads samples [first, last) of the shard;
            # entered at a window, its stream starts with sample win.first, and every sample must
            # start where the index's offsets say.
            first, last, indexed = _sample_range(shard)
            n, entry = (0, 0) if win is None else (win.first, win.offset)
            bounds = None if win is None else shard["offsets"]
            rules = how.rules if last == _NO_RANGE else counted
            notes, url, stream = ShardNotes(), None, None
            try:
                try:
                    url, stream, lpath = opened() if probe is None else probe.open(opened)
                    runs = may_run and base >= 0 and win is None and (first, last) == (0, _NO_RANGE)
                    groups = _grouped(stream, url, rules, policy, notes, lpath, how, entry, runs)
                    for done, start in groups:
                        if start is END:  # the members are all read: the stream is closed first
                            s, stream = stream, None
                            ends = n + (done is not None)
                            _end_of_shard(s, url, ends, last, indexed, notes, how.unterminated)
                        elif bounds is not None and (done is not None or n == win.first):
                            _check_start(url, bounds, n + (done is not None), start)
                        if type(done) is Run:
                            yield done.bind(ledger, base | n)  # (records its samples)
                            n += done.count
                        elif done is not None:
                            if n >= first and done is not ALL_FILTERED:
                                if base < 0:
                                    yield done
                                elif not resuming:
                                    ledger.current = base | n  # item_id(shard, n)
                                    reading[1] = n
                                    yield done
                                elif not ledger.consumed(base | n):
                                    ledger.produce(base | n)
                                    yield done
                            n += 1
                        if start is END:
                            break
                        if n >= last:
                            if last < indexed:
                                break  # the rest of the shard belongs to another reader
                            raise _stale_index(url, indexed, more=True)
                        if starts is not None:
                            starts.append(start)
                except ShardReadError as exn:
                    # No member where the index says a sample starts? (An end without the
                    # end-of-archive marker is judged by _end_of_shard.)
                    if bounds is None or exn.offset not in bounds or exn is notes.unmarked:
                        raise
                    where = f"byte {exn.offset}, where sample {bounds.index(exn.offset)}"
                    raise stale_index(url, f"no tar header at {where} starts") from exn
            except Exception as exn:
                if stream is not None:
                    s, stream = stream, None
                    _close_quietly(s)
                notes.warn_dotless(url)
                if policy(exn):
                    continue
                break
            finally:
                if stream is not None:  # stopped early: the consumer, the handler, the segment
                    _close_quietly(stream)
            notes.warn_dotless(url)
            if policy.stopped:
                break  # by the handler, in group_members
            if base >= 0:
                ledger.finish(shard_of(base))
    finally:
        shards.close()  # cancels the shards fetched ahead and not read
        policy.report()


def _grouped(
    stream: Any,
    url: str,
    rules: Grouping,
    policy: ErrorPolicy,
    notes: ShardNotes,
    local_path: Optional[str],
    how: _Reading,
    entry: int,
    runs: bool,
) -> Iterator[Tuple[Any, Any]]:
    """The shard's members from stream offset ``entry``, grouped (in bulk where the rules
    allow; with ``runs``, maybe in runs of samples)."""
    if takes_rules(rules) and how.max_sample_bytes is None:
        return bulk_groups(
            stream, url, rules, policy, notes, local_path, how.max_member_size, entry, runs
        )
    members = read_members(stream, url, how.max_member_size, entry, how.max_sample_bytes)
    return group_members(members, url, rules, policy, notes, local_path)


def _end_of_shard(
    stream: Any,
    url: str,
    n: int,
    last: int,
    indexed: int,
    notes: ShardNotes,
    unterminated: bool,
) -> None:
    """The members of a shard are all read, ``n`` samples counted: check that it ended as it
    should, close ``stream`` and report the members skipped for their names.

    A shard must end with its end-of-archive marker. One cut at a member boundary, or written
    without the marker (a window ends so too), is read as complete only if an index's sample
    count vouches for it, or the caller chose to (``accept_unterminated``: logged)."""
    unmarked = notes.unmarked
    try:
        if unmarked is not None and (n < last if indexed >= 0 else not unterminated):
            raise unmarked
        if n < last < _NO_RANGE:
            raise _stale_index(url, indexed, more=False, seen=n)
    except Exception:
        _close_quietly(stream)
        raise
    if unmarked is not None and indexed < 0:
        warn_unterminated(unmarked)
    if n >= last:
        _close_quietly(stream)  # a planned segment: maybe not read to its end
    else:
        stream.close()
    notes.warn_dotless(url)


_Entry = Tuple[Any, int, Optional[Window]]


def _fetch_shards(src: Iterable[Any], how: _Reading, ledger: Any, probe: Any) -> Any:
    """Each shard's :func:`_entries` entry and the function that opens it, the next shards
    fetched ahead (:func:`~webds.io.readahead.fetch_ahead`); ``probe`` (stats=True) reports
    how many."""
    budget, shards, every_shard = check_readahead(how.readahead, how.readahead_shards)
    if shards == AUTO:  # (this stage on its own: learned for this pass; WebDataset's is kept)
        shards = LearnedDepth()
    depth = shards.depth() if isinstance(shards, LearnedDepth) else Depth(int(shards))
    if probe is not None:
        probe.readahead = depth

    def opener(entry: _Entry) -> Callable[[], Tuple[Any, ...]]:
        shard, _, win = entry
        if win is not None:
            return window_opener(shard, win, how.storage_options)
        return _shard_opener(shard, how.storage_options)

    return fetch_ahead(
        _entries(src, ledger),
        name=lambda entry: _shard_name(entry[0]),
        opener=opener,
        ahead=lambda entry: _reads_ahead(entry[0], every_shard),
        shards=depth,
        budget=budget,
    )


def _entries(src: Iterable[Any], ledger: Any) -> Iterator[_Entry]:
    """Each shard with the ledger id of its sample 0 (-1 outside a pipeline) and the window to
    enter it at, taken as it is pulled (shards read ahead are pulled before the samples of the
    one being read are all yielded). Resuming, the samples consumed before are not read again:
    a shard without others is skipped unopened, and one is entered after them if it can be."""
    resuming = ledger is not None and ledger.resuming
    for shard in src:
        item = ledger.current if ledger is not None else None
        k = shard_of(item) if isinstance(item, int) else -1
        first, last, _ = _sample_range(shard)
        if resuming and k >= 0:
            if ledger.skips_item(k):
                continue  # all its samples were consumed before the resume: not opened
            first = ledger.first_unconsumed(k, first)
            if first >= last:
                ledger.finish(k)  # consumed up to its last planned sample
                continue
        yield shard, item_id(k, 0) if k >= 0 else -1, window(shard, first)


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
