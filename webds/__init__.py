"""webds: stream deep-learning training data from POSIX tar shards into PyTorch.

``webds.WebDataset(url).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(64)``
"""

from . import aliases, cache, compat, mix, tenbin
from .batching import batched, default_collation_fn, listed, unbatched, unlisted
from .cache import LRUCleanup, pipe_cleaner
from .compat import gopen_schemes, reader
from .decode import (
    IMAGE_EXTENSIONS,
    Continue,
    Decoder,
    DecodingError,
    decode,
    gzfilter,
    handle_extension,
    imagehandler,
    imagespecs,
    pytorch_weights_only,
    torch_audio,
    torch_loads,
    torch_video,
    xdecode,
)
from .errors import (
    ArgumentError,
    DecodeError,
    EncodeError,
    LengthError,
    OpenError,
    SampleError,
    ShardReadError,
    WebdsError,
    WriteError,
)
from .filters import (
    associate,
    detshuffle,
    extract_keys,
    getfirst,
    info,
    map,
    map_dict,
    map_tuple,
    rename,
    rename_keys,
    rsample,
    select,
    shuffle,
    slice,
    to_tuple,
    transform_with,
)
from .fluent import FluentMixin, FluidInterface, FluidWrapper, WebDataset
from .handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from .index import Problem as IndexProblem
from .index import ShardIndex, ShardInfo
from .legacy import (
    MockDataset,
    PipelineStage,
    repeatedly,
    with_epoch,
    with_length,
)
from .loader import WebLoader
from .mix import RandomMix, RoundRobin
from .pipeline import (
    BATCH,
    REORDER,
    SAME,
    UNBATCH,
    Count,
    DataPipeline,
    Stage,
    pipelinefilter,
    stage,
)
from .plan import PlannedShards
from .replay import Cached, LMDBCached
from .samples import (
    base_plus_ext,
    group_by_keys,
    tar_file_expander,
    tarfile_samples,
    tarfile_to_samples,
    url_opener,
)
from .shards import (
    ResampledShards,
    SimpleShardList,
    expand_urls,
    non_empty,
    resampled,
    single_node_only,
    split_by_node,
    split_by_worker,
    worker_info,
)
from .shardsources import DirectoryShardList, MultiShardSample, shardspec
from .urls import open_url
from .writer import ShardWriter, TarWriter, numpy_dumps, torch_dumps

# webdataset's module names (webds.shardlists, webds.gopen, ...), created on first use.
__getattr__ = aliases.package_getattr

__version__ = "0.1.0"

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
    # handlers
    "reraise_exception",
    "ignore_and_continue",
    "warn_and_continue",
    "ignore_and_stop",
    "warn_and_stop",
    # engine
    "stage",
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
]
