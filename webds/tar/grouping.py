"""Shard descriptors to samples one step at a time: the stages ``url_opener`` (shard descriptors
-> open streams), ``tar_file_expander`` (streams -> members) and ``group_by_keys`` (members ->
samples), each usable on its own or composed; :func:`webds.tar.samples.tarfile_to_samples` does
all three in one fast generator. Samples are made by the rules of :mod:`webds.tar.grouper` (whose
``base_plus_ext``, ``is_meta_name`` and ``META_PATTERN`` are importable from here too). Only the
sample in flight is held in memory; each shard's stream is closed as soon as the shard ends or
iteration stops.

Errors go through the stage's ``handler``. With the default (re-raise) the error surfaces after
every complete sample before it; with a skipping handler the rest of a broken shard is skipped,
the incomplete sample in flight is dropped, and reading goes on with the next shard.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

from ..base.handlers import ErrorPolicy, Handler, reraise_exception
from ..base.redact import redact
from ..base.stage import stage
from ..errors import ArgumentError, OpenError, WebdsError
from ..io.streams import abandon_stream
from ..io.urls import deferred_open, local_path
from .grouper import (
    END,
    META_PATTERN,
    Grouping,
    ShardNotes,
    _kept_name,
    base_plus_ext,
    group_members,
    is_meta_name,
)
from .reader import EndWithoutMarker, read_members

__all__ = [
    "base_plus_ext",
    "is_meta_name",
    "url_opener",
    "open_shards",
    "tar_file_expander",
    "group_by_keys",
    "META_PATTERN",
    "accepts_unterminated",
]

log = logging.getLogger("webds")

# Marker a stage yields after each shard so that samples never merge across shards. An empty
# dict, as in webdataset; a dict with "__bad__" means the shard broke and the sample in flight
# is incomplete and must be dropped.
_END_OF_SHARD: Dict[str, Any] = {}


def _shard_url(shard: Any) -> str:
    if isinstance(shard, dict):
        url = shard.get("url")
    elif isinstance(shard, (str, os.PathLike)):
        url = shard
    else:
        url = None
    if url is None:
        raise ArgumentError(
            f"expected a shard descriptor dict with a 'url' (from a shard list), got {shard!r}"
        )
    return os.fspath(url)


def _open_shard(shard: Any, storage_options: Dict[str, Any]) -> Tuple[str, Any, Optional[str]]:
    """Return ``(url, stream, local_path)`` for a shard descriptor, opening it if needed."""
    return _shard_opener(shard, storage_options)()


def _shard_opener(
    shard: Any, storage_options: Dict[str, Any]
) -> Callable[[], Tuple[str, Any, Optional[str]]]:
    """:func:`_open_shard` in two steps (see :func:`~webds.io.urls.deferred_open`): what needs
    no I/O now, the open when the function returned is called (maybe in another thread)."""
    try:
        url = _shard_url(shard)
    except Exception:
        return functools.partial(_open_shard_now, shard, None)
    given = shard if isinstance(shard, dict) else {}
    if given.get("stream") is not None:
        return functools.partial(_open_shard_now, shard, None)
    return functools.partial(_open_shard_now, shard, deferred_open(url, "rb", **storage_options))


def _open_shard_now(
    shard: Any, open_stream: Optional[Callable[[], Any]]
) -> Tuple[str, Any, Optional[str]]:
    url = _shard_url(shard)
    given = shard if isinstance(shard, dict) else {}
    stream = given.get("stream")
    if stream is None:
        assert open_stream is not None
        try:
            stream = open_stream()
        except WebdsError:
            raise
        except Exception as exn:
            raise OpenError(f"cannot open shard: {type(exn).__name__}: {exn}", url=url) from exn
    lpath = given.get("local_path")
    if lpath is None:
        lpath = local_path(url)
    return url, stream, lpath


#: The environment's default for ``accept_unterminated=`` (tarfile_to_samples, WebDataset...).
UNTERMINATED_ENV = "WDS_ACCEPT_UNTERMINATED"


def accepts_unterminated(given: Optional[bool]) -> bool:
    """Whether shards that end without their end-of-archive marker are read as complete:
    ``given`` if it is not None, else the environment variable ``WDS_ACCEPT_UNTERMINATED``
    (``1``, ``true``, ``yes`` or ``on``; read when a stage starts reading)."""
    if given is not None:
        return bool(given)
    value = os.environ.get(UNTERMINATED_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ArgumentError(f"{UNTERMINATED_ENV} must be 1 or 0 (true/false), got {value!r}")


def warn_unterminated(exn: EndWithoutMarker) -> None:
    """Log that a shard without its end-of-archive marker was read as complete (the caller
    chose to: accept_unterminated), naming the shard, since samples may be missing from it."""
    log.warning(
        "webds: shard %r ends without its end-of-archive marker (after member %r, byte %s); "
        "read as complete (accept_unterminated): whole samples after its last one may be "
        "missing",
        redact(exn.url),
        exn.member,
        exn.offset,
    )


def _members(
    stream: Any, url: Optional[str], max_member_size: Optional[int], unterminated: bool
) -> Iterator[Tuple[str, bytes, int]]:
    """:func:`read_members`, where ``unterminated`` makes a missing end-of-archive marker a
    logged end rather than an error."""
    try:
        yield from read_members(stream, url, max_member_size)
    except EndWithoutMarker as exn:
        if not unterminated:
            raise
        warn_unterminated(exn)


def _close_quietly(stream: Any) -> None:
    """Close a stream we are abandoning (a planned part of a shard read, the consumer broke
    off, an error on its way): a ``pipe:`` command is ended without a wait for its status,
    and a close error can't add to the error at hand."""
    try:
        abandon_stream(stream)
    except Exception as exn:  # e.g. a pipe command killed because we stopped early
        log.debug("webds: ignoring error closing abandoned stream: %s", redact(str(exn)))


@stage(stateless=True)
def url_opener(
    src: Iterable[Any], handler: Handler = reraise_exception, **storage_options: Any
) -> Iterator[Dict[str, Any]]:
    """Open each shard ``{"url": ...}``, adding ``"stream"`` (and ``"local_path"`` for files).

    ``storage_options`` go to :func:`webds.io.urls.open_url` (fsspec credentials, endpoints...).
    The stream is the next stage's to close.
    """
    return open_shards(
        src, lambda shard: _open_shard(shard, storage_options), handler, "url_opener"
    )


def open_shards(
    src: Iterable[Any],
    open_shard: Callable[[Any], Tuple[str, Any, Optional[str]]],
    handler: Handler,
    stage_name: str,
) -> Iterator[Dict[str, Any]]:
    """Yield each shard descriptor with ``"stream"`` (and ``"local_path"``) added by
    ``open_shard(shard) -> (url, stream, local_path)``; opening errors go to ``handler``."""
    policy = ErrorPolicy(handler, stage_name)
    try:
        for shard in src:
            try:
                url, stream, lpath = open_shard(shard)
            except Exception as exn:
                if policy(exn):
                    continue
                break
            out = dict(shard) if isinstance(shard, dict) else {"url": url}
            out["stream"] = stream
            if lpath is not None:
                out["local_path"] = lpath
            yield out
    finally:
        policy.report()


@stage
def tar_file_expander(
    src: Iterable[Dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Optional[Callable[[str], bool]] = None,
    rename_files: Optional[Callable[[str], Optional[str]]] = None,
    max_member_size: Optional[int] = None,
    *,
    accept_unterminated: Optional[bool] = None,
) -> Iterator[Dict[str, Any]]:
    """Turn opened shards into member dicts ``{"fname", "data", "__url__", "__offset__"}``.

    ``__local_path__`` is added for local files. Each shard's stream is closed when the shard
    ends (or iteration stops), and an end-of-shard marker follows each shard so that
    :func:`group_by_keys` never merges samples across shards. ``rename_files(name)`` runs
    before ``select_files(name)``. ``max_member_size`` bounds the members of compressed shards
    (see :func:`~webds.tar.reader.read_members`). A broken shard (truncated, corrupt, or cut at
    a member boundary without its end-of-archive marker) is followed by a marker that makes
    :func:`group_by_keys` drop its sample in flight; ``accept_unterminated`` reads a shard
    without the marker as complete (see :func:`~webds.tar.samples.tarfile_to_samples`).
    """
    policy = ErrorPolicy(handler, "tar_file_expander")
    unterminated = accepts_unterminated(accept_unterminated)
    try:
        for source in src:
            if not isinstance(source, dict) or "stream" not in source:
                exn: Exception = ArgumentError(
                    f"tar_file_expander expects dicts with an open 'stream' "
                    f"(from url_opener), got {source!r}"
                )
                if policy(exn):
                    continue
                break
            stream = source["stream"]
            url = source.get("url")
            lpath = source.get("local_path")
            stop = False
            try:
                for name, data, offset in _members(stream, url, max_member_size, unterminated):
                    try:
                        name = _kept_name(name, select_files, rename_files)
                    except Exception as exn:
                        if policy(exn):
                            continue
                        stop = True
                        break
                    if name is None:
                        continue
                    member = {"fname": name, "data": data, "__url__": url, "__offset__": offset}
                    if lpath is not None:
                        member["__local_path__"] = lpath
                    yield member
                s, stream = stream, None
                if stop:
                    _close_quietly(s)
                else:
                    s.close()
            except Exception as exn:
                if stream is not None:
                    s, stream = stream, None
                    _close_quietly(s)
                keep_going = policy(exn)
                yield {"__bad__": True, "__url__": url}
                if not keep_going:
                    break
                continue
            finally:
                if stream is not None:  # iteration stopped early
                    _close_quietly(stream)
            if stop:
                # The handler ended the stream mid-shard: the sample in flight is incomplete.
                yield {"__bad__": True, "__url__": url}
                break
            yield dict(_END_OF_SHARD)
    finally:
        policy.report()


@stage
def group_by_keys(
    src: Iterable[Dict[str, Any]],
    keys: Callable[[str], Tuple[Optional[str], Optional[str]]] = base_plus_ext,
    lcase: bool = True,
    suffixes: Optional[Iterable[str]] = None,
    handler: Handler = reraise_exception,
) -> Iterator[Dict[str, Any]]:
    """Group consecutive members with the same key into samples.

    Yields ``{"__key__", "__url__", ["__local_path__"], ext: bytes, ...}``. ``suffixes`` keeps
    only those extensions. A duplicate extension in one sample is a
    :class:`~webds.errors.SampleError`; if the handler skips it, the whole sample is dropped.
    """
    policy = ErrorPolicy(handler, "group_by_keys")
    rules = Grouping(
        lcase=lcase,
        keys=None if keys is base_plus_ext else keys,
        suffixes=None if suffixes is None else frozenset(suffixes),
        skip_meta=False,  # tar_file_expander skips them
    )
    try:
        runs = _ShardRuns(src)
        head = runs.next_run()
        while head is not None:
            # A run's url and local path are its first member's.
            url, lpath = head.get("__url__"), head.get("__local_path__")
            notes = ShardNotes()
            members = runs.members(head)
            for sample, start in group_members(members, url, rules, policy, notes, lpath):
                if sample is not None and not (start is END and runs.bad):
                    yield sample
            notes.warn_dotless(url)
            if policy.stopped:
                break
            head = runs.next_run()
    finally:
        policy.report()


class _ShardRuns:
    """:func:`group_by_keys`'s member dicts, one shard's run at a time: a run ends at an
    end-of-shard marker or where ``__url__`` changes (a new shard without a marker between).
    Nothing is pulled from the source before a run's last sample is given."""

    def __init__(self, src: Iterable[Dict[str, Any]]) -> None:
        self._src = iter(src)
        self._held: Optional[Dict[str, Any]] = None  # the member that ended a run: the next's
        #: Whether the last run ended with a broken shard's marker (``__bad__``): its sample in
        #: flight is incomplete.
        self.bad = False

    def next_run(self) -> Optional[Dict[str, Any]]:
        """The first member of the next run (None: no more)."""
        member, self._held = self._held, None
        return member if member is not None else self._next()

    def members(self, head: Dict[str, Any]) -> Iterator[Tuple[str, bytes, Any]]:
        """The run that starts with ``head``, as ``(name, data, offset)``."""
        url = head.get("__url__")
        self.bad = False
        member: Optional[Dict[str, Any]] = head
        while member is not None:
            fname = member.get("fname")
            if fname is None:  # the end-of-shard marker
                self.bad = bool(member.get("__bad__"))
                return
            if member.get("__url__") != url:
                self._held = member
                return
            yield fname, member["data"], member.get("__offset__")
            member = self._next()

    def _next(self) -> Optional[Dict[str, Any]]:
        for member in self._src:
            if not isinstance(member, dict):
                raise ArgumentError(
                    f"group_by_keys expects member dicts {{'fname', 'data'}} (from "
                    f"tar_file_expander), got a {type(member).__name__}"
                )
            return member
        return None
