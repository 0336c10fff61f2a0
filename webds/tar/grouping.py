"""Tar members to samples: the WebDataset grouping rules.

A sample is the run of *consecutive* tar members that share a key. The key of a member is its
directory plus its file name up to the **first** dot of the file name; the extension is everything
after that dot, and may itself contain dots::

    "a/b.c/d.seg.jpg"  ->  key "a/b.c/d",  extension "seg.jpg"   (dots in directories are fine)
    "0001.JPG"         ->  key "0001",     extension "jpg"       (lower-cased by default)
    "README", "dir.v2/file", ".hidden"  ->  no key: skipped, with one warning per shard
    "a/.hidden"        ->  key "a/",       extension "hidden"    (as webdataset does)

So ``0001.jpg``, ``0001.cls``, ``0001.seg.png`` become
``{"__key__": "0001", "__url__": url, "jpg": b"...", "cls": b"...", "seg.png": b"..."}``.
A key that comes back later in the shard starts a new sample; samples never span two shards; two
members with the same extension in one sample are an error (:class:`~webds.errors.SampleError`).
Top-level meta files named like ``__meta__`` or ``__index__/...`` are skipped.

Stages, each usable on its own or composed:
``url_opener`` (shard descriptors -> open streams), ``tar_file_expander`` (streams -> members),
``group_by_keys`` (members -> samples); :func:`webds.tar.samples.tarfile_to_samples` does all
three in one fast generator. Only the sample in flight is held in memory; each shard's stream
is closed as soon as the shard ends or iteration stops.

Errors go through the stage's ``handler``. With the default (re-raise) the error surfaces after
every complete sample before it; with a skipping handler the rest of a broken shard is skipped,
the incomplete sample in flight is dropped, and reading goes on with the next shard.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

from ..base.handlers import ErrorPolicy, Handler, reraise_exception
from ..base.stage import stage
from ..errors import ArgumentError, OpenError, SampleError, WebdsError
from ..io.streams import abandon_stream
from ..io.urls import deferred_open, local_path
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

#: Top-level meta files (``__meta__``, ``__index__/x``) that are not part of any sample.
META_PATTERN = r"__[^/]*__($|/)"
_meta_match = re.compile(META_PATTERN).match


def is_meta_name(name: str) -> bool:
    """Whether a member name is a top-level meta file (:data:`META_PATTERN`), which readers skip."""
    return name[:2] == "__" and _meta_match(name) is not None  # the prefix test is the fast path


# Marker a stage yields after each shard so that samples never merge across shards. An empty
# dict, as in webdataset; a dict with "__bad__" means the shard broke and the sample in flight
# is incomplete and must be dropped.
_END_OF_SHARD: Dict[str, Any] = {}


def base_plus_ext(path: str) -> Tuple[Optional[str], Optional[str]]:
    """Split a member name into ``(key, extension)`` at the first dot of its file name.

    ``base_plus_ext("a/b.c/d.seg.jpg") == ("a/b.c/d", "seg.jpg")``. A file name without a dot
    gives ``(None, None)``, and so does a top-level name starting with a dot (its key would be
    empty); this is webdataset's rule exactly.
    """
    slash = path.rfind("/")
    dot = path.find(".", slash + 1)
    if dot > slash + 1:
        return path[:dot], path[dot + 1 :]
    if dot <= 0:
        return None, None
    # A file name starting with a dot, inside a directory ("a/.hidden"). webdataset's regex,
    # ^((?:.*/|)[^.]+)[.]([^/]*)$, accepts it only if the key still ends with a dot-free run
    # that starts a path component: "a/.x" -> ("a/", "x"), but "a/b.c/.x" -> (None, None).
    last_dot = path.rfind(".", 0, dot)
    if last_dot >= 0 and path.rfind("/", 0, slash) <= last_dot:
        return None, None
    return path[:dot], path[dot + 1 :]


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
        exn.url,
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
        log.debug("webds: ignoring error closing abandoned stream: %s", exn)


def _warn_dotless(url: Optional[str], count: int, first: Optional[str]) -> None:
    if count:
        log.warning(
            "webds: skipped %d member(s) without a key.extension name in shard %r "
            "(first: %r); name them like 'key.ext' to make them part of a sample",
            count,
            url,
            first,
        )


def _member_key(name: str) -> Optional[str]:
    """The sample key of a member name as the shard has it (None: metadata, or no dot)."""
    if is_meta_name(name):
        return None
    slash = name.rfind("/")
    i = name.find(".", slash + 1)
    return name[:i] if i > slash + 1 else base_plus_ext(name)[0]


def _kept_name(
    name: str,
    select_files: Optional[Callable[[str], bool]],
    rename_files: Optional[Callable[[str], Optional[str]]],
) -> Optional[str]:
    """The member's name as the sample sees it, or None to skip it (a metadata member such as
    ``__index__``, or one that ``rename_files``/``select_files`` drop)."""
    if is_meta_name(name):
        return None
    if select_files is None and rename_files is None:
        return name
    return _rename_select(name, select_files, rename_files)


def _rename_select(
    name: str,
    select_files: Optional[Callable[[str], bool]],
    rename_files: Optional[Callable[[str], Optional[str]]],
) -> Optional[str]:
    """webdataset order: rename first, then select on the new name. None means skip."""
    if rename_files is not None:
        name = rename_files(name)  # type: ignore[assignment]
        if name is None:
            return None
    if select_files is not None and not select_files(name):
        return None
    return name


def _duplicate(key: str, ext: str, url: Optional[str], fname: str, offset: Any) -> SampleError:
    return SampleError(
        f"duplicate file {ext!r} in sample {key!r}: two members of one sample have the same "
        "extension; rename one, or write each sample's files once",
        url=url,
        member=fname,
        offset=offset,
    )


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
    wanted = None if suffixes is None else set(suffixes)
    cur: Optional[Dict[str, Any]] = None
    cur_key: Optional[str] = None
    cur_url: Any = None
    dotless, first_dotless = 0, None
    try:
        for member in src:
            if not isinstance(member, dict):
                raise ArgumentError(
                    f"group_by_keys expects member dicts {{'fname', 'data'}} (from "
                    f"tar_file_expander), got a {type(member).__name__}"
                )
            fname = member.get("fname")
            if fname is None:
                # End-of-shard marker (or a broken shard: its sample in flight is incomplete).
                if cur is not None and not member.get("__bad__"):
                    yield cur
                cur, cur_key = None, None
                _warn_dotless(cur_url, dotless, first_dotless)
                dotless, first_dotless = 0, None
                continue
            url = member.get("__url__")
            if url != cur_url:
                # A new shard without a marker in between: still never merge across shards.
                if cur is not None:
                    yield cur
                cur, cur_key = None, None
                _warn_dotless(cur_url, dotless, first_dotless)
                dotless, first_dotless = 0, None
                cur_url = url
            try:
                key, ext = keys(fname)
            except Exception as exn:
                if policy(exn):
                    continue
                break
            if key is None or ext is None:
                dotless += 1
                if first_dotless is None:
                    first_dotless = fname
                continue
            if lcase:
                ext = ext.lower()
            if key != cur_key:
                if cur is not None:
                    yield cur
                cur = {"__key__": key, "__url__": url}
                if "__local_path__" in member:
                    cur["__local_path__"] = member["__local_path__"]
                cur_key = key
            elif cur is None:
                continue  # the rest of a sample dropped for a duplicate
            if ext in cur:
                cur = None
                if policy(_duplicate(key, ext, url, fname, member.get("__offset__"))):
                    continue
                break
            if wanted is None or ext in wanted:
                cur[ext] = member["data"]
        else:
            if cur is not None:
                yield cur
        _warn_dotless(cur_url, dotless, first_dotless)
    finally:
        policy.report()
