"""Stages: the ones users chain, and the stage machinery served from :mod:`webds.base.stage`.

- :mod:`~webds.stages.filters`: shuffle, select, map, slice, info, ...
- :mod:`~webds.stages.fields`: to_tuple, rename, map_dict, map_tuple, extract_keys, ...
- :mod:`~webds.stages.batching`: batched, unbatched, collation.
- :mod:`~webds.stages.decode` (with :mod:`~webds.stages.codecs`, :mod:`~webds.stages.fastjpeg`,
  :mod:`~webds.stages.tenbin` and :mod:`~webds.stages.xdecode`) and :mod:`~webds.stages.encode`:
  field codecs; :mod:`~webds.stages.crop`: the fused crop decoders.
- :mod:`~webds.stages.mix`: mixing several datasets; :mod:`~webds.stages.replay`: record a pass
  and replay it.

``@stage``, :class:`Stage`, the count rules and the handlers live in :mod:`webds.base`, the
foundation every room builds on; the package serves the machinery's names
(``from webds.stages import stage``).
"""

from ..base import stage as machinery
from ..base.stage import (  # noqa: F401 (served from here: __all__ below is the machinery's)
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
__all__ = list(machinery.__all__)
