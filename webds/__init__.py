"""webds: stream deep-learning training data from POSIX tar shards into PyTorch.

``webds.WebDataset(url).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(64)``

The public names below are imported on first use (PEP 562 ``__getattr__``), so ``import webds``
and the ``webds`` command do not pay for importing torch until something needs it;
``webds.WebDataset``, ``from webds import WebDataset`` and ``dir(webds)`` work as always.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Dict, List, Optional, Tuple

# Installs the import hook that serves webdataset's module names (webds.shardlists,
# webds.tenbin, ...); cheap.
from .compat import aliases

__version__ = "0.1.0"

#: The public API, in one place: (module, the names it holds, space-separated), imported on first
#: use. ``new=old`` serves the module's ``old`` as ``new``; ``name=.`` is the module itself
#: (``webds.tenbin``). ``__all__`` and the lazy lookup below follow from it, and so does
#: ``__init__.pyi``, the imports type checkers and IDEs see (generated:
#: ``python tests/exports_stub.py``; the suite fails when it is out of date).
_EXPORTS: List[Tuple[str, str]] = [
    # errors
    (
        "errors",
        "WebdsError ArgumentError OpenError ShardReadError SampleError DecodeError EncodeError "
        "WriteError LengthError ResumeError SecureModeError NotFoundError MissingFieldError "
        "NoSamplesError NotATarError SampleTooLargeError",
    ),
    ("stages.decode", "DecodingError"),
    # handlers
    (
        "base.handlers",
        "reraise_exception ignore_and_continue warn_and_continue ignore_and_stop warn_and_stop",
    ),
    # engine
    (
        "base.stage",
        "stage stateless resume_kind pipelinefilter Stage Count SAME REORDER BATCH UNBATCH",
    ),
    ("pipeline", "DataPipeline"),
    # sources
    ("io.urls", "open_url"),
    ("compat", "gopen_schemes reader"),
    (
        "shards.shardlists",
        "expand_urls split_by_node split_by_worker single_node_only non_empty resampled",
    ),
    ("base.workers", "worker_info"),
    ("shards.datasets", "SimpleShardList ResampledShards"),
    ("shards.specs", "MultiShardSample shardspec"),
    ("compat.shardsources", "DirectoryShardList"),
    ("stages.mix", "RandomMix RoundRobin"),
    ("shards.index", "ShardIndex ShardInfo IndexProblem=Problem"),
    ("shards.access", "ShardListDataset"),
    ("shards.samplers", "ChunkedSampler DistributedChunkedSampler"),
    ("shards.plan", "PlannedShards"),
    (
        "tar.samples",
        "url_opener tar_file_expander group_by_keys base_plus_ext tarfile_samples "
        "tarfile_to_samples",
    ),
    # stages
    ("stages.filters", "shuffle detshuffle select rsample slice map info"),
    (
        "stages.fields",
        "map_dict map_tuple rename rename_keys extract_keys to_tuple associate getfirst "
        "transform_with",
    ),
    ("stages.batching", "batched unbatched listed unlisted default_collation_fn"),
    # decoding
    ("stages.decode", "decode Decoder Continue gzfilter handle_extension pytorch_weights_only"),
    (
        "stages.codecs",
        "imagehandler imagespecs IMAGE_EXTENSIONS torch_loads torch_video torch_audio",
    ),
    ("stages.xdecode", "xdecode"),
    ("stages.crop", "RandomResizedCropDecoder CenterCropDecoder"),
    ("stages.video", "VideoClipDecoder"),
    ("stages.audio", "AudioClipDecoder"),
    ("stages.tenbin", "tenbin=."),
    # faces
    ("fluent", "FluentMixin FluidInterface FluidWrapper WebDataset"),
    ("loader", "WebLoader"),
    ("compat", "compat=."),
    ("stages.mix", "mix=."),
    ("cache", "cache=."),
    ("io.cache", "LRUCleanup pipe_cleaner"),
    # webdataset's helpers
    ("compat.legacy", "PipelineStage repeatedly MockDataset with_epoch with_length"),
    ("stages.replay", "Cached LMDBCached"),
    # writing
    ("writer", "TarWriter ShardWriter numpy_dumps torch_dumps"),
    # processing shards at scale
    ("parallel", "map_shards ShardResult MapShardsError"),
    # converting datasets
    ("convert.packing", "pack"),
    ("convert.folders", "pack_folder"),
    ("convert.imagenet", "convert_imagenet"),
    ("convert.clips", "split_video clip_samples"),
    ("convert.clipshards", "pack_clips"),
]


def _where(exports: List[Tuple[str, str]]) -> Dict[str, Tuple[str, Optional[str]]]:
    """{public name: (module, its attribute, or None for the module itself)}."""
    where: Dict[str, Tuple[str, Optional[str]]] = {}
    for module, names in exports:
        for entry in names.split():
            name, _, real = entry.partition("=")
            where[name] = (f"{__name__}.{module}", None if real == "." else real or name)
    return where


_WHERE = _where(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and keep the value (PEP 562)."""
    where = _WHERE.get(name)
    if where is not None:
        module, attribute = where
        value = importlib.import_module(module)
        if attribute is not None:
            value = getattr(value, attribute)
        globals()[name] = value  # later lookups find it without calling this function
        return value
    if name in aliases.ALIASES or name in aliases.MOVED:  # webds.shardlists, webds.tenbin, ...
        return aliases.package_getattr(name)
    # Every submodule used to be imported with the package, so code could use webds.shards or
    # webds.writer after a bare "import webds"; that still works.
    if (
        name.isidentifier()
        and not name.startswith("_")
        and importlib.util.find_spec(f"{__name__}.{name}") is not None
    ):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


#: ``gopen`` is bound by the alias hook (a module that is also the function); the rest come from
#: the table.
__all__ = ["gopen", *_WHERE]
