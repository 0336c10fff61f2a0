"""Secure mode: for shard URLs and data that come from people you don't trust.

webdataset's switch, with its meaning: ``enforce_security`` (``webds.utils.enforce_security =
True`` in webdataset's spelling, or ``WDS_SECURE=1`` in the environment) refuses ``pipe:`` URLs,
local files in any spelling, listing a local folder, URL rewriting from the environment
(``GOPEN_REWRITE``), ``${NAME}`` in a URL spec read from any variable but ``WDS_NAME``, and
decoding pickles and ``torch.load`` (``.pyd .pickle .pkl .pth``), even with ``allow_pickle``.

It decides by allow-list. Only these URLs are opened: the remote protocols of
:data:`REMOTE_PROTOCOLS` (http, https, s3, s3a, gs, gcs, abfs, az, adl, hf, sftp, ssh, ftp, smb,
webdav, webhdfs, oss, oci, ocilake, tos, tosfs, dbfs, root, github, gist, box, dropbox, gdrive,
lakefs, wandb), fsspec's caches over them (:data:`CACHE_PROTOCOLS`: simplecache, blockcache,
filecache, cached), schemes with an opener registered by name in ``webds.io.urls.SCHEMES``, and
``-``. Every other protocol, in any case, is refused before fsspec makes a filesystem for it
(:func:`check_fsspec_url`), and every filesystem fsspec made is checked, with those it holds, at
any depth (:func:`check_filesystem`); :func:`url_to_fs` does both, at every door: reading,
writing, listing, the cache, the ``webds`` command. Each refusal (:func:`refuse`) is a
:class:`~webds.errors.SecureModeError` that names the setting. It is a process-wide switch, as in
webdataset: the module attribute and the environment variable are read at each check
(:func:`secure`), and either one turns it on. The spellings refused, and why:
docs/migrating.md, "Secure mode".
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ..errors import SecureModeError

__all__ = [
    "enforce_security",
    "secure",
    "refuse",
    "check_fsspec_url",
    "check_filesystem",
    "url_protocols",
    "url_to_fs",
    "REMOTE_PROTOCOLS",
    "CACHE_PROTOCOLS",
    "ALLOWED_PROTOCOLS",
    "WEBDATASET_LOCAL",
    "WEBDATASET_PIPE",
    "WEBDATASET_REWRITE",
    "WEBDATASET_PICKLE",
    "WEBDATASET_TORCH",
]

#: Secure mode, as webdataset's ``utils.enforce_security`` (also on with ``WDS_SECURE=1``).
enforce_security: bool = False

_SETTING = "secure mode is on (webds.utils.enforce_security = True, or WDS_SECURE=1)"

# webdataset 1.0.2's words for the same refusals, quoted in ours: code and tests written for it
# match them (pytest.raises(ValueError, match="cannot open pipe URLs")).
WEBDATASET_LOCAL = "gopen: unsafe_gopen is False, cannot open local files"
WEBDATASET_PIPE = "gopen_pipe: unsafe_gopen is False, cannot open pipe URLs"
WEBDATASET_REWRITE = (
    "rewrite_url: unsafe_gopen is False, cannot rewrite URLs using environment variables"
)
WEBDATASET_PICKLE = "Unpickling is not allowed for security reasons when enforce_security is set"
WEBDATASET_TORCH = "torch.loads is not allowed for security reasons when enforce_security is set"


def secure() -> bool:
    """Whether secure mode is on: :data:`enforce_security`, or ``WDS_SECURE`` set to a
    non-zero number."""
    if enforce_security:
        return True
    value = os.environ.get("WDS_SECURE", "").strip()
    try:
        return bool(int(value)) if value else False
    except ValueError:
        return value.lower() in ("true", "yes", "on")


def carried(state: Dict[str, Any]) -> Dict[str, Any]:
    """An object's pickled ``state`` with secure mode in it when it is on. Secure mode set in
    Python (``enforce_security = True``) is this process's: a DataLoader worker started by
    ``spawn`` or ``forkserver`` imports webds afresh, with it off; a dataset sent there carries
    it (:func:`arrived` turns it on)."""
    return dict(state, _secure=True) if secure() else state


def arrived(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` less what :func:`carried` added, turning secure mode on in this process
    when it was on where the state was made."""
    global enforce_security
    state = dict(state)
    if state.pop("_secure", False):
        enforce_security = True
    return state


def refuse(what: str, url: object = None, webdataset: Optional[str] = None) -> None:
    """Raise :class:`SecureModeError` for ``what`` if secure mode is on; ``webdataset`` is
    what webdataset says there (one of the ``WEBDATASET_*`` messages), quoted."""
    if secure():
        said = f' ("{webdataset}")' if webdataset else ""
        raise SecureModeError(
            f"{_SETTING}: {what} refused, as webdataset refuses it{said}. Turn secure mode off "
            "only for URLs and data you trust",
            url=None if url is None else str(url),
        )


_LOCAL_FILES = "local files (only remote URLs are opened)"

#: The protocols secure mode opens: stores and servers reached over the network, at the host or
#: bucket the URL names, through fsspec's backends (each spelled as fsspec registers it, lower
#: case). Left out, because they read this machine's files or the process's memory, or wrap
#: another filesystem the URL would choose: file, local, asynclocal, memory, data (the bytes are
#: in the URL), reference (its targets are any URLs, local files too), dir, zip, tar, libarchive,
#: git, dvc (local repositories), hdfs, arrow_hdfs (the default host comes from this machine's
#: Hadoop settings, which is the local filesystem unless set), jupyter, jlab (a Jupyter server,
#: usually this machine's, serving its folders), dask, generic, async_wrapper, asyncwrapper,
#: pyscript, and every protocol registered later.
REMOTE_PROTOCOLS = frozenset(
    {
        "http", "https", "s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "hf",
        "sftp", "ssh", "ftp", "smb", "webdav", "webhdfs", "oss", "oci", "ocilake", "tos",
        "tosfs", "dbfs", "root", "github", "gist", "box", "dropbox", "gdrive", "lakefs", "wandb",
    }
)  # fmt: skip

#: fsspec's caches, opened in secure mode over remote protocols only
#: (``simplecache::s3://b/a.tar``): what they read is a copy of what the remote one serves.
CACHE_PROTOCOLS = frozenset({"simplecache", "blockcache", "filecache", "cached"})

#: Every protocol secure mode opens.
ALLOWED_PROTOCOLS = REMOTE_PROTOCOLS | CACHE_PROTOCOLS

_LOCAL_PROTOCOLS = ("file", "local", "asynclocal")
# fsspec's test for a "::" link that is a path rather than a protocol name (fsspec.core).
_NOT_A_PROTOCOL = re.compile(".*[^a-z]+.*")


def url_protocols(url: str, options: Optional[Dict[str, Any]] = None) -> List[str]:
    """The protocols of the links of an fsspec URL, outermost first, as fsspec's
    ``url_to_fs(url, **options)`` reads them (``"file"`` for a link without one), from the
    string alone: no backend is imported and no filesystem made.
    ``url_protocols("simplecache::s3://b/a.tar") == ["simplecache", "s3"]``."""
    import fsspec
    from fsspec.core import split_protocol

    links = url.split("::")
    if len(links) > 1:
        known = set(fsspec.available_protocols())
        # As fsspec: a bare word is a protocol ("simplecache::"), a path keeps its own.
        links = [
            link
            if link not in known and ("://" in link or _NOT_A_PROTOCOL.match(link))
            else link + "://"
            for link in links
        ]
    protocols = [split_protocol(link)[0] or "file" for link in links]
    if (options or {}).get("protocol"):
        protocols[-1] = str(options["protocol"])  # fsspec gives it to the innermost link
    return protocols


def check_fsspec_url(url: str, options: Optional[Dict[str, Any]] = None) -> None:
    """In secure mode, refuse an fsspec URL unless every link of its chain is on
    :data:`ALLOWED_PROTOCOLS` and the innermost is on :data:`REMOTE_PROTOCOLS`: decided from
    the string, before any filesystem is made (making one may already read a file: a
    ``reference://`` index, a zip's directory). ``local:``, ``ab:y.tar`` (fsspec opens it from
    the current folder), ``FILE://``, ``S3://`` (protocols are lower case), ``data:``,
    ``memory://``, ``reference://`` are all refused."""
    if not secure():
        return
    protocols = url_protocols(url, options)
    for protocol in protocols:
        _check_protocol(protocol, url)
    if protocols[-1] not in REMOTE_PROTOCOLS:
        refuse(f"a '{protocols[-1]}::' cache with no remote URL under it", url)
    # fsspec's own reading of the chain, where it can make one: it must agree.
    try:
        told = [p for _, p, _ in _fsspec_chain(url, options)]
    except Exception:
        return  # fsspec cannot read it either, so it opens nothing; it will say why
    for protocol in told:
        for name in protocol if isinstance(protocol, (tuple, list)) else (protocol,):
            _check_protocol(name, url)


def _fsspec_chain(url: str, options: Optional[Dict[str, Any]]) -> List[Tuple[str, Any, Any]]:
    """fsspec's ``[(path, protocol, options), ...]`` for a URL (private in fsspec: a change of
    it raises here, and :func:`check_filesystem` still checks what is made)."""
    import fsspec

    return fsspec.core._un_chain(url, dict(options or {}))


def _check_protocol(protocol: str, url: str) -> None:
    if protocol in ALLOWED_PROTOCOLS:
        return
    if protocol.lower() in _LOCAL_PROTOCOLS:
        refuse(_LOCAL_FILES, url, WEBDATASET_LOCAL)
    lower = protocol.lower()
    spelled = protocol + (":" if lower == "data" else "://")
    case = f" (protocols are lower case: '{lower}://')" if protocol != lower else ""
    refuse(f"'{spelled}' URLs{case}: secure mode opens only {_ALLOWED_WORDS}", url)


_ALLOWED_WORDS = (
    "the remote protocols "
    + ", ".join(sorted(REMOTE_PROTOCOLS))
    + " (and fsspec's caches "
    + ", ".join(sorted(CACHE_PROTOCOLS))
    + " over them), and schemes with an opener registered "
    "in webds.io.urls.SCHEMES"
)


def check_filesystem(fs: Any, url: str) -> None:
    """In secure mode, refuse a filesystem fsspec made unless it and every filesystem it holds
    (``.fs``, ``.fss``, a wrapper's target, an archive's file), recursively, is of a protocol
    on :data:`ALLOWED_PROTOCOLS` and not fsspec's local one."""
    if not secure():
        return
    from fsspec.implementations.local import LocalFileSystem

    for found in _filesystems_in(fs):
        if isinstance(found, LocalFileSystem):
            refuse(_LOCAL_FILES, url, WEBDATASET_LOCAL)
        names = type(found).protocol
        names = (names,) if isinstance(names, str) else tuple(names)
        if not any(name in ALLOWED_PROTOCOLS for name in names):
            _check_protocol(names[0], url)
        for key, value in _attributes(found).items():
            # A target named but not made yet (a wrapper's target_protocol).
            if key.endswith("_protocol") and isinstance(value, str):
                _check_protocol(value, url)


def _attributes(obj: Any) -> Dict[str, Any]:
    # fsspec's caches hand attribute lookups to their target (even __dict__): ask the object.
    try:
        return dict(object.__getattribute__(obj, "__dict__"))
    except (AttributeError, TypeError):
        return {}


def _filesystems_in(fs: Any) -> List[Any]:
    """``fs`` and the filesystems it holds, at any depth: in attributes, in dicts or lists of
    them (``.fss``), and behind file objects (``.fs`` of an open file)."""
    from fsspec.spec import AbstractFileSystem

    found: List[Any] = []
    seen = set()
    todo = [fs]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not isinstance(obj, AbstractFileSystem):
            continue
        seen.add(id(obj))
        found.append(obj)
        for value in _attributes(obj).values():
            items = list(value.values()) if isinstance(value, dict) else [value]
            if isinstance(value, (list, tuple)):
                items = list(value)
            for item in items:
                todo.append(item)
                inner = _attributes(item).get("fs")  # an open file, an OpenFile
                if inner is not None:
                    todo.append(inner)
    return found


def url_to_fs(url: str, **options: Any) -> Tuple[Any, str]:
    """``fsspec.core.url_to_fs``, the one door through which webds resolves an fsspec URL, with
    secure mode's checks on what it resolves to: :func:`check_fsspec_url` before the
    filesystem is made, :func:`check_filesystem` on what was made."""
    import fsspec

    check_fsspec_url(url, options)
    fs, path = fsspec.core.url_to_fs(url, **options)
    check_filesystem(fs, url)
    return fs, path
