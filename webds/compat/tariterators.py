"""webdataset's ``tariterators`` module: its functions take the iterator first.

In webdataset 1.x ``url_opener``, ``tar_file_expander`` and ``group_by_keys`` are plain
generator functions, composed by calling them (``group_by_keys(tar_file_expander(url_opener(
shards)))``) or passed uncalled as pipeline stages. webds's names of the same
(``webds.url_opener``, ...) are stage factories (``url_opener()`` makes the stage), so this
module holds the functions behind them, with webdataset's signatures, plus
``tar_file_iterator`` over one open stream. New code reads shards with
:func:`webds.tarfile_to_samples`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterable, Iterator, Optional

from ..base.handlers import ErrorPolicy, Handler, reraise_exception
from ..errors import WebdsError
from ..tar import grouping
from ..tar.grouper import META_PATTERN, _rename_select, base_plus_ext
from ..tar.reader import read_members
from ..tar.samples import tarfile_samples, tarfile_to_samples
from .helpers import meta_prefix, meta_suffix, shardlist, trace, valid_sample

__all__ = [
    "base_plus_ext",
    "url_opener",
    "tar_file_iterator",
    "tar_file_expander",
    "group_by_keys",
    "tarfile_samples",
    "tarfile_to_samples",
    "meta_prefix",
    "meta_suffix",
    "shardlist",
    "trace",
    "valid_sample",
]


def url_opener(
    data: Iterable[Any], handler: Handler = reraise_exception, **kw: Any
) -> Iterator[Dict[str, Any]]:
    """Open each shard ``{"url": ...}``, adding ``"stream"`` (see :func:`webds.url_opener`)."""
    return grouping.url_opener.fn(data, handler, **kw)


#: ``tar_file_expander``'s default end-of-shard marker: a fresh empty dict per shard.
_EOF: Any = object()


def tar_file_expander(
    data: Iterable[Dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Optional[Callable[[str], bool]] = None,
    rename_files: Optional[Callable[[str], Optional[str]]] = None,
    eof_value: Any = _EOF,
) -> Iterator[Dict[str, Any]]:
    """Opened shards to member dicts ``{"fname", "data", "__url__"}`` (see
    :func:`webds.tar_file_expander`), each shard's followed by ``eof_value`` (an empty dict by
    default; None: nothing), as in webdataset.

    After a damaged shard (the handler chose to go on) the default yields webds's marker
    ``{"__bad__": True, "__url__": url}``: it is what keeps :func:`group_by_keys` from
    yielding the sample the damage cut short. A caller that chose ``eof_value`` groups
    members with its own code (open_clip's ``group_by_keys_nothrow`` reads ``"fname"`` from
    every item), so then a damaged shard is followed by nothing, as in webdataset: with
    ``eof_value=None`` only real members are yielded.
    """
    for item in grouping.tar_file_expander.fn(data, handler, select_files, rename_files):
        if "fname" in item:
            yield item
        elif eof_value is _EOF:
            yield item if item.get("__bad__") else {}
        elif eof_value is not None and not item.get("__bad__"):
            yield eof_value


def group_by_keys(
    data: Iterable[Dict[str, Any]],
    keys: Callable[[str], Any] = base_plus_ext,
    lcase: bool = True,
    suffixes: Optional[Iterable[str]] = None,
    handler: Handler = reraise_exception,
) -> Iterator[Dict[str, Any]]:
    """Group consecutive members with the same key into samples (see
    :func:`webds.group_by_keys`)."""
    return grouping.group_by_keys.fn(data, keys, lcase, suffixes, handler)


def tar_file_iterator(
    fileobj: Any,
    skip_meta: Optional[str] = META_PATTERN,
    handler: Handler = reraise_exception,
    select_files: Optional[Callable[[str], bool]] = None,
    rename_files: Optional[Callable[[str], Optional[str]]] = None,
) -> Iterator[Dict[str, Any]]:
    """webdataset's iterator over one open tar stream: ``{"fname", "data"}`` per regular file.

    Names matching ``skip_meta`` are skipped; ``rename_files(name)`` runs before
    ``select_files(name)``. The stream is never closed here. A read error goes to ``handler``
    and ends the iteration either way (the rest of a damaged stream cannot be trusted).
    """
    meta = re.compile(skip_meta).match if skip_meta else None
    url = getattr(fileobj, "name", None)
    policy = ErrorPolicy(handler, "tar_file_iterator")
    try:
        for name, data, _ in read_members(fileobj, url if isinstance(url, str) else None):
            if meta is not None and meta(name):
                continue
            try:
                renamed = _rename_select(name, select_files, rename_files)
            except Exception as exn:
                if policy(exn):
                    continue
                return
            if renamed is not None:
                yield {"fname": renamed, "data": data}
    except WebdsError as exn:
        policy(exn)
    finally:
        policy.report()
