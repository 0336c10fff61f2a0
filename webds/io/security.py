"""Secure mode: for shard URLs and data that come from people you don't trust.

webdataset's switch, with its meaning: ``enforce_security`` (``webds.utils.enforce_security =
True`` in webdataset's spelling, or ``WDS_SECURE=1`` in the environment) refuses what would let
a URL or a field run code or read this machine's files:

- ``pipe:`` URLs (a shell command);
- local files and ``file:`` URLs (only remote ones are opened: http(s), s3, gs, other fsspec
  protocols, and schemes with an opener you registered yourself);
- URL rewriting from the environment (``GOPEN_REWRITE``);
- decoding pickles and ``torch.load`` (``.pyd .pickle .pkl .pth``), even with ``allow_pickle``.

Each refusal is a :class:`~webds.errors.SecureModeError` that names the setting. It is a
process-wide switch, as in webdataset: the module attribute and the environment variable are
read at each check, and either one turns secure mode on.
"""

from __future__ import annotations

import os

from ..errors import SecureModeError

__all__ = ["enforce_security", "secure", "refuse"]

#: Secure mode, as webdataset's ``utils.enforce_security`` (also on with ``WDS_SECURE=1``).
enforce_security: bool = False

_SETTING = "secure mode is on (webds.utils.enforce_security = True, or WDS_SECURE=1)"


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


def refuse(what: str, url: object = None) -> None:
    """Raise :class:`SecureModeError` for ``what`` if secure mode is on."""
    if secure():
        raise SecureModeError(
            f"{_SETTING}: {what} refused, as webdataset refuses it. Turn secure mode off only "
            "for URLs and data you trust",
            url=None if url is None else str(url),
        )
