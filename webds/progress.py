"""Progress bars of the long-running library calls (``pack``, ``map_shards``, index builds)."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, desc: str, unit: str, enabled: bool, **kw: Any) -> Any:
    """A ``tqdm.auto`` bar on stderr; ``enabled=False`` turns it off.

    ``disable`` is passed only to turn the bar off: an explicit ``disable=False`` would override
    ``TQDM_DISABLE=1``, which notebooks and CI logs set to keep their output clean.
    """
    from tqdm.auto import tqdm

    if not enabled:
        kw["disable"] = True
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, **kw)
