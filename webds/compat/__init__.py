"""What code written for webdataset needs beyond the engine's own names.

- :func:`gopen` / :data:`gopen_schemes` / :func:`reader`: webdataset's stream opener and its
  registry of scheme handlers. ``gopen_schemes`` *is* :data:`webds.io.urls.SCHEMES`, so a handler
  registered here (``gopen_schemes["s3"] = my_boto3_opener``) is used by every reader in webds,
  ``WebDataset(...)`` included.
- ``FluidInterface``, ``FluidWrapper``, ``WebDataset``, ``WebLoader``: the names webdataset's own
  ``compat`` module held, so ``from webds.compat import WebDataset`` works.
- :func:`legacy_keywords` / :class:`LegacyPlan`: the translation of old ``WebDataset(...)``
  keywords, defined in :mod:`webds.keywords` (the core's constructor uses it).

The rest of the package holds what exists only so that webdataset code runs:
:mod:`~webds.compat.aliases` (webdataset's module names), :mod:`~webds.compat.legacy`
(webdataset's ``utils`` and ``extradatasets`` helpers), :mod:`~webds.compat.tariterators` and
:mod:`~webds.compat.shardsources`. It imports the core; the core never imports it. The fluent
names are imported on first use, so that importing ``webds`` (which installs the alias hook from
here) does not import torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, Tuple

from ..io.urls import DEFAULT_BUFSIZE, SCHEMES, SchemeOpener, open_url

if TYPE_CHECKING:
    from ..fluent import FluentMixin, FluidInterface, FluidWrapper, WebDataset
    from ..keywords import LegacyPlan, legacy_keywords
    from ..loader import WebLoader

__all__ = [
    "gopen",
    "gopen_schemes",
    "reader",
    "SchemeOpener",
    "FluentMixin",
    "FluidInterface",
    "FluidWrapper",
    "WebDataset",
    "WebLoader",
    "LegacyPlan",
    "legacy_keywords",
]

#: webdataset's registry of scheme handlers ``fn(url, mode, bufsize, **kw) -> stream``; the very
#: same dict as :data:`webds.io.urls.SCHEMES`. Empty at start (webds reads http, s3 and gs
#: itself); webdataset's command openers are in :mod:`webds.compat.openers`.
gopen_schemes: Dict[str, SchemeOpener] = SCHEMES


def _use_ais_for() -> None:
    """webdataset's ``USE_AIS_FOR=s3:gs``: read those schemes with the ``ais`` command (its
    cache), unless a handler is registered for them already. Read once, at import, as 1.x
    reads it."""
    schemes = [s for s in os.environ.get("USE_AIS_FOR", "").split(":") if s]
    if schemes:
        from .openers import gopen_ais

        for scheme in schemes:
            SCHEMES.setdefault(scheme, gopen_ais)


_use_ais_for()


def gopen(url: str, mode: str = "rb", bufsize: int = DEFAULT_BUFSIZE, **kw: Any) -> BinaryIO:
    """Open ``url`` like webdataset's ``gopen``: ``"-"``, paths, ``file:``, ``pipe:``, the
    handlers in :data:`gopen_schemes`, then fsspec for every other scheme.

    ``with gopen("pipe:cat a.tar") as stream: data = stream.read()``. It is
    :func:`webds.io.urls.open_url` under webdataset's signature; ``bufsize`` goes to registered
    handlers only, and ``kw`` to the handler or to fsspec.
    """
    return open_url(url, mode, bufsize=bufsize, **kw)


def reader(url: str, **kw: Any) -> BinaryIO:
    """``gopen(url, "rb", **kw)``."""
    return gopen(url, "rb", **kw)


#: The names served on first use: {name: (module, attribute)}.
_LAZY: Dict[str, Tuple[str, str]] = {
    "FluentMixin": ("webds.fluent", "FluentMixin"),
    "FluidInterface": ("webds.fluent", "FluidInterface"),
    "FluidWrapper": ("webds.fluent", "FluidWrapper"),
    "WebDataset": ("webds.fluent", "WebDataset"),
    "WebLoader": ("webds.loader", "WebLoader"),
    "LegacyPlan": ("webds.keywords", "LegacyPlan"),
    "legacy_keywords": ("webds.keywords", "legacy_keywords"),
    "check_empty": ("webds.compat.helpers", "check_empty"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
