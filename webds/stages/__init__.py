"""Stages: the machinery (:mod:`webds.stages.core`) and the stages users chain.

- :mod:`~webds.stages.core`: ``@stage``, :class:`Stage`, the count rules (``SAME``,
  ``REORDER``, ``BATCH``, ``UNBATCH``) from which a pipeline computes ``len()``, and what each
  stage owes a resume (``STATELESS``, ``LEDGER``, :func:`stateless`).
- :mod:`~webds.stages.handlers`: what a stage does with an exception (``warn_and_continue``, ...).
- :mod:`~webds.stages.filters`: shuffle, select, map, slice, info, ...
- :mod:`~webds.stages.fields`: to_tuple, rename, map_dict, map_tuple, extract_keys, ...
- :mod:`~webds.stages.batching`: batched, unbatched, collation.
- :mod:`~webds.stages.decode` (with :mod:`~webds.stages.codecs`, :mod:`~webds.stages.fastjpeg`,
  :mod:`~webds.stages.tenbin` and :mod:`~webds.stages.xdecode`) and :mod:`~webds.stages.encode`:
  field codecs; :mod:`~webds.stages.crop`: the fused crop decoders.
- :mod:`~webds.stages.mix`: mixing several datasets; :mod:`~webds.stages.replay`: record a pass
  and replay it.

The core and the handlers import nothing of webds but :mod:`webds.errors`, so every room (the tar
reader's stages included) builds on them.
"""

from . import core
from .core import (  # noqa: F401 (served from here: __all__ below is core's)
    BATCH,
    LEDGER,
    REORDER,
    SAME,
    STATELESS,
    UNBATCH,
    Count,
    Length,
    Stage,
    StageFactory,
    Stateless,
    pipelinefilter,
    resume_kind,
    stage,
    stateless,
)

# The package's public names are the machinery's: the stages live in their own modules.
__all__ = list(core.__all__)
