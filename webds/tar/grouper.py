"""Tar members to samples: the WebDataset grouping rules, in one generator (:func:`group_members`).

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

Both readers group so (:func:`~webds.tar.samples.tarfile_to_samples` and the one-step
:func:`~webds.tar.grouping.group_by_keys`); what differs between them is in :class:`Grouping`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, NamedTuple, Optional, Tuple

from ..base.handlers import ErrorPolicy
from ..base.redact import redact
from ..errors import SampleError
from .reader import EndWithoutMarker

__all__ = [
    "META_PATTERN",
    "is_meta_name",
    "base_plus_ext",
    "Grouping",
    "ShardNotes",
    "group_members",
    "END",
    "ALL_FILTERED",
]

log = logging.getLogger("webds")

#: Top-level meta files (``__meta__``, ``__index__/x``) that are not part of any sample.
META_PATTERN = r"__[^/]*__($|/)"
_meta_match = re.compile(META_PATTERN).match


def is_meta_name(name: str) -> bool:
    """Whether a member name is a top-level meta file (:data:`META_PATTERN`), which readers skip."""
    return name[:2] == "__" and _meta_match(name) is not None  # the prefix test is the fast path


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


def _member_key(name: str) -> Optional[str]:
    """The sample key of a member name as the shard has it (None: metadata, or no dot)."""
    if is_meta_name(name):
        return None
    slash = name.rfind("/")
    i = name.find(".", slash + 1)
    return name[:i] if i > slash + 1 else base_plus_ext(name)[0]  # base_plus_ext, inlined


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


class Grouping(NamedTuple):
    """How :func:`group_members` makes samples of members."""

    #: ``rename_files(name)`` runs first (None drops the member), then ``select_files(name)``.
    select_files: Optional[Callable[[str], bool]] = None
    rename_files: Optional[Callable[[str], Optional[str]]] = None
    lcase: bool = True  # lower-case each extension
    #: A name's ``(key, extension)``; None: :func:`base_plus_ext` (inlined, the fast path).
    keys: Optional[Callable[[str], Tuple[Optional[str], Optional[str]]]] = None
    suffixes: Optional[FrozenSet[str]] = None  # keep only these extensions (group_by_keys)
    skip_meta: bool = True  # skip metadata members (:func:`is_meta_name`)
    #: Separate samples by the keys the shard has, before renaming, and give a sample whose
    #: members are all filtered out as :data:`ALL_FILTERED`: an index counted samples so.
    count_raw: bool = False
    #: Where the members end without the end-of-archive marker
    #: (:class:`~webds.tar.reader.EndWithoutMarker`), they end at a member boundary: give the
    #: last sample with :data:`END`, the error kept in :attr:`ShardNotes.unmarked` for the
    #: caller to judge (without it, the error is raised and the sample in flight dropped).
    unmarked_end: bool = False


class ShardNotes:
    """What :func:`group_members` noticed in one shard, for its caller to act on when the shard
    ends: the members skipped for a name without a ``key.extension`` (reported in one warning),
    and an end without the end-of-archive marker (see :attr:`Grouping.unmarked_end`)."""

    __slots__ = ("dotless", "first_dotless", "unmarked")

    def __init__(self) -> None:
        self.dotless = 0
        self.first_dotless: Optional[str] = None
        self.unmarked: Optional[EndWithoutMarker] = None

    def skip_dotless(self, name: str) -> None:
        self.dotless += 1
        if self.first_dotless is None:
            self.first_dotless = name

    def warn_dotless(self, url: Optional[str]) -> None:
        """Log the members skipped so far for their names, if any, and start counting again."""
        if self.dotless:
            log.warning(
                "webds: skipped %d member(s) without a key.extension name in shard %r "
                "(first: %r); name them like 'key.ext' to make them part of a sample",
                self.dotless,
                redact(url),
                self.first_dotless,
            )
        self.dotless, self.first_dotless = 0, None


#: The start :func:`group_members` gives with a shard's last sample: no sample follows it.
END: Any = object()
#: The sample :func:`group_members` gives (with ``count_raw``) for one whose members were all
#: filtered out: counted, not yielded.
ALL_FILTERED: Dict[str, Any] = {"__all_filtered__": True}


def group_members(
    members: Iterable[Tuple[str, bytes, Any]],
    url: Optional[str],
    rules: Grouping,
    policy: ErrorPolicy,
    notes: ShardNotes,
    local_path: Optional[str] = None,
) -> Iterator[Tuple[Optional[Dict[str, Any]], Any]]:
    """Group one shard's members ``(name, data, header offset)`` into samples.

    Yields ``(sample, start)`` each time a sample starts, ``start`` being the header offset of
    its first member and ``sample`` the one it ends: a dict
    ``{"__key__", "__url__", ["__local_path__"], ext: data, ...}``, :data:`ALL_FILTERED`, or
    None where there is none (before the first; after one dropped for a duplicate). The last
    sample comes with :data:`END`. A member with an extension its sample already has is a
    :class:`~webds.errors.SampleError`, and an exception from ``rename_files``,
    ``select_files`` or ``keys`` is an error too: each goes to ``policy``, which skips it (a
    duplicate drops its sample) or stops, and then the generator ends without :data:`END`.
    Members without a ``key.extension`` name are skipped and counted in ``notes``. An error
    from ``members`` drops the sample in flight (but see :attr:`Grouping.unmarked_end`).
    """
    select_files, rename_files, lcase, keys, wanted, skip_meta, count_raw, unmarked_end = rules
    screen = skip_meta or select_files is not None or rename_files is not None
    general = keys is not None or select_files is not None or rename_files is not None
    fixed = 2 if local_path is None else 3  # __key__, __url__ and maybe __local_path__
    cur: Optional[Dict[str, Any]] = None
    cur_key: Optional[str] = None
    try:
        for name, data, offset in members:
            # This loop runs once per member: a plain "key.ext" name takes one partition;
            # everything else (folders, metadata members, renaming, names without a dot) the
            # general rules below.
            key, dot, ext = name.partition(".")
            sample_key = key  # what separates samples (before renaming, with count_raw)
            if general or not dot or not key or key[:2] == "__" or "/" in name:
                if count_raw:
                    sample_key = _member_key(name)
                try:
                    kept = _kept_name(name, select_files, rename_files) if screen else name
                    if kept is not None and keys is not None:
                        key, ext = keys(kept)
                except Exception as exn:
                    if policy(exn):
                        continue
                    return
                if kept is None:
                    if sample_key is None or sample_key == cur_key or not count_raw:
                        continue
                    # Filtered out, but it starts a sample that the index counts.
                    key, ext = sample_key, None
                else:
                    if keys is None:  # base_plus_ext, inlined
                        slash = kept.rfind("/")
                        i = kept.find(".", slash + 1)
                        if i > slash + 1:
                            key, ext = kept[:i], kept[i + 1 :]
                        else:
                            key, ext = base_plus_ext(kept)
                    if key is None or ext is None:
                        notes.skip_dotless(kept)
                        continue
                    if not count_raw:
                        sample_key = key
                    name = kept  # as errors name it
            if sample_key != cur_key:
                yield (_counted(cur, fixed) if count_raw else cur), offset
                cur = {"__key__": key, "__url__": url}
                if local_path is not None:
                    cur["__local_path__"] = local_path
                cur_key = sample_key
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
                return
            if wanted is None or ext in wanted:
                cur[ext] = data
    except EndWithoutMarker as exn:
        if not unmarked_end:
            raise
        notes.unmarked = exn  # every member read is whole: the last sample is given
    yield (_counted(cur, fixed) if count_raw else cur), END


def _counted(sample: Optional[Dict[str, Any]], fixed: int) -> Optional[Dict[str, Any]]:
    """``sample``, or :data:`ALL_FILTERED` if every member of it was filtered out."""
    return ALL_FILTERED if sample is not None and len(sample) <= fixed else sample
