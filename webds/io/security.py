"""Secure mode: for shard URLs and data that come from people you don't trust.

webdataset's switch, with its meaning: ``enforce_security`` (``webds.utils.enforce_security =
True`` in webdataset's spelling, or ``WDS_SECURE=1`` in the environment) refuses ``pipe:`` URLs,
local files in any spelling, URL rewriting from the environment (``GOPEN_REWRITE``), and
decoding pickles and ``torch.load`` (``.pyd .pickle .pkl .pth``), even with ``allow_pickle``.
Only remote URLs are opened: http(s), s3, gs, other fsspec protocols, and schemes with an opener
you registered. What is checked is the filesystem fsspec resolves (:func:`url_to_fs`,
:func:`refuse_local_fsspec`), at every door: reading, writing, listing, the cache, the ``webds``
command. Each refusal (:func:`refuse`) is a :class:`~webds.errors.SecureModeError` that names the
setting. It is a process-wide switch, as in webdataset: the module attribute and the environment
variable are read at each check (:func:`secure`), and either one turns it on. The spellings
refused, and why: docs/migrating.md, "Secure mode".
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from ..errors import SecureModeError

__all__ = [
    "enforce_security",
    "secure",
    "refuse",
    "refuse_local_fsspec",
    "refuse_local_filesystem",
    "url_to_fs",
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


def refuse_local_fsspec(url: str) -> None:
    """In secure mode, refuse an fsspec URL any link of whose chain fsspec would open on this
    machine's filesystem: ``local://``, ``local:``, a name with a colon but no ``://`` (fsspec
    opens ``ab:y.tar`` from the current folder), ``zip://m::/path/a.zip``. Decided from the
    protocols' classes, before any filesystem is made (making one may already read the file)."""
    if secure() and _fsspec_reads_local(url):
        refuse(_LOCAL_FILES, url, WEBDATASET_LOCAL)


def refuse_local_filesystem(fs: object, url: str) -> None:
    """In secure mode, refuse a resolved fsspec filesystem that is, or wraps, fsspec's local
    one (a cache or directory filesystem over local files)."""
    if not secure():
        return
    from fsspec.implementations.local import LocalFileSystem

    seen = 0
    while fs is not None and seen < 8:  # wrappers nest a few deep at most
        if isinstance(fs, LocalFileSystem):
            refuse(_LOCAL_FILES, url, WEBDATASET_LOCAL)
        fs = getattr(fs, "fs", None)
        seen += 1


def _fsspec_reads_local(url: str) -> bool:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    try:
        # fsspec's own reading of a URL: the links of a "::" chain, each with its protocol
        # ("file" where a link has none). Private, so a change of it falls back to the rule.
        protocols = [protocol for _, protocol, _ in fsspec.core._un_chain(url, {})]
    except Exception:
        links = url.split("::")
        protocols = [fsspec.core.split_protocol(link)[0] or "file" for link in links]
    for protocol in protocols:
        for name in protocol if isinstance(protocol, (tuple, list)) else (protocol,):
            try:
                cls = fsspec.get_filesystem_class(name)
            except (ImportError, ValueError):
                continue  # not installed or unknown: opening it will say so, reading nothing
            if issubclass(cls, LocalFileSystem):
                return True
    return False


def url_to_fs(url: str, **options: Any) -> Tuple[Any, str]:
    """``fsspec.core.url_to_fs``, the one door through which webds resolves an fsspec URL, with
    secure mode's check on what it resolves to: refused before the filesystem is made when a
    link of the URL is local, and after, when the filesystem made wraps a local one."""
    import fsspec

    refuse_local_fsspec(url)
    fs, path = fsspec.core.url_to_fs(url, **options)
    refuse_local_filesystem(fs, url)
    return fs, path
