"""webds: stream deep-learning training data from POSIX tar shards into PyTorch.

``webds.WebDataset(url).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(64)``

The public names below are imported on first use (PEP 562 ``__getattr__``), so ``import webds``
and the ``webds`` command do not pay for importing torch until something needs it;
``webds.WebDataset``, ``from webds import WebDataset`` and ``dir(webds)`` work as always.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

# Installs the import hook that serves webdataset's module names (webds.shardlists,
# webds.tenbin, ...); cheap.
from .compat import aliases

# webds.decode, the stage, is bound at import: cheap, its module imports neither torch nor numpy.
from .stages.decode import decode

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, _EXPORTS and __getattr__
    from . import compat
    from .compat import gopen_schemes, reader
    from .compat.legacy import (
        MockDataset,
        PipelineStage,
        repeatedly,
        with_epoch,
        with_length,
    )
    from .compat.shardsources import DirectoryShardList
    from .convert.folders import pack_folder
    from .convert.imagenet import convert_imagenet
    from .convert.packing import pack
    from .errors import (
        ArgumentError,
        DecodeError,
        EncodeError,
        LengthError,
        MissingFieldError,
        NoSamplesError,
        NotATarError,
        NotFoundError,
        OpenError,
        ResumeError,
        SampleError,
        SecureModeError,
        ShardReadError,
        WebdsError,
        WriteError,
    )
    from .fluent import FluentMixin, FluidInterface, FluidWrapper, WebDataset
    from .io import cache
    from .io.cache import LRUCleanup, pipe_cleaner
    from .io.urls import open_url
    from .loader import WebLoader
    from .parallel import MapShardsError, ShardResult, map_shards
    from .pipeline import DataPipeline
    from .shards.access import ShardListDataset
    from .shards.datasets import ResampledShards, SimpleShardList
    from .shards.index import Problem as IndexProblem
    from .shards.index import ShardIndex, ShardInfo
    from .shards.plan import PlannedShards
    from .shards.samplers import ChunkedSampler, DistributedChunkedSampler
    from .shards.shardlists import (
        expand_urls,
        non_empty,
        resampled,
        single_node_only,
        split_by_node,
        split_by_worker,
        worker_info,
    )
    from .shards.specs import MultiShardSample, shardspec
    from .stages import mix, tenbin
    from .stages.batching import batched, default_collation_fn, listed, unbatched, unlisted
    from .stages.codecs import (
        IMAGE_EXTENSIONS,
        imagehandler,
        imagespecs,
        torch_audio,
        torch_loads,
        torch_video,
    )
    from .stages.core import (
        BATCH,
        REORDER,
        SAME,
        UNBATCH,
        Count,
        Stage,
        pipelinefilter,
        resume_kind,
        stage,
        stateless,
    )
    from .stages.crop import CenterCropDecoder, RandomResizedCropDecoder
    from .stages.decode import (
        Continue,
        Decoder,
        DecodingError,
        gzfilter,
        handle_extension,
        pytorch_weights_only,
    )
    from .stages.fields import (
        associate,
        extract_keys,
        getfirst,
        map_dict,
        map_tuple,
        rename,
        rename_keys,
        to_tuple,
        transform_with,
    )
    from .stages.filters import detshuffle, info, map, rsample, select, shuffle, slice
    from .stages.handlers import (
        ignore_and_continue,
        ignore_and_stop,
        reraise_exception,
        warn_and_continue,
        warn_and_stop,
    )
    from .stages.mix import RandomMix, RoundRobin
    from .stages.replay import Cached, LMDBCached
    from .stages.xdecode import xdecode
    from .tar.samples import (
        base_plus_ext,
        group_by_keys,
        tar_file_expander,
        tarfile_samples,
        tarfile_to_samples,
        url_opener,
    )
    from .writer import ShardWriter, TarWriter, numpy_dumps, torch_dumps

__version__ = "0.1.0"

#: {module: the public names it holds}, imported on first use. "new=old" serves the module's
#: ``old`` as ``new``; "name=." is the module itself (``webds.cache``).
_EXPORTS: Dict[str, List[str]] = {
    "stages.batching": ["batched", "default_collation_fn", "listed", "unbatched", "unlisted"],
    # webds.cache: webdataset's module name, serving webds.io.cache and webds.tar.cached
    "cache": ["cache=."],
    "io.cache": ["LRUCleanup", "pipe_cleaner"],
    "compat": ["compat=.", "gopen_schemes", "reader"],
    "stages.codecs": [
        "IMAGE_EXTENSIONS",
        "imagehandler",
        "imagespecs",
        "torch_audio",
        "torch_loads",
        "torch_video",
    ],
    "stages.crop": ["CenterCropDecoder", "RandomResizedCropDecoder"],
    "stages.decode": [
        "Continue",
        "Decoder",
        "DecodingError",
        "gzfilter",
        "handle_extension",
        "pytorch_weights_only",
    ],
    "errors": [
        "ArgumentError",
        "DecodeError",
        "EncodeError",
        "LengthError",
        "MissingFieldError",
        "NoSamplesError",
        "NotATarError",
        "NotFoundError",
        "OpenError",
        "ResumeError",
        "SampleError",
        "SecureModeError",
        "ShardReadError",
        "WebdsError",
        "WriteError",
    ],
    "stages.fields": [
        "associate",
        "extract_keys",
        "getfirst",
        "map_dict",
        "map_tuple",
        "rename",
        "rename_keys",
        "to_tuple",
        "transform_with",
    ],
    "stages.filters": ["detshuffle", "info", "map", "rsample", "select", "shuffle", "slice"],
    "fluent": ["FluentMixin", "FluidInterface", "FluidWrapper", "WebDataset"],
    "stages.handlers": [
        "ignore_and_continue",
        "ignore_and_stop",
        "reraise_exception",
        "warn_and_continue",
        "warn_and_stop",
    ],
    "shards.index": ["IndexProblem=Problem", "ShardIndex", "ShardInfo"],
    "shards.access": ["ShardListDataset"],
    "shards.samplers": ["ChunkedSampler", "DistributedChunkedSampler"],
    "compat.legacy": ["MockDataset", "PipelineStage", "repeatedly", "with_epoch", "with_length"],
    "loader": ["WebLoader"],
    "stages.mix": ["mix=.", "RandomMix", "RoundRobin"],
    "parallel": ["MapShardsError", "ShardResult", "map_shards"],
    "convert.folders": ["pack_folder"],
    "convert.imagenet": ["convert_imagenet"],
    "convert.packing": ["pack"],
    "pipeline": ["DataPipeline"],
    "shards.plan": ["PlannedShards"],
    "stages.replay": ["Cached", "LMDBCached"],
    "stages.xdecode": ["xdecode"],
    "tar.samples": [
        "base_plus_ext",
        "group_by_keys",
        "tar_file_expander",
        "tarfile_samples",
        "tarfile_to_samples",
        "url_opener",
    ],
    "shards.datasets": ["ResampledShards", "SimpleShardList"],
    "shards.shardlists": [
        "expand_urls",
        "non_empty",
        "resampled",
        "single_node_only",
        "split_by_node",
        "split_by_worker",
        "worker_info",
    ],
    "compat.shardsources": ["DirectoryShardList"],
    "shards.specs": ["MultiShardSample", "shardspec"],
    "stages.core": [
        "BATCH",
        "REORDER",
        "SAME",
        "UNBATCH",
        "Count",
        "Stage",
        "pipelinefilter",
        "resume_kind",
        "stage",
        "stateless",
    ],
    "stages.tenbin": ["tenbin=."],
    "io.urls": ["open_url"],
    "writer": ["ShardWriter", "TarWriter", "numpy_dumps", "torch_dumps"],
}


def _where(exports: Dict[str, List[str]]) -> Dict[str, Tuple[str, Optional[str]]]:
    """{public name: (module, its attribute, or None for the module itself)}."""
    where: Dict[str, Tuple[str, Optional[str]]] = {}
    for module, names in exports.items():
        for entry in names:
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


__all__ = [
    # errors
    "WebdsError",
    "ArgumentError",
    "OpenError",
    "ShardReadError",
    "SampleError",
    "DecodeError",
    "DecodingError",
    "EncodeError",
    "WriteError",
    "LengthError",
    "ResumeError",
    "SecureModeError",
    "NotFoundError",
    "MissingFieldError",
    "NoSamplesError",
    "NotATarError",
    # handlers
    "reraise_exception",
    "ignore_and_continue",
    "warn_and_continue",
    "ignore_and_stop",
    "warn_and_stop",
    # engine
    "stage",
    "stateless",
    "resume_kind",
    "pipelinefilter",
    "Stage",
    "DataPipeline",
    "Count",
    "SAME",
    "REORDER",
    "BATCH",
    "UNBATCH",
    # sources
    "open_url",
    "gopen",
    "gopen_schemes",
    "reader",
    "expand_urls",
    "SimpleShardList",
    "ResampledShards",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "non_empty",
    "resampled",
    "MultiShardSample",
    "shardspec",
    "DirectoryShardList",
    "RandomMix",
    "RoundRobin",
    "worker_info",
    "ShardIndex",
    "ShardInfo",
    "IndexProblem",
    "ShardListDataset",
    "ChunkedSampler",
    "DistributedChunkedSampler",
    "PlannedShards",
    "url_opener",
    "tar_file_expander",
    "group_by_keys",
    "base_plus_ext",
    "tarfile_samples",
    "tarfile_to_samples",
    # stages
    "shuffle",
    "detshuffle",
    "select",
    "rsample",
    "slice",
    "map",
    "map_dict",
    "map_tuple",
    "rename",
    "rename_keys",
    "extract_keys",
    "to_tuple",
    "associate",
    "info",
    "batched",
    "unbatched",
    "listed",
    "unlisted",
    "default_collation_fn",
    "getfirst",
    "transform_with",
    # decoding
    "decode",
    "Decoder",
    "Continue",
    "gzfilter",
    "handle_extension",
    "imagehandler",
    "imagespecs",
    "IMAGE_EXTENSIONS",
    "torch_loads",
    "torch_video",
    "torch_audio",
    "xdecode",
    "RandomResizedCropDecoder",
    "CenterCropDecoder",
    "pytorch_weights_only",
    "tenbin",
    # faces
    "FluentMixin",
    "FluidInterface",
    "FluidWrapper",
    "WebDataset",
    "WebLoader",
    "compat",
    "mix",
    "cache",
    "LRUCleanup",
    "pipe_cleaner",
    # webdataset's helpers
    "PipelineStage",
    "repeatedly",
    "MockDataset",
    "with_epoch",
    "with_length",
    "Cached",
    "LMDBCached",
    # writing
    "TarWriter",
    "ShardWriter",
    "numpy_dumps",
    "torch_dumps",
    # processing shards at scale
    "map_shards",
    "ShardResult",
    "MapShardsError",
    # converting datasets
    "pack",
    "pack_folder",
    "convert_imagenet",
]
