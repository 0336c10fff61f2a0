"""Writing shards: :class:`~webds.tarwriter.TarWriter` (one tar) and
:class:`~webds.shardwriter.ShardWriter` (a numbered series).

Samples are dicts with a ``__key__`` and one value per extension; each field is encoded by
:mod:`webds.stages.encode` and written as the tar member ``f"{key}.{ext}"``, fields in sorted order.
Output is deterministic by default (mtime 0, uid/gid 0, gzip without timestamp or name), so the
same samples always give byte-identical shards. A shard appears under its final name only once
it is complete: an exception while writing discards it. That holds for remote URLs too
(``s3://``, ``gs://``, any fsspec store, with ``storage_options``): S3 multipart and GCS
resumable uploads create the object only when the shard is closed, and a discarded shard's
upload is aborted. A shard larger than memory streams out in parts as the upload buffer fills
(its size is the store's block size, e.g. s3fs's ``default_block_size``, 50 MiB by default).

    with ShardWriter("out/train-%06d.tar", maxcount=10000) as sink:
        for i, (image, label) in enumerate(data):
            sink.write({"__key__": f"{i:08d}", "jpg": image, "cls": label})
"""

from __future__ import annotations

from .shardwriter import ShardWriter

# webdataset's writer module also exported its encoders; code imports them from there.
from .stages.encode import (  # noqa: F401
    EncoderSpec,
    cbor_dumps,
    default_handlers,
    imageencoder,
    make_encoder,
    mp_dumps,
    numpy_dumps,
    numpy_npz_dumps,
    tenbin_dumps,
    torch_dumps,
)
from .stages.encode import encode_sample as encode_based_on_extension  # noqa: F401
from .tarwriter import TarWriter, check_key, is_numbered_pattern, single_shard_name  # noqa: F401

# numpy_dumps and torch_dumps are re-exported because webdataset's writer module has them.
__all__ = ["TarWriter", "ShardWriter", "check_key", "numpy_dumps", "torch_dumps"]
