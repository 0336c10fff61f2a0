"""Samples per shard without an index: local shards counted by reading them once.

A ``with_epoch`` pipeline started at epoch ``k`` in a new process must know its passes' lengths
to start where the uninterrupted run's epoch ``k`` does (:func:`webds.epochs.carry_start`). An
index says them at once; without one, local shards are counted here by reading each once, as the
pipeline's own tar stage reads it (its ``select_files``, ``rename_files`` and handler), without
decoding anything. Remote shards are not counted: reading a whole dataset over the network to
restart would cost more than it saves (make an index with ``webds index``).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence

from ..base.redact import redact
from ..errors import WebdsError
from ..io.urls import local_path

__all__ = ["count_local_samples"]

log = logging.getLogger("webds")


def count_local_samples(urls: Sequence[str], tar_stage: Any) -> Optional[Dict[str, int]]:
    """``{url: samples}`` for ``urls`` as ``tar_stage`` (a pipeline's ``tarfile_to_samples``
    stage) reads them, or None if one is not a local file or cannot be read."""
    if not all(local_path(url) is not None for url in urls):
        return None
    log.info(
        "webds: counting the samples of %d local shards to find where this epoch starts (an "
        "index makes this unnecessary: webds index)",
        len(urls),
    )
    kwargs = {**tar_stage.kwargs, "readahead": False}
    out: Dict[str, int] = {}
    try:
        for url in urls:
            samples = tar_stage.factory.fn(iter([{"url": url}]), *tar_stage.args, **kwargs)
            out[url] = sum(1 for _ in samples)
    except WebdsError as exn:
        log.warning("webds: could not count the samples of %s: %s", redact(url), exn)
        return None
    return out
